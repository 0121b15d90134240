"""translate and summarize on a decoder (tasks/nlp/completion.py): each pair a prompt and its
completion, the loss on the completion and its end token, packed rows that never attend across
examples, the prompt written as the template says, and a small decoder that learns the pairs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import apps, plain
from tiny_gguf import write_tiny_gguf

from core.errors import UserError
from core.generation.generate import generate
from core.run import load, make_config
from core.training.steps import build_model
from tasks.common.tokenizer import PretrainedTokenizer
from tasks.nlp.completion import CompletionFeaturizer
from tasks.nlp.translate import TranslateTask


@pytest.fixture(scope="module")
def chat_tokenizer(tiny):
    return PretrainedTokenizer.from_checkpoint(str(tiny))  # ChatML, as SmolLM2-Instruct's


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "base.gguf", chat_template=None)
    return PretrainedTokenizer.from_checkpoint(str(path))  # no template, as Gemma 3 base's


def train_and_evaluate(workdir, options: list[str]) -> dict:
    """`apps train translate --preset tiny` on the synthetic pairs with `options` (--set each),
    then `apps eval`: the test split's scores."""
    settings = [arg for option in options for arg in ("--set", option)]
    result = apps("train", "translate", "--preset", "tiny", "--data", "synthetic", "--workdir", workdir, *settings)
    assert result.exit_code == 0, result.output
    result = apps("eval", "translate", "--workdir", workdir, "--data", "synthetic")
    assert result.exit_code == 0, result.output
    return json.loads((workdir / "eval_test.json").read_text())


def scored(batch: dict, row: int = 0) -> list[int]:
    return batch["targets"][row][batch["target_mask"][row]].tolist()


def test_with_a_chat_template_the_loss_sees_the_answer_and_its_end_of_turn(chat_tokenizer):
    featurizer = CompletionFeaturizer(chat_tokenizer, "Say {source}.", 40, 40, 128)
    batch = featurizer([{"source": "ab", "target": "cd"}])
    im_end = chat_tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert scored(batch) == [*chat_tokenizer.pieces(["cd"])[0], im_end]
    # The row reads the conversation as the template writes it; its prompt is the one decoding continues.
    length = int(batch["mask"][0].sum())
    read = chat_tokenizer.tokenizer.decode([*batch["inputs"][0, :length], batch["targets"][0, length - 1]], False)
    assert read == "<|im_start|>user\nSay ab.<|im_end|>\n<|im_start|>assistant\ncd<|im_end|>\n"
    prompt = featurizer.prompts([{"source": "ab"}])[0]
    assert batch["inputs"][0, : len(prompt)].tolist() == prompt
    assert not batch["target_mask"][0, : len(prompt) - 1].any()


def test_without_a_template_the_ids_are_start_prompt_completion_eos(base_tokenizer):
    featurizer = CompletionFeaturizer(base_tokenizer, "Say {source}:\n", 40, 40, 128)
    batch = featurizer([{"source": "ab", "target": "cd"}])
    prompt, completion = base_tokenizer.pieces(["Say ab:\n", "cd"])
    start, eos = base_tokenizer.start_id, base_tokenizer.eos_id
    width = len(prompt) + len(completion) + 1
    assert batch["inputs"][0, :width].tolist() == [start, *prompt, *completion]
    assert batch["targets"][0, :width].tolist() == [*prompt, *completion, eos]
    assert batch["target_mask"][0, :width].tolist() == [False] * len(prompt) + [True] * (len(completion) + 1)
    assert featurizer.prompts([{"source": "ab"}]) == [[start, *prompt]]


def test_the_template_holds_the_source_and_gloss_as_written(base_tokenizer):
    glossed = CompletionFeaturizer(base_tokenizer, "EN: {source}\nGL: {gloss}\n", 40, 40, 128, {"house": "Haus"})
    assert glossed.prompt_text("the house") == "EN: the house\nGL: the Haus\n"
    plain_template = CompletionFeaturizer(base_tokenizer, "{source} =\n", 40, 40, 128)
    assert plain_template.prompt_text("a {gloss} b") == "a {gloss} b =\n"  # a source's braces stay
    # Decoding keeps the new text alone, up to the stop token.
    prompt = plain_template.prompts([{"source": "ab"}])[0]
    assert plain_template.text(prompt, [*base_tokenizer.pieces(["the cd"])[0], base_tokenizer.eos_id]) == "the cd"
    # A long source is cut to data.source_len pieces before it fills the template.
    short = CompletionFeaturizer(base_tokenizer, "{source}\n", 3, 40, 128)
    assert short.sources([{"source": "abcdef"}]) == ["abc"]
    with pytest.raises(UserError, match=r"data.prompt has \{gloss\}, but this run has no glossary"):
        CompletionFeaturizer(base_tokenizer, "{source} {gloss}", 40, 40, 128)
    with pytest.raises(UserError, match=r"has no \{source\}"):
        CompletionFeaturizer(base_tokenizer, "Translate:", 40, 40, 128)


