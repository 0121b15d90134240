"""Subtitles from a transcript's segments: SubRip (`.srt`) and WebVTT (`.vtt`).

A row of `apps predict speech` (from Whisper with timestamps) holds its file's `segments`, each
{"start", "end", "text"} in seconds; each becomes a cue. SubRip numbers its cues and writes
times as 00:01:02,345; WebVTT opens with its header and writes 00:01:02.345.
"""

from __future__ import annotations

from core.errors import UserError


def srt(row: dict) -> str:
    cues = [f"{n}\n{_time(s['start'], ',')} --> {_time(s['end'], ',')}\n{s['text']}\n" for n, s in _cues(row, "srt")]
    return "\n".join(cues)


def vtt(row: dict) -> str:
    cues = [f"{_time(s['start'], '.')} --> {_time(s['end'], '.')}\n{s['text']}\n" for _, s in _cues(row, "vtt")]
    return "\n".join(["WEBVTT\n", *cues])


def _cues(row: dict, form: str):
    if "segments" not in row:
        raise UserError(
            f"--format {form} writes subtitles from segments with times: Whisper gives them (apps predict speech "
            "--model whisper-tiny.en, with --timestamps), a CTC model does not."
        )
    # A cue's text on one line: a blank line would end the cue.
    return enumerate(({**s, "text": " ".join(s["text"].split())} for s in row["segments"]), 1)


def _time(seconds: float, mark: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d}{mark}{millis % 1000:03d}"
