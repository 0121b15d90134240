"""Generation: cached decoding equals the full forward pass, and the engine's choices are exact
(greedy, top-k, top-p, seeds, stop tokens, batching, streaming, beam search)."""

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY_BODY

from core.config import ModelConfig
from core.errors import UserError
from core.generation import abandon
from core.generation.beam import beam_search, gnmt_penalty
from core.generation.generate import extend, generate, generate_beams, prefill
from core.generation.penalties import repeats
from core.generation.sampling import Sampling, beam_settings, filter_logits, sample
from core.model.heads import TiedOutput, TokenEmbedder
from core.model.transformer import Model, Transformer
from core.serving.batcher import Batcher
from core.serving.metrics import Metrics

VOCAB = 50
PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 8, 9], [27]]
# Gemma 3's blocks at a tiny size: heads of their own size, QK-norm, sandwich norms, GeGLU, scaled
# embeddings, and a window of 4 on every other layer (with its own rotary base), which the 20
# positions of the cache test cross.
GEMMA_SHAPED = {
    "positions": "rotary",
    "num_kv_heads": 1,
    "head_size": 16,
    "qk_norm": True,
    "norm_position": "sandwich",
    "mlp": "geglu",
    "embedding_scale": True,
    "sliding_window": 4,
    "global_every": 2,
    "rope_local_base": 100.0,
}


def language_model(**changes) -> Model:
    config = ModelConfig(**{**TINY_BODY, "max_len": 24, "causal": True, **changes})
    rngs = nnx.Rngs(0)
    embedder = TokenEmbedder(VOCAB, config.d_model, rngs=rngs)
    return Model(embedder, Transformer(config, rngs=rngs), TiedOutput(embedder))


@pytest.fixture(scope="module")
def model():
    return language_model()


@nnx.jit
def forward(model, tokens):
    return model({"inputs": tokens, "mask": jnp.ones(tokens.shape, bool)}).logits()


def full_logits(model, tokens):
    return forward(model, jnp.asarray(tokens, jnp.int32))


jit_prefill = nnx.jit(prefill, static_argnums=3)
jit_extend = nnx.jit(extend)


@pytest.mark.parametrize(
    "changes",
    [
        {"positions": "learned"},
        {"positions": "rotary"},
        {"positions": "learned", "num_kv_heads": 2},
        {"positions": "rotary", "num_kv_heads": 1},
        {"positions": "rotary", "num_kv_heads": 2, "attention": "xla"},
        GEMMA_SHAPED,
        {**GEMMA_SHAPED, "attention": "xla"},
    ],
)
def test_cached_decoding_equals_the_full_forward_pass(changes):
    model = language_model(**changes)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 20)).astype(np.int32)
    full = full_logits(model, tokens)
    # Prefill prefixes of different lengths (right-padded with junk), then feed the rest.
    lengths = np.array([5, 8, 1], np.int32)
    prompts = np.where(np.arange(8)[None, :] < lengths[:, None], tokens[:, :8], 7)
    logits, cache = jit_prefill(model, jnp.asarray(prompts), jnp.asarray(lengths), 20)
    rows = np.arange(3)
    for offset in range(12):
        expected = full[rows, lengths - 1 + offset]
        np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=1e-5)
        logits, cache = jit_extend(model, cache, jnp.asarray(tokens[rows, lengths + offset]))
    np.testing.assert_array_equal(cache.lengths, lengths + 12)
    # The sliding layers keep a ring of their window's 4 slots (the prompt of 8 already wraps it).
    slots = [layer.keys.shape[2] for layer in cache.layers]
    assert slots == ([4, 20] if changes.get("sliding_window") else [20, 20])


@pytest.mark.parametrize("changes", [{}, {"positions": "rotary", "num_kv_heads": 2}, GEMMA_SHAPED])
@pytest.mark.parametrize("new", [3, 6])
def test_a_few_tokens_at_once_follow_the_cache(changes, new):
    """Chunks of 3 and 6 new tokens: 6 is more than a ring of 4 slots holds, so its first
    positions are seen by the chunk's own queries alone and never written."""
    model = language_model(**changes)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 18)).astype(np.int32)
    full = full_logits(model, tokens)
    lengths = np.array([4, 6], np.int32)
    _, cache = jit_prefill(model, jnp.asarray(tokens[:, :6]), jnp.asarray(lengths), 18)
    for _ in range(2):
        chunk = np.stack([tokens[row, start : start + new] for row, start in enumerate(lengths)])
        x, _ = model.embedder(jnp.asarray(chunk), jnp.ones(chunk.shape, bool))
        hidden, cache = model.body.extend(x, cache)
        logits = model.head(hidden, jnp.ones(chunk.shape, bool)).logits()
        for row, start in enumerate(lengths):
            np.testing.assert_allclose(logits[row], full[row, start : start + new], atol=2e-5, rtol=1e-5)
        lengths = lengths + new


