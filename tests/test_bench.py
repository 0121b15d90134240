"""`apps bench` runs: the core's own decoders on random weights, and a pretrained decoder's decode
and fine-tuning speed (the tiny GGUF of tests/tiny_gguf.py here)."""

import json

import pytest
from helpers import apps
from tiny_gguf import write_tiny_gguf

from core.bench import checkpoint, decode


def test_decoding_on_random_weights_runs_and_times_the_tokens_after_the_prompt_apart():
    """Beside the whole call's rate, the rate after the prompt (llama-bench's tg): the 127 tokens
    after the first over the call's time less that of a call that stops at the first token."""
    result = decode.run_decode(decode.DecodeRun("small", 1, True, calls=1))
    assert result["new_tokens"] == decode.NEW_TOKENS and result["new_tokens_per_s"] > 0
    assert 0 < result["prompt_s"] < result["call_s"]
    after = (decode.NEW_TOKENS - 1) / (result["call_s"] - result["prompt_s"])
    assert result["after_prompt_tokens_per_s"] == pytest.approx(after)


def test_a_pretrained_decoders_decode_and_finetune_speed(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    result = apps("bench", "decode", "--model", tiny, "--json", tmp_path / "decode.json")
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "decode.json").read_text())
    figures = written["decode"]
    assert written["device"]["platform"] == "cpu" and written["device"]["device_count"] == 8
    assert [(r["batch_size"], r["dtype"]) for r in figures] == list(checkpoint.PRETRAINED_DECODE)
    result = apps("bench", "finetune", "--model", tiny, "--steps", 1, "--json", tmp_path / "finetune.json")
    assert result.exit_code == 0, result.output
    figures = json.loads((tmp_path / "finetune.json").read_text())["finetune"]
    runs = [(r["lora_rank"], r["products"]) for r in figures]
    rank = checkpoint.LORA_RANK
    assert runs == [(0, "float32"), (0, "bfloat16"), (rank, "float32"), (rank, "bfloat16")]
    assert all(r["tokens_per_s"] > 0 for r in figures)


def test_the_transcription_benchmark_needs_a_whisper_model():
    result = apps("bench", "transcribe")
    assert (
        result.exit_code == 1 and "apps bench transcribe needs --model (whisper-tiny.en, whisper-base)" in result.output
    )


def test_the_train_step_benchmark_runs(tmp_path):
    """`make bench` (the README's): the core's train step compiled ahead of time and timed."""
    result = apps("bench", "train", "small", "--steps", 1, "--json", tmp_path / "bench.json")
    assert result.exit_code == 0, result.output
    (figures,) = json.loads((tmp_path / "bench.json").read_text())["train"]
    assert figures["tokens_per_s"] > 0 and figures["compile_s"] > 0
    # Model FLOPs as MaxText counts them: 6N, and the small decoder's causal attention at half
    # (4 layers, d 256, 256 positions); MFU against the measured product and, off a CPU, the chip.
    assert figures["flops_per_token"] == 6 * figures["params"] + 12 * 4 * 256 * 256 / 2
    assert figures["achieved_flops"] == pytest.approx(figures["flops_per_token"] * figures["tokens_per_s"])
    assert figures["mfu"] == pytest.approx(figures["achieved_flops"] / figures["peak_flops"])
    assert figures["platform"] == "cpu" and figures["device_count"] == 8 and figures["mfu_chip"] is None
    assert figures["products"] == "float32"  # a CPU's default
