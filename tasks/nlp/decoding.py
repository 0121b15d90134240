"""How the seq2seq tasks decode: their `apps predict` options (beam search, sampling, the
penalties of `core.generation.penalties`, minimum Bayes risk) and the minimum-Bayes-risk choice itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import sacrebleu

from core.generation import penalties
from core.options import PredictOption


def decoding_options() -> tuple[PredictOption, ...]:
    """`apps predict`'s options of a seq2seq task. The penalties (`core.generation.penalties`) default to
    the run's own (`data.no_repeat_ngram`, `data.word_reward`), which a preset tunes on the valid
    split for its model: None here stands for them."""
    return (
        PredictOption("beams", int, 4, "beam search with this many beams (1: greedy or sampling)"),
        PredictOption("length_penalty", float, 0.6, "beam search: GNMT length penalty exponent"),
        *(
            dataclasses.replace(option, default=None, help=f"{option.help}; default: the run's data.{option.name}")
            for option in penalties.options()
        ),
        PredictOption("temperature", float, 0.0, "with --beams 1: softmax temperature; 0 is greedy"),
        PredictOption("seed", int, 0, "random seed of the sampling"),
        PredictOption(
            "mbr",
            int,
            0,
            "minimum Bayes risk: sample this many outputs (at --mbr-temperature) and return, of them and "
            "the greedy and beam outputs, the one with the highest mean chrF against the samples; 0 is off",
        ),
        PredictOption("mbr_temperature", float, 0.7, "the softmax temperature of the samples of --mbr"),
    )


def minimum_bayes_risk(candidates: Sequence[Sequence[str]], samples: Sequence[Sequence[str]]) -> list[str]:
    """Per source, the candidate of highest expected utility, the mean sentence chrF against the
    model's own samples (sampling-based MBR with a chrF utility; Eikema & Aziz 2020, Freitag et
    al. 2022): the output that agrees most with what the model would write, not its single most
    likely one. The first of equal candidates wins."""
    chrf = sacrebleu.metrics.CHRF()
    chosen = []
    for pool, references in zip(candidates, samples):
        unique = list(dict.fromkeys(pool))
        utility = [sum(chrf.sentence_score(text, [reference]).score for reference in references) for text in unique]
        chosen.append(unique[int(np.argmax(utility))])
    return chosen
