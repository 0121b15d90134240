"""The encoder-decoder: cached decoding equals teacher forcing, the source's padding is invisible,
cross-attention reads the real source, the decoder is causal, the decoding engine's choices
carry over (greedy, beams, batching), and a tiny model learns to reverse a batch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import TINY_BODY as SETTINGS

from core.config import ModelConfig
from core.errors import UserError
from core.generation.seq2seq import (
    DecodeState,
    encode_prefill,
    encoder_decoder_step,
    first_logits,
    generate_beams_from_source,
    generate_from_source,
    prepare_sources,
)
from core.model.attention import attention, library_arguments, memory_attention
from core.model.encoder_decoder import EncoderDecoder, Start
from core.model.heads import CopyOutput, CopyProjection, TiedOutput, TokenEmbedder
from core.model.transformer import Transformer
from core.training import losses

VOCAB, BOS, EOS = 40, 1, 2
START = Start((BOS,))
SOURCES = [[5, 9, 12, 3, 30], [8, 8, 21, 4, 17, 26, 11, 19, 6], [33, 14]]


def encoder_decoder(copy: bool = False, **changes) -> EncoderDecoder:
    """A tiny model whose source and target share one vocabulary, one embedding table and the
    tied output (with `copy`, a pointer-generator over it)."""
    rngs = nnx.Rngs(0)
    embedder = TokenEmbedder(VOCAB, SETTINGS["d_model"], rngs=rngs)
    config = ModelConfig(**{**SETTINGS, **changes})
    head = CopyOutput(embedder, config.d_model, rngs=rngs) if copy else TiedOutput(embedder)
    return EncoderDecoder.build(config, embedder, embedder, head, rngs=rngs)


@pytest.fixture(scope="module")
def model():
    return encoder_decoder()


@nnx.jit
def forward(model, batch):
    return model(batch).logits()


def mean_cross_entropy(outputs, batch):
    """Either head's cross-entropy per scored target."""
    if isinstance(outputs, CopyProjection):
        total, weight = losses.copy_cross_entropy(outputs, batch["targets"], batch["target_mask"])
    else:
        total, weight = losses.linear_cross_entropy(
            outputs.hidden, outputs.weight, batch["targets"], batch["target_mask"]
        )
    return total / weight


def padded(sources, length, pad=7):
    """Sources right-padded to `length` with a junk token (not 0, so that only the mask hides it)."""
    tokens = np.full((len(sources), length), pad, np.int32)
    for row, source in enumerate(sources):
        tokens[row, : len(source)] = source
    return tokens, np.arange(length)[None, :] < np.array([len(s) for s in sources])[:, None]


def teacher_forced(model, sources, targets, length=9, pad=7):
    """Logits [B, U, V] of the whole forward pass with `targets` [B, U] shifted right behind BOS."""
    tokens, mask = padded(sources, length, pad)
    targets = np.asarray(targets, np.int32)
    decoder_inputs = np.concatenate([np.full((len(targets), 1), BOS, np.int32), targets[:, :-1]], axis=1)
    batch = {"inputs": tokens, "mask": mask, "decoder_inputs": decoder_inputs, "decoder_mask": decoder_inputs >= 0}
    return forward(model, jax.tree.map(jnp.asarray, batch))


jit_encode_prefill = nnx.jit(encode_prefill, static_argnums=(3, 4))
jit_step = nnx.jit(encoder_decoder_step, static_argnums=3)


@pytest.mark.parametrize(
    "changes",
    [
        {"positions": "learned"},
        {"positions": "rotary"},
        {"positions": "learned", "num_kv_heads": 2},
        {"positions": "rotary", "num_kv_heads": 1, "decoder_layers": 3},
        {"positions": "rotary", "num_kv_heads": 2, "attention": "xla"},
        {"positions": "rotary", "copy": True},
    ],
)
def test_cached_decoding_equals_teacher_forcing(changes):
    model = encoder_decoder(**changes)
    targets = np.random.default_rng(0).integers(3, VOCAB, (3, 10)).astype(np.int32)
    full = teacher_forced(model, SOURCES, targets)
    tokens, mask = padded(SOURCES, 9)
    logits, state, _ = jit_encode_prefill(model, jnp.asarray(tokens), jnp.asarray(mask), START, 10)
    for position in range(10):
        np.testing.assert_allclose(logits, full[:, position], atol=2e-5, rtol=1e-5)
        logits, state = jit_step(model, state, jnp.asarray(targets[:, position]))
    np.testing.assert_array_equal(state.cache.lengths, [11, 11, 11])
    # The memory's keys and values were projected once, for every decoder layer, batch first.
    assert len(state.cache.memory.layers) == len(model.decoder.blocks)
    assert (state.source is not None) == model.copies
    assert all(leaf.shape[0] == 3 for leaf in jax.tree.leaves(state))


