"""Constrained decoding: an answer kept to a grammar (a JSON schema, or any JSON object) by a mask
of the tokens it allows at each step.

llguidance (the library llama.cpp and vLLM use) parses the grammar as the tokens come, on the
host, and writes each step's mask as bits, 32 token ids to an int32; the slot engine applies it
in its sampling step (`core.generation.slot_sampling`), per slot, beside slots without one.
Chosen by measuring it beside outlines-core on a six-field schema (core/serving/README.md): a
mask costs 10-40 us a token at SmolLM2's and Gemma 3's vocabularies and a schema compiles in
about a millisecond, where outlines-core builds an index per schema (0.13 s at SmolLM2's
vocabulary, 1.1 s at Gemma's); llguidance also takes the whole of JSON Schema and
context-free grammars, and its wheel has no dependencies.

A JSON answer is written compactly (", " and ": " between items, no other whitespace): a small
model given free whitespace may spend its tokens on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.errors import UserError

# llguidance's options for a JSON schema's grammar: compact, and the schema as written.
JSON_OPTIONS = {"whitespace_flexible": False}


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of answers valid under `schema` (None: any JSON object); a schema that
    llguidance cannot compile is a UserError saying why."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults=JSON_OPTIONS
        )
    except ValueError as error:
        raise UserError(f"the JSON schema is not valid JSON ({error})") from None
    return _checked(grammar, "the JSON schema")


def lark_grammar(text: str, what: str) -> str:
    """A grammar in llguidance's Lark (which embeds JSON schemas as `%json {...}`); one that
    cannot be followed is a UserError naming `what` it was made from."""
    import llguidance

    return _checked(llguidance.LLMatcher.grammar_from_lark(text), what)


def _checked(grammar: str, what: str) -> str:
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise UserError(f"{what} cannot be followed: {problem.strip()}")
    return grammar


class Vocabulary:
    """llguidance's view of one tokenizer (a Hugging Face tokenizer's JSON) and the ids that end
    an answer. Built once per served model: it reads every token (2.4 s at Gemma's 262,144)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: frozenset[int]):
        import llguidance

        self.size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of a mask
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(stop_ids))

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


class Constraint:
    """One answer's place in its grammar: the mask of what may come next, and each token taken."""

    def __init__(self, vocabulary: Vocabulary, grammar: str):
        import llguidance

        self.matcher = llguidance.LLMatcher(vocabulary.tokenizer, grammar, log_level=0)
        self.stuck = False  # the last mask allowed no token
        if self.matcher.is_error():
            raise UserError(f"the grammar cannot be followed: {_first_line(self.matcher.get_error())}")
        # The tokens every answer must begin with, taken on a copy: a grammar that forces an
        # endless run (a required recursive $ref) fails here, before any answer is drawn.
        probe = self.matcher.deep_copy()
        forced = probe.compute_ff_tokens()
        if probe.is_error() or (forced and not probe.consume_tokens(forced)) or probe.is_error():
            raise UserError(f"no answer can complete the grammar: {_first_line(probe.get_error())}")

    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed ids' bits into `row` (int32 [words], C-contiguous); `stuck` says
        whether they allow none (the grammar at a dead end: the token drawn is not taken)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.stuck = not row.any()

    def problem(self) -> str:
        """Why the grammar took no further token."""
        return _first_line(self.matcher.get_error()) or "it allows no token here"

    def take(self, token: int) -> bool:
        """Advances past `token`; False if the grammar refused it."""
        return self.matcher.consume_token(token)

    def complete(self) -> bool:
        """Whether the grammar is satisfied and allows nothing more but an end token."""
        return self.matcher.is_stopped()


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
