"""Instruction data for the lm task: conversations, or prompt / completion pairs, trained on the
answers alone and packed into rows without attending across examples.

`--data` is a table file (.jsonl, .json, .csv, .tsv or .parquet) with either a `messages` column
(each row a conversation: a list of {"role", "content"} messages, the assistant's turns being
the answers) or `prompt` and `completion` columns (a one-turn conversation). It is split 90/5/5
by row, as text tables are (`tasks.nlp.corpus.split_documents`).

`tokenize` turns one example into ids and the mask of the ids the loss counts:
- with a chat template (an instruct model's), the conversation rendered as the model reads it,
  the loss on each assistant turn's text and the end-of-turn token that closes it. The turns are
  found by rendering the conversation's prefixes: the text that a prefix ending in an assistant
  turn adds to the one that asks for it (`add_generation_prompt`) is that answer, as Hugging
  Face's `assistant_only_loss` finds it where a template marks no generation blocks;
- without one (a base model, or the lm trained here), prompt / completion pairs as the start
  token, the prompt, the completion and EOS, the loss on the completion and EOS.

`pack` lays the examples end to end into rows of `max_len` predictions, each a segment of its
own (`segments`: attention stays within it and positions count from its start, core/model/transformer.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.errors import UserError
from tasks.common import cache, chat, tables

log = logging.getLogger("apps")


def is_instruction_table(spec: str | None) -> bool:
    """Whether `--data spec` is a local table with a messages column or prompt and completion columns."""
    if spec is None or not tables.is_table_file(spec) or Path(spec).suffix.lower() not in tables.FORMATS:
        return False
    columns = _columns(spec)
    return "messages" in columns or {"prompt", "completion"} <= columns


@cache.by_file
def _columns(spec: str) -> set[str]:
    return set(tables.read_file(Path(spec)).column_names)


def read(spec: str) -> list[dict]:
    """Every row of the table as an example: {"messages": [...]} or {"prompt", "completion"};
    read once per process while the file is unchanged (each split asks for it)."""
    return [dict(example) for example in _read(spec)]


@cache.by_file
def _read(spec: str) -> list[dict]:
    table = tables.read_file(Path(spec))
    examples = []
    if "messages" in table.column_names:
        for row, value in enumerate(table["messages"], 1):
            messages = chat.read_messages(value, f"{spec} row {row}")
            if not any(m["role"] == "assistant" for m in messages):
                raise UserError(f"{spec} row {row}: the conversation has no assistant turn to learn from.")
            if next(m["role"] for m in messages if m["role"] != "system") == "assistant":
                raise UserError(f"{spec} row {row}: the conversation begins with the assistant; a user asks first.")
            examples.append({"messages": messages})
    else:
        for row, (prompt, completion) in enumerate(zip(table["prompt"], table["completion"]), 1):
            if not isinstance(prompt, str) or not isinstance(completion, str) or not completion.strip():
                raise UserError(f"{spec} row {row}: prompt and completion must be texts, the completion not empty.")
            examples.append({"prompt": prompt, "completion": completion})
    if not examples:
        raise UserError(f"{spec} has no rows.")
    for example in examples:
        example["text"] = answers(example)
    return examples


def answers(example: dict) -> str:
    """The text that the loss scores (bits per character count its characters): the answers."""
    if "messages" in example:
        return "\n".join(m["content"] for m in example["messages"] if m["role"] == "assistant")
    return example["completion"]


def conversation(example: dict) -> list[chat.Message]:
    if "messages" in example:
        return example["messages"]
    return [{"role": "user", "content": example["prompt"]}, {"role": "assistant", "content": example["completion"]}]


def tokenize(tokenizer, example: dict, where: str) -> tuple[list[int], list[bool]]:
    """An example's ids and which of them the loss counts (see the module docstring)."""
    if tokenizer.chat_template:
        return _chat_ids(tokenizer, conversation(example), where)
    if "messages" in example:
        raise UserError(
            f"{where}: conversations need a model with a chat template (--preset smollm2); give prompt and "
            "completion columns for a model without one."
        )
    prompt, completion = tokenizer.pieces([example["prompt"], example["completion"]])
    ids = [tokenizer.start_id, *prompt, *completion, tokenizer.eos_id]
    return ids, [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)


def _chat_ids(tokenizer, messages: Sequence[chat.Message], where: str) -> tuple[list[int], list[bool]]:
    text = tokenizer.render_chat(messages, generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        asked = tokenizer.render_chat(messages[:index], generation_prompt=True)
        answered = tokenizer.render_chat(messages[: index + 1], generation_prompt=False)
        if not (answered.startswith(asked) and text.startswith(answered)):
            raise UserError(
                f"{where}: the chat template does not render the conversation turn by turn, so the assistant's "
                "turns cannot be told apart from the prompt."
            )
        answer = answered[len(asked) :]
        # The answer ends with the turn's end marker; what the template writes after it is not the model's.
        end = tokenizer.config.get("eos_token")
        stop = answer.find(end, answer.find(message["content"]) + len(message["content"])) if end else -1
        spans.append((len(asked), len(asked) + (stop + len(end) if stop >= 0 else len(answer))))
    ids, offsets = tokenizer.pieces_with_offsets(text)
    scored = [any(start <= first < stop for start, stop in spans) for first, _ in offsets]
    return ids, scored


def pack(examples: Sequence[tuple[list[int], list[bool]]], max_len: int, pad: int) -> dict[str, np.ndarray]:
    """Tokenized examples in rows of `max_len` predictions, first fit in order: example e predicts
    ids[1:] from ids[:-1], scored where its mask is; `segments` number the examples of a row.
    An example longer than a row keeps its first max_len + 1 ids."""
    rows: list[list[tuple]] = []
    room: list[int] = []
    cut = sum(len(ids) > max_len + 1 for ids, _ in examples)
    if cut:
        log.warning(
            "%d of %d examples are longer than a row (model.max_len=%d) and keep their first %d ids: the loss "
            "sees only the part of an answer within them.",
            cut,
            len(examples),
            max_len,
            max_len + 1,
        )
    for ids, scored in examples:
        ids, scored = ids[: max_len + 1], scored[: max_len + 1]
        length = len(ids) - 1
        if length < 1 or not any(scored[1:]):
            continue
        row = next((r for r, free in enumerate(room) if free >= length), None)
        if row is None:
            rows.append([])
            room.append(max_len)
            row = len(rows) - 1
        rows[row].append((ids, scored))
        room[row] -= length
    if not rows:
        raise UserError("No example has an answer to learn from within the row length (model.max_len).")
    shape = (len(rows), max_len)
    batch = {
        "inputs": np.full(shape, pad, np.int32),
        "targets": np.full(shape, pad, np.int32),
        "target_mask": np.zeros(shape, bool),
        "segments": np.zeros(shape, np.int32),
    }
    for r, members in enumerate(rows):
        start = 0
        for segment, (ids, scored) in enumerate(members, 1):
            stop = start + len(ids) - 1
            batch["inputs"][r, start:stop] = ids[:-1]
            batch["targets"][r, start:stop] = ids[1:]
            batch["target_mask"][r, start:stop] = scored[1:]
            batch["segments"][r, start:stop] = segment
            start = stop
    batch["mask"] = batch["segments"] > 0
    batch["weights"] = np.ones(len(rows), np.float32)
    return batch
