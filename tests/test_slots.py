"""Continuous batching (core/generation/slots.py): requests decoded side by side in slots of one cache give
exactly what the core's generation gives each alone, whenever they join and whatever their lengths."""

import threading

import jax
import numpy as np
import pytest
from test_generate import GEMMA_SHAPED, VOCAB, full_logits, language_model

from core.generation.generate import generate
from core.generation.slot_programs import EXTEND_WIDTHS
from core.generation.slots import Engine, QueueFull, Request

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 8, 9], [27], [4, 4, 4, 4, 1], [11, 12]]


class Collector:
    """A request's tokens (and their scores, if asked) and how it ended, with an event set at its end."""

    def __init__(self):
        self.tokens, self.scores, self.reason, self.done = [], [], None, threading.Event()

    def __call__(self, token, reason, scores=None):
        if token is None:
            self.reason = reason
            self.done.set()
        else:
            self.tokens.append(token)
            self.scores.append(scores)


def run_all(engine: Engine, requests: list[Request], collectors: list[Collector]):
    engine.start()
    try:
        for request in requests:
            engine.submit(request)
        for collector in collectors:
            assert collector.done.wait(60)
    finally:
        engine.stop(10)


@pytest.mark.parametrize("shape", [{}, GEMMA_SHAPED], ids=["llama-shaped", "gemma-shaped"])
def test_slots_give_what_each_request_gives_alone(shape):
    """Five greedy requests of different lengths through two slots (so three wait and join as
    others finish) equal the core's batched generation, token for token, and stop where it does."""
    model = language_model(**shape)
    lengths = [6, 2, 9, 4, 7]
    engine = Engine(model, slots=2)
    collectors = [Collector() for _ in PROMPTS]
    requests = [Request(p, n, c) for p, n, c in zip(PROMPTS, lengths, collectors)]
    run_all(engine, requests, collectors)
    for prompt, new, collector in zip(PROMPTS, lengths, collectors):
        expected = generate(model, [prompt], max_new_tokens=new)
        assert collector.tokens == list(expected.tokens[0][:new]) and collector.reason == "length"
    assert engine.prefills == len(PROMPTS) and not engine.busy()


def test_log_probabilities_are_the_models_at_the_chosen_tokens():
    """Greedy requests asking for log-probabilities, beside one that does not: each token's is the
    log-softmax of the full forward pass's logits there (by hand), its alternatives are the most
    likely ids best first (greedy's token the first), summing to at most 1; a sampled request's
    are those of its tempered distribution; the one that did not ask gets none."""
    model = language_model()
    engine = Engine(model, slots=3)
    collectors = [Collector() for _ in range(3)]
    requests = [
        Request(PROMPTS[0], 5, collectors[0], logprobs=4),
        Request(PROMPTS[1], 5, collectors[1]),
        Request(PROMPTS[2], 5, collectors[2], logprobs=0, temperature=0.5, seed=3),
    ]
    run_all(engine, requests, collectors)
    for request, collector in zip(requests, collectors):
        ids = list(request.prompt) + collector.tokens
        scale = request.temperature or 1.0
        logits = full_logits(model, [ids[:-1]])[0, len(request.prompt) - 1 :] / scale
        expected = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        if request.logprobs is None:
            assert collector.scores == [None] * 5
            continue
        for step, (token, scores) in enumerate(zip(collector.tokens, collector.scores)):
            assert scores.logprob == pytest.approx(expected[step, token], abs=1e-4)
            assert len(scores.top) == request.logprobs
            if scores.top:
                assert scores.top[0][0] == token and list(scores.top) == sorted(scores.top, key=lambda t: -t[1])
                assert [p for _, p in scores.top] == pytest.approx([expected[step, i] for i, _ in scores.top], abs=1e-4)
                assert sum(np.exp(p) for _, p in scores.top) <= 1 + 1e-5


