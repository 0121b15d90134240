"""Whisper with timestamps: segments read from timestamp tokens as Whisper reads them, long audio
advanced window by window, decoding that matches faster-whisper's on the same checkpoint, and
subtitles that parse."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import apps
from test_whisper import installed

from core.generation.timestamps import Timestamps
from tasks.speech import audio, segments, subtitles, windows
from tasks.speech.transcriber import Transcriber

FIXTURES = Path(__file__).parent / "fixtures" / "whisper_timestamps"


@pytest.fixture(scope="module")
def transcriber():
    return Transcriber(model=installed("whisper-tiny.en"))


def at(seconds: float) -> int:
    """whisper-tiny.en's timestamp token for a time: <|0.00|> is 50363, one a 20 ms step."""
    return 50363 + round(seconds / 0.02)


def test_a_windows_tokens_split_into_segments_as_whisper_splits_them(transcriber):
    featurizer = transcriber.featurizer
    hello, there = featurizer.tokenizer.pieces([" Hello there."])[0], featurizer.tokenizer.pieces([" How now?"])[0]
    # Two complete segments and one cut by the window: the next window starts at the second's end.
    tokens = [at(0), *hello, at(1.5), at(1.5), *there, at(3.1), at(3.1), *hello]
    found, read = segments.split(tokens, featurizer, offset=10.0, duration=30.0)
    assert [segments.shown(s) for s in found] == [
        {"start": 10.0, "end": 11.5, "text": "Hello there."},
        {"start": 11.5, "end": 13.1, "text": "How now?"},
    ]
    assert found[0]["tokens"] == hello and found[0]["text"] == " Hello there."
    assert read == pytest.approx(3.1)
    # Ending on a lone timestamp: the last segment is whole and the window read to its end.
    found, read = segments.split([at(0), *hello, at(1.5), at(2.0), *there, at(3.1)], featurizer, 0.0, 4.2)
    assert [(s["start"], s["end"]) for s in found] == [(0.0, 1.5), (2.0, 3.1)] and read == 4.2
    # No pair: one segment, to its last timestamp, or to the window's end without one.
    found, read = segments.split([at(0.4), *hello, at(2.4)], featurizer, 5.0, 7.0)
    assert [segments.shown(s) for s in found] == [{"start": 5.0, "end": 7.4, "text": "Hello there."}] and read == 7.0
    assert segments.split([at(0), *hello], featurizer, 0.0, 6.5)[0][0]["end"] == 6.5
    assert segments.split([at(0), at(0)], featurizer, 0.0, 6.5)[0] == []  # no text, no segment


def reference() -> dict:
    return json.loads((FIXTURES / "reference.json").read_text())