def test_a_prompt_prefills_at_once_with_its_suppressions_and_probe():
    """Whisper's shape (sinusoidal encoder positions, learned decoder ones, biases, exact GELU)
    and its start: a prompt of several tokens, ids suppressed always and at the first step, and
    the probability of a token after the prompt's first one."""
    model = encoder_decoder(encoder_positions="sinusoidal", bias=True, mlp="gelu_exact")
    assert model.encoder.config.positions == "sinusoidal" and model.encoder.position_embedding is None
    prompt = (BOS, 11, 12)
    targets = np.random.default_rng(1).integers(3, VOCAB, (3, 8)).astype(np.int32)
    # Teacher forcing over prompt + targets: position 0 reads BOS, position 2 the prompt's end.
    full = teacher_forced(model, SOURCES, np.concatenate([np.tile(prompt[1:], (3, 1)), targets], axis=1))
    start = Start(prompt, suppress=(4,), suppress_first=(5,), probe=6)
    tokens, mask = padded(SOURCES, 9)
    logits, state, probe = jit_encode_prefill(model, jnp.asarray(tokens), jnp.asarray(mask), start, 8)
    np.testing.assert_allclose(probe, jax.nn.softmax(full[:, 0])[:, 6], rtol=1e-5)
    expected = np.asarray(full[:, 2]).copy()
    expected[:, [4, 5]] = -np.inf
    np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=1e-5)
    for position in range(7):
        logits, state = jit_step(model, state, jnp.asarray(targets[:, position]), (4,))
        expected = np.asarray(full[:, 3 + position]).copy()
        expected[:, 4] = -np.inf
        np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(state.cache.lengths, [10, 10, 10])


def test_the_copy_head_gives_source_tokens_their_attention():
    model = encoder_decoder(copy=True)
    targets = np.random.default_rng(5).integers(3, VOCAB, (3, 4))
    log_probs = teacher_forced(model, SOURCES, targets)
    np.testing.assert_allclose(np.exp(log_probs).sum(-1), 1.0, atol=1e-5)
    # All copying (gate ~0) with uniform attention (a zero query): P(y) is y's share of the source.
    model.head.gate.bias[...] = jnp.full((1,), -40.0)
    model.head.query.kernel[...] = jnp.zeros_like(model.head.query.kernel[...])
    probs = np.exp(teacher_forced(model, SOURCES, targets))
    for row, source in enumerate(SOURCES):
        expected = np.bincount(source, minlength=VOCAB) / len(source)
        np.testing.assert_allclose(probs[row], np.broadcast_to(expected, probs[row].shape), atol=1e-6)


@nnx.jit
def prefill_targets(model, tokens, mask, prefix, lengths):
    """Target prefixes [B, T] of `lengths` through `Transformer.prefill` over the memory."""
    memory, memory_mask = model.encode(tokens, mask)
    decoder = model.decoder
    cache = decoder.init_cache(len(tokens), 12, memory=decoder.project_memory(memory, memory_mask))
    x, prefix_mask = model.target_embedder(prefix, jnp.arange(prefix.shape[1])[None, :] < lengths[:, None])
    hidden, cache = decoder.prefill(x, prefix_mask, cache)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
    return model.head(last, jnp.ones((len(tokens), 1), bool)).logits()[:, 0], cache


def test_a_prefilled_target_prefix_follows_the_memory_too(model):
    targets = np.random.default_rng(4).integers(3, VOCAB, (3, 10)).astype(np.int32)
    full = teacher_forced(model, SOURCES, targets)
    prefix = np.concatenate([np.full((3, 1), BOS, np.int32), targets[:, :4]], axis=1)
    lengths = np.array([3, 5, 1], np.int32)  # BOS and 2, 4 or 0 targets; the rest is padding
    tokens, mask = padded(SOURCES, 9)
    logits, cache = prefill_targets(model, tokens, mask, prefix, lengths)
    rows, state = np.arange(3), DecodeState(cache, None)
    for offset in range(4):
        np.testing.assert_allclose(logits, full[rows, lengths - 1 + offset], atol=2e-5, rtol=1e-5)
        logits, state = jit_step(model, state, jnp.asarray(targets[rows, lengths - 1 + offset]))


