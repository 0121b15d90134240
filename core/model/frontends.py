"""Front ends that shorten a sequence of frames before the body, returning the new mask.

`WhisperStem` is Whisper's audio front end: two 1-D convolutions of width 3 over time (the
mel bins are their input channels), the second with stride 2, each followed by exact GELU, so a
position covers 20 ms; the encoder adds its positions after it.

`ConvSubsampling` is the speech recognizers' convolutional front end (ESPnet's
Conv2dSubsampling, Conformer's): stride-2 3x3 convolutions over (time, feature), each halving
both axes, then a linear map of the flattened channels and features to the model width. Four
times fewer positions make attention sixteen times cheaper and leave 40 ms a position.

Each layer pads one frame on either side, whatever the batch width, and padding frames are
zeroed before every convolution, so a clip's outputs are the same in any batch (padding
invariance); the output mask keeps ceil(length / 2) positions per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def subsampled_lengths(lengths, layers: int):
    """Positions kept of sequences of `lengths` after `layers` stride-2 layers: ceil(L / 2) each
    time (numpy or jax arrays, or ints)."""
    for _ in range(layers):
        lengths = (lengths + 1) // 2
    return lengths


class ConvSubsampling(nnx.Module):
    """Frames [B, T, F] and their mask [B, T] -> vectors [B, T', D] and the mask [B, T'], with
    T' = ceil(T / 2 ** layers)."""

    def __init__(self, features: int, d_model: int, *, channels: int, layers: int = 2, rngs: nnx.Rngs):
        self.layers = layers
        self.convs = nnx.List(
            [
                nnx.Conv(
                    1 if i == 0 else channels,
                    channels,
                    kernel_size=(3, 3),
                    strides=(2, 2),
                    padding=((1, 1), (1, 1)),
                    rngs=rngs,
                )
                for i in range(layers)
            ]
        )
        self.out_features = int(subsampled_lengths(np.int64(features), layers))
        self.projection = nnx.Linear(channels * self.out_features, d_model, rngs=rngs)

    def __call__(self, frames: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        # The biases' dtype is the compute dtype (float32, or bfloat16 when the train step casts the
        # parameters; decoding weights narrow the kernels alone); frames may come in a narrower
        # storage dtype (float16).
        dtype = self.projection.bias.dtype
        lengths = mask.sum(-1)
        x = frames.astype(dtype)[..., None]  # [B, T, F, 1]: time and feature are the two spatial axes
        for conv in self.convs:
            x = x * mask[:, :, None, None].astype(dtype)
            x = jax.nn.relu(conv(x).astype(dtype))
            lengths = subsampled_lengths(lengths, 1)
            mask = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
        B, T, F, C = x.shape
        x = x * mask[:, :, None, None].astype(dtype)
        return self.projection(x.reshape(B, T, F * C)).astype(dtype), mask


class WhisperStem(nnx.Module):
    """Frames [B, T, F] and their mask [B, T] -> vectors [B, ceil(T / 2), D] and their mask."""

    def __init__(self, features: int, d_model: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(features, d_model, kernel_size=(3,), padding=((1, 1),), rngs=rngs)
        self.conv2 = nnx.Conv(d_model, d_model, kernel_size=(3,), strides=(2,), padding=((1, 1),), rngs=rngs)

    def __call__(self, frames: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        # The compute dtype: the biases' (decoding weights, `core.model.precision.narrowed`, narrow the kernels alone).
        dtype = self.conv1.bias.dtype
        x = frames.astype(dtype) * mask[..., None].astype(dtype)
        x = jax.nn.gelu(self.conv1(x), approximate=False) * mask[..., None].astype(dtype)
        x = jax.nn.gelu(self.conv2(x), approximate=False)
        kept = jnp.arange(x.shape[1])[None, :] < subsampled_lengths(mask.sum(-1), 1)[:, None]
        return x.astype(dtype), kept
