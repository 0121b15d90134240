"""Speech: log-mel features, audio reading, the conv front end, CTC loss and decoding by hand,
WER/CER goldens, bad input, and one end-to-end run of the CLI (slow)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import soundfile
from flax import nnx
from helpers import apps, table_rows

import tasks
from core import run
from core.errors import UserError
from core.generation import ctc
from core.model.frontends import ConvSubsampling, subsampled_lengths
from core.training import losses
from tasks.speech import audio, corpus, espeak
from tasks.speech.asr import SpeechData
from tasks.speech.data import load_user_data
from tasks.speech.featurizer import SpeechFeaturizer, check_frames_hold_labels, raw_frames
from tasks.speech.scoring import error_rates, grouped_error_rates, normalize

SpeechTask = tasks.get("speech")


def sine(frequency: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * frequency * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def test_log_mel_of_a_sine_peaks_in_its_mel_bin():
    import librosa

    centers = librosa.mel_frequencies(n_mels=audio.NUM_MELS + 2, fmax=audio.SAMPLE_RATE / 2)[1:-1]
    for frequency in (300.0, 1000.0, 3000.0):
        frames = audio.log_mel(sine(frequency, 0.5, audio.SAMPLE_RATE))
        assert frames.shape == (audio.frame_count(audio.SAMPLE_RATE // 2), audio.NUM_MELS)
        assert frames.mean(0).argmax() == np.abs(centers - frequency).argmin(), frequency


def test_resampling_and_downmixing(tmp_path, caplog):
    left = sine(440.0, 1.0, 44_100)
    path = tmp_path / "stereo.wav"
    soundfile.write(path, np.stack([left, np.zeros_like(left)], axis=1), 44_100)
    with caplog.at_level("INFO", logger="apps"):
        samples = audio.load_audio(path)
    assert "stereo.wav: 2 channel(s) at 44100 Hz, read as their mean at 16000 Hz." in caplog.text
    assert samples.dtype == np.float32 and len(samples) == audio.SAMPLE_RATE
    # Mono is the mean of the channels: half the left channel's amplitude; the tone stays at 440 Hz.
    assert abs(np.abs(samples[1000:-1000]).max() - 0.25) < 0.01
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.fft.rfftfreq(len(samples), 1 / audio.SAMPLE_RATE)[spectrum.argmax()] - 440.0) < 2.0


def test_greedy_collapse_by_hand():
    assert ctc.collapse([0, 1, 1, 0, 1, 2, 2, 0, 0, 3]) == [1, 1, 2, 3]
    assert ctc.collapse([0, 0, 0]) == [] and ctc.collapse([2, 2, 2]) == [2]
    log_probs = np.log(np.array([[0.1, 0.8, 0.1], [0.2, 0.7, 0.1], [0.9, 0.05, 0.05], [0.1, 0.1, 0.8]]))
    assert ctc.greedy(log_probs) == [1, 2]


def two_frames() -> np.ndarray:
    """Two frames over (blank, a): blank 0.6, a 0.4 in each."""
    return np.log(np.array([[0.6, 0.4], [0.6, 0.4]], np.float32))


def test_ctc_loss_of_two_frames_by_hand():
    logits = jnp.asarray(two_frames())[None]  # log-probabilities are logits whose softmax is themselves
    mask = jnp.ones((1, 2), bool)
    weights = jnp.ones((1,))
    # "a": paths (a, a), (a, -), (-, a): 0.16 + 0.24 + 0.24; "": the path (-, -) alone.
    for labels, label_mask, probability in (([[1, 0]], [[True, False]], 0.64), ([[0, 0]], [[False, False]], 0.36)):
        total, weight = losses.ctc_loss(logits, mask, jnp.asarray(labels), jnp.asarray(label_mask), weights)
        assert float(weight) == 1.0
        assert float(total) == pytest.approx(-math.log(probability), rel=1e-5)


def test_prefix_beam_search_equals_greedy_at_width_one():
    rng = np.random.default_rng(0)
    for _ in range(20):
        # Peaked frames (the best label above 1/sqrt(2) of the mass), where both must agree.
        best = rng.integers(0, 5, 30)
        probabilities = np.full((30, 5), 0.04)
        probabilities[np.arange(30), best] = 0.84
        log_probs = np.log(probabilities)
        assert ctc.prefix_beam_search(log_probs, beam_width=1) == ctc.greedy(log_probs)


def test_prefix_beam_search_finds_the_more_probable_labels():
    # The best path is (-, -), labels "" at 0.36; summed over its paths, "a" has 0.64.
    assert ctc.greedy(two_frames()) == []
    assert ctc.prefix_beam_search(two_frames(), beam_width=2) == [1]
    # A repeat needs a blank between: "a a" over three frames.
    repeated = np.log(np.array([[0.1, 0.9], [0.9, 0.1], [0.1, 0.9]]))
    assert ctc.prefix_beam_search(repeated, beam_width=4) == [1, 1] == ctc.greedy(repeated)


def test_wer_and_cer_goldens():
    assert normalize("Don't STOP-me, 'now'!  Really?") == "don't stop me now really"
    scores = error_rates(["The cat sat on the mat."], ["cat sit on the mat today"])
    # "the" deleted, sat->sit substituted, "today" inserted: 3 errors over 6 words.
    assert (scores["substitutions"], scores["deletions"], scores["insertions"]) == (1, 1, 1)
    assert scores["wer"] == pytest.approx(50.0) and scores["reference_words"] == 6
    # Characters: one substituted, then one deleted, of four.
    assert error_rates(["abcd"], ["abxd"])["cer"] == pytest.approx(25.0)
    assert error_rates(["abcd"], ["abd"])["cer"] == pytest.approx(25.0)
    grouped = grouped_error_rates(["one two", "three"], ["one two", "tree"], [("a",), ("a", "b")])
    assert grouped["wer"] == pytest.approx(100 / 3) and grouped["wer/b"] == 100.0 and grouped["wer/a"] == 100 / 3


def test_front_end_mask_matches_its_lengths_and_ignores_padding():
    lengths = np.array([5, 8, 1, 13])
    front = ConvSubsampling(16, 12, channels=4, layers=2, rngs=nnx.Rngs(0))
    frames = np.random.default_rng(0).normal(size=(4, 13, 16)).astype(np.float32)
    apply = nnx.jit(lambda module, x, mask: module(x, mask))
    outputs = []
    for width in (13, 21):
        padded = np.zeros((4, width, 16), np.float32)
        padded[:, :13] = frames
        mask = np.arange(width)[None, :] < lengths[:, None]
        x, new_mask = apply(front, jnp.asarray(np.where(mask[..., None], padded, 7.0)), jnp.asarray(mask))
        assert x.shape[:2] == new_mask.shape == (4, subsampled_lengths(width, 2))
        np.testing.assert_array_equal(np.asarray(new_mask).sum(1), subsampled_lengths(lengths, 2))
        outputs.append((np.asarray(x), np.asarray(new_mask)))
    (short, mask), (long, _) = outputs
    np.testing.assert_allclose(short[mask], long[:, : short.shape[1]][mask], atol=1e-5)


def test_renders_a_few_utterances():
    utterance = corpus.Utterance("test", "three oh seven", "three oh seven", "en-029+m3", 160, 50, 0.1, 0.2)
    samples = corpus.render(utterance)
    assert samples.dtype == np.int16 and 0.6 < len(samples) / audio.SAMPLE_RATE < 3.0
    assert np.abs(samples).max() > 1000
    splits = corpus.plan("digits", {"train": 20, "valid": 5, "test": 40}, seed=0)
    test_voices = {u.voice for u in splits if u.split == "test"}
    train_voices = {u.voice for u in splits if u.split != "test"}
    assert not test_voices & train_voices and any(v.startswith(corpus.ACCENT_HELD_OUT) for v in test_voices)
    words = {w for u in splits for w in u.text.split()}
    assert words <= {*corpus.DIGITS, "oh"}


def featurizer(**options) -> SpeechFeaturizer:
    data = SpeechData(**options)
    return SpeechFeaturizer("chars", data.alphabet, np.zeros(80), np.ones(80), 2, data.max_seconds)


def write_clip(path, seconds=1.0):
    soundfile.write(path, sine(300.0, seconds, 22_050), 22_050)
    return path


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no such audio file"),
        (b"", "the file is empty"),
        (b"this is not audio at all", "not a readable audio file"),
        ("truncated", "the file is truncated"),
        ("silent", "the audio is silent"),
        ("nan", "the audio holds NaN or infinite samples"),  # two channels: found before the mix-down
        ("one hertz", "a sample rate of 1 Hz; audio is read at 8000 Hz or more"),  # 500 "seconds" in 1 KB
    ],
)
def test_bad_audio_files_are_named(tmp_path, content, message):
    path = tmp_path / "clip.wav"
    if content == "truncated":
        write_clip(path)
        path.write_bytes(path.read_bytes()[:5000])
    elif content == "silent":
        soundfile.write(path, np.zeros(8000, np.float32), 16_000)
    elif content == "nan":
        stereo = np.full((8000, 2), 0.1, np.float32)
        stereo[100, 1] = np.nan
        soundfile.write(path, stereo, 16_000, subtype="FLOAT")
    elif content == "one hertz":
        soundfile.write(path, np.full(500, 0.1, np.float32), 1)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=message) as error:
        audio.load_audio(path)
    assert str(path) in str(error.value)


def test_clip_longer_than_the_context_and_too_short_for_its_transcript(tmp_path):
    example = {"id": None, "audio": None, "path": str(write_clip(tmp_path / "long.wav", 3.0)), "text": "a"}
    with pytest.raises(UserError, match=r"long.wav: the clip is 3.0 s long, longer than .* 2 s"):
        raw_frames([example], max_seconds=2.0)
    frames = [np.zeros((20, 80))]  # 5 positions after 4x subsampling
    with pytest.raises(UserError, match=r"short.wav \(5 frames for 7 labels\)"):
        check_frames_hold_labels([{"path": "short.wav"}], frames, [[1, 2, 2, 3, 4, 5]], 2)


def test_manifest_problems_are_named_by_line(tmp_path):
    write_clip(tmp_path / "a.wav")
    manifest = tmp_path / "m.csv"
    manifest.write_text("audio,text\na.wav,hello there\nmissing.wav,hi\n,no path\na.wav,\n")
    with pytest.raises(UserError) as error:
        load_user_data(str(manifest), SpeechData())
    message = str(error.value)
    assert "3 manifest line(s)" in message and "m.csv line 3: no such file" in message
    assert "m.csv line 4: no audio path" in message and "m.csv line 5: empty transcript" in message
    manifest.write_text("path,sentence\na.wav,hello\n")
    with pytest.raises(UserError, match="has no column 'audio', 'text'"):
        load_user_data(str(manifest), SpeechData())
    manifest.write_text("path,sentence\na.wav,café 3\n")
    examples = load_user_data(str(manifest), SpeechData(audio_column="path", text_column="sentence"))
    example = next(e for split in examples.values() for e in split)
    # Digits are spelled out (as Whisper writes them and the corpus speaks them); 'é' stays foreign.
    with pytest.raises(UserError, match=r"m.csv line 2 \(a.wav\): the transcript 'café three' has .*: 'é' \("):
        featurizer().encode(example["text"], example["where"])


def test_folder_of_clips_with_transcripts(tmp_path):
    for name in ("one", "two", "three"):
        write_clip(tmp_path / f"{name}.flac")
        (tmp_path / f"{name}.txt").write_text(f"Say {name.upper()}!\n")
    splits = load_user_data(str(tmp_path), SpeechData())
    examples = [e for split in splits.values() for e in split]
    assert sorted(e["text"] for e in examples) == ["say one", "say three", "say two"]
    (tmp_path / "two.txt").unlink()
    with pytest.raises(UserError, match="two.txt"):
        load_user_data(str(tmp_path), SpeechData())


def test_a_missing_espeak_library_is_one_clear_message(monkeypatch):
    import espeakng_loader

    monkeypatch.setattr(espeakng_loader, "get_library_path", lambda: "/nonexistent/libespeak-ng.so")
    with pytest.raises(UserError, match="eSpeak NG"):
        espeak.Speaker()


def test_spec_augment_masks_are_seeded_and_applied():
    task = SpeechTask(config=SpeechTask.presets["tiny"](), data="synthetic")
    batch = {"inputs": np.ones((4, 50, 80), np.float16), "mask": np.ones((4, 50), bool)}
    first = task.augment(batch, np.random.default_rng((0, 7)), None)
    again = task.augment(batch, np.random.default_rng((0, 7)), None)
    np.testing.assert_array_equal(first["keep_bins"], again["keep_bins"])
    assert not first["keep_bins"].all() and first["keep_bins"].shape == (4, 80)


@pytest.mark.slow
def test_train_eval_predict_end_to_end(tmp_path):
    workdir = tmp_path / "run"
    steps = ["--set", "train.steps=20", "--set", "train.eval_every=20"]
    result = apps("train", "speech", "--preset", "tiny", "--data", "synthetic", "--workdir", workdir, *steps)
    assert result.exit_code == 0, result.output
    result = apps("eval", "speech", "--workdir", workdir, "--data", "synthetic", "--split", "test")
    assert result.exit_code == 0, result.output
    report = json.loads((workdir / "eval_test.json").read_text())
    assert {"wer", "cer", "beam"} <= set(report) and "wer/en-029" in report["baselines"]["pocketsphinx"]
    # A spoken clip of the test split (int16 at 16 kHz, read back exactly) and a tone at 22.05 kHz.
    spoken = SpeechTask(config=SpeechTask.presets["tiny"](), data="synthetic").examples("test")[0]["audio"]
    clips = [tmp_path / "a.wav", write_clip(tmp_path / "b.flac")]
    soundfile.write(clips[0], spoken, audio.SAMPLE_RATE)
    greedy = run.predict(SpeechTask, workdir, [str(c) for c in clips], {"--beam-width": "1"})
    searched = run.predict(SpeechTask, workdir, [str(c) for c in clips])  # the default: 8 beams
    assert [row["file"] for row in greedy] == [row["file"] for row in searched] == [str(c) for c in clips]
    # Each transcript is the CTC decoding of the model's frames for that file alone: the best
    # path merged and stripped of blanks, or the prefix beam search.
    loaded = run.load(SpeechTask, workdir)
    model = nnx.merge(loaded.steps.graphdef, loaded.params)
    featurizer = loaded.featurizer
    for clip, fast, slow in zip(clips, greedy, searched):
        arrays = featurizer(loaded.task.parse_inputs([str(clip)], {}))
        outputs = model({"inputs": arrays["inputs"], "mask": arrays["mask"]})
        log_probs = np.asarray(jax.nn.log_softmax(outputs.logits[0]))[: int(outputs.mask[0].sum())]
        assert fast["transcript"] == featurizer.decode(ctc.collapse(log_probs.argmax(-1))), clip
        assert slow["transcript"] == featurizer.decode(ctc.prefix_beam_search(log_probs, 8)), clip
    # The CLI prints those transcripts (on a terminal wide enough that no cell is cut).
    result = apps("predict", "speech", "--workdir", workdir, *clips, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert table_rows(result.output) == [[row["file"], row["transcript"]] for row in searched]
    result = apps("predict", "speech", "--workdir", workdir, tmp_path / "nothing.wav")
    assert result.exit_code == 1 and "no such audio file" in result.output and "Traceback" not in result.output
    result = apps("predict", "speech", "--workdir", workdir, clips[0], "--prompt", "Five thirty.")
    assert result.exit_code == 1 and "--prompt is Whisper's earlier text" in result.output


def test_sentencepiece_units_round_trip(tmp_path):
    from tasks.speech.featurizer import fit_featurizer

    train = corpus.load_corpus("synthetic")["train"]
    fitted = fit_featurizer(train, SpeechData(units="pieces", vocab_size=30))
    fitted.save(tmp_path)
    loaded = SpeechFeaturizer.load(tmp_path, SpeechData(units="pieces"))
    ids = loaded.encode("three oh seven", "here")
    assert 0 not in ids and loaded.decode(ids) == "three oh seven" and loaded.vocab_size == fitted.vocab_size
