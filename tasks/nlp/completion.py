"""The decoder-only route of translate and summarize: each pair as a prompt and its completion.

A seq2seq run whose model is causal (a pretrained decoder, `--preset smollm2` or `gemma3`, or a
decoder built from `model.*` options) reads no encoder. The preset's prompt (`data.prompt`)
holds the source where `{source}` stands, and for translate the dictionary gloss where `{gloss}`
stands (a decoder copies well from its context); the target is the completion. With a chat
template (an instruct model's) the prompt is the user's message and the target the assistant's
answer; without one (a base model, or a decoder trained here) the ids are the start token, the
prompt, the target and EOS, and the prompt should end with a line break so that the target
begins a line. Either way the loss counts the target and the end token that closes it, and
examples are packed into rows of `model.max_len` without attending across them
(`tasks.nlp.instructions`, shared with the lm task's instruction data).

A source is cut to `data.source_len` pieces of the checkpoint's tokenizer (with a warning)
before it fills the prompt, so that a long document never pushes its target out of the row.
Decoding continues each prompt (`core.generation.generate`) until a stop token, at most
`data.max_len_a` * source pieces + `data.max_len_b` and `data.target_len` pieces, and keeps
the new text alone.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from flax import nnx

from core.config import Config
from core.errors import UserError
from core.generation import penalties
from core.model.heads import TiedOutput, TokenEmbedder
from core.model.transformer import Model, Transformer
from core.options import predict_option_values
from core.training.data import decoding_batches
from tasks.common.tokenizer import PretrainedTokenizer, Tokenizer, load_tokenizer
from tasks.nlp import instructions
from tasks.nlp.freedict import word_by_word

if TYPE_CHECKING:
    from tasks.nlp.seq2seq import Seq2SeqTask

log = logging.getLogger("apps")

SOURCE, GLOSS = "{source}", "{gloss}"


@dataclass
class CompletionFeaturizer:
    """The decoder's tokenizer, the prompt template, the length budgets (of a source, of a
    target, of a packed row) and, for translate, the glossary whose gloss `{gloss}` stands for."""

    tokenizer: Tokenizer | PretrainedTokenizer
    template: str
    source_len: int
    target_len: int
    max_len: int
    glossary: dict[str, str] | None = None
    # The ids the model's output covers (`data.shortlist`; None: the whole vocabulary).
    shortlist: tuple[int, ...] | None = None

    GLOSSARY = "glossary.json.gz"
    SHORTLIST = "shortlist.json"

    def __post_init__(self):
        if SOURCE not in self.template:
            raise UserError(f"data.prompt {self.template!r} has no {SOURCE} for the source text to stand in.")
        if GLOSS in self.template and self.glossary is None:
            raise UserError(
                f"data.prompt has {GLOSS}, but this run has no glossary to gloss the source with "
                "(translate with data.glossary=words, phrases or learned)."
            )

    def save(self, directory: Path) -> None:
        self.tokenizer.save(directory)
        if self.glossary is not None:
            (directory / self.GLOSSARY).write_bytes(gzip.compress(json.dumps(self.glossary).encode("utf-8")))
        if self.shortlist is not None:
            (directory / self.SHORTLIST).write_text(json.dumps(list(self.shortlist)))

    @classmethod
    def load(cls, directory: Path, template: str, source_len: int, target_len: int, max_len: int):
        path = directory / cls.GLOSSARY
        glossary = json.loads(gzip.decompress(path.read_bytes())) if path.exists() else None
        path = directory / cls.SHORTLIST
        shortlist = tuple(json.loads(path.read_text())) if path.exists() else None
        return cls(load_tokenizer(directory), template, source_len, target_len, max_len, glossary, shortlist)

    def covering(self, examples: Sequence[dict]) -> tuple[int, ...]:
        """A shortlist for these (training) examples: every id their loss counts (the
        completions and the tokens that end them), the pieces of the glossary's translations
        (words the completions may need beyond those seen) and the stop tokens."""
        rows = self(examples)
        ids = set(np.unique(rows["targets"][rows["target_mask"]]).tolist()) | set(self.tokenizer.stop_ids)
        if self.glossary is not None:
            ids |= {i for pieces in self.tokenizer.pieces(sorted(set(self.glossary.values()))) for i in pieces}
        log.info("The output covers %d of the %d pieces (data.shortlist).", len(ids), self.tokenizer.vocab_size)
        return tuple(sorted(ids))

    def sources(self, examples: Sequence[dict]) -> list[str]:
        """Each source, cut to `source_len` pieces (how many were cut is logged)."""
        texts, cut = [], 0
        for example, ids in zip(examples, self.tokenizer.pieces([e["source"] for e in examples])):
            if len(ids) > self.source_len:
                cut += 1
                texts.append(self.tokenizer.decode(ids[: self.source_len]))
            else:
                texts.append(example["source"])
        if cut:
            log.warning(
                "%d of %d sources are longer than data.source_len=%d pieces and were cut to it.",
                cut,
                len(examples),
                self.source_len,
            )
        return texts

    def prompt_text(self, source: str) -> str:
        """The prompt of a (cut) source: the template with the source, and its gloss, written in."""
        gloss = word_by_word(source, self.glossary) if GLOSS in self.template else ""
        # Replaced, not str.format: a user's template or source may hold braces of its own.
        return self.template.replace(GLOSS, gloss).replace(SOURCE, source)

    def prompts(self, examples: Sequence[dict]) -> list[list[int]]:
        """The ids that a decoding continues: the prompt as the user's turn, up to where the
        assistant's answer begins (chat template), or the start token and the prompt."""
        return self.prompt_ids(self.sources(examples))

    def prompt_ids(self, sources: Sequence[str]) -> list[list[int]]:
        """`prompts` of sources already cut (`sources`)."""
        texts = [self.prompt_text(source) for source in sources]
        if self.tokenizer.chat_template:
            return [self.tokenizer.chat_ids([{"role": "user", "content": text}]) for text in texts]
        return [[self.tokenizer.start_id, *ids] for ids in self.tokenizer.pieces(texts)]

    def __call__(self, examples: Sequence[dict]) -> dict[str, np.ndarray]:
        """Packed rows of the examples, the loss on each target and its end token."""
        texts = [self.prompt_text(source) for source in self.sources(examples)]
        tokenized = [
            instructions.tokenize(self.tokenizer, {"prompt": text, "completion": e["target"]}, f"example {i}")
            for i, (text, e) in enumerate(zip(texts, examples), 1)
        ]
        return instructions.pack(tokenized, self.max_len, self.tokenizer.pad_id)

    def text(self, prompt: Sequence[int], new: Sequence[int]) -> str:
        """The completion that the `new` ids (stop tokens left out) add after `prompt`."""
        ids = [int(i) for i in new if int(i) not in self.tokenizer.stop_ids]
        return self.tokenizer.decode([*prompt, *ids])[len(self.tokenizer.decode(prompt)) :].strip()


