"""Audio in, log-mel frames out: reading files of any rate and channel count as 16 kHz mono,
and the 80-bin log-mel features (25 ms windows, 10 ms hop) that the model reads, with librosa;
and Whisper's own log-mel features (`whisper_log_mel`).

Every problem with a file (missing, empty, truncated, not audio, silent) is a `UserError` that
names the file.
"""

from __future__ import annotations

import functools
import io
import logging
import re
from pathlib import Path

import numpy as np

from core.errors import UserError

SAMPLE_RATE = 16_000
NUM_MELS = 80
WINDOW = 400  # 25 ms at 16 kHz
HOP = 160  # 10 ms: 100 frames a second
FFT_SIZE = 512
WHISPER_FRAMES = 3000  # Whisper reads 30 s windows
FORMATS = (".wav", ".flac", ".ogg")
logger = logging.getLogger("apps")
# A clip whose peak stays under this (-80 dBFS) holds nothing to recognize.
SILENCE_PEAK = 1e-4
# The lowest sample rate read (telephone speech): a header that declares less would make a few
# bytes last minutes, and their decoding cost as much.
MIN_SAMPLE_RATE = 8_000


def load_audio(path: str | Path, silence_allowed: bool = False) -> np.ndarray:
    """The file at `path` as float32 samples in [-1, 1], mono (channels averaged) at 16 kHz
    (resampled with librosa); a silent file is refused unless `silence_allowed` (a recognizer
    that tells speech from none itself, as Whisper does)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such audio file.")
    return decode_audio(path.read_bytes(), str(path), silence_allowed)


def decode_audio(
    data: bytes, where: str, silence_allowed: bool = False, max_seconds: float | None = None
) -> np.ndarray:
    """`load_audio` of a file's bytes (an upload to `apps serve`); `where` names it in errors.
    A file whose header says it lasts more than `max_seconds` is refused before decoding."""
    import librosa
    import soundfile

    if not data:
        raise UserError(f"{where}: the file is empty.")
    try:
        info = soundfile.info(io.BytesIO(data))
        if info.samplerate < MIN_SAMPLE_RATE:
            raise UserError(
                f"{where}: a sample rate of {info.samplerate} Hz; audio is read at {MIN_SAMPLE_RATE} Hz or more."
            )
        if max_seconds is not None and info.duration > max_seconds:
            raise UserError(
                f"{where}: {info.duration:.1f} s of audio, more than the {max_seconds:g} s a file may last here."
            )
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        # libsndfile names the file object it was given ("<_io.BytesIO object at 0x...>"): say what
        # it found, not where in memory.
        found = re.sub(r"^Error opening <[^>]*>: ", "", str(error))
        raise UserError(
            f"{where}: not a readable audio file ({found}); expected {', '.join(FORMATS)} (or another format "
            "libsndfile reads)."
        ) from None
    if len(samples) < info.frames or "should be" in info.extra_info.lower():
        raise UserError(f"{where}: the file is truncated (its header promises more samples than it holds).")
    if len(samples) == 0:
        raise UserError(f"{where}: the file holds no samples.")
    if not np.all(np.isfinite(samples)):  # before the mix-down and resampling, which refuse them
        raise UserError(f"{where}: the audio holds NaN or infinite samples.")
    mono = librosa.to_mono(samples.T)
    if rate != SAMPLE_RATE or samples.shape[1] > 1:
        # A note, not an error: any rate and channel count is read, and the user should know how.
        logger.info(f"{where}: {samples.shape[1]} channel(s) at {rate} Hz, read as their mean at {SAMPLE_RATE} Hz.")
    if rate != SAMPLE_RATE:
        mono = librosa.resample(mono, orig_sr=rate, target_sr=SAMPLE_RATE)
    return check_audible(mono.astype(np.float32), where, silence_allowed)


def as_float_samples(samples) -> np.ndarray:
    """Samples as float32 in [-1, 1]: integer PCM is divided by its type's full scale."""
    samples = np.asarray(samples)
    if np.issubdtype(samples.dtype, np.integer):
        return (samples / (np.iinfo(samples.dtype).max + 1)).astype(np.float32)
    return samples.astype(np.float32)


