"""Decoding of CTC outputs on the host: greedy (best path) and prefix beam search.

Both read per-frame log-probabilities over a vocabulary whose id 0 is the blank. A path maps to
a label sequence by merging repeated ids and then removing blanks; the prefix beam search sums
the probabilities of all paths that map to one prefix (Hannun et al., 2014, "First-Pass Large
Vocabulary Continuous Speech Recognition using Bi-Directional Recurrent DNNs"), which the
greedy path does not.
"""

from __future__ import annotations

import functools

import numpy as np

BLANK = 0


def collapse(path) -> list[int]:
    """A frame-level path of ids -> its labels: repeats merged, then blanks removed."""
    labels, previous = [], None
    for token in path:
        token = int(token)
        if token != previous and token != BLANK:
            labels.append(token)
        previous = token
    return labels


def greedy(log_probs: np.ndarray) -> list[int]:
    """The labels of the single most probable path of log_probs [T, V]."""
    return collapse(np.asarray(log_probs).argmax(-1))


def prefix_beam_search(log_probs: np.ndarray, beam_width: int = 8, prune: float = -12.0) -> list[int]:
    """The most probable label sequence found by CTC prefix beam search over log_probs [T, V].

    Each prefix keeps two log-probabilities: of the paths so far that end in a blank, and of
    those that end in its last label; extending by the same label as the last one only counts
    paths that ended in a blank (otherwise the repeat merges). `prune` skips, at each frame, the
    labels whose log-probability is below it (they cannot change the kept beams meaningfully);
    the best label of each frame is always considered. At width 1 it keeps the greedy path's
    labels whenever each frame's best label holds more than 1/sqrt(2) of the mass; elsewhere
    it may differ, as it ranks prefixes by all their paths, not by the best one.
    """
    log_probs = np.asarray(log_probs, np.float64)
    beams: dict[tuple[int, ...], tuple[float, float]] = {(): (0.0, -np.inf)}  # prefix -> (blank, label)
    for frame in log_probs:
        candidates = np.flatnonzero(frame >= min(prune, frame.max()))
        next_beams: dict[tuple[int, ...], list[float]] = {}
        add = functools.partial(_add, next_beams)
        for prefix, (p_blank, p_label) in beams.items():
            p_total = np.logaddexp(p_blank, p_label)
            for token in candidates:
                p = frame[token]
                if token == BLANK:
                    add(prefix, p_total + p, -np.inf)
                elif prefix and token == prefix[-1]:
                    add(prefix, -np.inf, p_label + p)  # the repeat merges into the same label
                    add(prefix + (int(token),), -np.inf, p_blank + p)  # a blank separated them
                else:
                    add(prefix + (int(token),), -np.inf, p_total + p)
        ranked = sorted(next_beams.items(), key=lambda item: -np.logaddexp(*item[1]))
        beams = {prefix: (blank, label) for prefix, (blank, label) in ranked[:beam_width]}
    best = max(beams.items(), key=lambda item: np.logaddexp(*item[1]))
    return list(best[0])


def _add(beams: dict, prefix: tuple[int, ...], blank: float, label: float) -> None:
    """Adds path probabilities (log) ending in a blank and in the last label to `prefix`."""
    entry = beams.setdefault(prefix, [-np.inf, -np.inf])
    entry[0], entry[1] = np.logaddexp(entry[0], blank), np.logaddexp(entry[1], label)