def test_grouped_query_heads_must_divide_the_heads():
    with pytest.raises(UserError, match="model.num_kv_heads=3 must be positive and divide model.num_heads=4"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    assert ModelConfig(num_heads=4, num_kv_heads=2).key_value_heads == 2
    assert ModelConfig(num_heads=4).key_value_heads == 4


def test_greedy_top_k_one_and_beam_one_agree(model):
    greedy = generate(model, PROMPTS, max_new_tokens=6)
    top_one = generate(model, PROMPTS, max_new_tokens=6, temperature=1.5, top_k=1, seed=3)
    np.testing.assert_array_equal(greedy.tokens, top_one.tokens)
    beams = generate_beams(model, PROMPTS, beam_size=1, max_new_tokens=6)
    np.testing.assert_array_equal(beams.tokens[:, 0], greedy.tokens)
    np.testing.assert_array_equal(greedy.lengths, [6, 6, 6])
    # Greedy tokens are the argmax of the full forward pass over the prompt and what came so far.
    sequence = PROMPTS[1] + list(greedy.tokens[1])
    logits = full_logits(model, [sequence])[0]
    np.testing.assert_array_equal(np.argmax(logits[len(PROMPTS[1]) - 1 : -1], -1), greedy.tokens[1])


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probabilities = np.array([0.15, 0.5, 0.05, 0.2, 0.1])
    logits = jnp.asarray(np.log(probabilities)[None], jnp.float32)

    def kept(top_k=None, top_p=None):
        return set(np.flatnonzero(np.isfinite(filter_logits(logits, top_k, top_p)[0])))

    assert kept(top_p=0.45) == {1}
    assert kept(top_p=0.6) == {1, 3}
    assert kept(top_p=0.8) == {1, 3, 0}
    assert kept(top_p=0.9) == {1, 3, 0, 4}
    assert kept(top_p=1.0) == {0, 1, 2, 3, 4}
    assert kept(top_k=2) == {1, 3}
    # Top-k first, then the nucleus of what is left: 0.5 / 0.85 < 0.7 <= 0.7 / 0.85.
    assert kept(top_k=3, top_p=0.7) == {1, 3}
    # Kept logits are unchanged.
    np.testing.assert_array_equal(filter_logits(logits, None, 0.6)[0, [1, 3]], logits[0, [1, 3]])


def test_a_seed_reproduces_and_another_differs(model):
    def run(seed):
        return generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.95, seed=seed).tokens

    np.testing.assert_array_equal(run(0), run(0))
    np.testing.assert_array_equal(run(jax.random.key(5)), run(jax.random.key(5)))
    assert not np.array_equal(run(0), run(1))


@pytest.mark.parametrize("use_cache", [True, False])
def test_batched_prompts_give_what_each_gives_alone(model, use_cache):
    together = generate(model, PROMPTS, max_new_tokens=5, use_cache=use_cache)
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], max_new_tokens=5, use_cache=use_cache)
        np.testing.assert_array_equal(together.tokens[row], alone.tokens[0])
    if use_cache:
        np.testing.assert_array_equal(
            together.tokens, generate(model, PROMPTS, max_new_tokens=5, use_cache=False).tokens
        )


def test_rows_stop_at_their_first_stop_token_and_the_loop_ends(model):
    greedy = generate(model, PROMPTS, max_new_tokens=8).tokens
    stop = int(greedy[1, 2])  # what greedy writes third in row 1
    streamed = []
    result = generate(
        model, PROMPTS, max_new_tokens=8, stop_tokens=[stop], on_tokens=lambda t, a: streamed.append((t, a))
    )
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(greedy[row] == stop)
        length = hits[0] + 1 if len(hits) else 8
        assert result.lengths[row] == length
        np.testing.assert_array_equal(result.tokens[row, :length], greedy[row, :length])
        assert not result.tokens[row, length:].any()
    # One callback per step, in order, until the last row stopped; they spell the result.
    assert len(streamed) == result.lengths.max()
    tokens, active = (np.stack(x, 1) for x in zip(*streamed))
    np.testing.assert_array_equal(active.sum(1), result.lengths)
    np.testing.assert_array_equal(np.where(active, tokens, 0), result.tokens[:, : len(streamed)])


