"""A sentencepiece tokenizer trained on the task's own training split and kept in the workdir."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from core.errors import UserError

PAD, UNK, BOS, EOS = 0, 1, 2, 3


class Tokenizer:
    """Text <-> ids with fixed special ids: pad 0, unk 1, bos 2, eos 3."""

    FILE = "tokenizer.model"

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self.processor = spm.SentencePieceProcessor(model_proto=model_proto)

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, model_type: str = "unigram", lossless: bool = False
    ) -> Tokenizer:
        """Trains on `texts`. `lossless` (for generation): decode(encode(text)) == text for any
        text: no normalization, white space kept, newline a piece of its own, unknown characters
        as bytes. Texts are then given to the trainer line by line (it skips very long lines)."""
        model = io.BytesIO()
        options = {}
        if lossless:
            options = {
                "normalization_rule_name": "identity",
                "remove_extra_whitespaces": False,
                "user_defined_symbols": ["\n"],
                "byte_fallback": True,
                "split_digits": True,
            }
            texts = (line for text in texts for line in text.split("\n") if line.strip())
        try:
            spm.SentencePieceTrainer.train(
                **options,
                sentence_iterator=iter(texts),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                pad_id=PAD,
                unk_id=UNK,
                bos_id=BOS,
                eos_id=EOS,
                character_coverage=1.0,
                # A small corpus may not support the requested size; take what it supports.
                hard_vocab_limit=False,
                num_threads=2,
                minloglevel=2,
            )
        except RuntimeError as error:  # sentencepiece reports bad sizes and empty input this way
            message = str(error).split("] ")[-1]
            raise UserError(f"The tokenizer could not be trained with vocab_size={vocab_size}: {message}") from None
        return cls(model.getvalue())

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        path = directory / cls.FILE
        if not path.exists():
            raise UserError(f"{path} is missing: the workdir has no trained tokenizer.")
        return cls(path.read_bytes())

    def save(self, directory: Path) -> None:
        (directory / self.FILE).write_bytes(self.model_proto)

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size()

    def encode(self, texts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """ids [N, max_len] (bos first, truncated, padded with 0) and the mask of real tokens."""
        ids = np.full((len(texts), max_len), PAD, np.int32)
        for row, pieces in enumerate(self.processor.encode(list(texts))):
            pieces = [BOS, *pieces][:max_len]
            ids[row, : len(pieces)] = pieces
        return ids, ids != PAD

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode([int(i) for i in ids if i > EOS])