def steered_by_hand(model, prompt, new, bias=None, presence=0.0, frequency=0.0):
    """Greedy tokens, each chosen from the full forward pass's logits with `bias` {id: value}
    added and, for each token generated so far, `frequency` subtracted per time and `presence`
    once (OpenAI's definition); with each token the log-softmax of its steered logits."""
    ids, counts, chosen = list(prompt), np.zeros(VOCAB), []
    for _ in range(new):
        logits = np.asarray(full_logits(model, [ids])[0, -1], np.float64)
        for token, value in (bias or {}).items():
            logits[token] += value
        logits -= frequency * counts + presence * (counts > 0)
        token = int(np.argmax(logits))
        chosen.append((token, float(np.asarray(jax.nn.log_softmax(logits))[token])))
        ids.append(token)
        counts[token] += 1
    return chosen


def test_logit_bias_and_penalties_steer_each_request_as_by_hand_and_no_other():
    """A request with a logit bias and penalties, one with penalties alone and a plain one share
    two slots (the plain one takes a steered request's slot when it ends): the steered ones give
    the tokens and log-probabilities chosen by hand from the full forward pass, and the plain one
    what it gives alone, with nothing left over from the slot's last request."""
    model = language_model()
    plain = list(generate(model, [PROMPTS[2]], max_new_tokens=8).tokens[0])
    bias = {plain[0]: -5.0, 7: 2.5}  # the plain first choice pushed down, another pulled up
    steered = [
        dict(logit_bias=bias, frequency_penalty=0.8),
        dict(presence_penalty=1.5, frequency_penalty=-0.3),
    ]
    lengths = [5, 12, 8]
    collectors = [Collector() for _ in lengths]
    requests = [
        Request(PROMPTS[2], lengths[0], collectors[0], logprobs=0, **steered[0]),
        Request(PROMPTS[1], lengths[1], collectors[1], logprobs=0, **steered[1]),
        Request(PROMPTS[2], lengths[2], collectors[2]),
    ]
    run_all(Engine(model, slots=2), requests, collectors)
    for request, collector, options in zip(requests, collectors, steered):
        expected = steered_by_hand(
            model,
            request.prompt,
            request.max_new,
            request.logit_bias,
            request.presence_penalty,
            request.frequency_penalty,
        )
        assert collector.tokens == [token for token, _ in expected], options
        assert [s.logprob for s in collector.scores] == pytest.approx([p for _, p in expected], abs=1e-4)
    unsteered = [token for token, _ in steered_by_hand(model, PROMPTS[1], 12)]
    assert len(set(collectors[1].tokens)) > len(set(unsteered))  # it repeats itself less
    assert collectors[0].tokens[0] != plain[0]
    assert collectors[2].tokens == plain


def test_a_logit_bias_past_its_bounds_is_refused():
    engine = Engine(language_model(), slots=1)
    with pytest.raises(ValueError, match="outside the vocabulary's 50 ids"):
        engine.submit(Request([1], 2, Collector(), logit_bias={VOCAB: 1.0}))
    with pytest.raises(ValueError, match="at most 300 tokens"):
        engine.submit(Request([1], 2, Collector(), logit_bias={i: 1.0 for i in range(301)}))


def test_a_step_over_the_leading_rows_alone_gives_what_a_step_over_all_gives():
    """Six slots compile steps over their first 1, 2 and all 6 rows. The longest request sits in
    slot 0, so once the others end it steps alone in the one-row program; its tokens, and the
    others', are what each gives alone, and the one-row program ran."""
    model = language_model()
    assert Engine(model, slots=6).row_counts() == [1, 2, 6]
    lengths = [16, 3, 6, 2]
    engine = Engine(model, slots=6)
    rows_run = []
    step = engine.programs.step
    engine.programs.step = lambda rows, *args: rows_run.append(rows) or step(rows, *args)
    collectors = [Collector() for _ in lengths]
    run_all(engine, [Request(PROMPTS[i], n, c) for i, (n, c) in enumerate(zip(lengths, collectors))], collectors)
    for i, (new, collector) in enumerate(zip(lengths, collectors)):
        assert collector.tokens == list(generate(model, [PROMPTS[i]], max_new_tokens=new).tokens[0])
    assert {1, 6} <= set(rows_run)


