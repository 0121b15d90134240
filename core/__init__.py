"""The shared middle of the suite: model body, training loop, sharding, checkpoints, CLI back end.

Nothing in `core/` imports `tasks/`; tasks plug in through the protocol in `core.task`.
"""