def test_a_prompt_without_the_source_is_refused_at_the_command_line(tmp_path):
    command = ["train", "summarize", "--preset", "tiny", "--workdir", tmp_path / "run"]
    result = apps(*command, "--set", "data.prompt='Title:'")
    assert result.exit_code == 1 and "data.prompt='Title:' must hold {source}" in plain(result.output)
    result = apps(*command, "--set", "model.causal=true")
    assert result.exit_code == 1 and "reads a prompt: give data.prompt" in plain(result.output)


def test_packed_examples_never_attend_to_each_other(tiny, chat_tokenizer):
    overrides = [f"model.pretrained={str(tiny)!r}", "data.prompt='Say {source}.'"]
    config = make_config(TranslateTask, "tiny", overrides)
    task = TranslateTask(config=config, data="synthetic")
    featurizer = CompletionFeaturizer(chat_tokenizer, "Say {source}.", 40, 40, 128)
    model = build_model(task, featurizer, config, from_pretrained=True)
    first, second = {"source": "red cat", "target": "tac der"}, {"source": "the dog", "target": "god eht"}
    packed = featurizer([first, second])
    assert len(packed["inputs"]) == 1 and set(packed["segments"][0].tolist()) == {0, 1, 2}
    alone = featurizer([second])
    where = packed["segments"][0] == 2
    together = model({k: jnp.asarray(v) for k, v in packed.items()}).hidden[0][where]
    by_itself = model({k: jnp.asarray(v) for k, v in alone.items()}).hidden[0][: int(where.sum())]
    np.testing.assert_allclose(np.asarray(together), np.asarray(by_itself), atol=1e-5)
    assert scored(packed)[-len(scored(alone)) :] == scored(alone)


def test_a_pretrained_decoder_fine_tunes_predicts_and_is_scored_beside_itself_zero_shot(tiny, tmp_path):
    workdir = tmp_path / "run"
    options = [
        f"model.pretrained={str(tiny)!r}",
        "data.prompt='Say {source} backwards.'",
        "data.source_len=40",
        "data.target_len=40",
        "data.max_len_a=2",
        "model.max_len=128",
        "train.steps=4",
        "train.eval_every=4",
        "train.batch_size=8",
        "train.eval_batch_size=8",
    ]
    scores = train_and_evaluate(workdir, options)
    assert set(scores) >= {"greedy", "beam", "nll"} and "mbr" not in scores
    assert f"zero_shot ({tiny}, greedy)" in scores["baselines"] and "copy_source" in scores["baselines"]
    result = apps("predict", "translate", "--workdir", workdir, "red cat", "--beams", "1")
    assert result.exit_code == 0 and "red cat" in result.output


def test_a_small_decoder_learns_the_synthetic_pairs(tmp_path):
    """A decoder trained here from scratch (BPE on both sides) takes the same route and learns
    to reverse the words and spell each one backwards."""
    workdir = tmp_path / "run"
    options = [
        "model.causal=true",
        "model.max_len=64",
        "model.d_model=64",
        "model.num_layers=2",
        "model.mlp_dim=128",
        "data.prompt='{source} ='",
        "data.no_repeat_ngram=0",
        "data.word_reward=0",
        "train.steps=300",
        "train.eval_every=300",
        "optim.learning_rate=3e-3",
    ]
    scores = train_and_evaluate(workdir, options)
    assert scores["greedy"]["chrf"] > 90 and scores["baselines"]["copy_source"]["chrf"] < 30


def test_a_shortlisted_decoder_trains_scores_and_writes_within_its_shortlist(tiny, tmp_path):
    """`data.shortlist`: the output covers the ids the training completions are spelled with
    (and the stop tokens); the run keeps the list beside its tokenizer, reports how much of the
    test targets it covers, and every id it generates is on it."""
    workdir = tmp_path / "run"
    options = [
        f"model.pretrained={str(tiny)!r}",
        "data.prompt='Say {source} backwards.'",
        "data.shortlist=true",
        "data.source_len=40",
        "data.target_len=40",
        "model.max_len=128",
        "train.steps=2",
        "train.eval_every=2",
        "train.batch_size=8",
        "train.eval_batch_size=8",
    ]
    scores = train_and_evaluate(workdir, options)
    loaded = load(TranslateTask, workdir, data="synthetic")
    featurizer = loaded.featurizer
    shortlist = set(featurizer.shortlist)
    assert shortlist == set(json.loads((workdir / "featurizer" / "shortlist.json").read_text()))
    trained = featurizer(loaded.task.examples("train"))
    assert set(trained["targets"][trained["target_mask"]].tolist()) | set(featurizer.tokenizer.stop_ids) == shortlist
    assert len(shortlist) < featurizer.tokenizer.vocab_size / 2
    assert 0.9 < scores["shortlist_coverage"] <= 1.0
    model = nnx.merge(loaded.steps.graphdef, loaded.params)
    prompts = featurizer.prompts(loaded.task.examples("test")[:4])
    generated = generate(model, prompts, max_new_tokens=12, temperature=1.0, seed=3)
    assert set(generated.tokens.ravel().tolist()) <= shortlist | {0}
