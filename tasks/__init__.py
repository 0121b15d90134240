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


# The task that runs a checkpoint family's models as they are (`apps serve --model`).
AS_IS = {"decoder": "lm", "whisper": "speech"}


def for_checkpoint(name_or_path: str) -> type:
    """The task that serves a pretrained checkpoint as it is: a decoder's, lm; Whisper's, speech."""
    from core.checkpoints import pretrained

    served = sorted(
        [*pretrained.decoders(), *(name for name, item in pretrained.SHIPPED.items() if item.family == "whisper")]
    )
    if name_or_path.lower() not in served and not Path(name_or_path).exists():
        raise UserError(
            f"--model {name_or_path}: not a checkpoint this server runs. Shipped: {', '.join(served)}; or the path "
            "of a decoder's Hugging Face folder or .gguf file, or of a Whisper CTranslate2 folder. (Serve a run of "
            "another task with --workdir.)"
        )
    family = pretrained.families()[pretrained.read_checkpoint(name_or_path).reader]
    kind = "decoder" if family.decodes else family.name
    if kind not in AS_IS:
        raise UserError(f"--model {name_or_path}: a {family.name} checkpoint, which no task serves as it is.")
    return get(AS_IS[kind])


def pipeline(
    name: str, workdir: str | Path | None = None, *, model: str | None = None, data: str | None = None, dtype="float32"
):
    """Task `name`'s `core.predict.Predictor`: of the trained run in `workdir`, or of a pretrained
    checkpoint `model` (a shipped name or a path) for a task that uses one as it is (lm, speech).
    Its `predict(inputs, **options)` gives rows of typed values, as `apps predict` writes them."""
    from core.predict import Predictor

    return Predictor(get(name), workdir, data, model=model, dtype=dtype)


def tables(for_people: bool = True) -> dict[str, list[dict]]:
    """`apps tasks`: the tasks with their default data, model, metrics and presets, the options
    of `apps predict` and the prompts of the presets on a pretrained decoder, as titled rows.
    `for_people`: two columns, the fields one a line (it reads at 80 columns), prompts quoted."""
    listed, options, prompts = [], [], []
    for name in sorted(REGISTRY):
        task = get(name)
        presets = ", ".join(f"{p}*" if p == task.default_preset else p for p in task.presets)
        fields = {
            "what": task.summary,
            "default data": task.default_data,
            "model": task.model_summary,
            "metrics": ", ".join(task.metric_names),
            "presets": presets,
        }
        if for_people:
            what = fields.pop("what")
            fields = {"about": "\n".join([what, *(f"{key}: {value}" for key, value in fields.items())])}
        listed.append({"task": name, **fields})
        for option in task.predict_options:
            value = "" if option.type is bool else f" {option.type.__name__.upper()}"  # a switch takes none
            options.append({"task": name, "option": option.flag + value, "help": option.help})
        for preset, prompt in task.prompts.items():
            prompts.append({"task": name, "preset": preset, "prompt": repr(prompt) if for_people else prompt})
    return {
        "Tasks (* the default preset)": listed,
        "apps predict TASK options": options,
        "Prompts of the presets on a pretrained decoder (data.prompt)": prompts,
    }
