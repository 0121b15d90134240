"""The contract between the core and a task, and the batch conventions.

A task is a final frozen dataclass holding its `Config` and the user's `--data` spec. It supplies
only the edges of a pipeline: raw examples, a featurizer that turns them into arrays, an
embedder and a head around the shared body, a loss, streamed metrics, decoding and host-side
scoring. The core owns the body, the loop, sharding, checkpoints, logging and the CLI.

Batches are dicts of arrays with a leading batch axis B:

- `inputs`   [B, T] (or [B, T, F] for features): what the embedder reads;
- `mask`     [B, T] bool: true at real positions, false at padding;
- `targets`  [B] or [B, T]: what the loss compares with;
- `target_mask` [B, T] bool, optional: which target positions count;
- `weights`  [B] float: 1 for real examples, 0 for the rows that pad a last partial batch.

An encoder-decoder task (its `model` hook builds a `core.model.encoder_decoder.EncoderDecoder`) reads
`inputs` and `mask` as the source and adds the target side:

- `decoder_inputs` [B, U]: the targets shifted right, starting with the beginning-of-sequence
  token: what the decoder reads at each target position;
- `decoder_mask` [B, U] bool: true at real target positions;
- `targets` [B, U]: the token to predict at each target position (the last one an
  end-of-sequence token), with `target_mask` [B, U] marking the positions the loss counts.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jax
import numpy as np
from flax import nnx

from core.config import Config
from core.errors import UserError
from core.metrics import Streamed
from core.options import PredictOption, RequestLimits

Batch = dict[str, Any]
Example = dict[str, Any]


def scored_positions(batch: Batch) -> jax.Array:
    """Which target positions a per-position loss or metric counts: `target_mask` [B, T] at the
    rows that are real (weight > 0), not at those that pad a last partial batch."""
    return batch["target_mask"] & (batch["weights"][:, None] > 0)


class Trainable(Protocol):
    """What the core's compiled steps read of a task (`core.training.steps.build_model` and
    `make_steps`): its config, model, loss, streamed metrics, decoding and on-device
    augmentation. Every `Task` is one; a benchmark's model over random tokens
    (`core.bench.causal.CausalLM`) is one without data, featurizer or scores."""

    config: Config

    def model(self, featurizer: Any, config: Config, rngs: nnx.Rngs) -> nnx.Module: ...

    def loss(self, outputs: Any, batch: Batch) -> tuple[jax.Array, jax.Array]: ...

    def metrics(self, outputs: Any, batch: Batch) -> Streamed: ...

    def decode(self, outputs: Any, batch: Batch) -> dict[str, jax.Array]: ...

    def augment_on_device(self, batch: Batch) -> Batch: ...


class Featurizer(Protocol):
    """Learned preprocessing (tokenizer, label map): fitted on the training split, saved in the
    workdir, and turning examples into a numpy batch."""

    def save(self, directory: Path) -> None: ...

    def __call__(self, examples: Sequence[Example]) -> Batch: ...


class ToolFormat(Protocol):
    """How a chat model writes calls to the functions offered it: the text a call opens with,
    calls read back from an answer, and the grammar (llguidance's Lark) of an answer that is
    calls alone, for a call the request forces."""

    OPENING: str

    def parse(self, text: str, names: Collection[str]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
        """The answer's text besides its calls to the functions `names`, and the calls."""

    def grammar(self, functions: Sequence[dict[str, Any]], parallel: bool) -> str:
        """The grammar of one call (or with `parallel`, one or more) to one of `functions`."""


class ChatTokenizer(Protocol):
    """What the server reads of a completing featurizer's tokenizer: its chat template (None:
    the model takes no conversations) and tool-call format, the ids that end a generation, and
    itself as a Hugging Face tokenizer.json, for answers kept to a grammar (None where it is none)."""

    chat_template: str | None
    tool_format: ToolFormat | None
    stop_ids: Sequence[int]

    def tokenizer_json(self) -> str | None: ...


class CompletingFeaturizer(Featurizer, Protocol):
    """The featurizer of a task that `completes` (`apps serve` gives it OpenAI's routes): texts and
    conversations to the ids a decoder continues, and new ids back to text."""

    tokenizer: ChatTokenizer

    def prompt(self, example: Example, system: str = "") -> list[int]:
        """The ids a generation continues: a conversation (`messages`) rendered with the chat
        template (with `system` as its system message if given, and the function definitions
        of `tools` offered), or a text. Control tokens typed in a message's content are text
        unless the example says `content_markers`."""

    def continuation(self, prompt: Sequence[int], new: Sequence[int]) -> str:
        """The text that the `new` ids add after `prompt`."""


class Task(abc.ABC):
    """What every registered task implements. Tasks subclass it: the abstract hooks are
    required (a registered task lacking one fails when its module is imported, naming it), the
    others keep their defaults unless a task overrides them. A registered task is marked
    `@final`: nothing subclasses it, so that what it declares is what runs."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        sealed = [base.__name__ for base in cls.__mro__[1:] if base.__dict__.get("__final__")]
        if sealed:
            raise TypeError(f"{cls.__name__} subclasses the final task {sealed[0]}; share a base class instead.")

    name: ClassVar[str]
    summary: ClassVar[str]
    model_summary: ClassVar[str]
    default_data: ClassVar[str]
    metric_names: ClassVar[tuple[str, ...]]
    # The validation metric that picks the `best/` checkpoint, and its direction.
    best_metric: ClassVar[str]
    lower_is_better: ClassVar[bool] = False
    # Preset name -> function returning the full Config; at least "tiny" and "base".
    presets: ClassVar[dict[str, Callable[[], Config]]]
    default_preset: ClassVar[str]
    # The frozen dataclass type of `Config.data` for this task.
    data_type: ClassVar[type]
    # The prompts of the presets that prompt a pretrained decoder, by preset (`apps tasks` shows them).
    prompts: ClassVar[dict[str, str]] = {}

    config: Config
    data: str | None

    @abc.abstractmethod
    def examples(self, split: str) -> list[Example]:
        """The split ("train", "valid", "test") of the task's data, as raw examples."""

    @abc.abstractmethod
    def fit_featurizer(self, train: Sequence[Example]) -> Featurizer:
        """A new featurizer fitted on the training examples."""

    @abc.abstractmethod
    def load_featurizer(self, directory: Path) -> Featurizer:
        """The featurizer a run saved under `directory`."""

    def model(self, featurizer: Featurizer, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        """The whole model: a module called as `model(batch, dropout_key=...)` that returns what
        `loss`, `metrics` and `decode` read. The default is the core's composition
        `Model(embedder, Transformer, head)` from the task's `embedder` and `head`; a task of
        another shape (an `EncoderDecoder`) overrides `model` instead of those two."""
        from core.model.transformer import Model, Transformer  # the contract module stays light to import

        embedder = self.embedder(featurizer, rngs)
        body = Transformer(config.model, remat=config.train.remat, rngs=rngs)
        return Model(embedder, body, self.head(featurizer, embedder, rngs))

    def embedder(self, featurizer: Featurizer, rngs: nnx.Rngs) -> nnx.Module:
        """The front end of the default composition: (`inputs`, `mask`) -> (x [B, T', D], mask
        [B, T']); T' may differ from T (a strided convolution over frames shortens it)."""
        raise NotImplementedError(f"{type(self).__name__} builds its own model.")

    def head(self, featurizer: Featurizer, embedder: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
        """The head of the default composition: hidden states [B, T, D] and the mask -> the
        task's outputs."""
        raise NotImplementedError(f"{type(self).__name__} builds its own model.")

    @abc.abstractmethod
    def loss(self, outputs: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """(sum of weighted losses, sum of weights) over the batch."""

    @abc.abstractmethod
    def metrics(self, outputs: Any, batch: Batch) -> Streamed:
        """On-device metrics as (numerator, denominator) pairs."""

    @abc.abstractmethod
    def decode(self, outputs: Any, batch: Batch) -> dict[str, jax.Array]:
        """Predictions per batch row (an example, or for packing tasks such as lm a packed row),
        on device; one leading batch axis per array."""

    @abc.abstractmethod
    def score(
        self, predictions: dict[str, np.ndarray], examples: Sequence[Example], featurizer: Featurizer
    ) -> dict[str, float]:
        """Host-side metrics of decoded predictions against the examples' references."""

    @abc.abstractmethod
    def baselines(
        self, train: Sequence[Example], test: Sequence[Example], featurizer: Featurizer
    ) -> dict[str, dict[str, float]]:
        """Classical reference models fitted on `train` and scored like `score` on `test`."""

    @abc.abstractmethod
    def protocol(self) -> dict[str, str]:
        """{"dataset": ..., "protocol": ...}: what a reported number was measured on, and how."""

    # The `apps predict` options the task takes; their values reach `parse_inputs` (and, for a
    # generating task, the generation settings) by name.
    predict_options: ClassVar[tuple[PredictOption, ...]] = ()
    # True for tasks whose `apps predict` generates tokens (`generate`, through core.generation.generate)
    # instead of decoding one forward pass.
    generates: ClassVar[bool] = False
    # True for a task that predicts with a pretrained checkpoint as it is (`apps predict TASK
    # --model NAME`, core/run.py `load_pretrained`): its `fit_featurizer([])` is the checkpoint's.
    zero_shot: ClassVar[bool] = False
    # `--set` overrides for a checkpoint used as it is, where the task's fine-tuning presets
    # choose otherwise for speed (speech: Whisper reads in its own 30 s windows; the Whisper
    # presets train on 10 s).
    zero_shot_overrides: ClassVar[tuple[str, ...]] = ()
    # True for a language-modelling task whose featurizer is a `CompletingFeaturizer` (texts and
    # conversations into the ids a decoder continues): `apps serve` gives its runs OpenAI's
    # completion endpoints (core.serving.completions), continuously batched.
    completes: ClassVar[bool] = False

    def generate(
        self,
        model: nnx.Module,
        featurizer: Featurizer,
        examples: Sequence[Example],
        options: dict[str, Any],
        on_text: Callable[[str], None] | None = None,
    ) -> dict[str, Any]:
        """For a generating task: predictions (as `render` reads them) for the examples, the
        options being its `predict_options`' values; `on_text` receives the first example's new
        text piece by piece as it is produced, for a terminal to stream."""
        raise NotImplementedError(f"{self.name} does not generate.")

    def embed(
        self, model: nnx.Module, featurizer: Featurizer, examples: Sequence[Example], per_position: bool = False
    ) -> list[np.ndarray]:
        """For `apps embed TASK --workdir DIR`: each example's embedding [D] from the model's body
        (or [L, D], one per position, with `per_position`)."""
        raise UserError(f"apps embed does not read {self.name} runs.")

    # Output formats of its own beside the tables' (`apps predict TASK --format NAME`), each
    # writing one document per row: speech's subtitles (srt, vtt).
    formats: ClassVar[dict[str, Callable[[dict], str]]] = {}

    # Named decodings, as values of `predict_options` ({"greedy": {"beams": 1}, "beam": {"beams":
    # 4}}), under which `apps eval` generates for the split and reports `score_generated` side by
    # side. Empty, the default: evaluation is the forward pass alone.
    evaluated_decodings: ClassVar[dict[str, dict[str, Any]]] = {}
    # The decoding (values of `predict_options`) whose `score_generated` metrics join each
    # validation during training, for a task whose best metric needs generated outputs (Whisper's
    # WER); None, the default: validation is the forward pass and `score` alone.
    validation_decoding: ClassVar[dict[str, Any] | None] = None

    def score_generated(
        self, generated: dict[str, Any], examples: Sequence[Example], featurizer: Featurizer
    ) -> dict[str, float]:
        """Host-side metrics of `generate`'s predictions against the examples' references."""
        raise NotImplementedError(f"{self.name} does not score generated text.")

    # Training batches of rows of similar lengths, cut to their longest row (core.training.data): {mask
    # key: the keys whose second axis that mask measures}. Empty, the default: every batch keeps
    # the featurizer's width.
    trim: ClassVar[dict[str, tuple[str, ...]]] = {}

    def featurize_train(self, featurizer: Featurizer, examples: Sequence[Example]) -> Batch:
        """The training split's arrays. The default featurizes them as any split; a task whose
        training rows differ (whole sequences that `augment` crops at random, where evaluation
        reads sliding windows) overrides it."""
        return featurizer(examples)

    # The batch masks whose true entries count as tokens read, for throughput in the log: the
    # inputs' mask, and for an encoder-decoder the decoder's too.
    token_masks: ClassVar[tuple[str, ...]] = ("mask",)

    def augment_on_device(self, batch: Batch) -> Batch:
        """Applied inside the jitted train step to each training batch before the model reads it
        (never to evaluation batches): what is cheaper on the device than on the host, such as
        applying SpecAugment's masks to the frames. The default leaves the batch as it is."""
        return batch

    def augment(self, batch: Batch, rng: np.random.Generator, featurizer: Featurizer) -> Batch:
        """Applied to each global training batch with a generator seeded by (seed, step): random
        masking, negative sampling (over the featurizer's vocabulary). The default leaves the
        batch as it is."""
        return batch

    @abc.abstractmethod
    def parse_inputs(self, lines: Sequence[str], options: dict[str, Any]) -> list[Example]:
        """Examples from the lines a user gives `apps predict` and the values of `predict_options`."""

    def parse_request(
        self, inputs: Sequence[str], options: dict[str, Any], limits: RequestLimits = RequestLimits()
    ) -> list[Example]:
        """Examples from the inputs of a request to `apps serve`: as `parse_inputs`, except that
        no input is ever read as a path on the server (a task whose `parse_inputs` opens files
        overrides this), and each within `limits`."""
        return self.parse_inputs(inputs, options)

    @abc.abstractmethod
    def render(
        self, predictions: dict[str, np.ndarray], examples: Sequence[Example], featurizer: Featurizer
    ) -> list[dict[str, Any]]:
        """One row per prediction, column -> a typed value: text, a probability or score as a
        float, a rank or position as an int, a list of them. `apps predict --format json` writes
        these values as they are; only its table rounds them for people."""


def final(cls: type[Task]) -> type[Task]:
    """Marks a concrete, registered task: checks at import that it implements every required
    hook (and either `model` or both `embedder` and `head`), and seals it against subclassing."""
    missing = sorted(inspect.getattr_static(cls, "__abstractmethods__", ()))
    if missing:
        raise TypeError(f"Task {cls.__name__} does not implement the required hook(s) {', '.join(missing)}.")
    if cls.model is Task.model and (cls.embedder is Task.embedder or cls.head is Task.head):
        raise TypeError(f"Task {cls.__name__} must implement `model`, or both `embedder` and `head`.")
    cls.__final__ = True
    return cls
