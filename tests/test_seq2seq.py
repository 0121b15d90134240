"""Translation and summarization: decoding through the task (beam search, padding and batching,
length limits, minimum Bayes risk) and the CLI's train, eval and predict on real runs.

Their data (the FreeDict parser, the split, the featurizer, glossaries) and scores by hand are in
test_seq2seq_data.py."""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import apps

import tasks
from core import run
from core.generation.beam import beam_search, gnmt_penalty
from core.options import predict_option_values
from core.training.steps import build_model
from tasks.nlp import encoder_decoder, freedict
from tasks.nlp.decoding import minimum_bayes_risk
from tasks.nlp.seq2seq import Seq2SeqTask

# `apps predict`'s defaults: greedy (beams 1 below), no sampling, no MBR.
DECODING = predict_option_values(Seq2SeqTask, {})


@pytest.mark.parametrize("alpha,expected", [(0.0, [0]), (1.0, [1, 2, 0])])
def test_beam_search_returns_the_best_sequence_under_the_length_penalty(alpha, expected):
    # Stop at once (p 0.48), or 1 (0.52), 2 (0.9), stop (0.95): 0.4446 in all. Without a penalty
    # the short one wins (log 0.48 > log 0.4446); with alpha 1 the long one does (its log
    # probability is divided by ((5 + 3) / 6) ** 1: -0.608 > -0.734).
    table = np.full((4, 4), 0.25)
    table[1] = [1e-9, 1e-9, 0.9, 0.1]
    table[2] = [0.95, 1e-9, 1e-9, 0.05]
    table = jnp.log(jnp.asarray(table, jnp.float32))
    first = jnp.log(jnp.asarray([[0.48, 0.52, 1e-9, 1e-9]], jnp.float32))
    step = lambda state, tokens: (table[tokens], state)  # noqa: E731
    settings = dict(beam_size=2, max_new_tokens=4, stop_tokens=(0,), length_penalty=alpha)
    beams = beam_search(step, jnp.zeros((1, 1)), first, **settings)
    length = len(expected)
    np.testing.assert_array_equal(beams.tokens[0, 0, :length], expected)
    probability = 0.48 if length == 1 else 0.52 * 0.9 * 0.95
    assert float(beams.scores[0, 0]) == pytest.approx(np.log(probability) / gnmt_penalty(length, alpha), abs=1e-5)


@pytest.mark.parametrize("name,copy", [("translate", False), ("summarize", False), ("translate", True)])
def test_padding_and_batching_change_no_output(name, copy):
    task_type = tasks.get(name)
    config = task_type.presets["tiny"]()
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, copy=copy))
    task = task_type(config=config, data="synthetic")
    featurizer = task.fit_featurizer(task.examples("train"))
    model = build_model(task, featurizer, task.config)
    examples = task.examples("test")[:20]
    for beams in (1, 3):
        options = {**DECODING, "beams": beams}
        together = task.generate(model, featurizer, examples, options)["text"]
        alone = [task.generate(model, featurizer, [e], options)["text"][0] for e in examples[:4]]
        assert together[:4] == alone and all(isinstance(text, str) for text in together)


def test_decoding_limits_follow_the_source(monkeypatch):
    """max_len_a * width + max_len_b new pieces, capped by target_len."""
    task_type = tasks.get("translate")
    task = task_type(config=task_type.presets["tiny"](), data="synthetic")
    featurizer = task.fit_featurizer(task.examples("train"))
    model = build_model(task, featurizer, task.config)
    seen = []
    original = encoder_decoder.generate_from_source

    def spy(model, sources, **settings):
        seen.append((settings["width"], settings["max_new_tokens"]))
        return original(model, sources, **settings)

    monkeypatch.setattr(encoder_decoder, "generate_from_source", spy)
    options = {**DECODING, "beams": 1}
    task.generate(model, featurizer, [{"source": "red cat", "target": ""}], options)
    data = task.config.data
    assert seen == [(8, min(data.target_len, int(data.max_len_a * 8) + data.max_len_b))]


@pytest.fixture(scope="module")
def translate_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("translate") / "run"
    result = apps("train", "translate", "--preset", "tiny", "--data", "synthetic", "--workdir", workdir)
    assert result.exit_code == 0, result.output
    return workdir


def test_eval_reports_greedy_and_beam_beside_the_baseline(translate_run):
    result = apps("eval", "translate", "--data", "synthetic", "--workdir", translate_run)
    assert result.exit_code == 0, result.output
    assert re.search(r"bleu\s*│\s*│\s*[\d.]+\s*│\s*[\d.]+\s*│\s*[\d.]+", result.output), result.output
    saved = json.loads((translate_run / "eval_test.json").read_text())
    assert {"bleu", "chrf", "bleu_signature"} <= set(saved["greedy"]) and set(saved["beam"]) == set(saved["greedy"])
    assert set(saved["baselines"]) == {"copy_source"} and "nll" in saved and "token_accuracy" in saved


