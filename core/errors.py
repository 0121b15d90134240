"""The one exception type for mistakes a user can make (bad file, unknown option, ...).

The CLI prints a `UserError` as a one-paragraph message and exits non-zero, without a
traceback; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, described in words the user can act on."""