def test_an_abandoned_generation_ends_at_its_next_step_and_others_run_on(model):
    """Within `abandon.run`, a decode loop stops the step after its event is set (here by the
    streaming callback at the third step), every row cut there; the tokens it made are greedy's;
    an event never set changes nothing, and outside `run` nothing is asked."""
    greedy = generate(model, PROMPTS, max_new_tokens=8)
    event, steps = threading.Event(), []

    def third_step_abandons(tokens, active):
        steps.append(tokens)
        if len(steps) == 3:
            event.set()

    cut = abandon.run(
        event, functools.partial(generate, model, PROMPTS, max_new_tokens=8, on_tokens=third_step_abandons)
    )
    assert cut.lengths.max() == 3 and len(steps) == 3
    np.testing.assert_array_equal(cut.tokens[:, :3], greedy.tokens[:, :3])
    whole = abandon.run(threading.Event(), functools.partial(generate, model, PROMPTS, max_new_tokens=8))
    np.testing.assert_array_equal(whole.tokens, greedy.tokens)
    assert abandon.current() is None


def test_an_abandoned_beam_search_ends_with_its_chunk(model, monkeypatch):
    """Beam search runs two steps a call when abandonable (chunks.CHUNK): with its event set,
    the search ends with its first call (two tokens written, every later place empty); an event
    never set changes nothing."""
    from core.generation import chunks

    monkeypatch.setattr(chunks, "CHUNK", 2)
    settings = dict(beam_size=2, max_new_tokens=8, stop_tokens=())
    whole = generate_beams(model, PROMPTS, **settings)
    event = threading.Event()
    event.set()
    cut = abandon.run(event, functools.partial(generate_beams, model, PROMPTS, **settings))
    assert not cut.tokens[:, :, 2:].any() and cut.tokens[:, :, :2].all() and whole.tokens[:, :, 2:].any()
    kept = abandon.run(threading.Event(), functools.partial(generate_beams, model, PROMPTS, **settings))
    np.testing.assert_array_equal(kept.tokens, whole.tokens)


def test_a_predict_call_whose_requests_all_timed_out_is_abandoned(model):
    """The server's predict batcher: a call whose one request timed out (its client had a 504)
    stops decoding within a step or two, and the worker takes the next call, which runs whole."""
    steps = []

    def rows(groups, values):  # 20 steps of 50 ms: a second of decoding
        slow = lambda tokens, active: (steps.append(1), time.sleep(0.05))  # noqa: E731
        result = generate(model, PROMPTS, max_new_tokens=20, on_tokens=slow)
        return [[{"steps": int(result.lengths.max())}] for _ in groups]

    async def main():
        worker = ThreadPoolExecutor(1)
        batcher = Batcher("m", rows, worker, max_batch=4, max_wait=0, queue_size=4, metrics=Metrics())
        batcher.start()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(batcher.predict([{}], {}), 0.3)
        return await batcher.predict([{}], {})

    assert asyncio.run(main()) == [{"steps": 20}]
    assert len(steps) <= 20 + 10  # the first call stopped near its sixth step, not its twentieth


def sequence_score(model, prompt, new_tokens, alpha):
    logits = full_logits(model, [list(prompt) + list(new_tokens)])[0]
    log_probs = jax.nn.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return float(log_probs[np.arange(len(new_tokens)), new_tokens].sum()) / gnmt_penalty(len(new_tokens), alpha)


def test_beam_search_scores_at_least_greedy(model):
    alpha = 0.6
    greedy = generate(model, PROMPTS, max_new_tokens=5).tokens
    beams = generate_beams(model, PROMPTS, beam_size=4, max_new_tokens=5, length_penalty=alpha)
    assert np.all(np.diff(beams.scores, axis=1) <= 0)
    for row, prompt in enumerate(PROMPTS):
        best = beams.tokens[row, 0, : beams.lengths[row, 0]]
        # The reported score is the model's, and it is at least greedy's.
        assert beams.scores[row, 0] == pytest.approx(sequence_score(model, prompt, best, alpha), abs=1e-4)
        assert beams.scores[row, 0] >= sequence_score(model, prompt, greedy[row], alpha) - 1e-5