def test_more_source_padding_changes_nothing(model):
    targets = np.random.default_rng(1).integers(3, VOCAB, (3, 6))
    np.testing.assert_allclose(
        teacher_forced(model, SOURCES, targets, length=9, pad=7),
        teacher_forced(model, SOURCES, targets, length=15, pad=23),
        atol=1e-5,
    )


def test_cross_attention_reads_the_real_source_only(model):
    targets = np.random.default_rng(2).integers(3, VOCAB, (3, 6))
    base = teacher_forced(model, SOURCES, targets)
    changed = [list(s) for s in SOURCES]
    changed[2][1] = 25  # a real token of row 2
    after = teacher_forced(model, changed, targets)
    np.testing.assert_allclose(after[:2], base[:2], atol=1e-6)
    # Every target position of row 2 sees it.
    assert np.all(np.abs(after[2] - base[2]).max(-1) > 1e-4)
    # Row 2 is padded from position 2 on: a different pad token there is invisible.
    np.testing.assert_allclose(teacher_forced(model, SOURCES, targets, pad=31), base, atol=1e-6)


def test_the_decoder_is_causal_over_targets(model):
    targets = np.random.default_rng(3).integers(3, VOCAB, (3, 8))
    changed = targets.copy()
    changed[:, 4:] = 5  # decoder inputs from position 5 on
    a, b = teacher_forced(model, SOURCES, targets), teacher_forced(model, SOURCES, changed)
    np.testing.assert_allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not np.allclose(a[:, 5:], b[:, 5:])


def test_greedy_is_the_argmax_of_teacher_forcing_and_beam_one_agrees(model):
    greedy = generate_from_source(model, SOURCES, max_new_tokens=6, start=START)
    np.testing.assert_array_equal(greedy.lengths, [6, 6, 6])
    full = teacher_forced(model, SOURCES, greedy.tokens)
    np.testing.assert_array_equal(np.argmax(full, -1), greedy.tokens)
    beams = generate_beams_from_source(model, SOURCES, beam_size=1, max_new_tokens=6, start=START)
    np.testing.assert_array_equal(beams.tokens[:, 0], greedy.tokens)


def test_beam_scores_are_the_models_and_at_least_greedys(model):
    alpha = 0.6
    beams = generate_beams_from_source(model, SOURCES, beam_size=3, max_new_tokens=6, start=START, length_penalty=alpha)
    greedy = generate_from_source(model, SOURCES, max_new_tokens=6, start=START).tokens

    def score(row, tokens):
        log_probs = jax.nn.log_softmax(teacher_forced(model, [SOURCES[row]], [tokens])[0], -1)
        return float(log_probs[np.arange(len(tokens)), tokens].sum()) / ((5 + len(tokens)) / 6) ** alpha

    for row in range(len(SOURCES)):
        assert beams.scores[row, 0] == pytest.approx(score(row, beams.tokens[row, 0]), abs=1e-4)
        assert beams.scores[row, 0] >= score(row, greedy[row]) - 1e-5


def test_batched_sources_give_what_each_gives_alone(model):
    # A stop token that row 0 writes within its first four tokens.
    stop = int(generate_from_source(model, SOURCES, max_new_tokens=6, start=START).tokens[0, 3])
    together = generate_from_source(model, SOURCES, max_new_tokens=6, start=START, stop_tokens=[stop])
    assert together.lengths[0] <= 4
    for row, source in enumerate(SOURCES):
        alone = generate_from_source(model, [source], max_new_tokens=6, start=START, stop_tokens=[stop])
        np.testing.assert_array_equal(together.tokens[row], alone.tokens[0])
        assert together.lengths[row] == alone.lengths[0]
    # Beams too, for the shortest source, the one most padded in the batch.
    beams = generate_beams_from_source(model, SOURCES, beam_size=3, max_new_tokens=6, start=START)
    alone = generate_beams_from_source(model, SOURCES[2:], beam_size=3, max_new_tokens=6, start=START)
    np.testing.assert_array_equal(beams.tokens[2], alone.tokens[0])
    np.testing.assert_allclose(beams.scores[2], alone.scores[0], atol=1e-5)


