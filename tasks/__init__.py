"""The task registry: task name -> "module:Class", imported only when the task is used; and
`pipeline`, a task's predictor in one call:

    import tasks
    sentiment = tasks.pipeline("sentiment", workdir="runs/sentiment")
    sentiment.predict(["Lovely fabric, fits well"])  # [{"text": ..., "label": "positive", "probability": 0.99...}]
    tasks.pipeline("lm", model="smollm2-135m-instruct").predict(["Hi"], chat=True)
"""

from __future__ import annotations

import importlib
from pathlib import Path

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


def pipeline(
    name: str, workdir: str | Path | None = None, *, model: str | None = None, data: str | None = None, dtype="float32"
):
    """Task `name`'s `core.predict.Predictor`: of the trained run in `workdir`, or of a pretrained
    checkpoint `model` (a shipped name or a path) for a task that uses one as it is (lm, speech).
    Its `predict(inputs, **options)` gives rows of typed values, as `apps predict` writes them."""
    from core.predict import Predictor

    return Predictor(get(name), workdir, data, model=model, dtype=dtype)