def check_audible(samples: np.ndarray, where: str, silence_allowed: bool = False) -> np.ndarray:
    """`samples`, unless they are empty, not finite, or silent (unless `silence_allowed`)."""
    if not np.all(np.isfinite(samples)):
        raise UserError(f"{where}: the audio holds NaN or infinite samples.")
    if len(samples) == 0:
        raise UserError(f"{where}: the audio holds no samples.")
    if not silence_allowed and np.abs(samples).max() < SILENCE_PEAK:
        raise UserError(f"{where}: the audio is silent (peak below -80 dBFS): nothing to transcribe.")
    return samples


def frame_count(num_samples: int) -> int:
    """Log-mel frames of a clip of `num_samples` (centered windows: one per hop, plus one)."""
    return 1 + num_samples // HOP


@functools.cache
def mel_filters() -> np.ndarray:
    """librosa's (Slaney) mel filter bank [80, FFT_SIZE // 2 + 1]; built once, as building it
    costs more than a clip's whole spectrogram."""
    import librosa

    return librosa.filters.mel(sr=SAMPLE_RATE, n_fft=FFT_SIZE, n_mels=NUM_MELS)


@functools.cache
def whisper_filters(bins: int) -> np.ndarray:
    """Whisper's Slaney mel filter bank [bins, 201] for its 400-sample FFT (librosa's, as
    Whisper's own mel_filters.npz was made)."""
    import librosa

    return librosa.filters.mel(sr=SAMPLE_RATE, n_fft=WINDOW, n_mels=bins).astype(np.float32)


def whisper_log_mel(samples: np.ndarray, bins: int = NUM_MELS, frames: int = WHISPER_FRAMES) -> np.ndarray:
    """Whisper's features [frames, bins] (float32) of float32 samples at 16 kHz: the clip padded
    with silence (or cut) to frames * 10 ms, the power of centered 400-sample periodic-Hann
    windows every 160 samples (reflect-padded at the ends, the last frame dropped) through
    `whisper_filters`, log10 floored at 1e-10 and at 8 below the clip's maximum, then (x + 4) / 4.
    Padding in samples, as Hugging Face's feature extractor does, for fine-tuning and every
    window of transcription: silence after a clip reads as the clip's own floor. (Whisper's and
    faster-whisper's transcribe() instead slice one log-mel of the whole recording and pad a
    window's features with zeros; greedy on 96 test sentences of the embedded corpus, that read
    44.9 WER without timestamps and 45.6 with them, against 42.9 and 43.3 here.)"""
    length = frames * HOP
    samples = np.pad(samples[:length], (0, max(length - len(samples), 0)))
    log = _log10_mel(samples, bins)
    return ((np.maximum(log, log.max() - 8.0) + 4.0) / 4.0).T.astype(np.float32)


def _log10_mel(samples: np.ndarray, bins: int) -> np.ndarray:
    """log10 of the mel power [bins, frames] of `whisper_log_mel`, before its floor and scaling."""
    import librosa

    samples = samples.astype(np.float32)
    spectrum = librosa.stft(samples, n_fft=WINDOW, hop_length=HOP, window="hann", center=True, pad_mode="reflect")
    power = np.abs(spectrum[:, :-1]) ** 2
    return np.log10(np.maximum(whisper_filters(bins) @ power, 1e-10))


def log_mel(samples: np.ndarray) -> np.ndarray:
    """float32 samples at 16 kHz -> natural-log mel energies [frames, 80] (float32): the power
    spectrum of centered 25 ms Hann windows every 10 ms, through `mel_filters`."""
    import librosa

    spectrum = librosa.stft(samples, n_fft=FFT_SIZE, hop_length=HOP, win_length=WINDOW, window="hann")
    power = np.abs(spectrum) ** 2
    return np.log(mel_filters() @ power + 1e-6).T.astype(np.float32)
