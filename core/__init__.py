"""The shared middle of the suite: model body, training loop, sharding, checkpoints, CLI back end.

Nothing in `core/` imports `tasks/`; tasks plug in through the protocol in `core.task`.
Importing `core` changes nothing in the process: the allocator settings of `core.training.host` are
applied where the suite owns the process (the `apps` CLI and `core.run.train`).
"""
