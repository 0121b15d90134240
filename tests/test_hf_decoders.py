"""Hugging Face decoder folders (core/checkpoints/hf_decoders.py): tiny Llama, Qwen2 and Gemma 3 models with
random weights saved by transformers, and their logits there (tests/fixtures/hf_decoders/,
made by make_hf_decoders.py in that folder), read into the core's Transformer."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pretrained_decoder
from tiny_gguf import write_tiny_gguf

from core.checkpoints import pretrained
from core.errors import UserError
from tasks.common.tokenizer import PretrainedTokenizer

FIXTURES = "tests/fixtures/hf_decoders"


def folder(name: str, tmp_path) -> str:
    """The fixture folder with a tokenizer.json of the same 264 tokens (the tiny GGUF's)."""
    target = tmp_path / name
    shutil.copytree(f"{FIXTURES}/{name}", target)
    gguf = write_tiny_gguf(tmp_path / "tokens.gguf")
    (target / "tokenizer.json").write_text(pretrained.tokenizer_files(str(gguf))[0])
    return str(target)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_logits_match_transformers(name, tmp_path):
    path = folder(name, tmp_path)
    checkpoint, model, report = pretrained_decoder(path)
    assert report.new == () and report.unused == ()
    reference = np.load(f"{FIXTURES}/{name}/reference.npz")
    ids = jnp.asarray(reference["ids"], jnp.int32)
    logits = model({"inputs": ids, "mask": jnp.ones(ids.shape, bool)}).logits()[0]
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=1e-4)
    # export is load's inverse: the folder's own tensors come back.
    exported = pretrained.export(model, path)
    original = pretrained.read_tensors(checkpoint.weights)
    assert set(exported) == set(original)
    for key in original:
        np.testing.assert_allclose(exported[key], original[key], atol=1e-6)


def test_the_architecture_of_each_folder(tmp_path):
    llama, qwen, gemma = (pretrained.read_checkpoint(folder(n, tmp_path)).model for n in ("llama", "qwen2", "gemma3"))
    assert (llama.mlp, llama.key_value_heads, llama.rope_base, llama.qkv_bias) == ("swiglu", 2, 1e4, False)
    assert (qwen.rope_base, qwen.qkv_bias) == (1e6, True)
    assert (gemma.mlp, gemma.head_dim, gemma.norm_position, gemma.qk_norm, gemma.embedding_scale) == (
        "geglu",
        16,
        "sandwich",
        True,
        True,
    )
    assert [gemma.window(i) for i in range(6)] == [4] * 5 + [None]
    assert (gemma.rope_base_of(0), gemma.rope_base_of(5)) == (1e4, 1e6)
    stops = PretrainedTokenizer.from_checkpoint(folder("gemma3", tmp_path / "again")).stop_ids
    assert stops == (1,)  # generation_config.json's eos_token_id


def test_an_untied_or_unknown_folder_is_named(tmp_path):
    path = folder("llama", tmp_path)
    config_path = tmp_path / "llama" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(UserError, match="tie_word_embeddings is false"):
        pretrained.read_checkpoint(path)
    config_path.write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}))
    with pytest.raises(UserError, match="model_type 'mistral' is not a family this suite loads"):
        pretrained.read_checkpoint(path)
