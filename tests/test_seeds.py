"""`apps seeds`: one run per seed, the spread computed by hand, finished seeds read back."""

import json

import pytest
from helpers import apps, plain

from core import seeds

FIXTURE = "tests/fixtures/reviews.csv"
COLUMNS = ["--set", "data.text_column=review", "--set", "data.label_column=stars"]


def test_spread_by_hand():
    reports = {
        0: {"accuracy": 0.5, "greedy": {"bleu": 2.0}, "baselines": {"gloss": {"bleu": 4.0}}, "checkpoint": "x"},
        1: {"accuracy": 0.7, "greedy": {"bleu": 4.0}, "baselines": {"gloss": {"bleu": 4.0}}, "checkpoint": "y"},
        2: {"accuracy": 0.9, "greedy": {"bleu": 9.0}, "baselines": {"gloss": {"bleu": 4.0}}, "checkpoint": "z"},
    }
    rows = {(row["column"], row["metric"]): row for row in seeds.spread(reports)}
    assert set(rows) == {("model", "accuracy"), ("greedy", "bleu"), ("gloss", "bleu")}
    accuracy = rows["model", "accuracy"]
    # mean 0.7; sample variance ((-0.2)^2 + 0 + 0.2^2) / 2 = 0.04
    assert accuracy["mean"] == pytest.approx(0.7) and accuracy["std"] == pytest.approx(0.2)
    assert (accuracy["min"], accuracy["max"], accuracy["seed 1"]) == (0.5, 0.9, 0.7)
    assert rows["greedy", "bleu"]["mean"] == pytest.approx(5.0)
    assert rows["greedy", "bleu"]["std"] == pytest.approx(((3**2 + 1 + 4**2) / 2) ** 0.5)
    assert rows["gloss", "bleu"]["std"] == 0.0  # a deterministic baseline does not spread
    assert seeds.spread({3: reports[0]})[0]["std"] == 0.0


def test_seeds_train_each_seed_and_read_finished_ones_back(tmp_path):
    args = ["seeds", "sentiment", "--seeds", "2", "--workdir", tmp_path, "--preset", "tiny", "--data", FIXTURE]
    args += [*COLUMNS, "--set", "train.steps=20", "--set", "train.eval_every=20", "--format", "json"]
    result = apps(*args, "--output", tmp_path / "first.json")
    assert result.exit_code == 0, result.output
    first = json.loads((tmp_path / "first.json").read_text())
    for seed in (0, 1):
        saved = json.loads((tmp_path / f"seed{seed}" / "config.json").read_text())
        assert saved["train"]["seed"] == seed
    loss = next(row for row in first["rows"] if row["column"] == "model" and row["metric"] == "loss")
    assert loss["seed 0"] != loss["seed 1"]  # two initializations, two batch orders
    assert loss["min"] <= loss["mean"] <= loss["max"] and loss["std"] > 0
    assert all(value is not None for value in first["seconds"].values())

    before = (tmp_path / "seed0" / "eval_test.json").stat().st_mtime_ns
    again = apps(*args, "--output", tmp_path / "again.json")
    assert again.exit_code == 0, again.output
    assert "read back" in again.output
    assert (tmp_path / "seed0" / "eval_test.json").stat().st_mtime_ns == before
    assert json.loads((tmp_path / "again.json").read_text())["rows"] == first["rows"]
    assert json.loads((tmp_path / "seeds.json").read_text())["rows"] == first["rows"]


def test_seeds_refuse_a_seed_override(tmp_path):
    result = apps("seeds", "sentiment", "--workdir", tmp_path, "--set", "train.seed=4")
    assert result.exit_code == 1
    assert "--set train.seed is what the seeds set" in plain(result.output)
