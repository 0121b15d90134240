"""Adding a task, as the README's walk-through does: a new task is one file of edges on a family
of `tasks.common`, registered by name; the core trains, evaluates and predicts it with no change.

The toy task: which letter a string of a's and b's holds more of (odd lengths, no ties).
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from flax import nnx
from helpers import apps, plain, table_rows

import tasks
from core import run
from core.config import DataConfig
from core.model.heads import TokenEmbedder
from core.presets import tiny_body, tiny_preset
from core.task import final
from tasks.common.families import SequenceClassification, class_ids
from tasks.common.scoring import classification_scores
from tasks.common.splits import hash_split

LETTERS = "ab"


@dataclass(frozen=True, kw_only=True)
class MajorityData(DataConfig):
    count: int = 800  # strings in the generated set


@dataclass
class LetterFeaturizer:
    """Letters -> ids (0 pads), labels -> class ids."""

    classes: tuple[str, ...]
    max_len: int

    def save(self, directory: Path) -> None:
        (directory / "classes.json").write_text(json.dumps(self.classes))

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        inputs = np.zeros((len(examples), self.max_len), np.int32)
        for row, example in enumerate(examples):
            inputs[row, : len(example["text"])] = [LETTERS.index(c) + 1 for c in example["text"]]
        targets = class_ids([e["label"] for e in examples], self.classes)
        return {"inputs": inputs, "mask": inputs > 0, "targets": targets, "weights": np.ones(len(examples), np.float32)}


def tiny():
    return tiny_preset("majority", tiny_body(16), MajorityData(), learning_rate=1e-2)


@final
@dataclass(frozen=True, kw_only=True)
class MajorityTask(SequenceClassification):
    name: ClassVar[str] = "majority"
    summary: ClassVar[str] = "Which letter a string of a's and b's holds more of"
    default_data: ClassVar[str] = "generated strings"
    model_summary: ClassVar[str] = "encoder + mean pool"
    metric_names: ClassVar[tuple[str, ...]] = ("accuracy", "macro_f1")
    best_metric: ClassVar[str] = "accuracy"
    presets: ClassVar[dict] = {"tiny": tiny}
    default_preset: ClassVar[str] = "tiny"
    data_type: ClassVar[type] = MajorityData

    config: object
    data: str | None = None

    def examples(self, split: str) -> list[dict]:
        rng = np.random.default_rng(0)
        texts = {"".join(rng.choice(list(LETTERS), rng.choice([5, 7, 9, 11]))) for _ in range(self.config.data.count)}
        majority = lambda text: max(LETTERS, key=text.count)  # noqa: E731
        shares = {"train": 80, "valid": 10, "test": 10}
        return [{"text": t, "label": majority(t)} for t in sorted(texts) if hash_split(t, shares) == split]

    def fit_featurizer(self, train: Sequence[dict]) -> LetterFeaturizer:
        return LetterFeaturizer(tuple(LETTERS), self.config.model.max_len)

    def load_featurizer(self, directory: Path) -> LetterFeaturizer:
        return LetterFeaturizer(tuple(json.loads((directory / "classes.json").read_text())), self.config.model.max_len)

    def embedder(self, featurizer: LetterFeaturizer, rngs: nnx.Rngs) -> nnx.Module:
        return TokenEmbedder(len(LETTERS) + 1, self.config.model.d_model, rngs=rngs)

    def score(self, predictions, examples, featurizer) -> dict[str, float]:
        truth = class_ids([e["label"] for e in examples], featurizer.classes)
        predicted = self.example_probabilities(predictions, len(examples)).argmax(-1)
        return classification_scores(truth, predicted, featurizer.classes)

    def baselines(self, train, test, featurizer) -> dict[str, dict[str, float]]:
        """The first letter of the string as its majority."""
        truth = class_ids([e["label"] for e in test], featurizer.classes)
        return {"first_letter": classification_scores(truth, [LETTERS.index(e["text"][0]) for e in test], "ab")}

    def protocol(self) -> dict[str, str]:
        return {"dataset": self.default_data, "protocol": "split 80/10/10 by the CRC-32 of the string"}

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        return [{"text": line.strip(), "label": None} for line in lines if line.strip()]

    def render(self, predictions, examples, featurizer) -> list[dict[str, str]]:
        return [
            {"text": e["text"], **row} for e, row in zip(examples, self.predicted(predictions, examples, featurizer))
        ]


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(tasks.REGISTRY, "majority", f"{__name__}:MajorityTask")


def test_a_new_task_trains_evaluates_and_predicts(registered, tmp_path):
    workdir = tmp_path / "majority"
    assert "majority" in plain(apps("tasks").output)
    result = apps("train", "majority", "--workdir", workdir, "--set", "train.steps=60")
    assert result.exit_code == 0, result.output
    result = apps("eval", "majority", "--workdir", workdir, "--split", "test")
    assert result.exit_code == 0, result.output
    report = json.loads((workdir / "eval_test.json").read_text())
    # Counting letters is learnable by mean pooling: far above the first-letter guess.
    assert report["accuracy"] > 0.9 > report["baselines"]["first_letter"]["accuracy"]
    result = apps("predict", "majority", "--workdir", workdir, "aabab", "bbbba")
    assert result.exit_code == 0, result.output
    assert [row[:2] for row in table_rows(result.output)] == [["aabab", "a"], ["bbbba", "b"]]
    rows = run.Predictor(MajorityTask, workdir).predict(["abbba"])
    assert rows[0]["label"] == "b" and 0.5 < float(rows[0]["probability"]) <= 1


def test_a_task_missing_a_required_hook_fails_at_import():
    with pytest.raises(TypeError, match="does not implement the required hook\\(s\\) baselines"):

        @final
        @dataclass(frozen=True, kw_only=True)
        class Unfinished(SequenceClassification):
            def examples(self, split):
                return []

            def fit_featurizer(self, train): ...
            def load_featurizer(self, directory): ...
            def embedder(self, featurizer, rngs): ...
            def score(self, predictions, examples, featurizer): ...
            def protocol(self): ...
            def parse_inputs(self, lines, options): ...
            def render(self, predictions, examples, featurizer): ...


def test_a_final_task_is_sealed_and_the_registry_wants_final_tasks(monkeypatch):
    with pytest.raises(TypeError, match="subclasses the final task MajorityTask"):

        class Variant(MajorityTask):
            pass

    monkeypatch.setitem(tasks.REGISTRY, "open", "tasks.common.families:SequenceClassification")
    with pytest.raises(TypeError, match="is not marked @core.task.final"):
        tasks.get("open")