def bigram_step(first, table):
    """A hand-built decode step whose next token depends on the last one alone: probabilities
    `first` for the first token and `table[t]` after token t (0 stands for 1e-6) -> (step, the
    first token's logits [1, V])."""
    log = lambda p: jnp.log(jnp.maximum(jnp.asarray(p, jnp.float32), 1e-6))  # noqa: E731
    table = log(table)

    def step(state, tokens):
        return table[tokens], state

    return step, log([first])


def best_beam(step, first, **settings) -> tuple[list[int], float]:
    """The best beam of a `bigram_step` (up to 4 new tokens, token 0 stops): its tokens and score."""
    beams = beam_search(step, jnp.zeros((1, 1)), first, max_new_tokens=4, stop_tokens=(0,), **settings)
    return beams.tokens[0, 0, : beams.lengths[0, 0]].tolist(), float(beams.scores[0, 0])


def test_beam_search_finds_what_greedy_misses():
    # Token 1 looks best first (0.6 against 0.4 for token 2), but after it every token has
    # probability 1/4; after token 2, token 3 is certain. Token 0 stops.
    step, first = bigram_step([0, 0.6, 0.4, 0], [[0.25] * 4, [0.25] * 4, [0, 0, 0, 1], [1, 0, 0, 0]])
    beams = jax.jit(lambda s, x: beam_search(step, s, x, beam_size=2, max_new_tokens=4, stop_tokens=(0,)))(
        jnp.zeros((1, 1)), first
    )
    np.testing.assert_array_equal(beams.tokens[0, 0], [2, 3, 0, 0])
    assert beams.lengths[0, 0] == 3
    assert float(beams.scores[0, 0]) == pytest.approx(np.log(0.4) / gnmt_penalty(3, 0.6), abs=1e-4)


def test_too_long_prompts_are_cut_on_the_left(model, apps_log):
    long = list(range(1, 23))  # 22 tokens; with 4 new ones, max_len=24 leaves room for 20
    cut = generate(model, [long], max_new_tokens=4)
    assert "keeping its last 20" in apps_log.text
    np.testing.assert_array_equal(cut.tokens, generate(model, [long[-20:]], max_new_tokens=4).tokens)
    with pytest.raises(UserError, match="max_new_tokens=24 leaves no room"):
        generate(model, PROMPTS, max_new_tokens=24)
    with pytest.raises(UserError, match="at least one token"):
        generate(model, [[]], max_new_tokens=2)


def test_repeats_bans_what_followed_the_last_tokens_before():
    # Row 0 wrote 5 6 5: after 5 came 6. Row 1 wrote 5 6: its last token, 6, never came before.
    generated = jnp.asarray([[5, 6, 5, 0, 0], [5, 6, 0, 0, 0]], jnp.int32)
    banned = lambda length, n: {  # noqa: E731
        row: set(np.flatnonzero(mask).tolist()) for row, mask in enumerate(np.asarray(repeats(generated, length, n, 8)))
    }
    assert banned(3, 2) == {0: {6}, 1: set()}
    assert banned(3, 1) == {0: {5, 6}, 1: {0, 5, 6}}  # unigrams: every token written so far
    assert banned(3, 3) == {0: set(), 1: set()}  # (6, 5) never came before
    assert banned(2, 2) == {0: set(), 1: set()}  # the bigram (5, 6) has no earlier occurrence of 6
    assert banned(0, 2) == {0: set(), 1: set()}


