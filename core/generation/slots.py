"""Continuous batching for a decoder-only model: requests share one KV cache, slot by slot.

The cache holds `slots` rows of the model's context. A request waits in a bounded queue until a
slot is free; its prompt is then prefilled into that slot's row (padded to a width bucket,
`core.model.shapes.bucket_width`: a few compiled programs, all compiled by `warm_up`) and its first token
sampled; from the next step on it decodes beside every other active slot, one token per slot
per step, each row at its own position (`Cache.lengths`). A finished, failed or cancelled
request frees its slot at once and a waiting one takes it before the next step: one long
request never holds short ones back, and the step's batch is as full as the load allows.

Each slot samples with its own settings, steered by its own logit bias and penalties, kept to
its own grammar if it has one (`core.generation.grammar`: a request ends as soon as its grammar
is complete), and may ask for its tokens' log-probabilities (`core.generation.slot_sampling`).
An engine given LoRA runs of its model (`adapters`) decodes each slot through the adapter its
request names (`core.model.lora.stacked`), the base weights held once. Ended requests' prompts
are kept (`core.generation.prompt_cache`): a request that begins as a kept one did prefills the
rest of its prompt alone.

One engine thread owns the cache and runs every compiled call; callers submit from any thread
and receive tokens through their request's `emit` callback, on the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.generation import slot_memory
from core.generation.generate import logits_of
from core.generation.grammar import Constraint
from core.generation.prompt_cache import MIN_REUSE, PromptCache
from core.generation.slot_programs import CHUNK, EXTEND_WIDTHS, Programs
from core.generation.slot_sampling import BIASED, HELD, Scores, Steering, bias_of, scored, settings
from core.model import lora
from core.model.precision import narrowed
from core.model.shapes import bucket_width
from core.model.transformer import Model

log = logging.getLogger("apps")


@dataclass
class Request:
    """One generation: prompt ids, how many new tokens at most, the sampling settings, the ids
    that end it (never drawn before `min_new` new tokens), and `emit(token, reason)`: called with
    each new token (reason None; and, with `logprobs`, its `Scores`), then once with token None
    and why it ended ("stop": a stop id, not emitted, or its grammar complete; "length": max_new;
    "cancelled"; "error: ..."). `cancel()` from any thread frees its slot before the next step."""

    prompt: Sequence[int]
    max_new: int
    emit: Callable[[int | None, str | None], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()
    min_new: int = 0
    logprobs: int | None = None  # with each token its log-probability and this many alternatives
    presence_penalty: float = 0.0  # subtracted from the logit of each token generated so far
    frequency_penalty: float = 0.0  # subtracted once per time it was generated
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # added to these ids' logits
    constraint: Constraint | None = None  # the grammar its tokens follow
    adapter: int = 0  # which of the engine's adapters it decodes through (0: the base alone)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class QueueFull(Exception):
    """The engine's queue holds `queue_size` waiting requests already."""


