"""Sequence to sequence on the core's encoder-decoder: what `translate` and `summarize` share.

Pairs (source text, target text) and their fixed split are `tasks.nlp.pairs`'s;
`data.direction=reverse` swaps the sides.

A run takes one of two routes, chosen when the task is made (`route`): an encoder-decoder
built here (`tasks.nlp.encoder_decoder`), or, where the model is causal, a decoder completing
prompts (`tasks.nlp.completion`). The route supplies the featurizer, the model and the decoding;
the task the data, the loss and the scores.

Training minimizes cross-entropy, label-smoothed by `optim.label_smoothing` (0.1 in the
presets), over batches of similar lengths (the task's `trim`); the best checkpoint is the one
with the lowest validation `nll` (unsmoothed, nats per target piece). `apps eval` then decodes
the split greedily and with beam search and scores the text (the task's `score_generated`)
beside a classical baseline.

On the decoder-only route (`--preset smollm2`, `gemma3`: a pretrained decoder) each pair becomes
a prompt (`data.prompt`, the source written in) and its completion, the loss on the completion
alone; evaluation also reports the checkpoint zero-shot, with the same prompt, as a baseline.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from flax import nnx

from core import metrics as metric_lib
from core.checkpoints import pretrained
from core.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig, require
from core.errors import UserError
from core.model.encoder_decoder import EncoderDecoder
from core.model.heads import CopyProjection, Projection
from core.model.transformer import Model
from core.options import PredictOption, PredictOptionError
from core.task import Task, scored_positions
from core.training import losses
from tasks.nlp.completion import SOURCE, CompletionFeaturizer, DecoderOnlyRoute
from tasks.nlp.decoding import decoding_options, minimum_bayes_risk
from tasks.nlp.encoder_decoder import EncoderDecoderRoute, Seq2SeqFeaturizer
from tasks.nlp.pairs import read_pairs, split_pairs, synthetic_pairs

log = logging.getLogger("apps")


@dataclass(frozen=True, kw_only=True)
class Seq2SeqData(DataConfig):
    """Columns of a --data table, the direction, the vocabulary, lengths and decoding limits."""

    source_column: str = "source"
    target_column: str = "target"
    direction: Literal["forward", "reverse"] = "forward"  # reverse: the target column is the source
    vocab_size: int = 8000
    shared_vocab: bool = True
    source_len: int = 32  # pieces of a source, with its EOS; longer sources are cut
    target_len: int = 32  # pieces of a target, with its EOS; also the most a decoding generates
    # A decoding generates at most max_len_a * (source pieces) + max_len_b pieces (fairseq's rule).
    max_len_a: float = 1.5
    max_len_b: int = 8
    # A pointer-generator output (core.model.heads.CopyOutput): each target piece may be copied from
    # the source's pieces as well as generated; needs shared_vocab.
    copy: bool = False
    # The decoder-only route's prompt (tasks.nlp.completion): the source stands where {source}
    # is (and, for translate, its dictionary gloss where {gloss} is). None: the encoder-decoder.
    prompt: str | None = None
    # The penalties (core.generation.penalties) of the decodings, unless `apps predict` sets them.
    no_repeat_ngram: int = 0
    word_reward: float = 0.0
    # The decoder-only route's output covers only the pieces that the training completions
    # are spelled with, the glossary's translations' pieces and the stop tokens
    # (`CompletionFeaturizer.shortlist`): at a large vocabulary the output layer is most of
    # a fine-tuning step and of a decoding step, and a target language needs a small part of it.
    shortlist: bool = False
    # The valid split keeps its first `valid_size` examples (None: all): a pretrained decoder
    # reads a few hundred tokens a second here, and validation during training need not read
    # thousands of prompts each time. The test split is always whole.
    valid_size: int | None = None

    def __post_init__(self):
        for key in ("vocab_size", "source_len", "target_len"):
            require(getattr(self, key) > 0, f"data.{key}", getattr(self, key), "must be positive")
        require(self.max_len_a >= 0, "data.max_len_a", self.max_len_a, "must not be negative")
        require(self.max_len_b >= 0, "data.max_len_b", self.max_len_b, "must not be negative")
        require(
            not self.copy or self.shared_vocab, "data.copy", self.copy, "copies source pieces: needs data.shared_vocab"
        )
        require(
            not self.shortlist or self.prompt is not None,
            "data.shortlist",
            self.shortlist,
            "limits a decoder's output: needs the decoder-only route (data.prompt)",
        )
        require(self.valid_size is None or self.valid_size > 0, "data.valid_size", self.valid_size, "must be positive")
        require(
            self.prompt is None or SOURCE in self.prompt,
            "data.prompt",
            self.prompt,
            f"must hold {SOURCE}, where the source text goes",
        )


def preset(task: str, name: str, model: ModelConfig, data: Seq2SeqData, steps: int, batch_size: int, lr: float):
    """A seq2seq config; evaluation and checkpoints every quarter of the run."""
    every = max(steps // 4, 1)
    return Config(
        task=task,
        preset=name,
        model=model,
        optim=OptimConfig(learning_rate=lr, warmup_steps=max(steps // 20, 1), weight_decay=0.01, label_smoothing=0.1),
        train=TrainConfig(
            batch_size=batch_size,
            eval_batch_size=128,
            steps=steps,
            eval_every=every,
            checkpoint_every=every,
            log_every=max(steps // 40, 1),
        ),
        data=data,
    )


def decoder_preset(
    task: str, name: str, checkpoint: str, data: Seq2SeqData, steps: int, eval_batch_size: int = 16
) -> Config:
    """A pretrained decoder fine-tuned on prompt / completion pairs (`data.prompt`; see
    `core.checkpoints.pretrained.fine_tuning`): rows of 256 tokens, 8 a step, validated on the valid split's
    first 256 pairs; evaluation and decoding go `eval_batch_size` rows at a time."""
    data = dataclasses.replace(data, valid_size=256)
    return pretrained.fine_tuning(
        task, name, checkpoint, data, max_len=256, batch_size=8, eval_batch_size=eval_batch_size, steps=steps
    )


@dataclass(frozen=True, kw_only=True)
class Seq2SeqTask(Task):
    """The shared body of the seq2seq tasks; a task adds its data, scores and baseline."""

    output_name: ClassVar[str]  # the rendered column: "translation", "summary"
    best_metric: ClassVar[str] = "nll"
    lower_is_better: ClassVar[bool] = True
    data_type: ClassVar[type] = Seq2SeqData
    default_preset: ClassVar[str] = "base"
    generates: ClassVar[bool] = True
    # A pretrained decoder's preset translates or summarizes zero-shot too (`--model NAME`).
    zero_shot: ClassVar[bool] = True
    predict_options: ClassVar[tuple[PredictOption, ...]] = decoding_options()
    evaluated_decodings: ClassVar[dict[str, dict[str, Any]]] = {"greedy": {"beams": 1}, "beam": {"beams": 4}}

    config: Config
    data: str | None = None
    route: EncoderDecoderRoute | DecoderOnlyRoute = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # The route, chosen once: a causal model completes prompts, any other encodes sources.
        route = DecoderOnlyRoute(self) if self.config.model.causal else EncoderDecoderRoute(self)
        object.__setattr__(self, "route", route)

    @property
    def token_masks(self) -> tuple[str, ...]:
        return self.route.token_masks

    @property
    def trim(self) -> dict[str, tuple[str, ...]]:
        return self.route.trim

    @abc.abstractmethod
    def pairs(self) -> Sequence[tuple[str, str]]:
        """All (source, target) pairs of the embedded default, before the split."""

    @abc.abstractmethod
    def text_baselines(self, train, test, featurizer) -> dict[str, dict]:
        """The task's classical baselines, scored as `score_generated` scores the model."""

    def baselines(self, train, test, featurizer) -> dict[str, dict]:
        """The classical baselines, and for a pretrained decoder the checkpoint as it is."""
        return self.text_baselines(train, test, featurizer) | self.route.zero_shot(featurizer, test)

    def examples(self, split: str) -> list[dict]:
        examples = self.whole_split(split)
        return examples[: self.config.data.valid_size] if split == "valid" else examples

    def whole_split(self, split: str) -> list[dict]:
        """The split's every pair (`examples` keeps the valid split's first `data.valid_size`)."""
        options = self.config.data
        if self.data == "synthetic":
            pairs = synthetic_pairs()
        elif self.data is None:
            pairs = self.pairs()
        else:
            pairs = read_pairs(self.data, options.source_column, options.target_column)
        return split_pairs(pairs, split, options.direction)

    def glossary(self, train: Sequence[dict]) -> dict[str, str] | None:
        """The word -> translation map whose glosses the encoder reads (None: sources alone)."""
        return None

    def fit_featurizer(self, train: Sequence[dict]) -> Seq2SeqFeaturizer | CompletionFeaturizer:
        return self.route.fit_featurizer(train)

    def load_featurizer(self, directory: Path) -> Seq2SeqFeaturizer | CompletionFeaturizer:
        return self.route.load_featurizer(directory)

    def model(self, featurizer, config: Config, rngs: nnx.Rngs) -> EncoderDecoder | Model:
        return self.route.model(featurizer, config, rngs)

    def loss(self, outputs: Projection | CopyProjection, batch: dict):
        return _cross_entropy(outputs, batch, self.config.optim.label_smoothing)

    def metrics(self, outputs: Projection | CopyProjection, batch: dict):
        found = {
            "nll": _cross_entropy(outputs, batch),
            "token_accuracy": metric_lib.hits(outputs.predictions(), batch["targets"], scored_positions(batch)),
        }
        if isinstance(outputs, Projection) and outputs.shortlist is not None:
            # The share of target pieces the shortlist holds: nll and accuracy count those alone.
            covered = outputs.rows_of(batch["targets"])[1]
            found["shortlist_coverage"] = metric_lib.hits(covered, True, scored_positions(batch))
        return found

    def decode(self, outputs: Projection | CopyProjection, batch: dict) -> dict:
        return {}  # the text is generated (`generate`), not read off the teacher-forced pass

    def score(self, predictions, examples, featurizer) -> dict[str, float]:
        return {}

    def generate(self, model, featurizer: Seq2SeqFeaturizer, examples, options: dict, on_text=None) -> dict:
        """Each source's target text: beam search, greedy or sampled decoding with --beams 1, or
        minimum Bayes risk over all three with --mbr."""
        if options["beams"] < 1:
            raise PredictOptionError(
                f"--beams {options['beams']}: must be at least 1 (1 is greedy, more search).",
                "beams",
                "must be at least 1.",
            )
        if options["mbr"] < 0:
            raise UserError(f"--mbr {options['mbr']}: must be at least 0 (0 is off).")
        sources = self.route.sources(featurizer, examples)
        if not options["mbr"]:
            return {"text": self.decode_texts(model, featurizer, sources, options)}
        if options["mbr_temperature"] <= 0:
            raise UserError(f"--mbr-temperature {options['mbr_temperature']}: must be positive (samples differ).")
        # The pseudo-references are the model's own samples: no penalty reshapes them.
        sampled = {"beams": 1, "temperature": options["mbr_temperature"], "no_repeat_ngram": 0, "word_reward": 0.0}
        samples = [
            self.decode_texts(model, featurizer, sources, {**options, **sampled, "seed": seed})
            for seed in range(options["seed"], options["seed"] + options["mbr"])
        ]
        candidates = [self.decode_texts(model, featurizer, sources, {**options, "beams": 1, "temperature": 0.0})]
        if options["beams"] > 1:
            candidates.append(self.decode_texts(model, featurizer, sources, options))
        return {"text": minimum_bayes_risk(list(zip(*candidates, *samples)), list(zip(*samples)))}

    def decode_texts(self, model, featurizer, sources: list, options: dict) -> list[str]:
        """The target text of each source (token ids; for the decoder-only route, the examples)
        by one decoding: beam search, or greedy / sampled with beams 1. Sources go in batches of
        `train.eval_batch_size` of similar lengths, padded to a `core.training.data.bucket_width` (few
        compiled shapes)."""
        # A penalty left unset is the run's own (data.no_repeat_ngram, data.word_reward).
        data = self.config.data
        options = {key: getattr(data, key) if value is None else value for key, value in options.items()}
        return self.route.decode_texts(model, featurizer, sources, options)

    def parse_inputs(self, lines: Sequence[str], options: dict) -> list[dict]:
        sources = [line.strip() for line in lines if line.strip()]
        if not sources:
            raise UserError(f"apps predict {self.name} needs at least one non-empty text (as arguments or on stdin).")
        return [{"source": source, "target": ""} for source in sources]

    def render(self, predictions, examples, featurizer) -> list[dict[str, Any]]:
        return [{"source": e["source"], self.output_name: text} for e, text in zip(examples, predictions["text"])]


def _cross_entropy(outputs: Projection | CopyProjection, batch: dict, label_smoothing: float = 0.0):
    """Cross-entropy of the scored targets, through the tied projection or the copying head's
    parts, without forming the [B, T, V] distribution. Under a shortlist (`data.shortlist`) the
    distribution is over its pieces, and a target outside it is not scored (the metrics'
    `shortlist_coverage` says how many are)."""
    if isinstance(outputs, CopyProjection):
        return losses.copy_cross_entropy(outputs, batch["targets"], scored_positions(batch), label_smoothing)
    rows, covered = outputs.rows_of(batch["targets"])
    return losses.linear_cross_entropy(
        outputs.hidden, outputs.rows(), rows, scored_positions(batch) & covered, label_smoothing
    )
