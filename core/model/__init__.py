"""The network: what a task's model is built from, and nothing about how it is trained or decoded.

Holds the Transformer body (`transformer`: norms, dense layers, attention and MLP blocks, the
`Model` that joins a task's embedder, body and head), the attention kernels (`attention`), the
decoding cache as a plain pytree (`cache`), heads and embedders (`heads`), front ends that may
shorten a sequence (`frontends`), the encoder-decoder (`encoder_decoder`), LoRA (`lora`) and
mixed precision (`precision`: the dtype products run in).

Imports: `core.errors` and `core.config` only (tests/test_architecture.py holds the layers).
"""
