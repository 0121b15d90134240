"""N-gram language-model baselines over token ids: add-k `Unigram` and interpolated `KneserNey`.

Both score sequences of token ids (lists or 1-D arrays of ints, one per document) under one
convention:

- Every document starts in a context of `bos`: the Kneser-Ney model pads it on the left with
  `order - 1` copies of `bos`, so the first token is predicted from `bos ... bos`. `bos` is never
  predicted and may not occur inside a sequence.
- With `eos` given, `eos` is appended to every document and predicted like any other token (so
  an empty document still scores one token); with `eos=None` nothing is appended.
- Distributions cover the whole vocabulary `0 .. vocab_size - 1` (special ids included), and
  every id has a nonzero probability, so any id in range can be scored.

`log_prob(sequences)` returns the total natural-log probability and the number of predicted
tokens; bits per character are `-total / ln 2 / characters`.

The Kneser-Ney model is the interpolated form of Chen & Goodman (1998), section 3: for an order-k
n-gram `h w`,

    P_k(w | h) = (max(a(h w) - D_k(a), 0) + B_k(h) * P_{k-1}(w | h')) / S_k(h)   when S_k(h) > 0
    P_k(w | h) = P_{k-1}(w | h')                                               otherwise

where h' drops the first token of h, S_k(h) sums a(h v) over v, B_k(h) = sum over the counts
j in {1, 2, 3+} of D_k(j) times the number of v with a(h v) = j, and P_0 is uniform over the
vocabulary. The count a is the raw count at the highest order; below it, the continuation count
N1+(. h w) (how many distinct tokens precede `h w`), except for n-grams that start with `bos`,
whose left neighbour can only be more padding: they keep their raw counts (as in KenLM and SRILM).
Discounts: with `discount=None` (modified Kneser-Ney) three per order from the count-of-counts
n1..n4 of a: Y = n1 / (n1 + 2 n2), D(1) = 1 - 2 Y n2 / n1, D(2) = 2 - 3 Y n3 / n2,
D(3+) = 3 - 4 Y n4 / n3; an order whose n1..n4 include a zero, or whose estimates fall outside
0 < D(j) <= j, uses FALLBACK_DISCOUNT for all three. With a number, that one discount everywhere.

Counting is numpy only: each n-gram gets a dense id from (id of its prefix, last token) with
`np.unique`, so an order-5 model of a million tokens fits in about a second on one core.
(nltk.lm's KneserNeyInterpolated took 11 ms a token to score after fitting only 20k tokens;
KenLM ships no wheel, and trains with a separate compiled binary.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from core.errors import UserError

FALLBACK_DISCOUNT = 0.75


def _as_arrays(sequences: Iterable[Sequence[int]], vocab_size: int, bos: int | None) -> list[np.ndarray]:
    """The sequences as 1-D int64 arrays, with every id checked against the vocabulary."""
    arrays = []
    for index, sequence in enumerate(sequences):
        array = np.asarray(sequence, dtype=np.int64)
        if array.ndim != 1:
            raise UserError(f"Sequence {index} has shape {array.shape}; each sequence is a flat list of ids.")
        if array.size and (array.min() < 0 or array.max() >= vocab_size):
            bad = int(array[(array < 0) | (array >= vocab_size)][0])
            raise UserError(f"Sequence {index} holds the id {bad}, outside the vocabulary of {vocab_size} ids.")
        if bos is not None and array.size and (array == bos).any():
            raise UserError(f"Sequence {index} holds the bos id {bos}; bos is added by the model, not the caller.")
        arrays.append(array)
    return arrays


def _lookup(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """values[index], and 0 where the index is -1 (an n-gram or context unknown to the model)."""
    found = np.zeros(len(index))
    known = index >= 0
    found[known] = values[index[known]]
    return found


class Unigram:
    """Add-k smoothed unigram: P(w) = (count(w) + k) / (tokens + k * vocab_size); k = 1 is add-one."""

    def __init__(self, vocab_size: int, *, smoothing: float = 1.0, eos: int | None = None):
        if vocab_size < 1 or smoothing <= 0:
            raise UserError(f"Unigram needs vocab_size >= 1 and smoothing > 0, got {vocab_size} and {smoothing}.")
        if eos is not None and not 0 <= eos < vocab_size:
            raise UserError(f"eos {eos} is outside the vocabulary of {vocab_size} ids.")
        self.vocab_size, self.smoothing, self.eos = vocab_size, smoothing, eos
        self.log_probs: np.ndarray | None = None

    def fit(self, sequences: Iterable[Sequence[int]]) -> Unigram:
        counts = np.zeros(self.vocab_size, np.float64)
        for array in _as_arrays(sequences, self.vocab_size, None):
            counts += np.bincount(array, minlength=self.vocab_size)
            if self.eos is not None:
                counts[self.eos] += 1
        total = counts.sum() + self.smoothing * self.vocab_size
        self.log_probs = np.log((counts + self.smoothing) / total)
        return self

    def probabilities(self, context: Sequence[int] = ()) -> np.ndarray:
        """P(w) for every id w of the vocabulary; a unigram ignores the context."""
        return np.exp(self._fitted())

    def token_log_probs(self, sequences: Iterable[Sequence[int]]) -> np.ndarray:
        """The natural-log probability of every predicted token, documents one after another."""
        arrays = _as_arrays(sequences, self.vocab_size, None)
        if self.eos is not None:
            arrays = [np.append(array, self.eos) for array in arrays]
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        return self._fitted()[tokens]

    def log_prob(self, sequences: Iterable[Sequence[int]]) -> tuple[float, int]:
        """(total natural-log probability, number of predicted tokens)."""
        values = self.token_log_probs(sequences)
        return float(values.sum()), int(values.size)

    def _fitted(self) -> np.ndarray:
        if self.log_probs is None:
            raise RuntimeError("Unigram.fit must be called before scoring.")
        return self.log_probs


class KneserNey:
    """Interpolated (modified) Kneser-Ney of any order over a fixed vocabulary; see the module docstring."""

    def __init__(
        self, vocab_size: int, *, bos: int, order: int = 5, discount: float | None = None, eos: int | None = None
    ):
        if vocab_size < 1 or order < 1:
            raise UserError(f"KneserNey needs vocab_size >= 1 and order >= 1, got {vocab_size} and {order}.")
        if discount is not None and not 0 < discount <= 1:
            raise UserError(f"The Kneser-Ney discount must be in (0, 1], got {discount}.")
        for name, value in (("bos", bos), ("eos", eos)):
            if value is not None and not 0 <= value < vocab_size:
                raise UserError(f"{name} {value} is outside the vocabulary of {vocab_size} ids.")
        if eos is not None and eos == bos:
            raise UserError("bos and eos must be different ids.")
        # Keys are (prefix id) * vocab_size + token in int64; prefix ids stay below the token count.
        self.vocab_size, self.bos, self.order, self.discount, self.eos = vocab_size, bos, order, discount, eos
        self.tables: list[np.ndarray] = []  # per order k = 1..n: sorted keys of the known k-grams
        self.counts: list[np.ndarray] = []  # per order: a(g) of each k-gram (0 for context-only ones)
        self.totals: list[np.ndarray] = []  # per order: S_k(h) of each (k-1)-gram h
        self.backoffs: list[np.ndarray] = []  # per order: B_k(h) of each (k-1)-gram h
        self.discounts: list[tuple[float, float, float]] = []  # per order: D(1), D(2), D(3+)

    def fit(self, sequences: Iterable[Sequence[int]]) -> KneserNey:
        tokens, offsets = self._flatten(sequences)
        real = np.flatnonzero(offsets >= self.order - 1)
        ids, self.tables = self._gram_ids(tokens, offsets, tables=None)
        self.counts, self.totals, self.backoffs, self.discounts = [], [], [], []
        for k in range(1, self.order + 1):
            size = len(self.tables[k - 1])
            raw = np.bincount(ids[k][real], minlength=size)
            if k == self.order:
                adjusted = raw
            else:
                # Continuation count: the distinct (k+1)-grams whose last k tokens are this k-gram.
                _, first = np.unique(ids[k + 1][real], return_index=True)
                adjusted = np.bincount(ids[k][real][first], minlength=size)
                if k > 1:
                    starts_with_bos = np.zeros(size, bool)
                    starts_with_bos[ids[k][real]] = tokens[real - k + 1] == self.bos
                    adjusted = np.where(starts_with_bos, raw, adjusted)
            discounts = self._discounts(adjusted)
            seen = np.flatnonzero(adjusted)
            contexts = self.tables[k - 1][seen] // self.vocab_size
            context_count = len(self.tables[k - 2]) if k > 1 else 1
            per_count = np.asarray(discounts)[np.minimum(adjusted[seen], 3) - 1]
            self.counts.append(adjusted.astype(np.float64))
            self.totals.append(np.bincount(contexts, weights=adjusted[seen], minlength=context_count))
            self.backoffs.append(np.bincount(contexts, weights=per_count, minlength=context_count))
            self.discounts.append(discounts)
        return self

    def token_log_probs(self, sequences: Iterable[Sequence[int]]) -> np.ndarray:
        """The natural-log probability of every predicted token, documents one after another."""
        return self._score(*self._flatten(sequences))

    def log_prob(self, sequences: Iterable[Sequence[int]]) -> tuple[float, int]:
        """(total natural-log probability, number of predicted tokens)."""
        values = self.token_log_probs(sequences)
        return float(values.sum()), int(values.size)

    def probabilities(self, context: Sequence[int] = ()) -> np.ndarray:
        """P(w | context) for every id w of the vocabulary (bos and eos included).

        The context is read as the start of a document: one shorter than `order - 1` tokens is
        padded with `bos` on the left; of a longer one, the last `order - 1` tokens count.
        """
        (context,) = _as_arrays([context], self.vocab_size, self.bos)
        context = context[max(len(context) - self.order + 1, 0) :]
        # One document per candidate: padding, context, candidate; only the candidate is kept.
        prefix = np.concatenate([np.full(self.order - 1, self.bos, np.int64), context])
        rows = np.hstack([np.tile(prefix, (self.vocab_size, 1)), np.arange(self.vocab_size)[:, None]])
        offsets = np.tile(np.arange(rows.shape[1]), self.vocab_size)
        values = self._score(rows.reshape(-1), offsets).reshape(self.vocab_size, -1)
        return np.exp(values[:, -1])

    def _score(self, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Natural-log P(token | its order-1 predecessors) at every position past the padding."""
        if not self.tables:
            raise RuntimeError("KneserNey.fit must be called before scoring.")
        real = np.flatnonzero(offsets >= self.order - 1)
        ids, _ = self._gram_ids(tokens, offsets, tables=self.tables)
        probabilities = np.full(real.size, 1.0 / self.vocab_size)
        discounts = np.zeros(4)  # indexed by min(count, 3); an unseen n-gram has nothing to discount
        for k in range(1, self.order + 1):
            gram = ids[k][real]
            context = ids[k - 1][real - 1] if k > 1 else np.zeros(real.size, np.int64)
            count = _lookup(self.counts[k - 1], gram)
            total = _lookup(self.totals[k - 1], context)
            backoff = _lookup(self.backoffs[k - 1], context)
            discounts[1:] = self.discounts[k - 1]
            discount = discounts[np.minimum(count, 3).astype(np.int64)]
            mixed = (np.maximum(count - discount, 0.0) + backoff * probabilities) / np.where(total > 0, total, 1.0)
            probabilities = np.where(total > 0, mixed, probabilities)
        return np.log(probabilities)

    def _flatten(self, sequences: Iterable[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """All documents, each padded with order-1 bos ids (and followed by eos), end to end,
        with every position's offset from its document's start."""
        pad = np.full(self.order - 1, self.bos, np.int64)
        tail = np.asarray([self.eos] if self.eos is not None else [], np.int64)
        pieces = [np.concatenate([pad, array, tail]) for array in _as_arrays(sequences, self.vocab_size, self.bos)]
        if not pieces:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        lengths = np.asarray([len(piece) for piece in pieces])
        starts = np.cumsum(lengths) - lengths
        offsets = np.arange(lengths.sum()) - np.repeat(starts, lengths)
        return np.concatenate(pieces), offsets

    def _gram_ids(
        self, tokens: np.ndarray, offsets: np.ndarray, tables: list[np.ndarray] | None
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """ids[k][p]: the id of the k-gram that ends at position p (-1 when it would cross the
        document's start or, when scoring, is not among the training n-grams); ids[0] is the
        empty gram, id 0. Training builds the tables; scoring looks ids up in them."""
        ids = [np.zeros(len(tokens), np.int64)]
        built = []
        for k in range(1, self.order + 1):
            prefix = ids[0] if k == 1 else np.concatenate([[-1], ids[k - 1][:-1]])
            valid = np.flatnonzero((offsets >= k - 1) & (prefix >= 0))
            keys = prefix[valid] * self.vocab_size + tokens[valid]
            gram = np.full(len(tokens), -1, np.int64)
            if tables is None:
                table, gram[valid] = np.unique(keys, return_inverse=True)
                built.append(table)
            else:
                table = tables[k - 1]
                found = np.minimum(np.searchsorted(table, keys), max(len(table) - 1, 0))
                hit = table[found] == keys if len(table) else np.zeros(len(keys), bool)
                gram[valid[hit]] = found[hit]
            ids.append(gram)
        return ids, built

    def _discounts(self, counts: np.ndarray) -> tuple[float, float, float]:
        if self.discount is not None:
            return (self.discount,) * 3
        n1, n2, n3, n4 = (int(np.count_nonzero(counts == j)) for j in (1, 2, 3, 4))
        if min(n1, n2, n3, n4) == 0:
            return (FALLBACK_DISCOUNT,) * 3
        y = n1 / (n1 + 2 * n2)
        estimates = (1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3)
        if not all(0 < value <= j for j, value in enumerate(estimates, start=1)):
            return (FALLBACK_DISCOUNT,) * 3
        return estimates


def bits_per_character(total_log_prob: float, characters: int) -> float:
    """Bits per character from a total natural-log probability over a text of `characters` characters."""
    return -total_log_prob / math.log(2) / characters
