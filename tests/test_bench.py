"""`apps bench` runs: the core's own decoders on random weights, and a pretrained decoder's decode
and fine-tuning speed (the tiny GGUF of tests/tiny_gguf.py here)."""

import json

from helpers import apps
from tiny_gguf import write_tiny_gguf

from core.bench import speed as bench


def test_decoding_on_random_weights_runs():
    result = bench.run_decode(bench.DecodeRun("small", 1, True, calls=1))
    assert result["new_tokens"] == bench.NEW_TOKENS and result["new_tokens_per_s"] > 0


def test_a_pretrained_decoders_decode_and_finetune_speed(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    result = apps("bench", "--model", tiny, "--steps", 1, "--json", tmp_path / "bench.json")
    assert result.exit_code == 0, result.output
    figures = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["batch_size"], r["dtype"]) for r in figures["decode"]] == list(bench.PRETRAINED_DECODE)
    runs = [(r["lora_rank"], r["products"]) for r in figures["finetune"]]
    assert runs == [(0, "float32"), (0, "bfloat16"), (bench.LORA_RANK, "float32"), (bench.LORA_RANK, "bfloat16")]
    assert all(r["tokens_per_s"] > 0 for r in figures["finetune"])
    assert "finetune" in apps("bench", "nonsense", "--model", tiny).output


def test_the_transcription_benchmark_needs_a_whisper_model():
    result = apps("bench", "transcribe")
    assert (
        result.exit_code == 1 and "apps bench transcribe needs --model (whisper-tiny.en, whisper-base)" in result.output
    )


def test_the_train_step_benchmark_runs(tmp_path):
    """`make bench` (the README's): the core's train step compiled ahead of time and timed."""
    result = apps("bench", "small", "--steps", 1, "--json", tmp_path / "bench.json")
    assert result.exit_code == 0, result.output
    (figures,) = json.loads((tmp_path / "bench.json").read_text())["train"]
    assert figures["tokens_per_s"] > 0 and figures["compile_s"] > 0
