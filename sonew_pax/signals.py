"""Signal handling: `StopSignal` turns SIGTERM (preemption) and SIGINT (Ctrl-C) into a flag the
training loop polls, so that it saves a checkpoint at its current step and stops.
"""

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import jax
from absl import logging


class StopSignal:
    """Turns SIGTERM and SIGINT into a flag the training loop polls (single-process runs).

    The loop then saves at its current step and stops. A second SIGINT (Ctrl-C twice) raises
    KeyboardInterrupt: the run stops at once, saving nothing more. In multi-process runs JAX's
    preemption service handles SIGTERM and the loop asks `Checkpoints.reached_preemption`, so
    that every process stops at the same step; SIGINT keeps Python's default there.
    """

    def __init__(self):
        self.received = False

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if signum == signal.SIGINT and self.received:
            raise KeyboardInterrupt("second SIGINT: stopped without saving")
        name = signal.Signals(signum).name
        logging.warning(
            "Received %s: saving a checkpoint at the current step, then stopping%s.",
            name,
            " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else "",
        )
        self.received = True

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignal"]:
        """Handles SIGTERM and SIGINT while the block runs; restores the previous handlers."""
        if jax.process_count() > 1:
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
