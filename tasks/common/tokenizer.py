"""Tokenizers kept in the workdir: a sentencepiece model trained on the task's own training split
(`Tokenizer`), or a pretrained checkpoint's own (`PretrainedTokenizer`, its tokenizer.json).
Both encode texts to (ids, mask) the same way; `load_tokenizer` reads whichever a run saved."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm
import tokenizers

from core.checkpoints import pretrained
from core.errors import UserError
from tasks.common import chat, tools

PAD, UNK, BOS, EOS = 0, 1, 2, 3


class Tokenizer:
    """Text <-> ids with fixed special ids: pad 0, unk 1, bos 2, eos 3. A text begins with BOS
    (`start_id`) and a generation ends at EOS (`stop_ids`)."""

    FILE = "tokenizer.model"
    pad_id, bos_id, eos_id, start_id, stop_ids = PAD, BOS, EOS, BOS, (EOS,)
    chat_template = tool_format = None

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

    def pieces(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's pieces, whole, without BOS or EOS."""
        return self.processor.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode([int(i) for i in ids if i > EOS])

    def tokenizer_json(self) -> None:
        """None: a sentencepiece model is no tokenizer.json (so its answers follow no grammar)."""
        return None


class PretrainedTokenizer:
    """A pretrained checkpoint's tokenizer, read from its tokenizer.json with the `tokenizers`
    package: WordPiece for BERT, byte-level BPE for RoBERTa and SmolLM2, each with the special
    tokens its post-processor adds ([CLS] text [SEP] for BERT, <s> text </s> for RoBERTa), as the
    checkpoint was trained; and its `config` (`core.checkpoints.pretrained.Family.tokenizer_config`: the
    special tokens, whether a text begins with BOS, the chat template, what ends a generation).
    `vocab_size` is the rows of the checkpoint's embedding table, which must equal the
    tokenizer's size: a tokenizer of another model would feed the table the wrong rows."""

    FILE = "tokenizer.json"
    SIZE_FILE = "pretrained_vocab.json"
    CONFIG_FILE = "tokenizer_config.json"
    tool_format = tools  # how its chats offer functions and read calls back

    def __init__(self, text: str, vocab_size: int, where: str, config: dict | None = None):
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(text)
        except Exception as error:  # tokenizers reports every malformed file as a plain Exception
            raise UserError(f"{where} is not a tokenizer.json that the tokenizers package reads: {error}") from None
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # A table padded to a multiple of 64 rows (Qwen2's) holds a smaller tokenizer's ids.
        if size != vocab_size and not (size < vocab_size and vocab_size % 64 == 0):
            raise UserError(
                f"{where} has {size} tokens but the checkpoint's embedding table has {vocab_size} rows "
                "(vocab_size in its config.json): the tokenizer belongs to another model."
            )
        self.text, self.vocab_size, self.config, self.where = text, vocab_size, dict(config or {}), where
        if not isinstance(self.config.get("chat_template") or "", str):
            raise UserError(f"{where}: chat_template is not one text (named templates are not supported).")
        padding = self.tokenizer.padding
        # Padding and truncation are this class's, per call; the file's own settings would fight them.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.pad_id = self._first_id(self.config.get("pad_token"), "[PAD]", "<pad>") or 0
        if padding:
            self.pad_id = padding["pad_id"]
        self.bos_id = self._first_id(self.config.get("bos_token"))
        self._eos_id = self._first_id(self.config.get("eos_token"))
        add_bos = self.config.get("add_bos_token")
        if add_bos is None and self.bos_id is not None:
            # Not said (Llama 3's folders): what the tokenizer's post-processor does.
            add_bos = self.tokenizer.encode("a").ids[:1] == [self.bos_id]
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.chat_template: str | None = self.config.get("chat_template")
        # The control tokens' ids (special added tokens: <|im_end|>), which only a template places.
        self.markers = {i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special}
        ends = [self._eos_id] if self._eos_id is not None else []
        self.stop_ids = tuple(dict.fromkeys([*self.config.get("stop_ids", []), *ends]))

    def tokenizer_json(self) -> str:
        """The tokenizer as a tokenizer.json, without padding or truncation (what llguidance
        reads to keep answers to a grammar)."""
        return self.tokenizer.to_str()

    @property
    def eos_id(self) -> int:
        """The id that ends a text (and, with no BOS, separates documents)."""
        if self._eos_id is None:
            raise UserError(f"{self.where} names no EOS token (a checkpoint's tokenizer_config.json eos_token).")
        return self._eos_id

    def _first_id(self, *tokens: str | None) -> int | None:
        ids = [self.tokenizer.token_to_id(token) for token in tokens if token]
        return next((i for i in ids if i is not None), None)

    @classmethod
    def from_checkpoint(cls, name_or_path: str) -> PretrainedTokenizer:
        """The tokenizer of the checkpoint (a folder, a file or a shipped name) `name_or_path`."""
        text, config, vocab_size = pretrained.tokenizer_files(name_or_path)
        return cls(text, vocab_size, name_or_path, config)

    @classmethod
    def load(cls, directory: Path) -> PretrainedTokenizer:
        size = json.loads((directory / cls.SIZE_FILE).read_text())["vocab_size"]
        config_path = directory / cls.CONFIG_FILE
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls((directory / cls.FILE).read_text(), size, str(directory / cls.FILE), config)

    def save(self, directory: Path) -> None:
        (directory / self.FILE).write_text(self.text)
        (directory / self.SIZE_FILE).write_text(json.dumps({"vocab_size": self.vocab_size}))
        (directory / self.CONFIG_FILE).write_text(json.dumps(self.config))

    @property
    def start_id(self) -> int:
        """The id a text begins with: BOS for a tokenizer that adds one, else EOS, the separator
        between the documents it was trained on (as GPT-2's <|endoftext|>)."""
        return self.bos_id if self.add_bos else self.eos_id

    def encode(self, texts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """ids [N, max_len] (special tokens included, truncated to keep them, padded with the pad
        id) and the mask of real tokens."""
        self.tokenizer.enable_truncation(max_len)
        ids = np.full((len(texts), max_len), self.pad_id, np.int32)
        mask = np.zeros((len(texts), max_len), bool)
        for row, encoding in enumerate(self.tokenizer.encode_batch(list(texts))):
            ids[row, : len(encoding.ids)] = encoding.ids
            mask[row, : len(encoding.ids)] = True
        return ids, mask

    def pieces(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, whole, without special tokens added (those written in it, as chat
        markers, are read as theirs)."""
        self.tokenizer.no_truncation()
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def pieces_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The text's ids, as `pieces`, and each one's span of characters in it."""
        self.tokenizer.no_truncation()
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def render_chat(
        self, messages: Sequence[chat.Message], generation_prompt: bool = True, tools: Sequence[dict] | None = None
    ) -> str:
        """A conversation as the checkpoint's chat template writes it, with the functions `tools`
        offered (with `generation_prompt`, up to where the assistant's answer begins)."""
        special = {key: self.config[key] for key in ("bos_token", "eos_token", "pad_token") if key in self.config}
        return chat.render(self.chat_template, messages, special, self.where, generation_prompt, tools)

    def chat_ids(
        self, messages: Sequence[chat.Message], content_markers: bool = False, tools: Sequence[dict] | None = None
    ) -> list[int]:
        """A conversation rendered for the assistant's answer, with the functions `tools`
        offered, as ids (the template writes BOS itself where it wants one). Only the template
        places control tokens: a message's content is text, so `<|im_end|>` typed in it is
        spelled out, never read as the end of a turn (as llama-server and vLLM treat content),
        unless `content_markers`."""
        parts = chat.parts(lambda conversation: self.render_chat(conversation, tools=tools), messages)
        ids, offsets = self.pieces_with_offsets("".join(text for text, _ in parts))
        bounds = np.cumsum([0, *(len(text) for text, _ in parts)])
        spans = [(a, b) for (_, is_content), a, b in zip(parts, bounds, bounds[1:]) if is_content]
        if content_markers or not any(
            i in self.markers and any(a <= start < b for a, b in spans) for i, (start, _) in zip(ids, offsets)
        ):
            return ids  # the whole text at once: where pieces meet, a tokenizer may merge across
        ids = []
        for text, is_content in parts:
            self.tokenizer.encode_special_tokens = is_content
            try:
                ids += self.pieces([text])[0]
            finally:
                self.tokenizer.encode_special_tokens = False
        return ids


def load_tokenizer(directory: Path) -> Tokenizer | PretrainedTokenizer:
    """The tokenizer a run saved in `directory`: a checkpoint's if it kept one, else sentencepiece."""
    if (directory / PretrainedTokenizer.FILE).exists():
        return PretrainedTokenizer.load(directory)
    return Tokenizer.load(directory)