def faster_whisper_features(samples, start: int, frames: int = 3000):
    """The window of `frames` from `start` as faster-whisper reads it: one log-mel of the whole
    recording (160 samples of silence after it), floored at 8 below its maximum, sliced, padded
    with zeros (the suite pads a window's audio instead: tasks.speech.audio.whisper_log_mel)."""
    log = audio._log10_mel(np.pad(samples, (0, audio.HOP)), 80)
    features = ((np.maximum(log, log.max() - 8.0) + 4.0) / 4.0).T[: len(samples) // audio.HOP]
    window = features[start : start + frames]
    return np.pad(window, ((0, frames - len(window)), (0, 0))).astype(np.float16)


def test_greedy_timestamp_decoding_matches_faster_whispers(transcriber):
    """Each window faster-whisper decoded (CTranslate2, float32, greedy, the same checkpoint
    files; tests/fixtures/whisper_timestamps/make_reference.py), read from the same features,
    decodes to the same tokens, timestamps included, with the same mean log-probability and
    no-speech probability (unless the two part at a near tie: faster-whisper's own top two
    within 0.02 nats), and gives the same segments and the same start of the next window."""
    featurizer = transcriber.featurizer
    rules = Timestamps(featurizer.vocabulary.timestamp_begin, featurizer.vocabulary.end)
    greedy = windows.Decoding(featurizer.decoding(timestamps=True), 1, 1, fallback=False, timestamps=rules)
    compared = 0
    for name, transcript in reference()["transcripts"].items():
        samples = audio.load_audio(FIXTURES / f"{name}.flac")
        for window in transcript["windows"]:
            frames = faster_whisper_features(samples, window["seek"])
            decoded = windows.decode_windows(transcriber.model, featurizer, [frames], greedy)[0]
            theirs = window["tokens"]
            parted = next((i for i, (a, b) in enumerate(zip(decoded.tokens, theirs)) if a != b), None)
            if parted is not None:
                assert window["steps"][parted]["margin"] < 0.02, (name, parted, decoded.tokens, theirs)
                compared += parted
                continue
            assert decoded.tokens == theirs
            assert decoded.log_prob == pytest.approx(window["avg_logprob"], abs=1e-3)
            assert decoded.no_speech == pytest.approx(window["no_speech_prob"], abs=1e-3)
            compared += len(theirs)
            found, read = segments.split(decoded.tokens, featurizer, window["time_offset"], window["segment_duration"])
            # Ours end within the window's audio: faster-whisper's last may overshoot the recording.
            ends = window["time_offset"] + window["segment_duration"]
            expected = [s for s in window["timestamp_segments"] if s["text"].strip()]
            assert [(s["start"], s["end"], s["text"]) for s in found] == [
                (pytest.approx(s["start"]), pytest.approx(min(s["end"], ends)), s["text"]) for s in expected
            ]
            assert round(read * 100) == window["seek_after_timestamps"] - window["seek"]
    assert compared > 100


def test_long_audio_gives_segments_in_order_covering_it(transcriber):
    """A 41 s file of ten sentences between silences of known lengths: segments in order, none
    overlapping, within the file, each holding its sentence; the same when only its stretches
    of speech are decoded (`vad`), cut at their pauses and decoded at once (`batched`), the
    times put back on the file's clock."""
    clips = json.loads((FIXTURES / "clips.json").read_text())
    samples = audio.load_audio(FIXTURES / "long.flac")
    spoken = [(sentence["first_loud"], sentence["last_loud"]) for sentence in clips["long"]["sentences"]]
    [row] = transcriber.segments([FIXTURES / "long.flac"], beam_width=1)
    assert row["language"] == "en" and row["text"] == " ".join(s["text"] for s in row["segments"])
    [cut] = transcriber.segments([samples], beam_width=1, batched=True, vad=True)
    for found in (row["segments"], cut["segments"]):
        starts, ends = [s["start"] for s in found], [s["end"] for s in found]
        assert starts == sorted(starts) and all(e > s for s, e in zip(starts, ends))
        assert all(b >= a for a, b in zip(ends, starts[1:])) and ends[-1] <= len(samples) / audio.SAMPLE_RATE + 0.02
        # Each segment holds its sentence's speech and no other's, within 0.3 s: Whisper's
        # timestamps without word alignment run a segment from the previous one's end.
        assert len(found) == len(spoken), found
        for segment, (first, last), before in zip(found, spoken, [(0.0, 0.0), *spoken]):
            assert segment["start"] - 0.3 <= first and last <= segment["end"] + 0.3, (segment, first, last)
            assert segment["start"] >= before[1] - 0.3, (segment, before)


def test_voice_activity_detection_finds_the_speech_as_faster_whisper_does(transcriber):
    """Silero VAD's stretches of the 41 s file are faster-whisper's (1.2.1, `get_speech_timestamps`
    on the same samples, its defaults and its batched pipeline's); times in the joined stretches
    go back to the file's clock; a minute of silence or of faint noise holds no speech, so
    nothing is decoded."""
    from tasks.speech import vad

    samples = audio.load_audio(FIXTURES / "long.flac")
    assert vad.speech(samples) == [(1792, 186112), (214272, 421120), (446208, 558336), (584448, 656751)]
    assert vad.speech(samples, vad.BATCHED) == [
        (1792, 57600), (70400, 125440), (125440, 186112), (214272, 260864), (264448, 314112),
        (333568, 384768), (386304, 421120), (446208, 515840), (525568, 558336), (584448, 647424),
    ]  # fmt: skip
    kept = vad.Kept(((16000, 32000), (80000, 96000)))  # 1-2 s and 5-6 s
    assert kept.joined(np.arange(100_000)).tolist() == [*range(16000, 32000), *range(80000, 96000)]
    assert [kept.original(0.5), kept.original(1.0, end=True), kept.original(1.0), kept.original(1.25)] == [
        1.5, 2.0, 5.0, 5.25
    ]  # fmt: skip
    # Within a 20 ms step of the joint, a start is the later stretch's and an end the earlier's.
    assert [kept.original(0.99), kept.original(1.01, end=True), kept.original(0.97)] == [5.0, 2.0, 1.97]
    assert kept.windows(np.zeros(32000), 20000) == [slice(0, 16000), slice(16000, 32000)]
    minute = 60 * audio.SAMPLE_RATE
    noise = np.random.default_rng(0).normal(0, 10 ** (-60 / 20), minute).astype(np.float32)  # -60 dBFS
    assert vad.speech(np.zeros(minute, np.float32)) == [] and vad.speech(noise) == []
    rows = transcriber.segments([np.zeros(minute, np.float32), noise], vad=True)
    assert [(r["text"], r["segments"]) for r in rows] == [("", []), ("", [])]


def test_voice_activity_detection_names_its_missing_model(monkeypatch):
    import importlib.util

    from core.errors import UserError
    from tasks.speech import vad

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install --no-deps faster-whisper==1.2.1"):
        vad.model_path()


def test_subtitles_parse_as_srt_and_webvtt():
    import srt
    import webvtt

    row = {
        "file": "a.wav",
        "segments": [
            {"start": 0.0, "end": 1.5, "text": "Hello there."},
            {"start": 61.02, "end": 3725.5, "text": "A long\n\nsecond cue."},
        ],
    }
    cues = list(srt.parse(subtitles.srt(row)))
    assert [(c.index, c.start.total_seconds(), c.end.total_seconds(), c.content) for c in cues] == [
        (1, 0.0, 1.5, "Hello there."),
        (2, 61.02, 3725.5, "A long second cue."),
    ]
    assert "00:01:01,020 --> 01:02:05,500" in subtitles.srt(row)
    parsed = webvtt.from_buffer(io.StringIO(subtitles.vtt(row)))
    assert [(c.start, c.end, c.text) for c in parsed] == [
        ("00:00:00.000", "00:00:01.500", "Hello there."),
        ("00:01:01.020", "01:02:05.500", "A long second cue."),
    ]


def test_apps_predict_writes_subtitles_per_file(tmp_path):
    short = str(FIXTURES / "short.flac")
    result = apps(
        "predict", "speech", "--model", installed("whisper-tiny.en"), short, "--beam-width", "1", "--format", "srt"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("1\n00:00:00,000 --> 00:00:0") and "lazy dog" in result.stdout
    out = tmp_path / "subs"
    result = apps(
        "predict",
        "speech",
        "--model",
        installed("whisper-tiny.en"),
        short,
        short,
        "--beam-width",
        "1",
        "--format",
        "vtt",
        "--output",
        out,
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["short-2.vtt", "short.vtt"]
    assert (out / "short.vtt").read_text().startswith("WEBVTT\n\n00:00:00.000 --> ")
    refused = apps("predict", "speech", "--model", installed("whisper-tiny.en"), short, "--format", "ass")
    assert refused.exit_code == 1 and "srt, vtt" in refused.output


def test_the_audio_endpoints_answer_as_apps_predict_does(tmp_path, transcriber):
    """`apps serve --model whisper-tiny.en` through the official client: the transcription of a
    file is what `apps predict speech` gives for it, as text, JSON, verbose JSON with its
    segments, and subtitles that parse, and after a prompt; bad fields are named."""
    import httpx2 as httpx
    import srt
    from test_server import auth, client, serving

    short = FIXTURES / "short.flac"
    [row] = transcriber.predict([str(short)])
    with serving(tmp_path, "--model", installed("whisper-tiny.en")) as (_, url, _):
        speech = client(url).audio
        with short.open("rb") as file:
            assert speech.transcriptions.create(model="whisper-tiny.en", file=file).text == row["transcript"]
        with short.open("rb") as file:
            verbose = speech.transcriptions.create(model="whisper-tiny.en", file=file, response_format="verbose_json")
        assert [(s.start, s.end, s.text) for s in verbose.segments] == [
            (s["start"], s["end"], s["text"]) for s in row["segments"]
        ]
        assert verbose.language == "en" and verbose.duration == pytest.approx(3.767, abs=1e-3)
        with short.open("rb") as file:
            timed = speech.transcriptions.create(
                model="whisper-tiny.en", file=file, response_format="verbose_json", timestamp_granularities=["word"]
            )
        assert " ".join(w.word for w in timed.words) == row["transcript"] and timed.words[0].start >= 0
        with short.open("rb") as file:
            subtitles_text = speech.transcriptions.create(model="whisper-tiny.en", file=file, response_format="srt")
        [cue] = srt.parse(subtitles_text)
        assert cue.content == row["transcript"] and cue.end.total_seconds() == row["segments"][0]["end"]
        style = "the quick brown fox jumps over the lazy dog"  # lower case, no full stop: followed
        [prompted] = transcriber.predict([str(short)], prompt=style)
        with short.open("rb") as file:
            answer = speech.transcriptions.create(model="whisper-tiny.en", file=file, prompt=style)
        assert answer.text == prompted["transcript"] == style != row["transcript"]
        data = short.read_bytes()
        for fields, param in [
            ({"response_format": "xml"}, "response_format"),
            ({"timestamp_granularities[]": "letter"}, "timestamp_granularities[]"),
            ({"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),  # without verbose_json
            ({"language": "xx"}, "language"),  # an English-only model: named, not read as English
            ({"temperature": "hot"}, "temperature"),
            ({"voice": "x"}, "voice"),
        ]:
            response = httpx.post(
                f"{url}/v1/audio/transcriptions", files={"file": ("a.flac", data)}, data=fields, headers=auth()
            )
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        two = [("file", ("a.flac", data)), ("file", ("b.flac", data))]  # a second file is not dropped silently
        for files, param in [({"file": ("a.flac", b"not audio")}, "file"), ({}, "file"), (two, "file")]:
            response = httpx.post(
                f"{url}/v1/audio/transcriptions", files=files or None, data={"model": "whisper-tiny.en"}, headers=auth()
            )
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        translated = httpx.post(f"{url}/v1/audio/translations", files={"file": ("a.flac", data)}, headers=auth())
        error = translated.json()["error"]
        assert translated.status_code == 400 and error["param"] == "model" and "English-only" in error["message"]
        assert "--" not in error["message"]  # the API's words, not the command line's flags


def test_a_multilingual_whisper_finds_each_recordings_language():
    """whisper-base hears German and English (eSpeak NG's voices) for what they are, as
    Whisper's detection reads the first window; recordings of different languages are decoded
    apart, each in its own (tried by hand with French and Spanish too: "Guten Morgen, heute
    scheint die Sonne ...", "Buenos días, hoy vamos a la playa con mis amigos.")."""
    from tasks.speech import corpus, language

    spoken = {
        "de": ("de", "Guten Morgen, heute scheint die Sonne und wir gehen spazieren."),
        "en": ("en-us", "Good morning, the sun is shining and we are going for a walk."),
    }
    examples = [
        {"audio": corpus.render(corpus.Utterance("test", text, text, voice, 150, 50, 0.3, 0.3)) / 32768, "where": code}
        for code, (voice, text) in spoken.items()
    ]
    transcriber = Transcriber(model=installed("whisper-base"))
    found = language.detect(transcriber.model, transcriber.featurizer, examples, batch_size=2)
    assert [code for code, _ in found] == list(spoken) and all(p > 0.8 for _, p in found), found
    assert language.by_language(["de", "en", "de", "fr"]) == {"de": [0, 2], "en": [1], "fr": [3]}


def test_word_timestamps_follow_faster_whispers_and_the_speech(transcriber):
    """With word timestamps (cross-attention of the alignment heads, dynamic time warping), the
    words are faster-whisper's, their times within 0.1 s of its for 90% of them (the two read
    slightly different features of the last windows), and each sentence's first word starts
    near where its speech does; the next window starts at the last word's end, as
    faster-whisper's did."""
    clips = json.loads((FIXTURES / "clips.json").read_text())
    for name, transcript in reference()["transcripts"].items():
        [row] = transcriber.predict([str(FIXTURES / f"{name}.flac")], beam_width=1, word_timestamps=True)
        ours = [w for s in row["segments"] for w in s["words"]]
        theirs = [w for s in transcript["segments"] for w in s["words"]]
        assert [w["word"] for w in ours] == [w["word"].strip() for w in theirs]
        gaps = np.abs(
            [a["start"] - b["start"] for a, b in zip(ours, theirs)]
            + [a["end"] - b["end"] for a, b in zip(ours, theirs)]
        )
        assert np.median(gaps) <= 0.02 + 1e-9 and np.quantile(gaps, 0.9) <= 0.1, sorted(gaps)[-10:]  # a 20 ms step
        assert all(0 <= w["probability"] <= 1 and w["start"] <= w["end"] for w in ours)
        if name == "long":  # ten sentences (a recording's first word takes its leading silence, as Whisper's)
            firsts = [s["words"][0]["start"] for s in row["segments"]]
            spoken = [sentence["first_loud"] for sentence in clips[name]["sentences"]]
            errors = np.abs(np.subtract(firsts, spoken))
            # Measured: median 0.17 s, at most 0.50 s (the first, its leading silence); the
            # segments' own starts without words: median 0.11 s but up to 1.56 s.
            assert np.median(errors) < 0.25 and errors.max() < 0.6, (firsts, spoken)
