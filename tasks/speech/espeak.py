"""Speech synthesis with eSpeak NG through `ctypes`, for the embedded corpus.

The `espeakng-loader` wheel ships `libespeak-ng.so` and its voice data, so the corpus needs
nothing but PyPI. The library is driven in retrieval mode: `espeak_Synth` hands the samples to a
callback instead of a sound card, and `espeak_Synchronize` returns once the text is spoken. It
holds one global voice and parameter state per process, hence one `Speaker` per process.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from core.errors import UserError

# espeak_AUDIO_OUTPUT and espeak_PARAMETER values from speak_lib.h.
AUDIO_OUTPUT_RETRIEVAL = 1
PARAMETER_RATE, PARAMETER_PITCH = 1, 3
# espeakCHARS_AUTO: UTF-8 text.
CHARS_AUTO = 0
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class Speaker:
    """Renders text as 16-bit samples at `sample_rate` (22,050 Hz for eSpeak NG's voices)."""

    def __init__(self):
        try:
            import espeakng_loader

            library_path, data_path = espeakng_loader.get_library_path(), espeakng_loader.get_data_path()
            self.library = ctypes.CDLL(library_path)
        except (ImportError, OSError, RuntimeError) as error:
            raise UserError(
                "The embedded speech corpus is rendered with eSpeak NG, which the espeakng-loader wheel ships, "
                f"and it could not be loaded ({error}). Run `make install` (or `pip install espeakng-loader`), "
                "or train on your own recordings with --data."
            ) from None
        self.sample_rate = self.library.espeak_Initialize(AUDIO_OUTPUT_RETRIEVAL, 0, data_path.encode(), 0)
        if self.sample_rate <= 0:
            raise UserError(f"eSpeak NG did not start with the voice data in {data_path} (code {self.sample_rate}).")
        self._chunks: list[np.ndarray] = []

        def collect(samples, count, events):
            if count > 0:
                self._chunks.append(np.ctypeslib.as_array(samples, shape=(count,)).copy())
            return 0  # 0: go on synthesizing

        self._callback = CALLBACK(collect)  # kept referenced for as long as the library may call it
        self.library.espeak_SetSynthCallback(self._callback)

    def say(self, text: str, voice: str, rate: int, pitch: int) -> np.ndarray:
        """`text` spoken by `voice` ("en-us", or with a variant: "en-us+m3") at `rate` words per
        minute and `pitch` (0-100, 50 the voice's own) -> int16 samples."""
        if self.library.espeak_SetVoiceByName(voice.encode()) != 0:
            raise UserError(f"eSpeak NG has no voice {voice!r}.")
        self.library.espeak_SetParameter(PARAMETER_RATE, int(rate), 0)
        self.library.espeak_SetParameter(PARAMETER_PITCH, int(pitch), 0)
        self._chunks.clear()
        encoded = text.encode()
        self.library.espeak_Synth(encoded, len(encoded) + 1, 0, 0, 0, CHARS_AUTO, None, None)
        self.library.espeak_Synchronize()
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)


@functools.cache
def speaker() -> Speaker:
    """The process's one speaker (eSpeak NG keeps global state)."""
    return Speaker()
