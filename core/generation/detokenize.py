"""Incremental detokenization: a continuation's text as its tokens arrive one at a time.

A piece may end inside a character that byte fallback spells over several pieces (decoded so
far, it ends in U+FFFD), and a piece's leading space is dropped at the start of a text but not
after a prompt; so the text is the prompt and the new pieces decoded together, less the
prompt's text (the featurizer's `continuation`), and a text that ends inside a character is
held back until the character completes. The terminal's stream (`TextStream`, `apps predict lm`)
and the server's streams (`apps serve`) both read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Detokenizer:
    """The new text after `prompt` as tokens are added; `continuation(prompt, new)` decodes."""

    def __init__(self, continuation: Callable[[Sequence[int], Sequence[int]], str], prompt: Sequence[int]):
        self.continuation, self.prompt = continuation, prompt
        self.ids: list[int] = []

    def add(self, token: int) -> str | None:
        """The whole new text with `token` added, or None while it ends inside a character."""
        self.ids.append(token)
        text = self.text()
        return None if text.endswith("\ufffd") else text

    def text(self) -> str:
        """The new text as it stands, an unfinished character included (at the end of a stream)."""
        return self.continuation(self.prompt, self.ids)


class TextStream:
    """Hands `on_text` the first row's new text as the decode loop produces its tokens (an
    `OnTokens` callback: each step's tokens [B] and which rows are still producing), the stop
    tokens left out."""

    def __init__(
        self,
        continuation: Callable[[Sequence[int], Sequence[int]], str],
        prompt: Sequence[int],
        on_text: Callable[[str], None],
        stops: Sequence[int],
    ):
        self.text_of, self.on_text, self.stops = Detokenizer(continuation, prompt), on_text, set(stops)
        self.text = ""

    def __call__(self, tokens, active) -> None:
        if not active[0] or int(tokens[0]) in self.stops:
            return
        text = self.text_of.add(int(tokens[0]))
        if text is not None:
            self.on_text(text[len(self.text) :])
            self.text = text

    def finish(self, text: str) -> None:
        """Sends what the stream held back (bytes that never completed a character; all of a
        beam search's text, which streams nothing), so that the streamed text is the answer."""
        if text.startswith(self.text) and len(text) > len(self.text):
            self.on_text(text[len(self.text) :])