def test_no_repeat_ngram_breaks_a_loop():
    # A step that always prefers token 1, then 2, then 3, ...: after 1 comes 1 again (a loop).
    table = jnp.asarray(-np.arange(6)[None, :].repeat(6, 0), jnp.float32)

    def step(state, tokens):
        return table[tokens], state

    first = table[:1]
    decode = lambda n: sample(  # noqa: E731
        step, jnp.zeros((1, 1)), first, jax.random.key(0), Sampling(max_new_tokens=6, no_repeat_ngram=n)
    )[0]
    np.testing.assert_array_equal(decode(0)[0], [0] * 6)
    # Unigrams: every token once. Bigrams: 0 0, then 0 1 (0 0 is taken), 1 0, 0 2, 2 0.
    np.testing.assert_array_equal(decode(1)[0], [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(decode(2)[0], [0, 0, 1, 0, 2, 0])


def test_sampling_sums_each_rows_log_probabilities_untempered():
    # Token 0 stops; first 1 (0.7) or 2 (0.3); after 1: stop 0.6 or 3 0.4; after 2 and 3: stop.
    first_p, table = [0, 0.7, 0.3, 0], [[0.25] * 4, [0.6, 0, 0, 0.4], [1, 0, 0, 0], [1, 0, 0, 0]]
    step, first = bigram_step(first_p, table)

    def log_probability(path):  # as bigram_step reads the tables: 0 stands for 1e-6
        steps = [first_p[path[0]]] + [table[a][b] for a, b in zip(path, path[1:])]
        return float(np.sum(np.log(np.maximum(steps, 1e-6))))

    tokens, lengths, log_probs = sample(
        step, jnp.zeros((1, 1)), first, jax.random.key(0), Sampling(max_new_tokens=4, stop_tokens=(0,))
    )
    assert tokens[0].tolist() == [1, 0, 0, 0] and lengths[0] == 2
    np.testing.assert_allclose(log_probs[0], np.log(0.42), rtol=1e-5)
    # Sampled at a temperature, 64 rows: each row's sum is its path's log-probability under the
    # model's own distribution, not the flattened one it was drawn from.
    sampling = Sampling(max_new_tokens=4, stop_tokens=(0,), temperature=2.0)
    tokens, lengths, log_probs = sample(step, jnp.zeros((64, 1)), jnp.tile(first, (64, 1)), jax.random.key(1), sampling)
    paths = [tuple(row[:length].tolist()) for row, length in zip(tokens, lengths)]
    assert {(1, 0), (1, 3, 0), (2, 0)} <= set(paths)
    np.testing.assert_allclose(log_probs, [log_probability(path) for path in paths], rtol=1e-5)


def test_the_word_reward_lengthens_greedy_and_beam_outputs():
    # Token 0 stops. First token 1 (0.7) or 2 (0.3); after 1 the stop is likely (0.6) against
    # token 3 (0.4); after 2 and 3, the stop is certain.
    step, first = bigram_step([0, 0.7, 0.3, 0], [[0.25] * 4, [0.6, 0, 0, 0.4], [1, 0, 0, 0], [1, 0, 0, 0]])

    def greedy(reward):
        return sample(
            step,
            jnp.zeros((1, 1)),
            first,
            jax.random.key(0),
            Sampling(max_new_tokens=4, stop_tokens=(0,), word_reward=reward),
        )[0][0]

    np.testing.assert_array_equal(greedy(0.0), [1, 0, 0, 0])
    # 0.6 / 0.4 is 0.41 nats: a larger reward makes token 3 the argmax after token 1.
    np.testing.assert_array_equal(greedy(0.4), [1, 0, 0, 0])
    np.testing.assert_array_equal(greedy(0.45), [1, 3, 0, 0])

    def best(reward, alpha):
        return best_beam(step, first, beam_size=2, length_penalty=alpha, word_reward=reward)

    # Scores by hand, (log P + r * words) / penalty: "1 stop" (P 0.42, 1 word) against
    # "1 3 stop" (P 0.28, 2 words).
    for reward, alpha in ((0.0, 0.0), (0.3, 0.0), (0.5, 0.0), (0.5, 1.0), (1.0, 1.0)):
        short = (np.log(0.42) + reward) / gnmt_penalty(2, alpha)
        long = (np.log(0.28) + 2 * reward) / gnmt_penalty(3, alpha)
        tokens, score = best(reward, alpha)
        assert tokens == ([1, 0] if short > long else [1, 3, 0])
        assert score == pytest.approx(max(short, long), abs=1e-4)
    assert best(0.5, 0.0)[0] == [1, 3, 0] and best(0.3, 0.0)[0] == [1, 0]


def test_a_positive_reward_does_not_stop_the_beam_before_its_best():
    # 1, then 2, then the stop or 3 (1/2 each), then the stop. With alpha 10 and a reward of
    # 10, "1 2 stop" scores (log 1/2 + 20) / (8/6)^10 = 1.087; the unfinished "1 2 3" would
    # score 1.65 as it is, so the loop may not stop there, and "1 2 3 stop" scores only 0.51.
    step, first = bigram_step([0, 1, 0, 0], [[1, 0, 0, 0], [0, 0, 1, 0], [0.5, 0, 0, 0.5], [1, 0, 0, 0]])
    tokens, score = best_beam(step, first, beam_size=1, length_penalty=10.0, word_reward=10.0)
    assert tokens == [1, 2, 0] and score == pytest.approx((np.log(0.5) + 20) / gnmt_penalty(3, 10.0), abs=1e-3)


def test_decoding_penalties_are_checked():
    with pytest.raises(UserError, match="no_repeat_ngram=-1"):
        Sampling(max_new_tokens=4, no_repeat_ngram=-1)
    with pytest.raises(UserError, match="word_reward=nan"):
        beam_settings(beam_size=2, max_new_tokens=4, stop_tokens=(0,), word_reward=float("nan"))


def test_the_timestamp_rules_keep_whispers_shape():
    """Text ids 0-4, the end 5, a special 6, timestamps 7-9 (the first 7, at most one step in):
    each case's allowed ids worked out by hand from openai-whisper's rules."""
    from core.generation.timestamps import Timestamps, rules

    settings = Timestamps(begin=7, end=5, max_initial=1)
    flat = jnp.zeros(10)
    text_likely = flat.at[:5].set(3.0)  # text far likelier than any timestamp

    def allowed(generated, logits=flat):
        row = jnp.asarray([generated + [0] * (6 - len(generated))], jnp.int32)
        out = rules(logits[None, :], row, jnp.int32(len(generated)), settings)[0]
        return [int(i) for i in jnp.flatnonzero(jnp.isfinite(out))]

    assert allowed([]) == [7, 8]  # a window opens with a timestamp, within the first step
    assert allowed([7]) == [0, 1, 2, 3, 4, 5, 6]  # after the opening one: text (or the end)
    assert allowed([7, 2], text_likely) == [0, 1, 2, 3, 4, 5, 6, 8, 9]  # later than 7, or more text
    assert allowed([7, 2]) == [8, 9]  # the timestamps together outweigh the likeliest text token
    # A segment's end: the end token, or its time again to open the next (text far likelier
    # than the end here, which the ban on text leaves to the timestamps).
    assert allowed([7, 2, 8], flat.at[:6].set(3.0)) == [5, 6, 8, 9]
    assert allowed([7, 2, 8], text_likely) == [8, 9]
    assert allowed([7, 2, 8, 8], text_likely) == [0, 1, 2, 3, 4, 5, 6]  # after a pair: text
    assert allowed([7, 2, 9, 9, 3], text_likely) == [0, 1, 2, 3, 4, 5, 6]  # no timestamp left past 9


def test_a_watched_generation_runs_in_chunks_and_makes_the_tokens_of_one_loop(model, monkeypatch):
    """Streamed, a generation runs five steps a call (chunks.CHUNK) and the host looks between
    calls: twelve sampled tokens in three calls, each step streamed once in order, with the
    tokens, lengths and scores of the loop that runs in one call unwatched."""
    from core.generation import chunks
    from core.generation import generate as generate_module

    monkeypatch.setattr(chunks, "CHUNK", 5)
    calls = []
    original = generate_module._next_program
    monkeypatch.setattr(generate_module, "_next_program", lambda *a: calls.append(a[-1]) or original(*a))
    settings = dict(max_new_tokens=12, temperature=1.0, top_k=20, seed=7)
    whole = generate(model, PROMPTS, **settings)
    streamed = []
    watched = generate(model, PROMPTS, **settings, on_tokens=lambda t, a: streamed.append((t.copy(), a.copy())))
    assert [int(until) for until in calls] == [10, 15]  # the first call decoded steps 0-4
    np.testing.assert_array_equal(watched.tokens, whole.tokens)
    np.testing.assert_array_equal(watched.lengths, whole.lengths)
    np.testing.assert_allclose(watched.log_probs, whole.log_probs, rtol=1e-6)
    tokens, active = (np.stack(x, 1) for x in zip(*streamed))
    assert tokens.shape[1] == whole.lengths.max() and (active.sum(1) == whole.lengths).all()
    np.testing.assert_array_equal(np.where(active, tokens, 0), whole.tokens[:, : tokens.shape[1]])
