"""OpenAI's audio endpoints over the speech task: `POST /v1/audio/transcriptions` and
`/v1/audio/translations`, a multipart upload of one audio file.

The file runs as a predict request of the speech task does (`Served.batcher`, so concurrent
uploads share a call), with Whisper's timestamps on: the text, and its segments with their
times. Fields as OpenAI's API takes them: `file`, `model`, `language` (transcriptions),
`temperature` (0, the default, is greedy with Whisper's fallback to sampling; above 0 the first
decoding samples at it), `response_format` (`json`, `text`, `srt`, `vtt`, `verbose_json`) and
`timestamp_granularities[]` (`segment`, `word`: verbose_json's `words`), `prompt` (Whisper's
earlier text: the file's first window is decoded after it, as Whisper's `initial_prompt`). An
unknown field is refused by name.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse

from core.options import RequestLimits
from core.serving.api import ApiError, Deadline, within
from core.serving.models import Served

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
SAMPLE_RATE = 16_000  # of the speech task's examples' samples
FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]"}


async def read_form(request: Request) -> dict[str, Any]:
    """The multipart form's fields, each checked: the file's bytes under "file", texts else."""
    try:
        form = await request.form()
    except Exception as error:  # python-multipart's parse errors, or a body that is not a form
        raise ApiError(400, f"body: not a multipart form with a file ({error}).", "body") from None
    unknown = sorted(set(form.keys()) - FIELDS)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not a field of this endpoint ({', '.join(sorted(FIELDS))}).", unknown[0])
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise ApiError(400, "file: upload the audio as a file field.", "file")
    if len(form.getlist("file")) > 1:
        raise ApiError(400, "file: one file a request; send the others in requests of their own.", "file")
    fields = {key: value for key, value in form.multi_items() if key != "file"}
    if any(not isinstance(value, str) for value in fields.values()):
        raise ApiError(400, "Only the file field may be a file.", "body")
    fields["granularities"] = form.getlist("timestamp_granularities[]")
    fields["data"], fields["filename"] = await upload.read(), upload.filename or "the upload"
    return fields


def options(fields: dict[str, Any], translate: bool) -> dict[str, Any]:
    """The speech task's predict options for the request's fields, each bad value named."""
    if any(g not in ("segment", "word") for g in fields["granularities"]):
        raise ApiError(400, "timestamp_granularities[]: segment or word.", "timestamp_granularities[]")
    if fields.get("response_format", "json") not in FORMATS:
        raise ApiError(400, f"response_format: one of {', '.join(FORMATS)}.", "response_format")
    if fields["granularities"] and fields.get("response_format", "json") != "verbose_json":
        raise ApiError(
            400,
            "timestamp_granularities[]: timestamps come with response_format verbose_json.",
            "timestamp_granularities[]",
        )
    if translate and fields.get("language"):
        raise ApiError(400, "language: a translation is into English; the spoken language is found.", "language")
    try:
        temperature = float(fields.get("temperature", 0))
    except ValueError:
        raise ApiError(400, "temperature: a number from 0 to 1.", "temperature") from None
    if not 0 <= temperature <= 1:
        raise ApiError(400, "temperature: a number from 0 to 1.", "temperature")
    return {
        "language": fields.get("language") or "auto",
        "task": "translate" if translate else "",
        "timestamps": True,
        "word_timestamps": "word" in fields["granularities"],
        "temperature": temperature,
        "prompt": fields.get("prompt", ""),
    }


async def answer(served: Served, fields: dict[str, Any], translate: bool, limits: RequestLimits, timeout: float):
    """The transcript of the form's file in its `response_format`."""
    values = {**served.predictor.options({}), **options(fields, translate)}
    encoded = base64.b64encode(fields["data"]).decode()
    deadline = Deadline(timeout)
    try:  # decoded and resampled off the event loop, on the request's clock
        examples = await within(asyncio.to_thread(served.task.parse_request, [encoded], values, limits), deadline)
    except ApiError as error:
        if error.status != 400:
            raise
        message = error.message.replace("input 1", f"file {fields['filename']!r}")
        raise ApiError(400, message, "file") from None
    try:
        [row] = await within(served.batcher.predict(examples, values), deadline)
    except ApiError as error:  # the model's own refusal of a language or of translating, as the form names it
        if error.param not in ("options.language", "options.task"):
            raise
        field = "language" if error.param == "options.language" else "model"
        raise ApiError(400, f"{field}: {error.message.split(': ', 1)[1]}", field) from None
    form = fields.get("response_format", "json")
    if form == "json":
        return {"text": row["transcript"]}
    if form == "text":
        return PlainTextResponse(row["transcript"] + "\n")
    if form in ("srt", "vtt"):
        return PlainTextResponse(served.task.formats[form](row))
    duration = len(examples[0]["audio"]) / SAMPLE_RATE
    segments = [{"id": i, **segment} for i, segment in enumerate(row.get("segments", []))]
    words = [{k: w[k] for k in ("word", "start", "end")} for s in segments for w in s.pop("words", [])]
    return {
        "task": "translate" if translate else "transcribe",
        "language": row.get("language"),
        "duration": duration,
        "text": row["transcript"],
        "segments": segments,
    } | ({"words": words} if "word" in fields["granularities"] else {})
