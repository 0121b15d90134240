"""`apps export` (core/export.py): a fine-tuned decoder run as a Hugging Face folder or a GGUF
file. Round trips through the suite's own readers give the run's parameters; the tiny Llama's
export reads in transformers and llama.cpp as the suite reads it (tests/fixtures/export/,
made once by make_export_reference.py there); Whisper leaves as CTranslate2 wrote it; the
refusals name what is wrong."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import apps, plain, pretrained_decoder
from test_hf_decoders import FIXTURES as HF_FIXTURES
from test_hf_decoders import folder as hf_fixture
from test_pretrained import model_of
from test_whisper import installed
from tiny_gguf import CHATML

import tasks
from core import export, run
from core.checkpoints import gguf_files, pretrained, whisper
from core.checkpoints.rules import flat_params
from core.errors import UserError
from core.generation import generate
from core.loading import Loaded, load_pretrained, make_config
from core.model import lora
from core.training.steps import build_model, make_steps
from tasks.common.tokenizer import PretrainedTokenizer
from tasks.nlp.lm import LMTask
from tasks.nlp.sentiment import SentimentTask
from tasks.speech.asr import SpeechTask

REFERENCE = "tests/fixtures/export/reference.npz"


@pytest.fixture(scope="module")
def lora_run(tiny, tmp_path_factory):
    """A LoRA run on the tiny Llama: its adapters trained for 8 steps."""
    workdir = tmp_path_factory.mktemp("run")
    data = workdir / "corpus.txt"
    data.write_text("the theme of the thing is the thread.\n" * 100)
    overrides = [f"model.pretrained={str(tiny)!r}", "model.lora_rank=2", "optim.learning_rate=0.05", "train.steps=8"]
    run.train(LMTask, workdir=workdir, preset="tiny", overrides=overrides, data=str(data))
    return workdir


@pytest.fixture(scope="module")
def merged(lora_run):
    """The run's parameters with its adapters folded in, and the model holding them."""
    loaded = run.load(LMTask, lora_run)
    model = loaded.steps.model(loaded.params)
    assert lora.merge(model) == 2 * 4
    return {path: np.asarray(value) for path, value in flat_params(model).items()}, model


def logits(model, ids) -> np.ndarray:
    ids = jnp.asarray([ids], jnp.int32)
    return np.asarray(model({"inputs": ids, "mask": jnp.ones(ids.shape, bool)}).logits()[0])


def greedy(model, ids, count: int) -> list[int]:
    """`count` greedy tokens after `ids`, no stop token (as the references decode)."""
    return generate.generate(model, [ids], max_new_tokens=count).tokens[0, :count].tolist()


def same_parameters(model, params: dict) -> None:
    found = {path: np.asarray(value) for path, value in flat_params(model).items()}
    kept = {path: value for path, value in params.items() if path.rsplit(".", 1)[-1] not in lora.ADAPTERS}
    assert set(found) == set(kept)
    for path, value in kept.items():
        np.testing.assert_array_equal(found[path], value, err_msg=path)


def test_the_hugging_face_folder_reads_back_as_the_run(lora_run, merged, tmp_path, tiny):
    exported = export.export(LMTask, lora_run, "hf", tmp_path / "hf")
    assert (exported.adapters, exported.source) == (8, str(tiny))
    assert sorted(exported.files) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    _, model, report = pretrained_decoder(str(tmp_path / "hf"))
    assert report.new == () and report.unused == ()
    same_parameters(model, merged[0])
    # The tokenizer, its special tokens, stop ids and chat template come along.
    back, source = (
        PretrainedTokenizer.from_checkpoint(str(tmp_path / "hf")),
        PretrainedTokenizer.from_checkpoint(str(tiny)),
    )
    assert back.pieces(["the theme, <|im_end|>"]) == source.pieces(["the theme, <|im_end|>"])
    assert (back.bos_id, back.eos_id, back.stop_ids, back.chat_template) == (1, 2, (2,), CHATML)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["max_position_embeddings"], config["rms_norm_eps"]) == (
        ["LlamaForCausalLM"],
        128,  # the checkpoint's context, not the run's rows
        1e-05,
    )


