"""The CTC route of the speech task: a Transformer encoder over log-mel frames, trained with CTC.

The model is the core's default composition with a speech front end: 80-bin log-mel frames
(tasks/speech/audio.py) -> `core.model.frontends.ConvSubsampling` (4x fewer positions, 40 ms each) ->
the encoder stack (rotary positions) -> a linear CTC head over characters, blank id 0 ->
`core.training.losses.ctc_loss`. Decoding is greedy on device during training and validation, and
greedy or CTC prefix beam search (`core.generation.ctc`) in `apps eval` and `apps predict`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.config import Config, require
from core.errors import UserError
from core.generation import ctc as ctc_decoding
from core.model.frontends import ConvSubsampling
from core.model.transformer import Model, Transformer
from core.training import losses
from core.training.data import decoding_batches
from tasks.speech.featurizer import SpeechFeaturizer, fit_featurizer

if TYPE_CHECKING:
    from tasks.speech.asr import SpeechTask


class CTCOutputs(NamedTuple):
    """Per-position logits [B, T', V] (float32) and the front end's mask [B, T']."""

    logits: jax.Array
    mask: jax.Array


class CTCHead(nnx.Module):
    def __init__(self, d_model: int, vocab_size: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(d_model, vocab_size, rngs=rngs)

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> CTCOutputs:
        return CTCOutputs(self.linear(hidden).astype(jnp.float32), mask)


class CTCRoute:
    """How the speech task trains, scores and decodes a CTC encoder built here."""

    # Validation scores the greedy paths on the device (`score`); evaluation adds beam search.
    validation_decoding: ClassVar[dict[str, Any] | None] = None
    evaluated_decodings: ClassVar[dict[str, dict[str, Any]]] = {"beam": {"beam_width": 8}}

    def __init__(self, task: SpeechTask):
        smoothing = task.config.optim.label_smoothing
        require(smoothing == 0, "optim.label_smoothing", smoothing, "must be 0: the CTC loss has no label smoothing")
        self.task = task

    def fit_featurizer(self, train: Sequence[dict]) -> SpeechFeaturizer:
        return fit_featurizer(train, self.task.config.data)

    def load_featurizer(self, directory: Path) -> SpeechFeaturizer:
        return SpeechFeaturizer.load(directory, self.task.config.data)

    def model(self, featurizer: SpeechFeaturizer, config: Config, rngs: nnx.Rngs) -> Model:
        options, d_model = config.data, config.model.d_model
        embedder = ConvSubsampling(
            featurizer.num_mels, d_model, channels=options.conv_channels, layers=options.subsampling_layers, rngs=rngs
        )
        body = Transformer(config.model, remat=config.train.remat, rngs=rngs)
        return Model(embedder, body, CTCHead(d_model, featurizer.vocab_size, rngs=rngs))

    def loss(self, outputs: CTCOutputs, batch: dict):
        return losses.ctc_loss(outputs.logits, outputs.mask, batch["targets"], batch["target_mask"], batch["weights"])

    def metrics(self, outputs: CTCOutputs, batch: dict):
        total, _ = self.loss(outputs, batch)
        labels = (batch["target_mask"].sum(-1) * batch["weights"]).sum()
        return {"loss_per_label": (total, labels.astype(jnp.float32))}

    def decode(self, outputs: CTCOutputs, batch: dict) -> dict[str, jax.Array]:
        # The best path's ids; merged and stripped of blanks on the host (`score`).
        return {"path": outputs.logits.argmax(-1).astype(jnp.int32), "length": outputs.mask.sum(-1)}

    def score(self, predictions, examples: Sequence[dict], featurizer: SpeechFeaturizer) -> dict[str, float]:
        texts = [
            featurizer.decode(ctc_decoding.collapse(path[:length]))
            for path, length in zip(predictions["path"], predictions["length"])
        ]
        return self.task.score_generated({"text": texts}, examples, featurizer)

    def transcribe(self, model, featurizer: SpeechFeaturizer, examples, options: dict) -> dict[str, list]:
        """Greedy (`beam_width` 1) or CTC prefix beam search over the model's log-probabilities.
        Clips go in batches of similar lengths, padded to a `core.training.data.bucket_width` of
        frames (few compiled shapes)."""
        if options["language"] not in ("", "auto") or options["task"]:
            raise UserError("--language and --task choose Whisper's prompt; a CTC model reads one language only.")
        if options.get("prompt", "").strip():
            raise UserError("--prompt is Whisper's earlier text; a CTC model reads the audio alone.")
        width, arrays = options["beam_width"], featurizer(examples)
        graphdef, state = nnx.split(model)
        forward = _forward(graphdef)
        texts = [""] * len(examples)
        lengths, batch_size = arrays["mask"].sum(1), self.task.config.train.eval_batch_size
        for rows, padded, frames in decoding_batches(lengths, batch_size, arrays["mask"].shape[1]):
            batch = {key: arrays[key][padded, :frames] for key in ("inputs", "mask")}
            log_probs, kept = jax.device_get(forward(state, batch))
            for i, row in enumerate(rows):
                frame_log_probs = np.asarray(log_probs[i, : kept[i]])
                if width == 1:
                    ids = ctc_decoding.greedy(frame_log_probs)
                else:
                    ids = ctc_decoding.prefix_beam_search(frame_log_probs, width)
                texts[row] = featurizer.decode(ids)
        return {"text": texts}


@functools.cache
def _forward(graphdef):
    """A jitted forward to per-frame log-probabilities and kept lengths, per model graph."""

    @jax.jit
    def forward(state, batch):
        outputs = nnx.merge(graphdef, state)(batch)
        return jax.nn.log_softmax(outputs.logits), outputs.mask.sum(-1)

    return forward
