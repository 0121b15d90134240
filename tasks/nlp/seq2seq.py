"""Sequence to sequence on the core's encoder-decoder: what `translate` and `summarize` share.

Pairs (source text, target text) and their fixed split are `tasks.nlp.pairs`'s;
`data.direction=reverse` swaps the sides.

One sentencepiece model over both sides (`data.shared_vocab`, the default: one embedding table
for source, target and output) or one per side. A source is its pieces and EOS; a target is
read as [BOS] pieces and predicted as pieces [EOS] (core/task.py's encoder-decoder keys); both
are cut to `data.source_len` / `data.target_len` with a warning.

Training minimizes cross-entropy, label-smoothed by `optim.label_smoothing` (0.1 in the
presets), over batches of similar lengths (the task's `trim`); the best checkpoint is the one
with the lowest validation `nll` (unsmoothed, nats per target piece). `apps eval` then decodes
the split greedily and with beam search and scores the text (the task's `score_generated`)
beside a classical baseline.
"""

from __future__ import annotations

import abc
import gzip
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import sacrebleu
from flax import nnx

from core import losses, penalties
from core import metrics as metric_lib
from core.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, require
from core.data import decoding_batches
from core.encoder_decoder import EncoderDecoder, generate_beams_from_source, generate_from_source
from core.errors import UserError
from core.heads import CopyOutput, CopyProjection, Projection, TiedOutput, TokenEmbedder
from core.task import PredictOption, Task, scored_positions
from tasks.common.tokenizer import BOS, EOS, PAD, Tokenizer
from tasks.nlp.freedict import word_by_word
from tasks.nlp.pairs import read_pairs, split_pairs, synthetic_pairs

log = logging.getLogger("apps")


@dataclass(frozen=True, kw_only=True)
class Seq2SeqData(DataConfig):
    """Columns of a --data table, the direction, the vocabulary, lengths and decoding limits."""

    source_column: str = "source"
    target_column: str = "target"
    direction: Literal["forward", "reverse"] = "forward"  # reverse: the target column is the source
    vocab_size: int = 8000
    shared_vocab: bool = True
    source_len: int = 32  # pieces of a source, with its EOS; longer sources are cut
    target_len: int = 32  # pieces of a target, with its EOS; also the most a decoding generates
    # A decoding generates at most max_len_a * (source pieces) + max_len_b pieces (fairseq's rule).
    max_len_a: float = 1.5
    max_len_b: int = 8
    # A pointer-generator output (core.heads.CopyOutput): each target piece may be copied from
    # the source's pieces as well as generated; needs shared_vocab.
    copy: bool = False

    def __post_init__(self):
        for key in ("vocab_size", "source_len", "target_len"):
            require(getattr(self, key) > 0, f"data.{key}", getattr(self, key), "must be positive")
        require(self.max_len_a >= 0, "data.max_len_a", self.max_len_a, "must not be negative")
        require(self.max_len_b >= 0, "data.max_len_b", self.max_len_b, "must not be negative")
        require(
            not self.copy or self.shared_vocab, "data.copy", self.copy, "copies source pieces: needs data.shared_vocab"
        )