def test_a_stop_id_ends_a_request_without_being_emitted():
    model = language_model()
    alone = list(generate(model, [PROMPTS[1]], max_new_tokens=8).tokens[0])
    stop = alone[3]
    first = alone.index(stop)
    collector = Collector()
    run_all(Engine(model, slots=3), [Request(PROMPTS[1], 8, collector, stop_ids=frozenset({stop}))], [collector])
    assert collector.tokens == alone[:first] and collector.reason == "stop"


def test_sampling_depends_on_the_seed_alone_not_on_the_slot_or_the_neighbours():
    model = language_model()
    settings = dict(temperature=1.0, top_p=0.9, seed=7)
    alone = Collector()
    run_all(Engine(model, slots=1), [Request(PROMPTS[0], 10, alone, **settings)], [alone])
    crowd = [Collector() for _ in range(4)]
    neighbours = [Request(PROMPTS[i], 10, crowd[i], temperature=1.0, seed=i) for i in range(3)]
    run_all(Engine(model, slots=4), [*neighbours, Request(PROMPTS[0], 10, crowd[3], **settings)], crowd)
    assert crowd[3].tokens == alone.tokens
    assert len({tuple(c.tokens) for c in crowd}) > 1  # other seeds, other draws
    assert all(0 <= t < VOCAB for c in crowd for t in c.tokens)


def test_a_request_decodes_alike_whether_or_not_its_neighbours_sample_or_cut_a_nucleus():
    """The step draws random numbers only when some slot samples and sorts the vocabulary only
    when some slot cuts a nucleus: a greedy request among sampling ones, and a plain sampled one
    (top_p 1) beside a nucleus, give what they give among their own kind."""
    model = language_model()
    greedy, plain = dict(), dict(temperature=0.8, seed=3)
    alone = [Collector(), Collector()]
    run_all(Engine(model, slots=2), [Request(PROMPTS[0], 10, alone[0], **greedy)], alone[:1])
    run_all(Engine(model, slots=2), [Request(PROMPTS[1], 10, alone[1], **plain)], alone[1:])
    mixed = [Collector() for _ in range(3)]
    requests = [
        Request(PROMPTS[0], 10, mixed[0], **greedy),
        Request(PROMPTS[1], 10, mixed[1], **plain),
        Request(PROMPTS[2], 10, mixed[2], temperature=1.0, top_p=0.5, seed=9),
    ]
    run_all(Engine(model, slots=3), requests, mixed)
    assert mixed[0].tokens == alone[0].tokens == list(generate(model, [PROMPTS[0]], max_new_tokens=10).tokens[0])
    assert mixed[1].tokens == alone[1].tokens


def test_a_cancelled_request_frees_its_slot_for_the_next():
    model = language_model(max_len=64)
    engine = Engine(model, slots=1)
    long, short = Collector(), Collector()
    long_request = Request(PROMPTS[0], 60, long)
    engine.start()
    try:
        engine.submit(long_request)
        engine.submit(Request(PROMPTS[2], 3, short))
        while len(long.tokens) < 2:
            assert not long.done.is_set()
        long_request.cancel()
        assert short.done.wait(60) and long.done.wait(60)
    finally:
        engine.stop(10)
    assert long.reason == "cancelled" and len(long.tokens) < 60
    assert short.reason == "length" and short.tokens == list(generate(model, [PROMPTS[2]], max_new_tokens=3).tokens[0])


def test_the_queue_is_bounded_and_a_request_past_the_context_is_refused():
    engine = Engine(language_model(), slots=1, queue_size=2)  # not started: nothing leaves the queue
    for _ in range(2):
        engine.submit(Request([1], 2, Collector()))
    with pytest.raises(QueueFull):
        engine.submit(Request([1], 2, Collector()))
    with pytest.raises(ValueError, match="exceed the 24 positions of the context"):
        engine.submit(Request([1] * 20, 5, Collector()))


