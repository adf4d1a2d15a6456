"""What train.py, sample.py and the other commands import: the library around model.py, one concern a module."""


class UserError(Exception):
    """A mistake the user can fix, found where it is made: a one-line message saying what was wrong and what to do,
    which each command prints as `error: ...` before it exits with status 1."""
