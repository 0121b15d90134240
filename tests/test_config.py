"""Config overrides, their checks, and the JSON round trip."""

import json

import pytest

from core.config import Config, apply_overrides
from core.errors import UserError
from tasks.nlp.sentiment import SentimentData, base


def test_overrides_reach_every_section():
    config = apply_overrides(
        base(),
        [
            "model.d_model=64",
            "train.steps=7",
            "optim.learning_rate=1e-2",
            "model.norm=rmsnorm",
            "data.labels=five",
            "optim.warmup_steps=0",
        ],
    )
    assert (config.model.d_model, config.train.steps, config.optim.learning_rate) == (64, 7, 0.01)
    assert config.model.norm == "rmsnorm" and config.data.labels == "five"


def test_int_widens_to_float_but_not_back():
    assert apply_overrides(base(), ["optim.learning_rate=1"]).optim.learning_rate == 1.0
    with pytest.raises(UserError, match="expected int"):
        apply_overrides(base(), ["train.steps=1.5"])


def test_booleans_read_as_python_or_as_a_shell_user_types_them():
    for text, value in [("True", True), ("true", True), ("FALSE", False), ("false", False)]:
        assert apply_overrides(base(), [f"train.remat={text}"]).train.remat is value
    with pytest.raises(UserError, match="expected bool"):
        apply_overrides(base(), ["train.remat=yes"])


def test_unknown_key_lists_valid_ones():
    with pytest.raises(UserError, match=r"unknown key 'dmodel'.*d_model, num_layers"):
        apply_overrides(base(), ["model.dmodel=3"])


@pytest.mark.parametrize("item", ["train.steps", "model.norm=batchnorm", "train.remat=maybe?", "=3"])
def test_bad_overrides_are_user_errors(item):
    with pytest.raises(UserError):
        apply_overrides(base(), [item])


def test_json_round_trip():
    config = apply_overrides(base(), ["model.d_model=96", "data.labels=raw"])
    again = Config.from_dict(json.loads(json.dumps(config.to_dict())), SentimentData)
    assert again == config


def test_train_fraction_is_a_nested_stratified_share_of_train():
    from tasks.nlp.data import split

    columns = {"text": [f"t{i}" for i in range(1000)], "label": ["a"] * 700 + ["b"] * 300}
    train = split(columns, "train")
    tenth, hundredth = split(columns, "train", 0.1), split(columns, "train", 0.01)
    assert [sum(e["label"] == name for e in tenth) for name in "ab"] == [56, 24]  # 10% of 560 / 240
    assert [sum(e["label"] == name for e in hundredth) for name in "ab"] == [6, 2]
    texts = lambda examples: {e["text"] for e in examples}  # noqa: E731
    assert texts(hundredth) < texts(tenth) < texts(train)
    assert split(columns, "valid", 0.1) == split(columns, "valid") and split(columns, "test", 0.1) == split(
        columns, "test"
    )
    with pytest.raises(UserError, match=r"data.train_fraction=0.0 must be in \(0, 1\]"):
        apply_overrides(base(), ["data.train_fraction=0"])
