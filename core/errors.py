"""The exception types for mistakes a user can make (bad file, unknown option, ...) and for a
multi-process run that lost one of its processes.

The CLI prints a `UserError` as a one-paragraph message and exits non-zero, without a
traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, described in words the user can act on."""


class LostPeer(UserError):
    """Another process of a multi-process run stopped: its collectives fail from now on.

    The process should exit at once: JAX's exit handler would otherwise wait at the shutdown
    barrier of `jax.distributed` for the lost process until the coordination service's heartbeat
    timeout, which ends the wait by aborting the process with a fatal log and a C++ stack trace.
    """
