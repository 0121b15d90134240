"""Log-probabilities in OpenAI's two shapes, from the `Scores` the slot engine gives each token.

Chat completions: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}; legacy
completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}.
A token's text is what it adds after the token before it (`continuation`), so a piece's leading
space is kept; a piece inside a character spelled over several tokens is its bytes' replacement.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from core.generation.slot_sampling import Scores

Entry = tuple[int, int, Scores]  # (the token before, the token, its scores)


def _text(continuation: Callable, before: int, token: int) -> str:
    return continuation([before], [token])


def chat(entries: Sequence[Entry], continuation: Callable) -> dict:
    def item(before: int, token: int, logprob: float) -> dict:
        text = _text(continuation, before, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            item(before, token, scores.logprob)
            | {"top_logprobs": [item(before, other, logprob) for other, logprob in scores.top]}
            for before, token, scores in entries
        ]
    }


def completion(entries: Sequence[Entry], continuation: Callable, offset: int) -> dict:
    """`offset`: where the first entry's text begins in the choice's text."""
    tokens = [_text(continuation, before, token) for before, token, _ in entries]
    offsets = list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1]
    return {
        "tokens": tokens,
        "token_logprobs": [scores.logprob for _, _, scores in entries],
        "top_logprobs": [
            {_text(continuation, before, other): logprob for other, logprob in scores.top}
            for before, _, scores in entries
        ],
        "text_offset": offsets,
    }
