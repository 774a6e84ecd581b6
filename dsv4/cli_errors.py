"""The error a command-line user caused: `python -m dsv4` prints its message on one line and
exits with status 2 (with `--debug`, the traceback)."""


class UsageError(ValueError):
    pass
