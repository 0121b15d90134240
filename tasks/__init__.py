"""The task registry: task name -> "module:Class", imported only when the task is used."""

from __future__ import annotations

import importlib

from core.errors import UserError

REGISTRY = {
    "lm": "tasks.nlp.lm:LMTask",
    "sentiment": "tasks.nlp.sentiment:SentimentTask",
    "translate": "tasks.nlp.translate:TranslateTask",
    "summarize": "tasks.nlp.summarize:SummarizeTask",
    "recsys": "tasks.recsys.sequential:RecsysTask",
    "protein-mlm": "tasks.protein.mlm:ProteinMLMTask",
    "protein-class": "tasks.protein.classify:ProteinClassTask",
    "protein-residue": "tasks.protein.residue:ProteinResidueTask",
    "speech": "tasks.speech.asr:SpeechTask",
}


def get(name: str) -> type:
    """The task class registered as `name`."""
    if name not in REGISTRY:
        raise UserError(f"Unknown task {name!r}; the tasks are: {', '.join(sorted(REGISTRY))}.")
    module, _, attribute = REGISTRY[name].partition(":")
    task_type = getattr(importlib.import_module(module), attribute)
    if not task_type.__dict__.get("__final__"):
        raise TypeError(f"The registered task {REGISTRY[name]} is not marked @core.task.final.")
    return task_type
