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

A run whose model is causal (`--preset smollm2`, `gemma3`: a pretrained decoder) takes the
decoder-only route instead (`tasks.nlp.completion`): each pair becomes a prompt (`data.prompt`,
the source written in) and its completion, the loss on the completion alone; evaluation also
reports the checkpoint zero-shot, with the same prompt, as a baseline.
"""

from __future__ import annotations

import abc
import dataclasses
import gzip
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import numpy as np
from flax import nnx

from core import metrics as metric_lib
from core.checkpoints import pretrained
from core.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, require
from core.errors import UserError
from core.generation import penalties
from core.generation.seq2seq import generate_beams_from_source, generate_from_source
from core.model.encoder_decoder import EncoderDecoder, Start
from core.model.heads import CopyOutput, CopyProjection, Projection, TiedOutput, TokenEmbedder
from core.model.transformer import Model, Transformer
from core.task import PredictOption, Task, predict_option_values, scored_positions
from core.training import losses
from core.training.data import decoding_batches
from tasks.common.tokenizer import BOS, EOS, PAD, PretrainedTokenizer, Tokenizer
from tasks.nlp import completion
from tasks.nlp.completion import SOURCE, CompletionFeaturizer
from tasks.nlp.decoding import decoding_options, minimum_bayes_risk
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
    # A pointer-generator output (core.model.heads.CopyOutput): each target piece may be copied from
    # the source's pieces as well as generated; needs shared_vocab.
    copy: bool = False
    # The decoder-only route's prompt (tasks.nlp.completion): the source stands where {source}
    # is (and, for translate, its dictionary gloss where {gloss} is). None: the encoder-decoder.
    prompt: str | None = None
    # The penalties (core.generation.penalties) of the decodings, unless `apps predict` sets them.
    no_repeat_ngram: int = 0
    word_reward: float = 0.0
    # The decoder-only route's output covers only the pieces that the training completions
    # are spelled with, the glossary's translations' pieces and the stop tokens
    # (`CompletionFeaturizer.shortlist`): at a large vocabulary the output layer is most of
    # a fine-tuning step and of a decoding step, and a target language needs a small part of it.
    shortlist: bool = False
    # The valid split keeps its first `valid_size` examples (None: all): a pretrained decoder
    # reads a few hundred tokens a second here, and validation during training need not read
    # thousands of prompts each time. The test split is always whole.
    valid_size: int | None = None

    def __post_init__(self):
        for key in ("vocab_size", "source_len", "target_len"):
            require(getattr(self, key) > 0, f"data.{key}", getattr(self, key), "must be positive")
        require(self.max_len_a >= 0, "data.max_len_a", self.max_len_a, "must not be negative")
        require(self.max_len_b >= 0, "data.max_len_b", self.max_len_b, "must not be negative")
        require(
            not self.copy or self.shared_vocab, "data.copy", self.copy, "copies source pieces: needs data.shared_vocab"
        )
        require(
            not self.shortlist or self.prompt is not None,
            "data.shortlist",
            self.shortlist,
            "limits a decoder's output: needs the decoder-only route (data.prompt)",
        )
        require(self.valid_size is None or self.valid_size > 0, "data.valid_size", self.valid_size, "must be positive")
        require(
            self.prompt is None or SOURCE in self.prompt,
            "data.prompt",
            self.prompt,
            f"must hold {SOURCE}, where the source text goes",
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


def decoder_preset(
    task: str, name: str, checkpoint: str, data: Seq2SeqData, steps: int, eval_batch_size: int = 16
) -> Config:
    """A pretrained decoder fine-tuned on prompt / completion pairs (`data.prompt`; see
    `core.checkpoints.pretrained.fine_tuning`): rows of 256 tokens, 8 a step, validated on the valid split's
    first 256 pairs; evaluation and decoding go `eval_batch_size` rows at a time."""
    data = dataclasses.replace(data, valid_size=256)
    return pretrained.fine_tuning(
        task, name, checkpoint, data, max_len=256, batch_size=8, eval_batch_size=eval_batch_size, steps=steps
    )


class SourceFeaturizer(Protocol):
    """The source side of a seq2seq example as the encoder reads it: token ids of a text
    (`TextSource`) or an audio clip's frames. `length`: the most positions of a source (longer
    ones are cut); `vocabulary`: the tokenizer of token ids (shared with the target or not), or
    None for frames."""

    length: int
    vocabulary: Tokenizer | None

    def __call__(self, examples: Sequence[dict]) -> list[np.ndarray]:
        """Each example's source rows: ids [S] or frames [S, F], S at most `length`."""

    def embedder(self, d_model: int, rngs: nnx.Rngs) -> nnx.Module:
        """The front end that reads these rows: (rows [B, S(, F)], mask) -> (x [B, S', D], mask)."""

    def save(self, directory: Path) -> None:
        """What the source side keeps besides its tokenizer (which `Seq2SeqFeaturizer` saves)."""


