"""OpenAI's embeddings (`POST /v1/embeddings`) over any served model whose task embeds.

Each input's vector is the mean of the model body's last states over its positions (the task's
`embed`: a decoder's prompt tokens, as llama-server's mean pooling; a protein run's residues),
scaled to unit length, as OpenAI's embeddings are. Concurrent requests run as one call on the
model's worker thread (a `Batcher`, as predict requests do). Token ids as input are a
decoder's alone; `dimensions` may only repeat the model's own width: these models were not
trained to be cut shorter.
"""

from __future__ import annotations

import base64

import numpy as np

from core.errors import UserError
from core.options import RequestLimits, predict_option_values
from core.serving.api import ApiError, EmbeddingsBody, within
from core.serving.models import Served


def examples_of(served: Served, body: EmbeddingsBody, limits: RequestLimits) -> list[dict]:
    """The request's inputs as the task's examples (texts parsed as predict inputs are; token
    lists, for a decoder, as its "ids"), each checked."""
    given = body.input
    inputs = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else given
    if not inputs or any(not item for item in inputs):
        raise ApiError(400, "input: give a non-empty text or list of token ids (or a list of them).", "input")
    if len(inputs) > limits.inputs:
        raise ApiError(400, f"input: {len(inputs)} inputs, more than the {limits.inputs} a request may hold.", "input")
    if isinstance(inputs[0], str):
        try:
            return served.task.parse_request(inputs, predict_option_values(served.task, {}), limits)
        except UserError as error:
            raise ApiError(400, f"input: {error}", "input") from None
    if served.engine is None:
        raise ApiError(400, f"input: {served.name} reads texts; token ids are a decoder's input.", "input")
    for index, ids in enumerate(inputs):
        if not all(0 <= i < served.engine.vocab_size for i in ids):
            where = "input" if inputs is not given else f"input.{index}"
            raise ApiError(400, f"{where}: token ids are from 0 to {served.engine.vocab_size - 1} here.", where)
    return [{"id": f"input {i + 1}", "text": None, "ids": list(ids)} for i, ids in enumerate(inputs)]


def check_before_work(served: Served, body: EmbeddingsBody, examples: list[dict]) -> None:
    """What can be refused before any embedding is computed: `dimensions` other than the
    model's width, and (a decoder's) an input longer than the server's context (`--context`),
    whose cost would otherwise grow with the model's own positions."""
    width = served.task.config.model.d_model
    if body.dimensions is not None and body.dimensions != width:
        raise ApiError(
            400,
            f"dimensions: {served.name}'s embeddings have {width} dimensions, and it was not trained for fewer.",
            "dimensions",
        )
    if served.engine is None:
        return
    context, featurizer = served.engine.context, served.predictor.featurizer
    for index, example in enumerate(examples):
        length = len(example["ids"]) if example.get("ids") is not None else len(featurizer.prompt(example))
        if length > context:
            where = "input" if len(examples) == 1 else f"input.{index}"
            raise ApiError(
                400,
                f"{where}: {length} tokens, more than the {context} positions this server holds (--context).",
                where,
            )


async def answer(served: Served, body: EmbeddingsBody, limits: RequestLimits, timeout: float) -> dict:
    examples = examples_of(served, body, limits)
    check_before_work(served, body, examples)
    states = await within(served.embedder.predict(examples, {}), timeout)
    vectors = [s.mean(0) for s in states]
    data = []
    for index, vector in enumerate(vectors):
        unit = (vector / max(float(np.linalg.norm(vector)), 1e-12)).astype("<f4")
        value = base64.b64encode(unit.tobytes()).decode() if body.encoding_format == "base64" else unit.tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    tokens = sum(len(s) for s in states)
    return {
        "object": "list",
        "data": data,
        "model": served.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
