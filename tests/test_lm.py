"""The lm task: packing predicts every piece and EOS exactly once, the n-gram baselines score the
same predictions, bits per character by hand, generation through the CLI, and bad input."""

import math

import numpy as np
import pytest
from flax import nnx
from helpers import apps, plain

from core import run
from core.errors import UserError
from core.generation.generate import generate_beams
from tasks.common.tokenizer import BOS, EOS, PAD
from tasks.nlp.lm import LanguageModel, LMTask, tiny
from tasks.nlp.lm_featurizer import LMFeaturizer, characters


@pytest.fixture(scope="module")
def task_and_featurizer():
    task = LMTask(config=tiny(), data="synthetic")
    return task, task.fit_featurizer(task.examples("train"))


def test_packing_predicts_every_piece_and_end_once(task_and_featurizer):
    _, featurizer = task_and_featurizer
    examples = [{"text": "The cat sees the dog.\n"}, {"text": "A fox."}, {"text": "The birds chase the red fox again."}]
    pieces = featurizer.pieces(examples)
    arrays = LMFeaturizer(featurizer.tokenizer, max_len=8)(examples)
    stream = [token for ids in pieces for token in (BOS, *ids, EOS)]
    rows = math.ceil((len(stream) - 1) / 8)
    assert arrays["inputs"].shape == (rows, 8)
    # Inputs are the stream, targets the stream shifted by one, both padded at the end only.
    np.testing.assert_array_equal(arrays["inputs"].reshape(-1)[: len(stream) - 1], stream[:-1])
    np.testing.assert_array_equal(arrays["targets"].reshape(-1)[: len(stream) - 1], stream[1:])
    assert (arrays["inputs"].reshape(-1)[len(stream) - 1 :] == PAD).all()
    # Scored: every piece and every EOS, never the BOS that follows an EOS, never padding.
    scored = arrays["targets"][arrays["target_mask"]]
    assert len(scored) == sum(len(ids) + 1 for ids in pieces)
    assert (scored == EOS).sum() == len(examples) and not (scored == BOS).any()
    assert characters(examples) == sum(len(e["text"]) + 1 for e in examples)


def test_baselines_score_the_same_predictions(task_and_featurizer):
    task, featurizer = task_and_featurizer
    train, test = task.examples("train"), task.examples("test")
    results = task.baselines(train, test, featurizer)
    predictions = int(featurizer(test)["target_mask"].sum())
    for name, scores in results.items():
        # bits per character and perplexity are two views of one summed log-likelihood.
        nll_from_bits = scores["bits_per_character"] * math.log(2) * characters(test)
        assert nll_from_bits / predictions == pytest.approx(scores["loss"], rel=1e-9), name
        assert scores["perplexity"] == pytest.approx(math.exp(scores["loss"]), rel=1e-9)
    # On text from a small grammar the 5-gram beats the unigram by far.
    assert results["kneser_ney_5gram"]["bits_per_character"] < 0.6 * results["unigram"]["bits_per_character"]


def test_score_by_hand(task_and_featurizer):
    task, featurizer = task_and_featurizer
    examples = [{"text": "abc"}, {"text": "de"}]  # 3 + 1 + 2 + 1 = 7 characters
    predictions = {"nll": np.array([2.0, 5.0]), "predictions": np.array([3, 4])}
    scores = task.score(predictions, examples, featurizer)
    assert scores["loss"] == pytest.approx(1.0)
    assert scores["perplexity"] == pytest.approx(math.e)
    assert scores["bits_per_character"] == pytest.approx(7.0 / math.log(2) / 7)


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "lm", "--data", "{folder}"], "no .txt files"),
        (["train", "lm", "--data", "{empty}"], "the file is only whitespace"),
        (["train", "lm", "--data", "{table}", "--set", "data.text_column=body"], "no column 'body'"),
    ],
)
def test_bad_corpus_is_named(tmp_path, args, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "table.csv").write_text("text\nsome words\n")
    paths = {"folder": tmp_path / "folder", "empty": tmp_path / "empty.txt", "table": tmp_path / "table.csv"}
    args = [a.format(**paths) for a in args]
    result = apps(*args, "--preset", "tiny", "--workdir", tmp_path / "run")
    assert result.exit_code == 1 and message in plain(result.output), result.output
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lm") / "run"
    result = apps(
        "train", "lm", "--preset", "tiny", "--data", "synthetic", "--workdir", workdir, "--set", "train.steps=40"
    )
    assert result.exit_code == 0, result.output
    return workdir


