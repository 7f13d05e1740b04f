"""The errors a run reports to its user as one message, without a traceback.

`RunError` marks what the user can fix (a configuration, a run directory in use, a run that
diverged): ``python -m sonew_pax.train`` prints its message and exits with status 1. Anything else
is a bug and keeps its traceback.
"""


class RunError(Exception):
    """An error in a run's configuration, data or directory; the message says what to do."""


class ConfigError(RunError, ValueError):
    """A setting that cannot work, found before the run writes anything; the message names it."""