def preset(task: str, name: str, model: ModelConfig, data: Seq2SeqData, steps: int, batch_size: int, lr: float):
    """A seq2seq config; evaluation and checkpoints every quarter of the run."""
    every = max(steps // 4, 1)
    return Config(
        task=task,
        preset=name,
        model=model,
        optim=OptimConfig(learning_rate=lr, warmup_steps=max(steps // 20, 1), weight_decay=0.01, label_smoothing=0.1),
        train=TrainConfig(
            batch_size=batch_size,
            eval_batch_size=128,
            steps=steps,
            eval_every=every,
            checkpoint_every=every,
            log_every=max(steps // 40, 1),
        ),
        data=data,
    )


@dataclass
class Seq2SeqFeaturizer:
    """The source and target tokenizers (one object when shared), the length budgets, and an
    optional glossary (word -> translation) whose word-by-word gloss the encoder reads after
    each source."""

    source: Tokenizer
    target: Tokenizer
    source_len: int
    target_len: int
    glossary: dict[str, str] | None = None

    GLOSSARY = "glossary.json.gz"

    @property
    def shared(self) -> bool:
        return self.source is self.target

    def save(self, directory: Path) -> None:
        if self.glossary is not None:
            (directory / self.GLOSSARY).write_bytes(gzip.compress(json.dumps(self.glossary).encode("utf-8")))
        if self.shared:
            self.source.save(directory)
            return
        for side, tokenizer in (("source", self.source), ("target", self.target)):
            (directory / side).mkdir(exist_ok=True)
            tokenizer.save(directory / side)

    @classmethod
    def load(cls, directory: Path, source_len: int, target_len: int) -> Seq2SeqFeaturizer:
        glossary = directory / cls.GLOSSARY
        glossary = json.loads(gzip.decompress(glossary.read_bytes())) if glossary.exists() else None
        if (directory / Tokenizer.FILE).exists():
            shared = Tokenizer.load(directory)
            return cls(shared, shared, source_len, target_len, glossary)
        sides = Tokenizer.load(directory / "source"), Tokenizer.load(directory / "target")
        return cls(*sides, source_len, target_len, glossary)

    def encoder_text(self, source: str) -> str:
        """What the encoder reads: the source, and with a glossary " = " and its gloss."""
        return source if self.glossary is None else f"{source} = {word_by_word(source, self.glossary)}"

    def source_ids(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each source's pieces (with its gloss) and EOS, cut to `source_len` (with a warning)."""
        texts = [self.encoder_text(text) for text in texts]
        return _cut(self.source.processor.encode(texts), self.source_len, "source", "data.source_len")

    def text(self, ids: Sequence[int]) -> str:
        """The target text of generated ids (up to the first EOS)."""
        ids = list(ids)
        return self.target.decode(ids[: ids.index(EOS)] if EOS in ids else ids)

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        sources = self.source_ids([e["source"] for e in examples])
        targets = _cut(
            self.target.processor.encode([e["target"] for e in examples]), self.target_len, "target", "data.target_len"
        )
        inputs = np.full((len(examples), self.source_len), PAD, np.int32)
        decoder_inputs = np.full((len(examples), self.target_len), PAD, np.int32)
        outputs = np.full((len(examples), self.target_len), PAD, np.int32)
        for row, (source, target) in enumerate(zip(sources, targets)):
            inputs[row, : len(source)] = source
            outputs[row, : len(target)] = target
            decoder_inputs[row, : len(target)] = [BOS, *target[:-1]]
        return {
            "inputs": inputs,
            "mask": inputs != PAD,
            "decoder_inputs": decoder_inputs,
            "decoder_mask": outputs != PAD,
            "targets": outputs,
            "target_mask": outputs != PAD,
            "weights": np.ones(len(examples), np.float32),
        }


def _cut(pieces: list[list[int]], length: int, side: str, key: str) -> list[np.ndarray]:
    """Pieces and EOS of each text, at most `length`; how many were cut is logged."""
    rows = [np.asarray([*ids, EOS], np.int32) for ids in pieces]
    long = sum(len(row) > length for row in rows)
    if long:
        log.warning("%d of %d %ss are longer than %s=%d pieces and were cut to it.", long, len(rows), side, key, length)
    return [row[:length] for row in rows]


def decoding_options(no_repeat_ngram: int = 0, word_reward: float = 0.0) -> tuple[PredictOption, ...]:
    """`apps predict`'s options of a seq2seq task, with the task's defaults of the penalties
    (`core.penalties`), which it tunes on its valid split."""
    return (
        PredictOption("beams", int, 4, "beam search with this many beams (1: greedy or sampling)"),
        PredictOption("length_penalty", float, 0.6, "beam search: GNMT length penalty exponent"),
        *penalties.options(no_repeat_ngram, word_reward),
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


@dataclass(frozen=True, kw_only=True)
class Seq2SeqTask(Task):
    """The shared body of the seq2seq tasks; a task adds its data, scores and baseline."""

    output_name: ClassVar[str]  # the rendered column: "translation", "summary"
    best_metric: ClassVar[str] = "nll"
    lower_is_better: ClassVar[bool] = True
    data_type: ClassVar[type] = Seq2SeqData
    default_preset: ClassVar[str] = "base"
    generates: ClassVar[bool] = True
    token_masks: ClassVar[tuple[str, ...]] = ("mask", "decoder_mask")
    trim: ClassVar[dict[str, tuple[str, ...]]] = {
        "mask": ("inputs",),
        "decoder_mask": ("decoder_inputs", "targets", "target_mask"),
    }
    predict_options: ClassVar[tuple[PredictOption, ...]] = decoding_options()
    evaluated_decodings: ClassVar[dict[str, dict[str, Any]]] = {"greedy": {"beams": 1}, "beam": {"beams": 4}}

    config: Config
    data: str | None = None

    @abc.abstractmethod
    def pairs(self) -> Sequence[tuple[str, str]]:
        """All (source, target) pairs of the embedded default, before the split."""

    def examples(self, split: str) -> list[dict]:
        options = self.config.data
        if self.data == "synthetic":
            pairs = synthetic_pairs()
        elif self.data is None:
            pairs = self.pairs()
        else:
            pairs = read_pairs(self.data, options.source_column, options.target_column)
        return split_pairs(pairs, split, options.direction)

    def glossary(self, train: Sequence[dict]) -> dict[str, str] | None:
        """The word -> translation map whose glosses the encoder reads (None: sources alone)."""
        return None

    def fit_featurizer(self, train: Sequence[dict]) -> Seq2SeqFeaturizer:
        options = self.config.data
        sources, targets = [e["source"] for e in train], [e["target"] for e in train]
        if options.shared_vocab:
            source = target = Tokenizer.train(sources + targets, options.vocab_size)
        else:
            source, target = Tokenizer.train(sources, options.vocab_size), Tokenizer.train(targets, options.vocab_size)
        return Seq2SeqFeaturizer(source, target, options.source_len, options.target_len, self.glossary(train))

    def load_featurizer(self, directory: Path) -> Seq2SeqFeaturizer:
        return Seq2SeqFeaturizer.load(directory, self.config.data.source_len, self.config.data.target_len)

    def model(self, featurizer: Seq2SeqFeaturizer, config: Config, rngs: nnx.Rngs) -> EncoderDecoder:
        d_model = config.model.d_model
        source = TokenEmbedder(featurizer.source.vocab_size, d_model, rngs=rngs)
        target = source if featurizer.shared else TokenEmbedder(featurizer.target.vocab_size, d_model, rngs=rngs)
        head = CopyOutput(target, d_model, rngs=rngs) if config.data.copy else TiedOutput(target)
        return EncoderDecoder.build(config.model, source, target, head, remat=config.train.remat, rngs=rngs)

    def loss(self, outputs: Projection | CopyProjection, batch: dict):
        return _cross_entropy(outputs, batch, self.config.optim.label_smoothing)

    def metrics(self, outputs: Projection | CopyProjection, batch: dict):
        return {
            "nll": _cross_entropy(outputs, batch),
            "token_accuracy": metric_lib.accuracy(outputs.logits(), batch["targets"], scored_positions(batch)),
        }

    def decode(self, outputs: Projection | CopyProjection, batch: dict) -> dict:
        return {}  # the text is generated (`generate`), not read off the teacher-forced pass

    def score(self, predictions, examples, featurizer) -> dict[str, float]:
        return {}

    def generate(self, model, featurizer: Seq2SeqFeaturizer, examples, options: dict, on_text=None) -> dict:
        """Each source's target text: beam search, greedy or sampled decoding with --beams 1, or
        minimum Bayes risk over all three with --mbr."""
        if options["beams"] < 1:
            raise UserError(f"--beams {options['beams']}: must be at least 1 (1 is greedy, more search).")
        if options["mbr"] < 0:
            raise UserError(f"--mbr {options['mbr']}: must be at least 0 (0 is off).")
        sources = featurizer.source_ids([e["source"] for e in examples])
        if not options["mbr"]:
            return {"text": self.decode_texts(model, featurizer, sources, options)}
        if options["mbr_temperature"] <= 0:
            raise UserError(f"--mbr-temperature {options['mbr_temperature']}: must be positive (samples differ).")
        # The pseudo-references are the model's own samples: no penalty reshapes them.
        sampled = {"beams": 1, "temperature": options["mbr_temperature"], "no_repeat_ngram": 0, "word_reward": 0.0}
        samples = [
            self.decode_texts(model, featurizer, sources, {**options, **sampled, "seed": seed})
            for seed in range(options["seed"], options["seed"] + options["mbr"])
        ]
        candidates = [self.decode_texts(model, featurizer, sources, {**options, "beams": 1, "temperature": 0.0})]
        if options["beams"] > 1:
            candidates.append(self.decode_texts(model, featurizer, sources, options))
        return {"text": minimum_bayes_risk(list(zip(*candidates, *samples)), list(zip(*samples)))}

    def decode_texts(self, model, featurizer: Seq2SeqFeaturizer, sources: list[np.ndarray], options: dict) -> list[str]:
        """The target text of each source (token ids) by one decoding: beam search, or greedy /
        sampled with beams 1. Sources go in batches of `train.eval_batch_size` of similar lengths,
        padded to a `core.data.bucket_width` (few compiled shapes)."""
        batch_size, data = self.config.train.eval_batch_size, self.config.data
        texts: list[str] = [""] * len(sources)
        lengths = [len(source) for source in sources]
        for rows, padded, width in decoding_batches(lengths, batch_size, data.source_len):
            settings = {
                "max_new_tokens": max(1, min(data.target_len, int(data.max_len_a * width) + data.max_len_b)),
                "bos": BOS,
                "stop_tokens": (EOS,),
                "width": width,
            }
            batch = [sources[i] for i in padded]
            settings |= penalties.from_options(options)
            if options["beams"] > 1:
                beams = generate_beams_from_source(
                    model, batch, beam_size=options["beams"], length_penalty=options["length_penalty"], **settings
                )
                tokens = beams.tokens[:, 0]
            else:
                tokens = generate_from_source(
                    model, batch, temperature=options["temperature"], seed=options["seed"], **settings
                ).tokens
            for i, row in zip(rows, tokens):
                texts[i] = featurizer.text(row)
        return texts

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        sources = [line.strip() for line in lines if line.strip()]
        if not sources:
            raise UserError(f"apps predict {self.name} needs at least one non-empty text (as arguments or on stdin).")
        return [{"source": source, "target": ""} for source in sources]

    def render(self, predictions, examples, featurizer) -> list[dict[str, str]]:
        return [{"source": e["source"], self.output_name: text} for e, text in zip(examples, predictions["text"])]


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


def _cross_entropy(outputs: Projection | CopyProjection, batch: dict, label_smoothing: float = 0.0):
    """Cross-entropy of the scored targets, through the tied projection or the copying head's
    parts, without forming the [B, T, V] distribution."""
    if isinstance(outputs, CopyProjection):
        return losses.copy_cross_entropy(outputs, batch["targets"], scored_positions(batch), label_smoothing)
    return losses.linear_cross_entropy(
        outputs.hidden, outputs.weight, batch["targets"], scored_positions(batch), label_smoothing
    )
