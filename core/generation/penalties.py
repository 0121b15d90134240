"""Adjustments of next-token scores that sampling (core/generation/generate.py) and beam search
(core/generation/beam.py) both apply at every step, before they choose.

- `no_repeat_ngram` n: a token that would complete an n-gram the row has already generated is
  banned (Hugging Face's `no_repeat_ngram_size`; only the new tokens count, not a prompt). A weak
  decoder stuck in a loop ("mir mir mir ...") must then say something else.
- `word_reward` r: every token that is not a stop token earns r nats (Murray and Chiang 2018,
  "Correcting length bias in neural machine translation"): a model trained on short targets
  stops too early, and a beam prefers the short hypotheses its probabilities favour. In greedy
  decoding this lowers the stop tokens' logits by r; sampling divides the lowered logits by its
  temperature, r / T.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from core.errors import UserError
from core.options import PredictOption


def options(no_repeat_ngram: int = 0, word_reward: float = 0.0) -> tuple[PredictOption, ...]:
    """The `apps predict` options that set them, with a task's defaults (0 is off)."""
    return (
        PredictOption(
            "no_repeat_ngram", int, no_repeat_ngram, "never generate an n-gram of pieces twice in one output; 0 is off"
        ),
        PredictOption("word_reward", float, word_reward, "nats added per generated piece but the stop: longer outputs"),
    )


def from_options(values: dict) -> dict:
    """The generators' keyword arguments from the values of `apps predict` options."""
    return {option.name: values[option.name] for option in options()}


def check(no_repeat_ngram: int, word_reward: float) -> None:
    if no_repeat_ngram < 0:
        raise UserError(f"no_repeat_ngram={no_repeat_ngram} must be >= 0 (0 is off).")
    if not math.isfinite(word_reward):
        raise UserError(f"word_reward={word_reward} must be a finite number of nats.")


def adjust(
    scores: jax.Array,
    generated: jax.Array,
    length: jax.Array,
    stops: jax.Array,
    no_repeat_ngram: int,
    word_reward: float,
) -> jax.Array:
    """Next-token `scores` [R, V] (logits or log-probabilities) of rows whose first `length`
    (a scalar) tokens of `generated` [R, M] are their output so far, with the word reward added
    and repeated n-grams banned (-inf)."""
    if word_reward:
        scores = scores + jnp.where(jnp.isin(jnp.arange(scores.shape[-1]), stops), 0.0, word_reward)[None, :]
    if no_repeat_ngram:
        scores = jnp.where(repeats(generated, length, no_repeat_ngram, scores.shape[-1]), -jnp.inf, scores)
    return scores


def repeats(generated: jax.Array, length: jax.Array, n: int, vocab_size: int) -> jax.Array:
    """Which next tokens [R, V] would complete an n-gram that occurs within the first `length`
    tokens of each row of `generated` [R, M]: those that followed an earlier occurrence of the
    row's last n - 1 tokens."""
    R, M = generated.shape
    if M < n:
        return jnp.zeros((R, vocab_size), bool)
    starts = M - n + 1
    # Every n-gram of the buffer: its last token [R, starts] and its first n - 1 [R, starts, n - 1].
    nexts = generated[:, n - 1 :]
    found = (jnp.arange(starts) + n <= length)[None, :]  # the n-gram lies within the output so far
    if n > 1:
        heads = jnp.stack([generated[:, k : starts + k] for k in range(n - 1)], axis=-1)
        last = jax.lax.dynamic_slice(generated, (0, jnp.maximum(length - (n - 1), 0)), (R, n - 1))
        found = found & (length >= n - 1) & jnp.all(heads == last[:, None, :], axis=-1)
    return jnp.zeros((R, vocab_size), bool).at[jnp.arange(R)[:, None], nexts].max(found)
