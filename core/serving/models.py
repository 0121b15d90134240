"""What a server serves: trained runs and shipped checkpoints, each loaded once.

A `Served` model is a `core.run.Predictor` with its worker thread (predictions run off the event
loop, one at a time per model), its predict `Batcher` and, for a language model (a task that
`completes`), a generation `Engine` of `--max-batch` slots over one KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import UserError
from core.generation.grammar import Constraint, Vocabulary
from core.generation.slots import Engine
from core.serving.api import ApiError
from core.serving.batcher import Batcher


@dataclass
class Served:
    """One model: a trained run or a checkpoint, loaded once (`core.run.Predictor`), with its
    worker thread, its predict batcher and, for a language model, its generation engine."""

    name: str
    predictor: Any
    engine: Engine | None = None
    worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    batcher: Batcher | None = None
    embedder: Batcher | None = None  # its embeddings requests, batched as predict requests are
    vocabulary: Vocabulary | None = None  # a language model's tokens as its grammars read them
    adapter: int = 0  # which of its engine's adapters it decodes through (`core.serving.adapters`)

    def __post_init__(self):
        if self.engine is not None and self.vocabulary is None:
            tokenizer = self.predictor.featurizer.tokenizer
            text = tokenizer.tokenizer_json()
            if text is not None:  # built now: at Gemma's vocabulary it takes seconds
                self.vocabulary = Vocabulary(text, self.engine.vocab_size, frozenset(tokenizer.stop_ids))

    @property
    def task(self):
        return self.predictor.task

    @property
    def embeds(self) -> bool:
        """Whether its task gives embeddings (overrides `Task.embed`)."""
        from core.task import Task

        return type(self.task).embed is not Task.embed

    def states(self, groups: list[list[dict]], values: dict[str, Any]) -> list[list[np.ndarray]]:
        """Each request's examples' last states [L, D] (the task's `embed`, per position), every
        request's examples in one call."""
        examples = [e for group in groups for e in group]
        found = self.task.embed(self.predictor.model, self.predictor.featurizer, examples, per_position=True)
        bounds = np.cumsum([0, *(len(group) for group in groups)])
        return [found[a:b] for a, b in zip(bounds, bounds[1:])]

    def waiting(self) -> int:
        """Requests waiting for its predict worker or for a generation slot."""
        return self.batcher.waiting() + (self.engine.queued(self.adapter) if self.engine is not None else 0)

    def check_room(self, examples: list[dict], values: dict[str, Any]) -> None:
        """Each prompt of a decoder's predict request and its new tokens within the positions
        the server gives a generation (`--context`), as the completions endpoints keep them."""
        context, new = self.engine.context, values["max_new_tokens"]
        for index, example in enumerate(examples):
            length = len(self.predictor.featurizer.prompt(example, values.get("system", "")))
            if length + new > context:
                raise ApiError(
                    400,
                    f"inputs.{index}: {length} prompt tokens and max_new_tokens {new} take more than the {context} "
                    "positions this server gives a generation.",
                    f"inputs.{index}",
                )

    def constraints(self, grammar: str | None, field: str) -> Callable[[], Constraint] | None:
        """What makes each answer's constraint under `grammar` (None: answers are free text),
        which the request's `field` asked for."""
        if grammar is None:
            return None
        if self.vocabulary is None:
            raise ApiError(
                400,
                f"{field}: {self.name}'s tokenizer (a sentencepiece model trained here) cannot be read as a "
                "grammar's vocabulary; constrained answers need a pretrained decoder's tokenizer.",
                field,
            )
        try:  # one made now: a grammar no answer can complete is refused before any work
            self.vocabulary.constraint(grammar)
        except UserError as error:
            raise ApiError(400, f"{field}: {error}.", field) from None
        return lambda: self.vocabulary.constraint(grammar)

    def rows(self, groups: list[list[dict]], values: dict[str, Any]) -> list[list[dict]]:
        """Each request's rows, its examples run with every other request's in one call. The
        predictions hold an entry per example (`core.run.Predictor.run_examples`), so each
        request's share is cut out and rendered apart (a task may render several rows an
        example: recsys, one per recommended item)."""
        examples = [e for group in groups for e in group]
        predictions = self.predictor.run_examples(examples, values)
        bounds = np.cumsum([0, *(len(group) for group in groups)])
        return [
            self.task.render({k: v[a:b] for k, v in predictions.items()}, group, self.predictor.featurizer)
            for group, a, b in zip(groups, bounds, bounds[1:])
        ]


def load(
    workdirs: list[Path],
    models: list[str],
    task_named: Callable[[str], type],
    task_for: Callable[[str], type],
    *,
    slots: int,
    context: int | None,
    queue: int,
    dtype: str = "float32",
    prompt_cache: int = 8,
) -> list[Served]:
    """The served models: each run of `workdirs` (its task read from its config.json and found
    by `task_named`, the registry's lookup) and each pretrained checkpoint of `models` (served by
    the task `task_for` it: a decoder by the language-model task, Whisper by speech), loaded and,
    for a language model, given an engine whose weights are in `dtype`
    (`core.model.precision.narrowed`), which LoRA runs of one base share (`core.serving.adapters`),
    keeping `prompt_cache` ended prompts (`core.generation.prompt_cache`)."""
    from core import run
    from core.loading import run_task
    from core.serving.adapters import grouped

    loaded = [(served_name(workdir=w), run.Predictor(task_named(run_task(w)), w), None) for w in workdirs] + [
        (served_name(model=m), run.Predictor(task_for(m), model=m), m) for m in models
    ]
    served = []
    for group in grouped(loaded):
        (name, predictor, adapter), runs = group[0], [p for _, p, a in group if a > 0]
        engine = _engine(predictor, slots, context, queue, dtype, runs if len(group) > 1 else [], prompt_cache)
        first = Served(name, predictor, engine, adapter=adapter)
        served.append(first)
        served += [Served(n, p, engine, adapter=a, vocabulary=first.vocabulary) for n, p, a in group[1:]]
    order = [name for name, _, _ in loaded]
    return sorted(served, key=lambda s: order.index(s.name))  # as given


def served_name(*, model: str | None = None, workdir: str | Path | None = None) -> str:
    """The name a served model answers to (`"model"` in requests, GET /v1/models): a run's
    folder name, or a checkpoint's name or file name."""
    return Path(workdir).resolve().name if workdir is not None else Path(model).name


DEFAULT_CONTEXT = 2048


def _engine(predictor, slots, context, queue, dtype, runs=(), prompt_cache: int = 8) -> Engine | None:
    """A generation engine for a language model (a task that `completes`), with the LoRA `runs`
    of its weights as adapters (`core.serving.adapters`), its slots `context` positions long
    (default: the longest of theirs, at most DEFAULT_CONTEXT: each slot's cache is that long),
    at most `queue` requests waiting; None for any other task."""
    if not predictor.task.completes:
        return None
    limit = max(p.task.config.model.max_len for p in (predictor, *runs))
    if context is not None and not 2 <= context <= limit:
        raise UserError(f"--context {context}: must be from 2 to the model's {limit} positions.")
    context = context or min(limit, DEFAULT_CONTEXT)
    adapters = [p.model for p in runs]
    kept = {"adapters": adapters, "prompt_cache": prompt_cache}
    return Engine(predictor.model, slots=slots, context=context, queue_size=queue, dtype=dtype, **kept)