def test_predict_translates_arguments_and_stdin(translate_run):
    texts = ["red cat", "big dog runs"]
    expected = run.predict(tasks.get("translate"), translate_run, texts, {"--beams": "2"})
    assert [row["source"] for row in expected] == texts and all("translation" in row for row in expected)
    result = apps("predict", "translate", "--workdir", translate_run, "--beams", "2", *texts)
    assert result.exit_code == 0 and all(row["translation"] in result.output for row in expected), result.output
    result = apps("predict", "translate", "--workdir", translate_run, "--beams=2", input="\n".join(texts) + "\n")
    assert result.exit_code == 0 and all(row["translation"] in result.output for row in expected), result.output
    result = apps("predict", "translate", "--workdir", translate_run, "--beams", "0", "red cat")
    assert result.exit_code == 1 and "--beams 0: must be at least 1" in result.output


def test_minimum_bayes_risk_by_hand():
    samples = [("der Hund", "der Hund", "die Katze"), ("ein Haus", "eine Maus")]
    candidates = [("die Katze", "das Haus", "der Hund"), ("das Haus", "einHaus", "ein Haus")]
    # Source 1: "der Hund" matches two of three samples exactly (chrF 100 each) and wins.
    # Source 2: chrF ignores spaces, so "einHaus" and "ein Haus" tie above "das Haus": the
    # earlier of the two wins.
    assert minimum_bayes_risk(candidates, samples) == ["der Hund", "einHaus"]


def test_mbr_chooses_among_greedy_beam_and_samples(translate_run):
    texts = ["red cat", "big dog runs", "small house tree"]
    loaded = run.load(tasks.get("translate"), translate_run)
    task, featurizer = loaded.task, loaded.featurizer
    model = nnx.merge(loaded.steps.graphdef, loaded.params)
    # translate's own defaults: its penalties shape greedy and beam, not the samples.
    options = predict_option_values(task, {})
    assert options["no_repeat_ngram"] is None and task.config.data.no_repeat_ngram and task.config.data.word_reward
    examples = task.parse_inputs(texts, options)
    unshaped = {"beams": 1, "temperature": 0.7, "no_repeat_ngram": 0, "word_reward": 0.0}
    decoded = [
        task.generate(model, featurizer, examples, {**options, **settings})["text"]
        for settings in [{"beams": 1}, {"beams": 2}] + [{**unshaped, "seed": seed} for seed in (3, 4, 5)]
    ]
    chosen = task.generate(model, featurizer, examples, {**options, "beams": 2, "mbr": 3, "seed": 3})["text"]
    assert chosen == minimum_bayes_risk(list(zip(*decoded)), list(zip(*decoded[2:])))
    rows = run.predict(tasks.get("translate"), translate_run, texts, {"--beams": "2", "--mbr": "3", "--seed": "3"})
    assert [row["translation"] for row in rows] == chosen
    for flags, message in [
        (("--mbr", "-1"), "--mbr -1: must be at least 0"),
        (("--mbr", "2", "--mbr-temperature", "0"), "--mbr-temperature 0.0: must be positive"),
        (("--no-repeat-ngram", "-1"), "no_repeat_ngram=-1 must be >= 0"),
        (("--word-reward", "nan", "--beams", "1"), "word_reward=nan must be a finite number"),
    ]:
        result = apps("predict", "translate", "--workdir", translate_run, *flags, "red cat")
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_a_missing_default_dictionary_is_one_clear_message(tmp_path, monkeypatch):
    monkeypatch.setattr(freedict, "DICTIONARY", tmp_path / "freedict-eng-deu.dict.dz")
    result = apps("train", "translate", "--preset", "tiny", "--workdir", tmp_path / "run")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "dict-freedict-eng-deu" in result.output and "--data" in result.output


def test_a_copying_model_trains_predicts_and_needs_one_vocabulary(tmp_path):
    workdir = tmp_path / "run"
    copy = ("--set", "data.copy=True")
    result = apps("train", "translate", "--preset", "tiny", "--data", "synthetic", *copy, "--workdir", workdir)
    assert result.exit_code == 0, result.output
    [row] = run.predict(tasks.get("translate"), workdir, ["red cat"], {"--beams": "2"})
    assert isinstance(row["translation"], str)
    result = apps("train", "translate", "--preset", "tiny", *copy, "--set", "data.shared_vocab=False")
    assert result.exit_code == 1 and "data.copy=True copies source pieces: needs data.shared_vocab" in result.output
