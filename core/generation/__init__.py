"""Decoding trained models: sampling, beam search, penalties, CTC, and the slot engine.

`generate` samples from decoders (prefill, KV-cached steps, top-k/top-p, streaming callbacks)
and runs beam search (`beam`) with `penalties`; `seq2seq` decodes an encoder-decoder from its
sources; `ctc` decodes CTC outputs on the host; `slots` is the continuous-batching engine
(a slot table over one KV cache) that the server drives, its slots picking their tokens in
`slot_sampling`, what it holds reckoned in `slot_memory`; `chunks` runs a loop the host watches
(streaming, abandonment) a chunk of steps a call; `abandon` lets the thread running a
generation end it midway (a served request past its timeout).

Imports: everything below it (`core.model`, the contract, `core.checkpoints`, `core.training`),
never `core.run`, `core.bench` or `core.serving`.
"""
