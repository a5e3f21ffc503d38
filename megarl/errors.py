"""Errors a user can act on.

A `UserError` says what is wrong with the input (naming the key, file or tensor) and what would be valid. The CLI
prints it as one paragraph without a traceback; anything else is a bug and keeps its traceback under `--debug`.
"""


class UserError(ValueError):
    """Bad input: a config key, a file, a CLI flag or a checkpoint that cannot be used as given."""


class RunFailure(RuntimeError):
    """A run stopped on a failure it could not recover from (a worker died, restarts ran out, too many non-finite
    steps). The message says what failed, where, and which checkpoint a rerun resumes from."""