def test_the_float32_gguf_reads_back_as_the_run_with_its_metadata(lora_run, merged, tmp_path, tiny):
    export.export(LMTask, lora_run, "gguf", tmp_path / "run.gguf")
    _, model, _ = pretrained_decoder(str(tmp_path / "run.gguf"))
    same_parameters(model, merged[0])  # the rotary rows permuted for llama.cpp and back
    # Predicting (and so `apps serve --model run.gguf`) with the file answers as the run does.
    options = {"max_new_tokens": 8}
    from_file = tasks.pipeline("lm", model=str(tmp_path / "run.gguf")).predict(["the theme"], **options)
    assert from_file == tasks.pipeline("lm", workdir=lora_run).predict(["the theme"], **options)
    written, source = gguf_files.reader(tmp_path / "run.gguf"), gguf_files.reader(tiny)
    assert written.fields["general.file_type"] == 0
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "llama.context_length"):
        assert written.fields[key] == source.fields[key]
        assert written.types[key] == source.types[key]


@pytest.mark.parametrize(
    ("dtype", "tolerance", "file_type"), [("float16", 0.02, 1), ("bfloat16", 0.1, 32), ("q8_0", 0.1, 7)]
)
def test_narrower_ggufs_stay_within_their_rounding(lora_run, merged, tmp_path, dtype, tolerance, file_type):
    export.export(LMTask, lora_run, "gguf", tmp_path / "run.gguf", dtype=dtype)
    assert gguf_files.reader(tmp_path / "run.gguf").fields["general.file_type"] == file_type
    _, model, _ = pretrained_decoder(str(tmp_path / "run.gguf"))
    ids = [1, 71, 76, 73, 260, 263, 76, 73]
    expected = logits(merged[1], ids)
    found = logits(model, ids)
    # The largest logit error over the spread of the logits: float16 keeps 11 bits, bfloat16 8,
    # Q8_0 8 bits a block of 32 with a float16 scale.
    error = np.abs(found - expected).max() / np.ptp(expected)
    assert 0 < error < tolerance
    assert (found.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_transformers_and_llama_cpp_read_the_export_as_the_suite_does(tiny, tmp_path):
    """The tiny Llama (its GGUF's rotary rows put back in Hugging Face's order) exported: the
    logits that transformers computed from the folder, the continuation llama.cpp decoded from
    the GGUF, against the suite's model."""
    loaded = load_pretrained(LMTask, str(tiny), whole_context=True)
    model = loaded.steps.model(loaded.params)
    reference = np.load(REFERENCE)
    ids = reference["ids"].tolist()
    np.testing.assert_allclose(logits(model, ids), reference["logits"], atol=1e-4, rtol=1e-4)
    continuation = greedy(model, ids, len(reference["greedy"]))
    assert continuation == reference["greedy"].tolist() == reference["llama_cpp"].tolist()
    # At every step of that continuation, llama.cpp's five likeliest tokens and their
    # log-probabilities are the suite's (a rotary row order left unpermuted moves them by 0.1-1).
    steps = np.asarray(jax.nn.log_softmax(logits(model, ids + continuation)[len(ids) - 1 : -1]))
    top = np.argsort(-steps, axis=-1)[:, :5]
    np.testing.assert_array_equal(top, reference["top_ids"])
    np.testing.assert_allclose(np.take_along_axis(steps, top, -1), reference["top_logprobs"], atol=1e-4)
    # And the files the reference was made from are what export writes today.
    export.written(loaded, "tiny", "hf", tmp_path / "hf", "float32")
    _, again, _ = pretrained_decoder(str(tmp_path / "hf"))
    np.testing.assert_array_equal(logits(again, ids), logits(model, ids))


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_a_hugging_face_checkpoint_exports_as_transformers_wrote_it(name, tmp_path):
    path = hf_fixture(name, tmp_path)
    export.written(load_pretrained(LMTask, path, whole_context=True), name, "hf", tmp_path / "out", "float32")
    original = pretrained.read_tensors(tmp_path / name / "model.safetensors")
    written = pretrained.read_tensors(tmp_path / "out" / "model.safetensors")
    assert set(written) == set(original)
    for key, value in original.items():
        # Exact, but Gemma's norm weights: read as 1 + w in float32 and written as that - 1,
        # they come back within one step of float32 at 1.
        np.testing.assert_allclose(written[key], value, rtol=0, atol=float(np.spacing(np.float32(1))), err_msg=key)
    # Every field transformers wrote that says how to run the weights, as it wrote it.
    theirs = json.loads((tmp_path / name / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    theirs_rope = (theirs.get("rope_parameters") or {}).get("rope_theta") or theirs.get("rope_theta")
    if name == "gemma3":
        theirs_rope = theirs["rope_parameters"]["full_attention"]["rope_theta"]
        assert ours["rope_local_base_freq"] == theirs["rope_parameters"]["sliding_attention"]["rope_theta"]
    assert ours["rope_theta"] == theirs_rope
    shared = set(ours) & set(theirs) - {"torch_dtype", "dtype", "transformers_version", "rope_theta"}
    assert shared >= {"hidden_size", "num_key_value_heads", "intermediate_size", "vocab_size", "model_type"}
    assert {key: ours[key] for key in shared} == {key: theirs[key] for key in shared}
    assert np.load(f"{HF_FIXTURES}/{name}/reference.npz")["logits"].shape[-1] == ours["vocab_size"]


def test_refusals_name_what_is_wrong(lora_run, tmp_path):
    with pytest.raises(UserError, match="--format onnx: expected one of hf"):
        export.export(LMTask, lora_run, "onnx", tmp_path / "x")
    with pytest.raises(UserError, match="--dtype q4_0: a GGUF file holds float32, float16, bfloat16, q8_0"):
        export.export(LMTask, lora_run, "gguf", tmp_path / "x", dtype="q4_0")
    with pytest.raises(UserError, match="--dtype q8_0: a Hugging Face folder holds float32, bfloat16, float16"):
        export.export(LMTask, lora_run, "hf", tmp_path / "x", dtype="q8_0")
    with pytest.raises(UserError, match="is or holds the run"):
        export.export(LMTask, lora_run, "hf", lora_run.parent, force=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "config.json").write_text(json.dumps(LMTask.presets["tiny"]().to_dict()))
    with pytest.raises(
        UserError, match="its lm run was trained from scratch .* decoder runs as hf, gguf, peft; whisper runs as ct2"
    ):
        export.export(LMTask, scratch, "hf", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_an_existing_out_is_kept_without_force_and_whole_on_a_failure(lora_run, tmp_path, monkeypatch):
    out = tmp_path / "run.gguf"
    out.write_text("someone's file")
    result = apps("export", "--workdir", lora_run, "--format", "gguf", "--out", out)
    assert result.exit_code == 1 and f"--out {out} exists: give --force" in plain(result.output)

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(export.gguf_writer, "write", broken)
    with pytest.raises(OSError, match="disk full"):
        export.export(LMTask, lora_run, "gguf", out, force=True)
    assert out.read_text() == "someone's file" and sorted(p.name for p in tmp_path.iterdir()) == ["run.gguf"]
    monkeypatch.undo()
    result = apps("export", "--workdir", lora_run, "--format", "gguf", "--out", out, "--dtype", "q8_0", "--force")
    assert result.exit_code == 0, result.output
    assert "(gguf, q8_0" in plain(result.output) and "8 LoRA layers folded in" in plain(result.output)
    assert gguf_files.reader(out).fields["general.file_type"] == 7


def test_a_whisper_checkpoint_exports_to_its_own_bytes_and_a_changed_one_reads_back(tmp_path):
    """Whisper leaves as a CTranslate2 folder: the shipped tiny.en (float16) exported unchanged
    is its own model.bin byte for byte; with every weight changed, the float32 folder reads back
    into those weights. (A fine-tuned run's export decodes in CTranslate2 itself to the suite's
    greedy ids: the issue's closing note, measured once with ctranslate2 4.8.5.)"""
    name = installed("whisper-tiny.en")
    loaded = load_pretrained(SpeechTask, name)
    exported = export.written(loaded, name, "ct2", tmp_path / "same", "float16")
    source = pretrained.read_checkpoint(name).directory
    assert sorted(exported.files) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.txt"]
    assert (tmp_path / "same" / "model.bin").read_bytes() == (source / "model.bin").read_bytes()
    # Changed in numpy: eager jax.numpy would compile an add for every parameter shape (3 s).
    changed = jax.tree.map(lambda p: np.asarray(p) + np.float32(0.01) * np.sign(np.asarray(p)), loaded.params)
    export.written(dataclasses.replace(loaded, params=changed), name, "ct2", tmp_path / "changed", "float32")
    model, _ = whisper.load(str(tmp_path / "changed"))
    expected = flat_params(loaded.steps.model(changed))
    for path, value in flat_params(model).items():
        np.testing.assert_array_equal(value, expected[path], err_msg=path)
    with pytest.raises(UserError, match="--format gguf: a whisper run leaves as ct2"):
        export.written(loaded, name, "gguf", tmp_path / "x.gguf", "float32")


SENTIMENT_TEXTS = [
    "Lovely fabric, fits well",
    "The zipper broke after two days and the seller never answered.",
    "It is okay, nothing special, runs a bit small.",
    "Absolutely love it! Wearing it every day.",
    "Terrible quality, returned it immediately.",
]


def sentiment_model() -> Loaded:
    """The sentiment task's minilm preset as a run never trained: MiniLM's weights, a new classifier."""
    config = make_config(SentimentTask, "minilm", ["model.dropout=0.0"])
    task = SentimentTask(config=config)
    featurizer = task.fit_featurizer([])
    model = build_model(task, featurizer, config, from_pretrained=True)
    steps = make_steps(task, model, config, config.train.steps, training=False)
    return Loaded(task, featurizer, steps, steps.state["params"], "minilm")


def classifier_head(loaded):
    """The sentiment model's classifier set from RandomState(0), as the reference's was."""
    rng = np.random.RandomState(0)
    kernel, bias = (rng.standard_normal(shape).astype(np.float32) for shape in ((384, 2), (2,)))
    params = {**loaded.params, "head": {"linear": {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}}}
    return dataclasses.replace(loaded, params=params)


def test_a_sentiment_run_leaves_as_the_sentence_transformers_pipeline_it_is(tmp_path):
    """MiniLM under a classifier: the folder's encoder reads back as the run's, and
    sentence-transformers computes the run's probabilities from it (tests/fixtures/export/
    sentiment_reference.npz, made once by make_sentiment_reference.py there)."""
    reference = np.load("tests/fixtures/export/sentiment_reference.npz")
    loaded = classifier_head(sentiment_model())
    export.written(loaded, "minilm", "hf", tmp_path / "out", "float32")
    assert json.loads((tmp_path / "out" / "modules.json").read_text())[1]["path"] == "1_Pooling"
    ids, mask = loaded.featurizer.tokenizer.encode(SENTIMENT_TEXTS, loaded.featurizer.max_len)
    model = loaded.steps.model(loaded.params)
    found = jax.nn.softmax(model({"inputs": jnp.asarray(ids), "mask": jnp.asarray(mask, bool)}), -1)
    np.testing.assert_allclose(found, reference["probabilities"], atol=1e-5)
    assert list(loaded.featurizer.classes) == reference["labels"].tolist()
    # The encoder read back from the folder: the run's parameters, its position table whole.
    config = pretrained.architecture(str(tmp_path / "out"), dropout=0.0)
    back = model_of(config)
    report = pretrained.load(back, str(tmp_path / "out"))
    assert sorted(report.unused) == ["pooler.dense.bias", "pooler.dense.weight"]  # the source's, kept for AutoModel
    ours, found = flat_params(model), flat_params(back)
    for path in report.filled:
        if path != "body.position_embedding.embedding":
            np.testing.assert_array_equal(found[path], ours[path], err_msg=path)
    table = np.asarray(back.body.position_embedding.embedding[...])
    np.testing.assert_array_equal(table[:128], ours["body.position_embedding.embedding"])
    assert table.shape == (512, 384)


def test_peft_adapters_over_the_exported_base_make_the_merged_weights(lora_run, tiny, tmp_path):
    """`--format peft`: PEFT adds B (A x) alpha / r to each projection of the base folder that
    `apps export --model` writes; done by hand here, that is the merged export, tensor by tensor.
    (PEFT 0.21.2 itself, once: its logits over the base equal the merged folder's to 8e-6.)"""
    result = apps("export", "--model", tiny, "--format", "hf", "--out", tmp_path / "base")
    assert result.exit_code == 0 and "from the checkpoint" in plain(result.output), result.output
    export.export(LMTask, lora_run, "peft", tmp_path / "adapter")
    export.export(LMTask, lora_run, "hf", tmp_path / "merged")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (2, 16.0, "LORA")
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    base, merged = (pretrained.read_tensors(tmp_path / name / "model.safetensors") for name in ("base", "merged"))
    adapter = pretrained.read_tensors(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 2 * 7  # two layers, seven projections, A and B
    scale = config["lora_alpha"] / config["r"]
    for name, weight in base.items():
        stem = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{stem}.lora_A.weight" in adapter:
            weight = weight + adapter[f"{stem}.lora_B.weight"] @ adapter[f"{stem}.lora_A.weight"] * scale
        np.testing.assert_allclose(merged[name], weight, atol=1e-6, err_msg=name)
    with pytest.raises(UserError, match="writes the adapters of a LoRA run .* this model has none"):
        export.export_checkpoint(LMTask, str(tiny), "peft", tmp_path / "nothing")