@dataclass
class TextSource:
    """A text source: its sentencepiece pieces and EOS, cut to `length` (with a warning); with a
    glossary (word -> translation), the source followed by " = " and its word-by-word gloss."""

    vocabulary: Tokenizer
    length: int
    glossary: dict[str, str] | None = None

    GLOSSARY = "glossary.json.gz"

    def text(self, source: str) -> str:
        """What the encoder reads of a source text."""
        return source if self.glossary is None else f"{source} = {word_by_word(source, self.glossary)}"

    def __call__(self, examples: Sequence[dict]) -> list[np.ndarray]:
        texts = [self.text(e["source"]) for e in examples]
        return _cut(self.vocabulary.processor.encode(texts), self.length, "source", "data.source_len")

    def embedder(self, d_model: int, rngs: nnx.Rngs) -> nnx.Module:
        return TokenEmbedder(self.vocabulary.vocab_size, d_model, rngs=rngs)

    def save(self, directory: Path) -> None:
        if self.glossary is not None:
            (directory / self.GLOSSARY).write_bytes(gzip.compress(json.dumps(self.glossary).encode("utf-8")))

    @classmethod
    def load(cls, directory: Path, vocabulary: Tokenizer, length: int) -> TextSource:
        path = directory / cls.GLOSSARY
        glossary = json.loads(gzip.decompress(path.read_bytes())) if path.exists() else None
        return cls(vocabulary, length, glossary)


@dataclass
class Seq2SeqFeaturizer:
    """A source featurizer, the target tokenizer (the source's own when they share a vocabulary)
    and the target's length budget: examples -> the encoder-decoder's batch arrays."""

    source: SourceFeaturizer
    target: Tokenizer
    target_len: int

    @property
    def shared(self) -> bool:
        return self.source.vocabulary is self.target

    @property
    def glossary(self) -> dict[str, str] | None:
        """The glossary whose glosses the encoder reads, if any."""
        return getattr(self.source, "glossary", None)

    def save(self, directory: Path) -> None:
        self.source.save(directory)
        if self.shared:
            self.target.save(directory)
            return
        sides = (("source", self.source.vocabulary), ("target", self.target))
        for side, tokenizer in ((side, tokenizer) for side, tokenizer in sides if tokenizer is not None):
            (directory / side).mkdir(exist_ok=True)
            tokenizer.save(directory / side)

    @classmethod
    def load_text(cls, directory: Path, source_len: int, target_len: int) -> Seq2SeqFeaturizer:
        """The featurizer of a text-to-text run, saved under `directory`."""
        if (directory / Tokenizer.FILE).exists():
            shared = Tokenizer.load(directory)
            return cls(TextSource.load(directory, shared, source_len), shared, target_len)
        source = TextSource.load(directory, Tokenizer.load(directory / "source"), source_len)
        return cls(source, Tokenizer.load(directory / "target"), target_len)

    def text(self, ids: Sequence[int]) -> str:
        """The target text of generated ids (up to the first EOS)."""
        ids = list(ids)
        return self.target.decode(ids[: ids.index(EOS)] if EOS in ids else ids)

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        inputs, mask = padded(self.source(examples), self.source.length)
        targets = _cut(
            self.target.processor.encode([e["target"] for e in examples]), self.target_len, "target", "data.target_len"
        )
        decoder_inputs = np.full((len(examples), self.target_len), PAD, np.int32)
        outputs = np.full((len(examples), self.target_len), PAD, np.int32)
        for row, target in enumerate(targets):
            outputs[row, : len(target)] = target
            decoder_inputs[row, : len(target)] = [BOS, *target[:-1]]
        return {
            "inputs": inputs,
            "mask": mask,
            "decoder_inputs": decoder_inputs,
            "decoder_mask": outputs != PAD,
            "targets": outputs,
            "target_mask": outputs != PAD,
            "weights": np.ones(len(examples), np.float32),
        }


