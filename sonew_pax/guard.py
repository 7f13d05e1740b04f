"""The non-finite guard: the host side of `train`'s ``non_finite`` policy (`NonFiniteGuard`),
which stops a diverged run with `NonFiniteError` or counts the steps the train step skipped.
"""

import math
from collections.abc import Callable, Mapping

from absl import logging

from sonew_pax.errors import RunError

NON_FINITE_POLICIES = ("stop", "skip")


class NonFiniteError(RunError):
    """A step's loss, gradient norm or learning rate is not finite (or the rate is negative)."""


class NonFiniteGuard:
    """The host side of `train`'s ``non_finite`` policy.

    `check` reads each step's metrics where the loop already brings them to the host (one step
    behind the device, and before every save), so the guard adds no device work and no wait.
    Under ``"stop"`` a non-finite loss or grad_norm ends the run; nothing is saved after it (the
    loop checks a step's metrics before saving its state). Under ``"skip"`` the train step has
    kept the state (`make_train_step`'s ``skip_non_finite``) and the guard counts the step, up to
    ``max_skipped_steps`` in the whole run (the count is saved in checkpoints). A learning rate
    that is not finite or negative ends the run under both.

    Args:
      policy: ``"stop"`` or ``"skip"``.
      max_skipped_steps: ``"skip"``: the most steps skipped before the run stops.
      skipped_steps: steps already skipped (from the checkpoint resumed).
      newest_checkpoint: returns where the run can be resumed from, for the message.
    """

    def __init__(
        self,
        policy: str,
        max_skipped_steps: int,
        skipped_steps: int,
        newest_checkpoint: Callable[[], str],
    ):
        self.policy = policy
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps = skipped_steps
        self._newest_checkpoint = newest_checkpoint

    def metrics(self) -> dict[str, float]:
        """What the guard adds to each step's metrics: ``skipped_steps`` (the run's total) under
        ``"skip"``."""
        return {"skipped_steps": self.skipped_steps} if self.policy == "skip" else {}

    def run_state(self) -> dict[str, int]:
        """The counters a checkpoint keeps."""
        return {"skipped_steps": self.skipped_steps}

    def check(self, step: int, scalars: Mapping[str, float]) -> NonFiniteError | None:
        """Counts a skipped step and returns the error that ends the run, if any (the caller
        raises it after writing the step's metrics)."""
        rate = scalars["learning_rate"]
        if not (math.isfinite(rate) and rate >= 0):
            return NonFiniteError(
                f"step {step}: the learning rate is {rate}; it must be finite and >= 0 (check "
                f"the schedule). {self._newest_checkpoint()}"
            )
        bad = [f"{name} {scalars[name]}" for name in ("loss", "grad_norm")
               if not math.isfinite(scalars[name])]  # fmt: skip
        if not bad:
            return None
        what = f"step {step}: non-finite {' and '.join(bad)}"
        if self.policy == "stop":
            return NonFiniteError(
                f"{what}. The run stopped; nothing after the last finite checkpoint was saved. "
                f"{self._newest_checkpoint()} Lower the learning rate (or raise warmup, clip "
                f"harder), or set train.non_finite = 'skip' to skip such steps."
            )
        self.skipped_steps += 1
        if self.skipped_steps > self.max_skipped_steps:
            return NonFiniteError(
                f"{what}: {self.skipped_steps} steps skipped, more than "
                f"train.max_skipped_steps = {self.max_skipped_steps}. The run stopped. "
                f"{self._newest_checkpoint()}"
            )
        logging.warning(
            "%s: step skipped (parameters and optimizer state kept; %d of at most %d).",
            what,
            self.skipped_steps,
            self.max_skipped_steps,
        )
        return None