@pytest.mark.parametrize("copy", [False, True])
def test_a_tiny_model_learns_to_reverse_one_batch(copy):
    rng = np.random.default_rng(0)
    sources = [list(rng.integers(3, 16, n)) for n in (3, 4, 5, 6, 6, 5, 4, 3)]
    targets = [source[::-1] + [EOS] for source in sources]
    inputs, mask = padded(sources, 6, pad=0)
    shifted = [[BOS] + target[:-1] for target in targets]
    decoder_inputs, decoder_mask = padded(shifted, 7, pad=0)
    batch = {
        "inputs": inputs,
        "mask": mask,
        "decoder_inputs": decoder_inputs,
        "decoder_mask": decoder_mask,
        "targets": padded(targets, 7, pad=0)[0],
        "target_mask": decoder_mask,
    }
    model = encoder_decoder(copy, num_layers=1, decoder_layers=2, num_heads=2, num_kv_heads=1, positions="rotary")
    graphdef, params = nnx.split(model)
    tx = optax.adam(1e-2)

    @jax.jit
    def train_step(params, opt_state, batch):
        def loss(params):
            return mean_cross_entropy(nnx.merge(graphdef, params)(batch), batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = tx.init(params)
    for _ in range(60):
        params, opt_state, value = train_step(params, opt_state, batch)
    assert float(value) < 0.05
    nnx.update(model, params)
    result = generate_from_source(model, sources, max_new_tokens=7, start=START, stop_tokens=[EOS])
    for row, target in enumerate(targets):
        assert list(result.tokens[row, : result.lengths[row]]) == target


def test_dropout_acts_only_with_a_key():
    model = encoder_decoder(dropout=0.3)
    tokens, mask = padded(SOURCES, 9)
    batch = {"inputs": tokens, "mask": mask, "decoder_inputs": tokens[:, :4], "decoder_mask": np.ones((3, 4), bool)}
    run = nnx.jit(lambda model, key: model(batch, dropout_key=key).logits())
    np.testing.assert_array_equal(run(model, None), run(model, None))
    assert not np.allclose(run(model, None), run(model, jax.random.key(0)))


@pytest.mark.parametrize("heads,key_value_heads", [(4, 4), (4, 2)])
def test_cross_attention_kernels_agree_on_values_and_gradients(heads, key_value_heads):
    rng = np.random.default_rng(heads + key_value_heads)
    q, cotangent = (jnp.asarray(rng.standard_normal((2, 5, heads, 8), np.float32)) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, 7, key_value_heads, 8), np.float32)) for _ in range(2))
    mask = jnp.asarray(np.arange(7)[None, :] < np.array([[7], [3]]))

    def loss(implementation):
        def f(q, k, v):
            out = attention(q, k, v, mask, causal=False, implementation=implementation, cross=True)
            return (out * cotangent).sum()

        return jax.value_and_grad(f, (0, 1, 2))(q, k, v)

    for a, b in zip(jax.tree.leaves(loss("blockwise")), jax.tree.leaves(loss("xla"))):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    # Decoding's form reads the keys and values in the cache's layout.
    decoding = memory_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 3, 1), mask)
    np.testing.assert_allclose(decoding, attention(q, k, v, mask, causal=False, implementation="xla"), atol=2e-5)
    # cuDNN is told the keys' lengths only: every query of the other sequence runs.
    arguments = library_arguments(mask, False, "cudnn", cross=True)
    assert "query_seq_lengths" not in arguments
    np.testing.assert_array_equal(arguments["key_value_seq_lengths"], [7, 3])


def test_the_stacks_and_their_settings_are_checked():
    model = encoder_decoder(decoder_layers=3, causal=True)
    assert (len(model.encoder.blocks), len(model.decoder.blocks)) == (2, 3)
    assert not model.encoder.config.causal and model.decoder.config.causal
    assert all(block.cross_attention is None for block in model.encoder.blocks)
    with pytest.raises(UserError, match="model.decoder_layers=0 must be positive"):
        ModelConfig(decoder_layers=0)
    with pytest.raises(ValueError, match="needs a memory"):
        model.decoder(jnp.zeros((1, 3, 32)), jnp.ones((1, 3), bool))
    with pytest.raises(ValueError, match="takes none"):
        model.encoder(jnp.zeros((1, 3, 32)), jnp.ones((1, 3), bool), memory=jnp.zeros((1, 2, 32)))
    causal = Transformer(ModelConfig(**SETTINGS, causal=True), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="encoder without cross-attention"):
        EncoderDecoder(model.source_embedder, causal, model.target_embedder, causal, model.head)
    with pytest.raises(UserError, match="exceeds the decoder's max_len=16"):
        generate_from_source(model, SOURCES, max_new_tokens=17, start=START)
    with pytest.raises(UserError, match="at least one position"):
        generate_from_source(model, [[]], max_new_tokens=2, start=START)
    with pytest.raises(UserError, match="exceed the encoder's max_len=16"):
        generate_from_source(model, [list(range(3, 20))], max_new_tokens=2, start=START)
    # Feature sources [S, F] pad on their first axis.
    features, mask = prepare_sources(model, [np.ones((3, 5), np.float32), np.ones((1, 5), np.float32)], 2)
    assert features.shape == (2, 3, 5) and features.dtype == np.float32
    np.testing.assert_array_equal(mask, [[True, True, True], [True, False, False]])


