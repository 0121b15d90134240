"""`apps bench transcribe --model whisper-tiny.en`: the real-time factor of Whisper's transcription.

Real-time factor: seconds of wall time per second of audio, over the whole transcription of a
set of clips (log-mel features, the encoder, greedy decoding and the text), once compiled.
Two sets, from the embedded sentences corpus's test split: 8 short clips (one utterance each,
2-4 s) and 8 long ones (6 utterances joined, 10-30 s). Each set runs at batch 1 (a call per
clip) and batch 8 (one call); Whisper reads a 30 s window whatever the clip's length, so the
encoder costs the same for a 2 s clip as for a 30 s one. Greedy without the temperature
fallback (`Decoding(fallback=False)`), as CTranslate2's `generate` decodes: a window that the
model doubts is otherwise sampled again 5 times at up to 5 temperatures, each run to its
length limit when it loops, and one such clip of the 8 short ones (test clip 5) took 10 of
their 11 s.
"""

from __future__ import annotations

import time

import numpy as np
from flax import nnx
from rich.console import Console

from core.bench.timing import figures
from core.model.precision import narrowed
from tasks.speech import corpus
from tasks.speech.audio import SAMPLE_RATE
from tasks.speech.featurizer import clip
from tasks.speech.windows import Decoding, transcribe

CLIPS = 8
JOINED = 6  # utterances in a long clip
DTYPES = ("float32", "bfloat16")  # the weights of the linear layers


def clip_sets() -> dict[str, list[np.ndarray]]:
    test = corpus.load_corpus("sentences")["test"]
    samples = [clip(example) for example in test[: CLIPS * (1 + JOINED)]]
    long = [np.concatenate(samples[CLIPS + JOINED * i : CLIPS + JOINED * (i + 1)]) for i in range(CLIPS)]
    return {"short": samples[:CLIPS], "long": long}


def transcription(name: str, console: Console) -> list[dict]:
    from tasks.speech.transcriber import Transcriber

    transcriber = Transcriber(model=name)
    featurizer = transcriber.featurizer
    graphdef, params = nnx.split(transcriber.model)  # the checkpoint read once, its weights narrowed per row
    models = {dtype: nnx.merge(graphdef, narrowed(params, dtype)) for dtype in DTYPES}
    start = featurizer.decoding()
    table = figures(
        title=f"{name}: greedy transcription, real-time factor (wall s per audio s, compiled)",
        caption="batch 1: a call per clip; batch 8: one call; greedy, no temperature fallback. "
        "Whisper reads a 30 s window per clip. bfloat16: the linear layers' weights in bfloat16, "
        "multiplied with float32 sums (core.model.precision.narrowed); activations, embeddings and caches in float32.",
        columns=("clips", "audio s", "weights", "batch", "RTF", "wall s"),
    )
    results = []
    for kind, clips in clip_sets().items():
        examples = [{"id": None, "audio": c, "where": f"{kind} clip {i}", "text": ""} for i, c in enumerate(clips)]
        seconds = sum(len(c) for c in clips) / SAMPLE_RATE
        for dtype, model in models.items():
            for batch in (1, 8):
                greedy = Decoding(start, beam_width=1, batch_size=batch, fallback=False)
                transcribe(model, featurizer, examples[:batch], greedy)  # compiles
                began = time.perf_counter()
                transcribe(model, featurizer, examples, greedy)
                wall = time.perf_counter() - began
                results.append(
                    {"model": name, "clips": kind, "audio_s": seconds, "dtype": dtype, "batch_size": batch}
                    | {"rtf": wall / seconds}
                )
                table.add_row(kind, f"{seconds:.1f}", dtype, str(batch), f"{wall / seconds:.3f}", f"{wall:.1f}")
    console.print(table)
    return results
