"""The lm task's featurizer: documents (or instruction data) packed into rows of next-piece
predictions, and prompts that a decoder continues."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UserError
from tasks.common import chat
from tasks.common.tokenizer import PretrainedTokenizer, Tokenizer
from tasks.nlp import instructions


@dataclass
class LMFeaturizer:
    """The tokenizer (trained here, or a pretrained checkpoint's) and the row length: documents
    -> packed rows of next-piece predictions."""

    tokenizer: Tokenizer | PretrainedTokenizer
    max_len: int

    def save(self, directory: Path) -> None:
        self.tokenizer.save(directory)

    def pieces(self, examples: Sequence[dict]) -> list[list[int]]:
        return self.tokenizer.pieces([e["text"] for e in examples])

    def prompt(self, example: dict, system: str = "") -> list[int]:
        """The ids that a generation continues: a conversation (`messages`) rendered with the
        checkpoint's chat template, with `system` as its system message if given and the
        functions `tools` offered (control tokens typed in its content are text, unless
        `content_markers` says otherwise); or a text after the start id, as documents begin in
        training."""
        if "messages" in example:
            if self.tokenizer.chat_template is None:
                raise UserError(
                    "--chat needs a checkpoint with a chat template (apps predict lm --model smollm2-135m-instruct "
                    "--chat ...); this model's tokenizer has none."
                )
            messages = chat.with_system(example["messages"], system)
            return self.tokenizer.chat_ids(messages, example.get("content_markers", False), example.get("tools"))
        return [self.tokenizer.start_id, *self.tokenizer.pieces([example["text"]])[0]]

    def continuation(self, prompt: Sequence[int], new: Sequence[int]) -> str:
        """The text that `new` pieces add after `prompt`: decoded together, since a piece's
        leading space is dropped at the start of a text but not after a prompt."""
        return self.tokenizer.decode([*prompt, *new])[len(self.tokenizer.decode(prompt)) :]

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        if examples and "text" in examples[0] and ("messages" in examples[0] or "completion" in examples[0]):
            tokenized = [instructions.tokenize(self.tokenizer, e, f"example {i}") for i, e in enumerate(examples, 1)]
            return instructions.pack(tokenized, self.max_len, self.tokenizer.pad_id)
        start, end = self.tokenizer.start_id, self.tokenizer.eos_id
        # Documents as [start] pieces [end]; for a tokenizer that adds no BOS (start is EOS) one
        # EOS separates two documents, as in GPT-2's training: [EOS] doc [EOS] doc [EOS].
        prefix = [start] if start != end else []
        documents = [np.asarray([*prefix, *ids, end], np.int32) for ids in self.pieces(examples)]
        stream = np.concatenate([np.asarray([] if prefix else [end], np.int32), *documents])
        # The starts are given, never predicted: each document's BOS, or the leading EOS.
        predicted = np.ones(len(stream), bool)
        predicted[np.cumsum([0, *map(len, documents[:-1])]) if prefix else 0] = False
        # Row r reads the stream from r * stride on and predicts each piece from the one before;
        # a row that begins with BOS spends its first position on it (read, never scored).
        lead = 0 if self.row_start is None else 1
        length, stride = self.max_len, self.max_len - lead
        rows = max(1, -(-(len(stream) - 1) // stride))
        read = np.arange(rows)[:, None] * stride + np.arange(length)[None, :] - lead
        padded = np.append(stream, np.full(rows * stride + 1 - len(stream), self.tokenizer.pad_id, np.int32))
        scored = np.append(predicted, np.zeros(len(padded) - len(stream), bool))
        inputs = padded[np.maximum(read, 0)]
        if lead:
            inputs[:, 0] = self.row_start
        return {
            "inputs": inputs,
            "mask": read < len(stream) - 1,
            "targets": padded[read + 1],
            "target_mask": scored[read + 1] & (np.arange(length) >= lead),
            "weights": np.ones(rows, np.float32),
        }

    @property
    def row_start(self) -> int | None:
        """The id that every row begins with: BOS for a pretrained model whose tokenizer adds it to
        every text (Gemma was trained so, and reads worse without it); none otherwise, where a row
        is a plain window on the stream."""
        tokenizer = self.tokenizer
        return tokenizer.bos_id if isinstance(tokenizer, PretrainedTokenizer) and tokenizer.add_bos else None


def characters(examples: Sequence[dict]) -> int:
    """The characters that a split's predictions cover: every text, plus one per document end
    (for instruction data, the answers, plus one per answer's end)."""
    return sum(len(e["text"]) + 1 for e in examples)