def test_streamed_continuation_is_the_tabled_one(trained):
    greedy = ["--max-new-tokens", "12", "--temperature", "0"]
    streamed = apps("predict", "lm", "The cat", "--workdir", trained, *greedy)
    assert streamed.exit_code == 0, streamed.output
    rows = run.predict(LMTask, trained, ["The cat", "The dogs"], {"--max-new-tokens": "12", "--temperature": "0"})
    assert [row["prompt"] for row in rows] == ["The cat", "The dogs"]
    # The terminal shows the prompt and then, piece by piece, exactly the continuation.
    assert streamed.output == "The cat" + rows[0]["continuation"] + "\n"
    assert rows[0]["continuation"].startswith(" ")  # a new word after the prompt keeps its space


def test_python_generation_on_a_loaded_run(trained):
    model = LanguageModel(trained)
    texts = model.generate(["The cat", "The dogs"], max_new_tokens=12, temperature=0)
    rows = run.predict(LMTask, trained, ["The cat", "The dogs"], {"--max-new-tokens": "12", "--temperature": "0"})
    assert texts == [row["continuation"] for row in rows]
    # Greedy text is the argmax continuation, one full forward pass (no cache) per new piece,
    # until EOS, decoded after its prompt.
    featurizer = model.loaded.featurizer
    # One compiled forward over a fixed-width buffer: causal, so the padding after the last real
    # piece changes nothing before it.
    logits_at = nnx.jit(lambda m, tokens, last: m({"inputs": tokens, "mask": tokens != PAD}).logits()[0, last])
    for text, prompt in zip(texts, ["The cat", "The dogs"]):
        start = [BOS, *featurizer.pieces([{"text": prompt}])[0]]
        ids = list(start)
        while len(ids) < len(start) + 12:
            tokens = np.full((1, 32), PAD, np.int32)
            tokens[0, : len(ids)] = ids
            best = int(np.argmax(logits_at(model.model, tokens, len(ids) - 1)))
            if best == EOS:
                break
            ids.append(best)
        assert text == featurizer.continuation(start, ids[len(start) :]), prompt
    # beams=2 is the beam search of width 2 (its quality is tested in test_generate): the text of
    # its best beam, whose EOS ends it.
    start = [BOS, *featurizer.pieces([{"text": "The cat"}])[0]]
    beams = generate_beams(model.model, [start], beam_size=2, max_new_tokens=8, stop_tokens=(EOS,))
    best = [int(t) for t in beams.tokens[0, 0, : beams.lengths[0, 0]] if t != EOS]
    assert model.generate(["The cat"], max_new_tokens=8, beams=2) == [featurizer.continuation(start, best)]
    with pytest.raises(UserError, match="lm predictions take no temp; the options are max_new_tokens"):
        model.generate(["The cat"], temp=0.5)


def test_generation_mistakes_are_named(trained, tmp_path):
    cases = [
        (["predict", "lm", "--max-new-tokens", "40"], "max_new_tokens=40 leaves no room for a prompt"),
        (["predict", "lm", "--max-new-tokens", "8", "--beams", "0"], "--beams 0: must be at least 1"),
        (["predict", "lm", "--max-new-tokens", "8", "--top-p", "1.5"], "top_p=1.5 must be in (0, 1]"),
        (["predict", "lm", "--max-new-tokens", "ten"], "--max-new-tokens 'ten': expected int"),
        (["predict", "lm", "--size", "3"], "does not take --size"),
    ]
    for args, message in cases:
        result = apps(*args, "The cat", "--workdir", trained)
        assert result.exit_code == 1 and message in plain(result.output), result.output
        assert result.output.startswith("Error:"), result.output  # nothing streamed before the message
    result = apps("predict", "lm", "--workdir", trained, input="  \n")
    assert result.exit_code == 1 and "at least one non-empty prompt" in result.output


def test_long_prompt_keeps_its_end(trained, apps_log):
    rows = run.predict(LMTask, trained, ["The cat sees the dog. " * 20], {"--max-new-tokens": "4"})
    assert len(rows) == 1 and "keeping its last 28 so that 4 new tokens fit in model.max_len=32" in apps_log.text


def test_abandoned_embeddings_stop_before_the_next_text(trained):
    """Within `abandon.run` (a served call), a decoder's embeddings read one text at a time and
    stop at the next once every request of the call has given up: the texts left are not read."""
    import threading

    from core.generation import abandon
    from core.run import Predictor

    predictor = Predictor(LMTask, trained)
    examples = predictor.task.parse_inputs(["The cat", "The dogs", "A bird"], predictor.options({}))
    gone = threading.Event()
    states = abandon.run(gone, predictor.task.embed, predictor.model, predictor.featurizer, examples)
    assert len(states) == 3  # not given up: every text read
    gone.set()
    with pytest.raises(abandon.Abandoned):
        abandon.run(gone, predictor.task.embed, predictor.model, predictor.featurizer, examples)
    predictor.task.embed(predictor.model, predictor.featurizer, examples[:1])  # outside a run: no question asked
