"""The shared middle of the suite: model body, training loop, sharding, checkpoints, CLI back end.

Nothing in `core/` imports `tasks/`; tasks plug in through the protocol in `core.task`.
Importing `core` tunes the host allocator first (see `core.host`), before JAX starts its threads.
"""

from core import host

host.keep_freed_memory()
