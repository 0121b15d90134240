"""Speed of the shared core (`apps bench`): `train_step` (the jitted train step and its MFU),
`decode` (generation on random weights), `checkpoint` (a pretrained decoder's decoding and
fine-tuning); `causal` holds their model, `timing` the table, the compile-then-time loop and
the matmul peak that they share.

Imports: anything in the core below `core.serving`.
"""
