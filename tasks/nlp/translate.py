"""Machine translation, English to German by default, on the core's encoder-decoder.

Default data: the usage examples of Debian's `dict-freedict-eng-deu` (see `tasks.nlp.freedict`),
pairs of 1 to `MAX_WORDS` words a side, deduplicated and split on the source side (see
`tasks.nlp.seq2seq`). Metrics: BLEU and chrF by sacrebleu (its default 13a tokenization; the
signatures are written beside the scores) for greedy and beam decoding; the baseline translates
word by word with the same dictionary's headwords (`freedict.word_by_word`), each headword's
sense chosen by the training targets' word counts, unknown words copied. With other data (or
`data.direction=reverse`), the baseline copies the source.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import sacrebleu

from core.config import modern_blocks
from tasks.nlp import freedict
from tasks.nlp.seq2seq import Seq2SeqData, Seq2SeqTask, preset

MAX_WORDS = 24


def tiny():
    return preset("translate", "tiny", modern_blocks(32, 1, 2, 64, 32, 0.0), Seq2SeqData(vocab_size=300), 20, 16, 3e-3)


def base():
    # Sized for about 12 minutes of training on 2 CPU cores (about 190 pairs/s): some 2.6 epochs.
    return preset(
        "translate",
        "base",
        modern_blocks(256, 2, 4, 704, 64, 0.1),
        Seq2SeqData(vocab_size=6000, source_len=40, target_len=40),
        steps=2000,
        batch_size=64,
        lr=2e-3,
    )


@functools.cache
def dictionary_pairs() -> tuple[tuple[str, str], ...]:
    """The dictionary's usage examples of 1 to MAX_WORDS words a side, in dictionary order;
    parsed once per process (each split reads them)."""
    pairs = freedict.example_pairs(freedict.read().decode("utf-8"))
    return tuple((s, t) for s, t in pairs if len(s.split()) <= MAX_WORDS and len(t.split()) <= MAX_WORDS)


def translation_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus BLEU and chrF (0-100) and their sacrebleu signatures."""
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    return {
        "bleu": bleu.corpus_score(list(hypotheses), [list(references)]).score,
        "chrf": chrf.corpus_score(list(hypotheses), [list(references)]).score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


@dataclass(frozen=True, kw_only=True)
class TranslateTask(Seq2SeqTask):
    name: ClassVar[str] = "translate"
    summary: ClassVar[str] = "Translation (English to German by default)"
    default_data: ClassVar[str] = f"FreeDict English-German usage examples (Debian {freedict.PACKAGE})"
    model_summary: ClassVar[str] = "encoder-decoder (RMSNorm, SwiGLU, rotary), shared vocabulary"
    metric_names: ClassVar[tuple[str, ...]] = ("bleu", "chrf", "nll", "token_accuracy")
    output_name: ClassVar[str] = "translation"
    presets: ClassVar[dict] = {"tiny": tiny, "base": base}

    def pairs(self):
        return dictionary_pairs()

    def protocol(self) -> dict[str, str]:
        limit = f"1 to {MAX_WORDS} words a side, " if self.data is None else ""
        return {
            "dataset": self.data or self.default_data,
            "protocol": f"{limit}one pair per normalized source, split 90/5/5 by a hash of the source; "
            "greedy and beam decoding; sacrebleu BLEU and chrF (13a tokenization)",
        }

    def score_generated(self, generated, examples, featurizer) -> dict:
        return translation_scores(generated["text"], [e["target"] for e in examples])

    def baselines(self, train, test, featurizer) -> dict[str, dict]:
        sources, references = [e["source"] for e in test], [e["target"] for e in test]
        if self.data is None and self.config.data.direction == "forward":
            words = freedict.choose_senses(freedict.senses(), [e["target"] for e in train])
            return {"dictionary": translation_scores([freedict.word_by_word(s, words) for s in sources], references)}
        return {"copy_source": translation_scores(sources, references)}