def decode_texts(model, featurizer: CompletionFeaturizer, examples: Sequence[dict], options: dict, data, batch_size):
    """The completion of each example's prompt by one decoding: beam search, or greedy / sampled
    with beams 1 (`options`, a seq2seq task's predict options). Prompts go in batches of
    `batch_size` of similar lengths, padded to a `core.training.data.bucket_width` (few compiled shapes);
    `data` (Seq2SeqData) bounds the new pieces."""
    from core.generation import generate as generation

    sources = featurizer.sources(examples)
    prompts = featurizer.prompt_ids(sources)
    source_pieces = [len(ids) for ids in featurizer.tokenizer.pieces(sources)]
    texts: list[str] = [""] * len(prompts)
    stops = featurizer.tokenizer.stop_ids
    for rows, filled, width in decoding_batches([len(p) for p in prompts], batch_size, featurizer.max_len):
        longest = max(source_pieces[i] for i in rows)
        new = max(1, min(data.target_len, int(data.max_len_a * longest) + data.max_len_b))
        prompt = max(len(prompts[i]) for i in rows)
        if prompt + new > featurizer.max_len:
            raise UserError(
                f"A prompt of {prompt} ids and {new} new pieces do not fit in the {featurizer.max_len} positions of "
                "model.max_len: raise it, or lower data.source_len or data.target_len."
            )
        batch = [prompts[i] for i in filled]
        settings = {"max_new_tokens": new, "stop_tokens": stops, "width": width, **penalties.from_options(options)}
        tokens, lengths = generation.best_continuations(model, batch, options, **settings)
        for i, row, length in zip(rows, tokens, lengths):
            texts[i] = featurizer.text(prompts[i], row[:length])
    return texts


