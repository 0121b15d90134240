"""Predictions from Python and the command line: a run (or a pretrained checkpoint) loaded once.

    from core import predict
    import tasks
    predictor = predict.Predictor(tasks.get("sentiment"), "runs/sentiment")
    predictor.predict(["Lovely fabric, fits well"])  # [{"text": ..., "label": "positive", "probability": 0.997...}]

`tasks.pipeline("sentiment", workdir="runs/sentiment")` gives the same object from a task's
name. Rows hold typed values (probabilities and scores as floats, ranks as ints); only the
CLI's table rounds them for people.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flax import nnx

from core.checkpoints.rules import set_params
from core.errors import UserError
from core.loading import load, load_pretrained
from core.model import lora
from core.model.precision import narrowed
from core.options import predict_option_values
from core.training.steps import evaluate_arrays

# The weights a generating task decodes with: float32, its linear layers' in bfloat16, those and
# its token table in int8, or its linear layers' in four bits and the table in int8
# (`core.model.precision.narrowed`).
DTYPES = ("float32", "bfloat16", "int8", "int4")


def check_dtype(dtype: str) -> None:
    """`--dtype` of `apps predict`, `apps serve` and `apps bench serve`: one of `DTYPES`."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: expected {', '.join(DTYPES[:-1])} or {DTYPES[-1]}.")


class Predictor:
    """A trained run (or, for a zero-shot task, a pretrained checkpoint) loaded once, predicting
    many times: the one way to call a model from Python (tasks add methods on top:
    `tasks.nlp.lm.LanguageModel`, `tasks.recsys.sequential.Recommender`, `tasks.speech.asr.Transcriber`).

    predictor = Predictor(tasks.get("translate"), "runs/translate")
    predictor.predict(["the new house"], beams=4)  # rows of typed values, as `apps predict` writes them
    predictor.outputs(["the new house"], beams=4)  # the examples and the task's raw predictions
    Predictor(tasks.get("lm"), model="smollm2-135m-instruct").predict(["Hi"], chat=True)
    """

    def __init__(
        self,
        task_type: type,
        workdir: str | Path | None = None,
        data: str | None = None,
        *,
        model: str | None = None,
        dtype: str = "float32",
    ):
        """`dtype` "bfloat16": a generating task decodes with its linear layers' weights in
        bfloat16; "int8": those and its token table in int8; "int4": its linear layers' in four
        bits, the table in int8 (`core.model.precision.narrowed`)."""
        if (workdir is None) == (model is None):
            raise UserError("A Predictor reads a trained run (workdir) or a pretrained checkpoint (model): give one.")
        check_dtype(dtype)
        if dtype != "float32" and not task_type.generates:
            raise UserError(f"{task_type.name} predicts in float32; {dtype} weights serve generating tasks only.")
        if model is None:
            self.loaded = load(task_type, workdir, data)
        else:
            self.loaded = load_pretrained(task_type, model, data=data, whole_context=True)
        self.task, self.featurizer = self.loaded.task, self.loaded.featurizer
        graphdef, params = nnx.split(self.loaded.steps.decoder(self.loaded.params))
        self.model = nnx.merge(graphdef, narrowed(params, dtype))

    def share_weights(self, weights: dict[str, Any]) -> None:
        """Take `weights` (flat parameter paths to arrays: another run's, equal to this one's
        frozen weights) in place of this run's own, so that one copy serves both (a LoRA run
        served beside its base: `core.serving.adapters`); the run's steps read them too."""
        set_params(self.model, weights)
        pure = nnx.to_pure_dict(nnx.state(self.model, nnx.Param))
        self.loaded.steps.frozen = lora.split(pure, self.task.config.model, type(self.model).transferred)[1]

    def options(self, given: dict[str, Any]) -> dict[str, Any]:
        """Every `predict_options` value by name: the given ones (checked), else the defaults."""
        return predict_option_values(self.task, given)

    def outputs(
        self, inputs: Sequence[str], on_text: Callable[[str], None] | None = None, **options
    ) -> tuple[list[dict], dict[str, Any]]:
        """The examples read from `inputs` (as `apps predict` reads its lines) and the task's
        predictions for them; a generating task streams the first input's new text to `on_text`."""
        values = self.options(options)
        examples = self.task.parse_inputs(inputs, values)
        return examples, self.run_examples(examples, values, on_text)

    def run_examples(self, examples: list[dict], values: dict[str, Any], on_text=None) -> dict[str, Any]:
        """The task's predictions for parsed examples under every option's value (`options`)."""
        if self.task.generates:
            return self.task.generate(self.model, self.featurizer, examples, values, on_text)
        _, predictions = evaluate_arrays(
            self.loaded.steps, self.loaded.params, self.featurizer(examples), self.task.config.train.eval_batch_size
        )
        return predictions

    def predict(self, inputs: Sequence[str], on_text: Callable[[str], None] | None = None, **options) -> list[dict]:
        """One row per prediction (column -> a typed value), as `apps predict` writes them."""
        examples, predictions = self.outputs(inputs, on_text, **options)
        return self.task.render(predictions, examples, self.featurizer)


def predict(
    task_type: type,
    workdir: str | Path | None = None,
    lines: Sequence[str] = (),
    options: dict[str, str] | None = None,
    on_text: Callable[[str], None] | None = None,
    *,
    model: str | None = None,
    dtype: str = "float32",
) -> list[dict]:
    """`Predictor.predict` once (of the run in `workdir` or the checkpoint `model`, its decoding
    weights in `dtype`), with `options` as the command line gives them: the task's `apps
    predict` flags (`--max-new-tokens`) mapped to their text."""
    values = predict_option_values(task_type, options or {}, command_line=True)
    return Predictor(task_type, workdir, model=model, dtype=dtype).predict(lines, on_text, **values)