def test_warm_up_compiles_every_prompt_width_once_and_requests_compile_nothing_more():
    engine = Engine(language_model(max_len=128), slots=2)
    timings = engine.warm_up()
    assert engine.widths() == [8, 16, 24, 32, 48, 64, 96, 127]
    assert engine.row_counts() == [2]
    assert set(timings) == {f"prefill {w}" for w in engine.widths()} | {"decode step, 2 rows", "prompt cache"}
    assert np.all(engine.counts == 0)
    programs = engine.programs

    def compiled():
        return [f._cache_size() for f in (programs.prefill, programs.extend, programs.begin, programs.step)]

    counts = compiled()
    assert counts == [len(engine.widths()), len(EXTEND_WIDTHS), 1, 1] and engine.kept._copy._cache_size() == 2
    # The first requests, at the first width, compile nothing more; nor does one after a kept prompt.
    long = list(range(3, 23))
    prompts = [PROMPTS[0], PROMPTS[1], long, [*long, 5]]
    collectors = [Collector() for _ in prompts]
    run_all(engine, [Request(p, 4, c) for p, c in zip(prompts[:3], collectors)], collectors[:3])
    run_all(engine, [Request(prompts[3], 4, collectors[3])], collectors[3:])
    assert engine.reused == 20
    assert compiled() == counts and engine.kept._copy._cache_size() == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_narrow_weights_decode_in_slots_as_the_narrowed_model_does_alone(dtype):
    """An engine given dtype="bfloat16" holds every linear kernel in bfloat16 and nothing else
    (the embeddings and norms stay float32), "int8" those kernels and the token table in int8
    with float32 scales, "int4" the kernels in four bits (float16 scales) and the table int8; its slots give,
    token for token, what the core's generation gives each request alone with those weights."""
    import jax
    from flax import nnx

    from core.model.precision import narrowed

    model = language_model()
    engine = Engine(model, slots=2, dtype=dtype)
    dtypes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.params)[0]:
        dtypes.setdefault("'kernel'" in jax.tree_util.keystr(path), set()).add(leaf.dtype.name)
    if dtype == "bfloat16":
        assert dtypes == {True: {"bfloat16"}, False: {"float32"}}
    else:  # four-bit kernels: two weights a uint8, float16 scales; the table int8 either way, the norms float32
        kernels = {"int8", "float32"} if dtype == "int8" else {"uint8", "float16"}
        assert dtypes == {True: kernels, False: {"int8", "float32"}}
    lengths = [6, 2, 9]
    collectors = [Collector() for _ in lengths]
    run_all(engine, [Request(PROMPTS[i], n, c) for i, (n, c) in enumerate(zip(lengths, collectors))], collectors)
    graphdef, params = nnx.split(model)
    narrow = nnx.merge(graphdef, narrowed(params, dtype))
    for i, (new, collector) in enumerate(zip(lengths, collectors)):
        assert collector.tokens == list(generate(narrow, [PROMPTS[i]], max_new_tokens=new).tokens[0])


def adapted(base, seed: int, **lora):
    """A LoRA run of `base`: its weights, and adapters of its own (B nonzero, so that they change
    the tokens)."""
    from flax import nnx

    from core.checkpoints.rules import flat_params, set_params

    model = language_model(pretrained="tiny", **lora)  # a name: the config asks adapters for one
    set_params(model, flat_params(base))
    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if getattr(module, "lora_b", None) is not None:
            module.lora_b[...] = rng.normal(0, 0.5, module.lora_b.shape).astype(np.float32)
    return model