class Engine:
    """The slots, their cache and the thread that decodes them (see the module's text)."""

    def __init__(
        self,
        model: Model,
        *,
        slots: int,
        queue_size: int = 256,
        context: int | None = None,
        dtype: str = "float32",
        adapters: Sequence[Model] = (),
        prompt_cache: int = 8,
    ):
        """`adapters`: LoRA runs of `model`'s weights, which requests name by number (1, 2, ...;
        0 is `model` without adapters); `prompt_cache`: rows that keep ended requests' prompts."""
        config = model.body.config
        if not config.causal:
            raise ValueError("Continuous batching needs a causal (decoder-only) model.")
        self.adapters = len(adapters)
        if adapters:
            model = lora.stacked(model, adapters)
        self.slots, self.context = slots, min(context or config.max_len, config.max_len)
        self.graphdef, params = nnx.split(model)
        # On one device, whatever mesh the run was loaded onto: the cache lives there too, placed
        # there from the start (a step returns it so placed, and a program compiled for the first
        # placement would compile again for the second at the first request).
        device = jax.local_devices()[0]
        self.params = jax.device_put(narrowed(params, dtype), device)
        # The cache holds the activations the embedder gives the body, in their dtype (as `prefill`'s).
        probe = jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)
        cache_dtype = jax.eval_shape(lambda: model.embedder(*probe)[0]).dtype
        self.vocab_size = jax.eval_shape(lambda: logits_of(model, model.embedder(*probe)[0])).shape[-1]
        # The slots' and the kept prompts' rows are allocated once, here: reckoned first.
        self.held = slot_memory.plan(model, self.params, slots, prompt_cache, self.context, cache_dtype)
        self.cache = jax.device_put(model.body.init_cache(slots, self.context, cache_dtype), device)
        windows = [w for w in (config.window(i) for i in range(config.num_layers)) if w is not None]
        self.kept = PromptCache(prompt_cache, self.cache, min(windows, default=None)) if prompt_cache else None
        self.reused = 0  # prompt tokens read from kept prompts rather than prefilled
        self.steering = jax.device_put(Steering.empty(slots, self.vocab_size), device)
        self.mask_words = (self.vocab_size + 31) // 32
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=queue_size)
        self.active: list[Request | None] = [None] * slots
        self.counts = np.zeros(slots, np.int32)  # tokens each slot's request has had
        self.last = np.zeros(slots, np.int32)  # each slot's latest token, the next step's input
        self.steps = self.prefills = 0
        self.on_step: Callable[[int], None] | None = None  # told each step's active slots (a server's metrics)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.programs = Programs(self.graphdef, self.adapters, slots)

    # Running ---------------------------------------------------------------------------------

    def widths(self) -> list[int]:
        """The prompt widths that prefill compiles for: every bucket up to the context."""
        found, length = [], 1
        while length <= self.context - 1:
            width = bucket_width(length, self.context - 1)
            found.append(width)
            length = width + 1
        return found

    def warm_up(self) -> dict[str, float]:
        """Compiles a prefill for every width and the decode step for every count of leading
        rows (a served request then never waits for a compiler); -> seconds taken by each."""
        timings = {}
        for width in self.widths():
            started = time.perf_counter()
            self._prefill_slot(0, Request([0] * width, 1, lambda *_: None))
            timings[f"prefill {width}"] = time.perf_counter() - started
        if self.kept is not None and MIN_REUSE + CHUNK <= self.context:
            started = time.perf_counter()
            self.cache = self.kept.warm_up(self.cache)
            for width in EXTEND_WIDTHS:  # a kept prompt's rest: one chunk of each width
                self._fill(0, [0] * (MIN_REUSE + width), MIN_REUSE, 0)
            timings["prompt cache"] = time.perf_counter() - started
        for rows in self.row_counts():
            started = time.perf_counter()
            self._run_step(np.arange(self.slots) == rows - 1)
            timings[f"decode step, {rows} rows"] = time.perf_counter() - started
        self.counts[:] = 0
        self.prefills = self.steps = 0  # the counts are of requests served
        return timings

    def start(self) -> None:
        self._stop.clear()  # an engine stopped once may start again
        self._thread = threading.Thread(target=self._loop, name="apps-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ends the loop once the active and waiting requests are done (or after `timeout`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request) -> None:
        if request.min_new and len(request.stop_ids) > HELD:
            raise ValueError(f"min_new holds back at most {HELD} stop ids; the request has {len(request.stop_ids)}")
        if len(request.logit_bias) > BIASED:
            raise ValueError(f"logit_bias names at most {BIASED} tokens; the request names {len(request.logit_bias)}")
        if any(not 0 <= i < self.vocab_size for i in request.logit_bias):
            raise ValueError(f"logit_bias names a token outside the vocabulary's {self.vocab_size} ids")
        if not 0 <= request.adapter <= self.adapters:
            raise ValueError(f"adapter {request.adapter}: this engine holds {self.adapters}")
        if len(request.prompt) + request.max_new > self.context:
            raise ValueError(
                f"{len(request.prompt)} prompt tokens and {request.max_new} new ones exceed the {self.context} "
                "positions of the context"
            )
        try:
            self.waiting.put_nowait(request)
        except queue.Full:
            raise QueueFull from None

    def busy(self, adapter: int | None = None) -> int:
        """Slots in use (by requests through `adapter`, if given)."""
        return sum(r is not None and adapter in (None, r.adapter) for r in self.active)

    def queued(self, adapter: int | None = None) -> int:
        """Requests waiting for a slot (through `adapter`, if given)."""
        if adapter is None:
            return self.waiting.qsize()
        with self.waiting.mutex:
            return sum(r.adapter == adapter for r in self.waiting.queue)

    def _loop(self) -> None:
        while True:
            self._admit()
            if not self.busy():
                if self._stop.is_set() and self.waiting.empty():
                    return
                try:
                    request = self.waiting.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._start(self.active.index(None), request)
                continue
            active = np.array([r is not None for r in self.active])
            if self.on_step is not None:
                self.on_step(int(active.sum()))
            try:
                tokens, scores = self._run_step(active)
            except Exception as error:  # the step failed: every request in it fails, the engine goes on
                log.exception("A decode step failed.")
                for slot, request in enumerate(self.active):
                    if request is not None:
                        self._finish(slot, f"error: {error}")
                continue
            for slot, request in enumerate(self.active):
                if request is not None:
                    self._advance(slot, request, int(tokens[slot]), scores[slot])

    def _admit(self) -> None:
        """Fills free slots from the queue, skipping cancelled requests."""
        while None in self.active:
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                return
            self._start(self.active.index(None), request)

    def _start(self, slot: int, request: Request) -> None:
        if request.cancelled.is_set():
            _tell(request, None, "cancelled")
            return
        self.active[slot] = request
        try:
            token, scores = self._prefill_slot(slot, request)
        except Exception as error:
            log.exception("A prefill failed.")
            self._finish(slot, f"error: {error}")
            return
        self.counts[slot] = 0
        self._advance(slot, request, token, scores)

    def _prefill_slot(self, slot: int, request: Request) -> tuple[int, Scores | None]:
        """The request's prompt into the slot's row (after the beginning a kept prompt shares
        with it, if one does and that pays) -> its first token and its scores."""
        prompt = request.prompt
        row, held = self.kept.find(prompt, request.adapter) if self.kept is not None else (-1, 0)
        rest = len(prompt) - held
        last = (rest - 1) % CHUNK + 1  # the last chunk's tokens, padded to its width
        # Chunks after the kept beginning cost more a token than one prefill: used for a short rest.
        if row >= 0 and rest <= max(held, CHUNK) and held + rest - last + _width(last) <= self.context:
            self.cache = self.kept.restore(self.cache, row, slot)
            self.reused += held
        else:
            held = 0
        logits = self._fill(slot, prompt, held, request.adapter)
        token, scores, self.steering = self.programs.begin(
            self.steering, logits, jnp.int32(slot), settings([request], [0], self.mask_words), bias_of(request)
        )
        self.prefills += 1
        return int(token), scored(request, *(np.asarray(a) for a in scores))

    def _fill(self, slot: int, prompt: Sequence[int], held: int, adapter: int) -> jax.Array:
        """The prompt's tokens after the `held` ones into the slot's row: whole, in one padded
        width, or (after a kept beginning) chunk by chunk -> the logits of the token after it."""
        ids = np.array([adapter], np.int32)
        if not held:
            tokens = np.zeros((1, bucket_width(len(prompt), self.context - 1)), np.int32)
            tokens[0, : len(prompt)] = prompt
            logits, self.cache = self.programs.prefill(
                self.params, self.cache, tokens, jnp.int32(len(prompt)), jnp.int32(slot), ids
            )
            return logits
        for start in range(held, len(prompt), CHUNK):
            chunk = prompt[start : start + CHUNK]
            tokens = np.zeros((1, _width(len(chunk))), np.int32)
            tokens[0, : len(chunk)] = chunk
            logits, self.cache = self.programs.extend(
                self.params, self.cache, tokens, jnp.int32(len(chunk)), jnp.int32(start), jnp.int32(slot), ids
            )
        return logits

    def row_counts(self) -> list[int]:
        """The numbers of leading rows that a decode step compiles for: all of them, and the
        powers of two up to a third of them. A step's cost is far from proportional to its rows
        on two CPU cores (SmolLM2 at 512 positions in bfloat16, 16 slots: 1 row 36 ms a step, 2
        rows 50, 4 rows 67, 8 rows 107, all 16 95), so fewer rows pay below a third alone."""
        return sorted({*(1 << i for i in range(self.slots.bit_length()) if 3 << i <= self.slots), self.slots})

    def _run_step(self, active: np.ndarray) -> tuple[np.ndarray, list[Scores | None]]:
        """A decode step over the fewest leading rows that hold every active slot -> a token per
        slot, and each slot's log-probabilities where its request wants them."""
        last = int(np.flatnonzero(active)[-1]) + 1 if active.any() else 1
        rows = next(n for n in self.row_counts() if n >= last)
        requests = [r if r is not None else Request((), 1, lambda *_: None) for r in self.active[:rows]]
        tokens, scores, self.cache, self.steering = self.programs.step(
            rows,
            self.params,
            self.cache,
            self.steering,
            self.last[:rows],
            active[:rows],
            settings(requests, self.counts[:rows], self.mask_words),
            np.array([r.adapter for r in requests], np.int32),
        )
        self.steps += 1
        found = np.zeros(self.slots, np.int32)
        found[:rows] = np.asarray(tokens)
        found_scores: list[Scores | None] = [None] * self.slots
        if any(r.logprobs is not None for r in requests):
            chosen, ids, top = (np.asarray(a) for a in scores)
            found_scores[:rows] = [scored(r, chosen[i], ids[i], top[i]) for i, r in enumerate(requests)]
        return found, found_scores

    def _advance(self, slot: int, request: Request, token: int, scores: Scores | None = None) -> None:
        """A slot's new token (with its log-probabilities if asked): emitted, or the end of its request."""
        self.counts[slot] += 1
        self.last[slot] = token
        if request.cancelled.is_set():
            self._finish(slot, "cancelled")
        elif token in request.stop_ids:
            self._finish(slot, "stop")
        elif request.constraint is not None and (request.constraint.stuck or not request.constraint.take(token)):
            # A mask that allowed nothing: the token drawn under it is not taken.
            self._finish(slot, f"error: the answer's grammar took no further token ({request.constraint.problem()})")
        else:
            _tell(request, token, None, scores)
            if request.constraint is not None and request.constraint.complete():
                self._finish(slot, "stop")  # nothing may follow but an end token
            elif self.counts[slot] >= request.max_new:
                self._finish(slot, "length")

    def _finish(self, slot: int, reason: str) -> None:
        request, self.active[slot] = self.active[slot], None
        if request is not None:
            if self.kept is not None and reason in ("stop", "length"):
                written = len(request.prompt) + int(self.counts[slot])
                self.kept.keep(self.cache, slot, request.prompt, written, request.adapter)
            _tell(request, None, reason)


def _width(tokens: int) -> int:
    """The narrowest width an `extend` is compiled for that holds a chunk of `tokens` (1..CHUNK)."""
    return next(width for width in EXTEND_WIDTHS if width >= tokens)


def _tell(request: Request, token: int | None, reason: str | None, scores: Scores | None = None) -> None:
    """`request.emit` (with the token's `scores` where its request asked), whose failure (a
    caller's bug) cancels that request alone."""
    try:
        request.emit(token, reason) if scores is None else request.emit(token, reason, scores)
    except Exception:
        log.exception("A request's emit failed; cancelling it.")
        request.cancel()
