"""An encoder-decoder built from the shared blocks: the model of translation and summarization.

The source front end maps (`inputs`, `mask`) to vectors and a mask, which a bidirectional
`Transformer` encodes into the memory [B, S, D]. The target front end embeds `decoder_inputs`
(the targets shifted right behind a beginning-of-sequence token), and a causal `Transformer`
built with `cross_attention=True` runs over them and over the memory; the head maps its states
to the task's outputs, which the loss compares with `targets` (see core/task.py for the keys).
A `core.model.heads.CopyOutput` head also reads the source (the memory and the source tokens), so that
the model may copy source tokens into the target.

Its decoding (`encode_prefill`, `generate_from_source`, `generate_beams_from_source`) lives in
`core.generation.seq2seq`; `Start` says how it begins.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
from flax import nnx

from core.config import ModelConfig
from core.model.heads import Source
from core.model.transformer import Transformer


class EncoderDecoder(nnx.Module):
    """source front end -> encoder -> memory; target front end -> decoder over the memory -> head.

    The two front ends may be one module (a vocabulary shared by source and target), and the
    head may tie its output to the target front end (`core.model.heads.TiedOutput`).
    """

    # The parts that another run's weights fill (`--init-from`): everything but the head.
    transferred: ClassVar[tuple[str, ...]] = ("source_embedder", "encoder", "target_embedder", "decoder")

    def __init__(
        self,
        source_embedder: nnx.Module,
        encoder: Transformer,
        target_embedder: nnx.Module,
        decoder: Transformer,
        head: nnx.Module,
    ):
        if encoder.cross_attention or not decoder.cross_attention:
            raise ValueError("An EncoderDecoder needs an encoder without cross-attention and a decoder with it.")
        if not decoder.config.causal:
            raise ValueError("An EncoderDecoder's decoder must be causal: it predicts each target from those before.")
        if encoder.config.d_model != decoder.config.d_model:
            raise ValueError(
                f"The encoder's d_model={encoder.config.d_model} differs from the decoder's {decoder.config.d_model}."
            )
        self.source_embedder = source_embedder
        self.encoder = encoder
        self.target_embedder = target_embedder
        self.decoder = decoder
        self.head = head

    @property
    def copies(self) -> bool:
        """Whether the head reads the source (its declared `reads_source`, as `CopyOutput`
        does): the source front end must then be token ids of the target's vocabulary."""
        return self.head.reads_source

    def source(self, memory: jax.Array, memory_mask: jax.Array, inputs: jax.Array) -> Source | None:
        """The head's view of the source, or None for a head that does not read it."""
        return self.head.source(memory, memory_mask, inputs) if self.copies else None

    def outputs(self, hidden: jax.Array, mask: jax.Array, source: Source | None):
        """The head's outputs at the decoder states `hidden` [B, T, D]."""
        return self.head(hidden, mask) if source is None else self.head(hidden, mask, source)

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        source_embedder: nnx.Module,
        target_embedder: nnx.Module,
        head: nnx.Module,
        *,
        remat: bool = False,
        rngs: nnx.Rngs,
    ) -> EncoderDecoder:
        """Both stacks from one config: a bidirectional encoder of `num_layers` blocks and a
        causal decoder of `decoder_layers` (default `num_layers`); `config.causal` is set per
        stack, whatever its value, and the encoder's positions are `encoder_positions` where set."""
        positions = config.encoder_positions or config.positions
        encoder = Transformer(dataclasses.replace(config, causal=False, positions=positions), remat=remat, rngs=rngs)
        depth = config.num_layers if config.decoder_layers is None else config.decoder_layers
        decoder_config = dataclasses.replace(config, causal=True, num_layers=depth)
        decoder = Transformer(decoder_config, remat=remat, cross_attention=True, rngs=rngs)
        return cls(source_embedder, encoder, target_embedder, decoder, head)

    def encode(
        self, inputs: jax.Array, mask: jax.Array, *, dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Source `inputs` and `mask` -> the memory [B, S, D] and its mask [B, S] (the front
        end's, which may be shorter than the inputs)."""
        x, memory_mask = self.source_embedder(inputs, mask)
        return self.encoder(x, memory_mask, dropout_key=dropout_key), memory_mask

    def __call__(self, batch: dict, *, dropout_key: jax.Array | None = None):
        """Teacher forcing: the head's outputs at every target position of the batch."""
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        memory, memory_mask = self.encode(batch["inputs"], batch["mask"], dropout_key=keys[0])
        x, mask = self.target_embedder(batch["decoder_inputs"], batch["decoder_mask"])
        hidden = self.decoder(x, mask, memory=memory, memory_mask=memory_mask, dropout_key=keys[1])
        return self.outputs(hidden, mask, self.source(memory, memory_mask, batch["inputs"]))


class Start(NamedTuple):
    """How decoding begins and what it never writes (hashable: a static argument of the jitted
    programs). `prompt`: the decoder's first tokens, the same for every row (a
    beginning-of-sequence token; Whisper's start, language, task and no-timestamps tokens).
    `suppress`: ids banned at every step; `suppress_first`: also banned at the first new token
    (Whisper's blank and end). `probe`: a token whose probability right after the prompt's first
    token the programs report (Whisper's no-speech probability), or None."""

    prompt: tuple[int, ...]
    suppress: tuple[int, ...] = ()
    suppress_first: tuple[int, ...] = ()
    probe: int | None = None
