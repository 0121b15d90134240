"""Serving: the HTTP layer over loaded runs and the slot engine, and its load benchmark.

`server` loads runs and checkpoints and puts them behind FastAPI (OpenAI-compatible completions
and chat, predict endpoints, metrics); it validates and translates, and holds no model logic.
`load` measures a server (ours or any OpenAI-compatible one) under concurrent clients.

Imports: anything in the core; nothing in the core imports it.
"""