def test_requests_through_different_adapters_in_one_step_give_each_adapter_alone():
    """One engine over a base and two LoRA runs of it (ranks 4 and 2, different layers adapted):
    requests to the base and to each adapter, side by side in its slots, give what each model
    gives alone; the base is held once (the engine's kernels are the base's own arrays)."""
    base = language_model(max_len=128)
    first = adapted(base, 1, max_len=128, lora_rank=4)
    second = adapted(base, 2, max_len=128, lora_rank=2, lora_alpha=4.0, lora_targets=("qkv", "down"))
    models = [base, first, second]
    engine = Engine(base, slots=4, adapters=[first, second])
    jobs = [(0, PROMPTS[0]), (1, PROMPTS[1]), (2, PROMPTS[2]), (1, PROMPTS[3]), (2, PROMPTS[4]), (0, PROMPTS[1])]
    collectors = [Collector() for _ in jobs]
    requests = [Request(p, 6, c, adapter=a) for (a, p), c in zip(jobs, collectors)]
    run_all(engine, requests, collectors)
    for (adapter, prompt), collector in zip(jobs, collectors):
        expected = generate(models[adapter], [prompt], max_new_tokens=6).tokens[0][:6]
        assert collector.tokens == list(expected), adapter
    alone = [generate(m, [PROMPTS[1]], max_new_tokens=6).tokens[0][:6] for m in models]
    assert len({tuple(t) for t in alone}) == 3  # the adapters do change the tokens
    # A kept prompt serves its own adapter alone: the same long prompt through each in turn.
    long = list(range(3, 23))
    for adapter in (0, 1, 2, 1):
        collector = Collector()
        run_all(engine, [Request(long, 4, collector, adapter=adapter)], [collector])
        assert collector.tokens == list(generate(models[adapter], [long], max_new_tokens=4).tokens[0][:4])
    assert engine.reused == 19  # adapter 1's second request, after its first
    pointer = base.body.blocks[0].attention.qkv.kernel[...].unsafe_buffer_pointer()
    assert pointer in {leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(engine.params)}
    with pytest.raises(ValueError, match="adapter 3"):
        engine.submit(Request([1], 1, Collector(), adapter=3))


@pytest.mark.parametrize("shape", [{}, {**GEMMA_SHAPED, "sliding_window": 32}], ids=["llama-shaped", "windowed"])
def test_a_prompt_that_begins_as_a_kept_one_prefills_the_rest_alone_and_decodes_alike(shape):
    """Requests whose prompts begin as an ended one's did (a shared preamble of 20 tokens, and
    one prompt whole again) read those positions from the kept prompt and prefill the rest
    alone, and give what each gives with nothing kept; a prompt shorter than MIN_REUSE or sharing
    less is prefilled whole; in a sliding-window layer a request that wrote past its window
    leaves its prompt unkept (its ring no longer holds the beginning)."""
    model = language_model(max_len=128, **shape)
    preamble = list(range(3, 23))
    first, again, other = [*preamble, 30, 31], [*preamble, 40, 41, 42], [7, *preamble]
    runs = [(first, 6), (again, 6), (first, 6), (other, 4), (list(preamble[:12]), 4)]
    engine = Engine(model, slots=2, prompt_cache=2)
    for prompt, new in runs:  # one at a time, each kept when it ends
        collector = Collector()
        run_all(engine, [Request(prompt, new, collector)], [collector])
        assert collector.tokens == list(generate(model, [prompt], max_new_tokens=new).tokens[0][:new])
    assert engine.reused == 20 + 21  # `again` after `first`'s preamble, then `first` after itself (all but its last)
    if "sliding_window" in shape:
        engine = Engine(model, slots=2, prompt_cache=2)
        for prompt, new in [(first, 12), (again, 4)]:  # 22 + 12 positions: past the window of 32
            collector = Collector()
            run_all(engine, [Request(prompt, new, collector)], [collector])
            assert collector.tokens == list(generate(model, [prompt], max_new_tokens=new).tokens[0][:new])
        assert engine.reused == 0


def test_an_engine_states_what_it_holds_and_refuses_a_cache_past_the_memory(monkeypatch):
    """Two slots and three kept prompts of the context's positions: five rows of every layer's
    float32 keys and values, counted by hand; past the memory available, refused with the knobs."""
    from flax import nnx

    from core.errors import UserError
    from core.generation import slot_memory

    model = language_model()
    engine = Engine(model, slots=2, prompt_cache=3)
    c = model.body.config
    row = c.num_layers * 2 * c.key_value_heads * c.head_dim * engine.context * 4
    weights = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert (engine.held.weights, engine.held.cache, engine.held.kept) == (weights, 2 * row, 3 * row)
    assert f"{2 * row / 2**20:.1f} MB of cache, {3 * row / 2**20:.1f} MB of kept prompts" in engine.held.describe()
    monkeypatch.setattr(slot_memory, "available", lambda: (4 * row, "host"))
    with pytest.raises(UserError, match=r"2 slots of 24 positions and 3 kept prompts need .* \(--max-batch\)"):
        Engine(model, slots=2, prompt_cache=3)
