"""Speed of the shared core (`apps bench`): the train step, decoding and fine-tuning.

Imports: anything in the core below `core.serving`.
"""