def padded(rows: Sequence[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Source rows (ids [S] or frames [S, F]) padded to `width` positions (PAD, or zero frames),
    and the mask [B, width] of their real positions."""
    shape, dtype = (rows[0].shape[1:], rows[0].dtype) if rows else ((), np.int32)
    inputs = np.full((len(rows), width, *shape), PAD, dtype)
    mask = np.zeros((len(rows), width), bool)
    for row, source in enumerate(rows):
        inputs[row, : len(source)], mask[row, : len(source)] = source, True
    return inputs, mask


def _cut(pieces: list[list[int]], length: int, side: str, key: str) -> list[np.ndarray]:
    """Pieces and EOS of each text, at most `length`; how many were cut is logged."""
    rows = [np.asarray([*ids, EOS], np.int32) for ids in pieces]
    long = sum(len(row) > length for row in rows)
    if long:
        log.warning("%d of %d %ss are longer than %s=%d pieces and were cut to it.", long, len(rows), side, key, length)
    return [row[:length] for row in rows]


@dataclass(frozen=True, kw_only=True)
class Seq2SeqTask(Task):
    """The shared body of the seq2seq tasks; a task adds its data, scores and baseline."""

    output_name: ClassVar[str]  # the rendered column: "translation", "summary"
    best_metric: ClassVar[str] = "nll"
    lower_is_better: ClassVar[bool] = True
    data_type: ClassVar[type] = Seq2SeqData
    default_preset: ClassVar[str] = "base"
    generates: ClassVar[bool] = True
    # A pretrained decoder's preset translates or summarizes zero-shot too (`--model NAME`).
    zero_shot: ClassVar[bool] = True
    predict_options: ClassVar[tuple[PredictOption, ...]] = decoding_options()
    evaluated_decodings: ClassVar[dict[str, dict[str, Any]]] = {"greedy": {"beams": 1}, "beam": {"beams": 4}}

    config: Config
    data: str | None = None

    def __post_init__(self):
        if self.decoder_only and self.config.data.prompt is None:
            raise UserError(
                f"A decoder-only {self.name} model (model.causal) reads a prompt: give data.prompt, with {SOURCE} "
                "where the source goes (the smollm2 and gemma3 presets have theirs)."
            )

    @property
    def decoder_only(self) -> bool:
        """Whether the run takes the decoder-only route (tasks.nlp.completion)."""
        return self.config.model.causal

    @property
    def token_masks(self) -> tuple[str, ...]:
        return ("mask",) if self.decoder_only else ("mask", "decoder_mask")

    @property
    def trim(self) -> dict[str, tuple[str, ...]]:
        """Packed rows are full; the encoder-decoder's batches are cut to their longest source and target."""
        if self.decoder_only:
            return {}
        return {"mask": ("inputs",), "decoder_mask": ("decoder_inputs", "targets", "target_mask")}

    def route(self) -> str:
        """The protocol's words on the decoder-only route (empty for the encoder-decoder)."""
        if not self.decoder_only:
            return ""
        model = self.config.model.pretrained or "a decoder trained here"
        return (
            f"; decoder-only: {model} reads the prompt {self.config.data.prompt!r} (the chat template's user turn "
            "where the checkpoint has one), the loss on the completion and its end token, pairs packed into rows "
            f"of {self.config.model.max_len}"
        )

    @abc.abstractmethod
    def pairs(self) -> Sequence[tuple[str, str]]:
        """All (source, target) pairs of the embedded default, before the split."""

    @abc.abstractmethod
    def text_baselines(self, train, test, featurizer) -> dict[str, dict]:
        """The task's classical baselines, scored as `score_generated` scores the model."""

    def baselines(self, train, test, featurizer) -> dict[str, dict]:
        """The classical baselines, and for a pretrained decoder the checkpoint as it is (before
        any fine-tuning) with the same prompt, decoded greedily: what a user would try first."""
        found = self.text_baselines(train, test, featurizer)
        name = self.config.model.pretrained
        if self.decoder_only and name is not None:
            from core.training.steps import build_model

            model = build_model(self, featurizer, self.config, from_pretrained=True)
            options = {**predict_option_values(self, {}), "beams": 1, "temperature": 0.0}
            generated = {"text": self.decode_texts(model, featurizer, test, options)}
            found[f"zero_shot ({name}, greedy)"] = self.score_generated(generated, test, featurizer)
        return found

    def examples(self, split: str) -> list[dict]:
        examples = self.whole_split(split)
        return examples[: self.config.data.valid_size] if split == "valid" else examples

    def whole_split(self, split: str) -> list[dict]:
        """The split's every pair (`examples` keeps the valid split's first `data.valid_size`)."""
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

    def fit_featurizer(self, train: Sequence[dict]) -> Seq2SeqFeaturizer | CompletionFeaturizer:
        options = self.config.data
        if self.decoder_only:
            # A checkpoint used as it is (`--model`) is fitted on no examples; its glossary still
            # comes from the training split.
            train = train or self.examples("train")
            featurizer = self._completion_featurizer(self._decoder_tokenizer(train), self.glossary(train))
            if options.shortlist:
                featurizer.shortlist = featurizer.covering(train)
            return featurizer
        if self.config.model.pretrained is not None:
            raise UserError(
                f"{self.config.model.pretrained} is not a decoder: the encoder-decoder route of {self.name} trains "
                "from scratch, and the decoder-only one reads a causal checkpoint (--preset smollm2)."
            )
        sources, targets = [e["source"] for e in train], [e["target"] for e in train]
        if options.shared_vocab:
            source = target = Tokenizer.train(sources + targets, options.vocab_size)
        else:
            source, target = Tokenizer.train(sources, options.vocab_size), Tokenizer.train(targets, options.vocab_size)
        text = TextSource(source, options.source_len, self.glossary(train))
        return Seq2SeqFeaturizer(text, target, options.target_len)

    def _decoder_tokenizer(self, train: Sequence[dict]) -> Tokenizer | PretrainedTokenizer:
        """The checkpoint's tokenizer, or for a decoder built here one trained on both sides."""
        if self.config.model.pretrained is not None:
            return PretrainedTokenizer.from_checkpoint(self.config.model.pretrained)
        texts = [text for e in train for text in (e["source"], e["target"])]
        return Tokenizer.train(texts, self.config.data.vocab_size, "bpe", lossless=True)

    def _completion_featurizer(self, tokenizer, glossary) -> CompletionFeaturizer:
        data = self.config.data
        return CompletionFeaturizer(
            tokenizer, data.prompt, data.source_len, data.target_len, self.config.model.max_len, glossary
        )

    def load_featurizer(self, directory: Path) -> Seq2SeqFeaturizer | CompletionFeaturizer:
        data = self.config.data
        if self.decoder_only:
            return CompletionFeaturizer.load(
                directory, data.prompt, data.source_len, data.target_len, self.config.model.max_len
            )
        return Seq2SeqFeaturizer.load_text(directory, data.source_len, data.target_len)

    def model(self, featurizer, config: Config, rngs: nnx.Rngs) -> EncoderDecoder | Model:
        if self.decoder_only:
            embedder = TokenEmbedder(featurizer.tokenizer.vocab_size, config.model.d_model, rngs=rngs)
            head = TiedOutput(embedder, featurizer.shortlist)
            return Model(embedder, Transformer(config.model, remat=config.train.remat, rngs=rngs), head)
        d_model = config.model.d_model
        source = featurizer.source.embedder(d_model, rngs)
        target = source if featurizer.shared else TokenEmbedder(featurizer.target.vocab_size, d_model, rngs=rngs)
        head = CopyOutput(target, d_model, rngs=rngs) if config.data.copy else TiedOutput(target)
        return EncoderDecoder.build(config.model, source, target, head, remat=config.train.remat, rngs=rngs)

    def loss(self, outputs: Projection | CopyProjection, batch: dict):
        return _cross_entropy(outputs, batch, self.config.optim.label_smoothing)

    def metrics(self, outputs: Projection | CopyProjection, batch: dict):
        found = {
            "nll": _cross_entropy(outputs, batch),
            "token_accuracy": metric_lib.hits(outputs.predictions(), batch["targets"], scored_positions(batch)),
        }
        if isinstance(outputs, Projection) and outputs.shortlist is not None:
            # The share of target pieces the shortlist holds: nll and accuracy count those alone.
            covered = outputs.rows_of(batch["targets"])[1]
            found["shortlist_coverage"] = metric_lib.hits(covered, True, scored_positions(batch))
        return found

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
        sources = examples if self.decoder_only else featurizer.source(examples)
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

    def decode_texts(self, model, featurizer, sources: list, options: dict) -> list[str]:
        """The target text of each source (token ids; for the decoder-only route, the examples)
        by one decoding: beam search, or greedy / sampled with beams 1. Sources go in batches of
        `train.eval_batch_size` of similar lengths, padded to a `core.training.data.bucket_width` (few
        compiled shapes)."""
        batch_size, data = self.config.train.eval_batch_size, self.config.data
        # A penalty left unset is the run's own (data.no_repeat_ngram, data.word_reward).
        options = {key: getattr(data, key) if value is None else value for key, value in options.items()}
        if self.decoder_only:
            return completion.decode_texts(model, featurizer, sources, options, data, batch_size)
        texts: list[str] = [""] * len(sources)
        lengths = [len(source) for source in sources]
        for rows, filled, width in decoding_batches(lengths, batch_size, data.source_len):
            settings = {
                "max_new_tokens": max(1, min(data.target_len, int(data.max_len_a * width) + data.max_len_b)),
                "start": Start((BOS,)),
                "stop_tokens": (EOS,),
                "width": width,
            }
            batch = [sources[i] for i in filled]
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

    def render(self, predictions, examples, featurizer) -> list[dict[str, Any]]:
        return [{"source": e["source"], self.output_name: text} for e, text in zip(examples, predictions["text"])]


def _cross_entropy(outputs: Projection | CopyProjection, batch: dict, label_smoothing: float = 0.0):
    """Cross-entropy of the scored targets, through the tied projection or the copying head's
    parts, without forming the [B, T, V] distribution. Under a shortlist (`data.shortlist`) the
    distribution is over its pieces, and a target outside it is not scored (the metrics'
    `shortlist_coverage` says how many are)."""
    if isinstance(outputs, CopyProjection):
        return losses.copy_cross_entropy(outputs, batch["targets"], scored_positions(batch), label_smoothing)
    rows, covered = outputs.rows_of(batch["targets"])
    return losses.linear_cross_entropy(
        outputs.hidden, outputs.rows(), rows, scored_positions(batch) & covered, label_smoothing
    )
