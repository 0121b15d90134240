"""Pretrained weights in and out: checkpoint formats, and one module per family.

`pretrained` is the shared machinery (finding a checkpoint by its shipped name or path, the
declarative `Rule` tables that map a checkpoint's tensors onto the core's parameters and back,
loading and exporting); `gguf_files` and `ctranslate2_files` read those formats. Each family
module registers itself on import, with its weight table and the core options its architecture
needs: `bert` (BERT/RoBERTa folders), `hf_decoders` (Llama, Qwen2, Gemma 3 folders), `llama` and
`gemma` (GGUF files), `whisper` (CTranslate2 folders); `pretrained.families()` imports every
module of this package, so a new family is a new module here and nothing else.

Imports: `core.errors`, `core.config`, `core.model`, and the contract (`core.task`).
"""