class DecoderOnlyRoute:
    """How a seq2seq task trains and decodes a causal decoder (pretrained, or built here): each
    pair a prompt and its completion, packed into full rows."""

    token_masks: ClassVar[tuple[str, ...]] = ("mask",)
    trim: ClassVar[dict[str, tuple[str, ...]]] = {}  # packed rows are full
    # Ten decodings of a pretrained decoder are too slow for an evaluation here.
    affords_mbr: ClassVar[bool] = False

    def __init__(self, task: Seq2SeqTask):
        if task.config.data.prompt is None:
            raise UserError(
                f"A decoder-only {task.name} model (model.causal) reads a prompt: give data.prompt, with {SOURCE} "
                "where the source goes (the smollm2 and gemma3 presets have theirs)."
            )
        self.task = task

    def protocol(self) -> str:
        model = self.task.config.model.pretrained or "a decoder trained here"
        return (
            f"; decoder-only: {model} reads the prompt {self.task.config.data.prompt!r} (the chat template's user turn "
            "where the checkpoint has one), the loss on the completion and its end token, pairs packed into rows "
            f"of {self.task.config.model.max_len}"
        )

    def fit_featurizer(self, train: Sequence[dict]) -> CompletionFeaturizer:
        # A checkpoint used as it is (`--model`) is fitted on no examples; its glossary still
        # comes from the training split.
        train = train or self.task.examples("train")
        featurizer = self._featurizer(self._tokenizer(train), self.task.glossary(train))
        if self.task.config.data.shortlist:
            featurizer.shortlist = featurizer.covering(train)
        return featurizer

    def _tokenizer(self, train: Sequence[dict]) -> Tokenizer | PretrainedTokenizer:
        """The checkpoint's tokenizer, or for a decoder built here one trained on both sides."""
        if self.task.config.model.pretrained is not None:
            return PretrainedTokenizer.from_checkpoint(self.task.config.model.pretrained)
        texts = [text for e in train for text in (e["source"], e["target"])]
        return Tokenizer.train(texts, self.task.config.data.vocab_size, "bpe", lossless=True)

    def _featurizer(self, tokenizer, glossary) -> CompletionFeaturizer:
        data, max_len = self.task.config.data, self.task.config.model.max_len
        return CompletionFeaturizer(tokenizer, data.prompt, data.source_len, data.target_len, max_len, glossary)

    def load_featurizer(self, directory: Path) -> CompletionFeaturizer:
        data = self.task.config.data
        return CompletionFeaturizer.load(
            directory, data.prompt, data.source_len, data.target_len, self.task.config.model.max_len
        )

    def model(self, featurizer: CompletionFeaturizer, config: Config, rngs: nnx.Rngs) -> Model:
        embedder = TokenEmbedder(featurizer.tokenizer.vocab_size, config.model.d_model, rngs=rngs)
        head = TiedOutput(embedder, featurizer.shortlist)
        return Model(embedder, Transformer(config.model, remat=config.train.remat, rngs=rngs), head)

    def sources(self, featurizer: CompletionFeaturizer, examples: Sequence[dict]) -> list:
        """What `decode_texts` reads of the examples: the examples, whose prompts it writes."""
        return list(examples)

    def zero_shot(self, featurizer: CompletionFeaturizer, test: Sequence[dict]) -> dict[str, dict]:
        """For a pretrained decoder, the checkpoint as it is (before any fine-tuning) with the same
        prompt, decoded greedily: what a user would try first."""
        name = self.task.config.model.pretrained
        if name is None:
            return {}
        from core.training.steps import build_model

        task = self.task
        model = build_model(task, featurizer, task.config, from_pretrained=True)
        options = {**predict_option_values(task, {}), "beams": 1, "temperature": 0.0}
        generated = {"text": task.decode_texts(model, featurizer, test, options)}
        return {f"zero_shot ({name}, greedy)": task.score_generated(generated, test, featurizer)}

    def decode_texts(self, model, featurizer: CompletionFeaturizer, sources: list, options: dict) -> list[str]:
        """The completion of each example by one decoding (see `Seq2SeqTask.decode_texts`)."""
        task = self.task
        return decode_texts(model, featurizer, sources, options, task.config.data, task.config.train.eval_batch_size)