def test_rematerialized_stacks_give_the_same_gradients():
    tokens, mask = padded(SOURCES, 9)
    batch = {"inputs": tokens, "mask": mask, "decoder_inputs": tokens[:, :5], "decoder_mask": np.ones((3, 5), bool)}

    def gradients(remat):
        rngs = nnx.Rngs(0)
        embedder = TokenEmbedder(VOCAB, SETTINGS["d_model"], rngs=rngs)
        model = EncoderDecoder.build(
            ModelConfig(**SETTINGS), embedder, embedder, TiedOutput(embedder), remat=remat, rngs=rngs
        )
        graphdef, params = nnx.split(model)
        loss = lambda params: nnx.merge(graphdef, params)(batch).logits().std()  # noqa: E731
        return jax.jit(jax.grad(loss))(params), jax.make_jaxpr(jax.grad(loss))(params)

    (plain, _), (rematerialized, jaxpr) = gradients(False), gradients(True)
    # One checkpoint per block: two encoder and two decoder blocks.
    assert len(re.findall(r"\b(?:remat\d*|checkpoint)\[", str(jaxpr))) == 4
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(rematerialized)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_earlier_tokens_before_the_prompt_decode_as_a_prompt_that_holds_them():
    """Rows with earlier tokens of their own (Whisper's prompt of earlier text; traced, so one
    program serves them all) beside a row with none: each row's greedy and beam tokens equal a
    decoding whose static prompt holds its earlier tokens, and its probe is read right after its
    prompt's first token, where it begins (the first logits of a prompt that ends there). Learned
    positions, as Whisper's decoder has: the earlier tokens shift every later position."""
    model = encoder_decoder(positions="learned")
    previous = [[11, 12, 13], [], [20]]
    start = Start((BOS, 4), probe=9)
    greedy = generate_from_source(model, SOURCES, max_new_tokens=6, start=start, previous=previous)
    beams = generate_beams_from_source(model, SOURCES, beam_size=3, max_new_tokens=6, start=start, previous=previous)
    for row, source in enumerate(SOURCES):
        holding = Start((*previous[row], BOS, 4))
        alone = generate_from_source(model, [source], max_new_tokens=6, start=holding)
        np.testing.assert_array_equal(greedy.tokens[row], alone.tokens[0])
        alone_beams = generate_beams_from_source(model, [source], beam_size=3, max_new_tokens=6, start=holding)
        np.testing.assert_array_equal(beams.tokens[row], alone_beams.tokens[0])
        np.testing.assert_allclose(beams.scores[row], alone_beams.scores[0], atol=1e-5)
        after_start = first_logits(model, [source], start=Start((*previous[row], BOS)))[0]
        assert greedy.probe[row] == pytest.approx(float(jax.nn.softmax(after_start)[9]), abs=1e-6)
    without = generate_from_source(model, SOURCES, max_new_tokens=6, start=start)
    assert not np.array_equal(without.tokens[0], greedy.tokens[0])  # the earlier tokens do change row 0
    np.testing.assert_array_equal(without.tokens[1], greedy.tokens[1])
    with pytest.raises(UserError, match="earlier tokens"):
        generate_from_source(model, SOURCES[:1], max_new_tokens=6, start=start, previous=[[5] * 40])


def test_a_watched_encoder_decoder_runs_in_chunks_as_one_loop(model, monkeypatch):
    """Streamed (or abandonable), an encoder-decoder decodes two steps a call; its tokens,
    lengths and scores are the unwatched loop's."""
    from core.generation import chunks

    monkeypatch.setattr(chunks, "CHUNK", 2)
    whole = generate_from_source(model, SOURCES, max_new_tokens=6, start=START, temperature=0.8, seed=1)
    steps = []
    watched = generate_from_source(
        model, SOURCES, max_new_tokens=6, start=START, temperature=0.8, seed=1, on_tokens=lambda t, a: steps.append(t)
    )
    assert len(steps) == whole.lengths.max()
    np.testing.assert_array_equal(watched.tokens, whole.tokens)
    np.testing.assert_array_equal(watched.lengths, whole.lengths)
    np.testing.assert_allclose(watched.log_probs, whole.log_probs, rtol=1e-6)
