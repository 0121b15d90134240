"""The encoder-decoder route of translate and summarize: sources read by an encoder, targets
decoded from its memory.

One sentencepiece model over both sides (`data.shared_vocab`, the default: one embedding table
for source, target and output) or one per side. A source is its pieces and EOS; a target is
read as [BOS] pieces and predicted as pieces [EOS] (core/task.py's encoder-decoder keys); both
are cut to `data.source_len` / `data.target_len` with a warning. Training batches are cut to
their longest source and target (the route's `trim`).
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
from flax import nnx

from core.config import Config
from core.errors import UserError
from core.generation import penalties
from core.generation.seq2seq import generate_beams_from_source, generate_from_source
from core.model.encoder_decoder import EncoderDecoder, Start
from core.model.heads import CopyOutput, TiedOutput, TokenEmbedder
from core.training.data import decoding_batches
from tasks.common.tokenizer import BOS, EOS, PAD, Tokenizer
from tasks.nlp.freedict import word_by_word

if TYPE_CHECKING:
    from tasks.nlp.seq2seq import Seq2SeqTask

log = logging.getLogger("apps")


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


class EncoderDecoderRoute:
    """How a seq2seq task trains and decodes an encoder-decoder built here."""

    token_masks: ClassVar[tuple[str, ...]] = ("mask", "decoder_mask")
    trim: ClassVar[dict[str, tuple[str, ...]]] = {
        "mask": ("inputs",),
        "decoder_mask": ("decoder_inputs", "targets", "target_mask"),
    }
    # Decoding is fast enough for minimum Bayes risk over ten decodings in an evaluation.
    affords_mbr: ClassVar[bool] = True

    def __init__(self, task: Seq2SeqTask):
        self.task = task

    def protocol(self) -> str:
        """The protocol's words on this route: none, it is the task's own."""
        return ""

    def fit_featurizer(self, train: Sequence[dict]) -> Seq2SeqFeaturizer:
        options, pretrained = self.task.config.data, self.task.config.model.pretrained
        if pretrained is not None:
            raise UserError(
                f"{pretrained} is not a decoder: the encoder-decoder route of {self.task.name} trains "
                "from scratch, and the decoder-only one reads a causal checkpoint (--preset smollm2)."
            )
        sources, targets = [e["source"] for e in train], [e["target"] for e in train]
        if options.shared_vocab:
            source = target = Tokenizer.train(sources + targets, options.vocab_size)
        else:
            source, target = Tokenizer.train(sources, options.vocab_size), Tokenizer.train(targets, options.vocab_size)
        text = TextSource(source, options.source_len, self.task.glossary(train))
        return Seq2SeqFeaturizer(text, target, options.target_len)

    def load_featurizer(self, directory: Path) -> Seq2SeqFeaturizer:
        data = self.task.config.data
        return Seq2SeqFeaturizer.load_text(directory, data.source_len, data.target_len)

    def model(self, featurizer: Seq2SeqFeaturizer, config: Config, rngs: nnx.Rngs) -> EncoderDecoder:
        d_model = config.model.d_model
        source = featurizer.source.embedder(d_model, rngs)
        target = source if featurizer.shared else TokenEmbedder(featurizer.target.vocab_size, d_model, rngs=rngs)
        head = CopyOutput(target, d_model, rngs=rngs) if config.data.copy else TiedOutput(target)
        return EncoderDecoder.build(config.model, source, target, head, remat=config.train.remat, rngs=rngs)

    def sources(self, featurizer: Seq2SeqFeaturizer, examples: Sequence[dict]) -> list:
        """What `decode_texts` reads of the examples: each source's ids."""
        return featurizer.source(examples)

    def zero_shot(self, featurizer, test: Sequence[dict]) -> dict[str, dict]:
        """No checkpoint to try as it is: a model built here starts from random weights."""
        return {}

    def decode_texts(self, model, featurizer: Seq2SeqFeaturizer, sources: list, options: dict[str, Any]) -> list[str]:
        """The target text of each source's ids by one decoding (see `Seq2SeqTask.decode_texts`)."""
        batch_size, data = self.task.config.train.eval_batch_size, self.task.config.data
        texts: list[str] = [""] * len(sources)
        lengths = [len(source) for source in sources]
        for rows, filled, width in decoding_batches(lengths, batch_size, data.source_len):
            settings = {
                "max_new_tokens": max(1, min(data.target_len, int(data.max_len_a * width) + data.max_len_b)),
                "start": Start((BOS,)),
                "stop_tokens": (EOS,),
                "width": width,
                **penalties.from_options(options),
            }
            batch = [sources[i] for i in filled]
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
