"""Checkpoints on disk: save, auto-resume onto any mesh, corrupt-checkpoint fallback, preemption.

Each checkpoint is an orbax directory ``MODEL_DIR/checkpoint_<step>/`` with two items: ``state``
(the whole `TrainState`: step, parameters, full optimizer state) and ``data`` (the training data
iterator's position, JSON). Orbax writes into a temporary directory and renames it when complete,
so a run killed mid-save leaves no ``checkpoint_<step>`` behind.

Rules kept here:
- Restores read each array straight into its target sharding, so a checkpoint written on one
  mesh or device count restores on another.
- A checkpoint that fails to restore is reported (a warning naming it), renamed to
  ``checkpoint_<step>.corrupt`` (kept for inspection, invisible to the manager), and the previous
  one is used. A save that never finished (orbax's temporary directory) is reported and renamed
  ``checkpoint_<step>.partial``. Nothing is ever deleted except by the ``keep`` limit, and no
  existing checkpoint is overwritten.
- SIGTERM (preemption) sets a flag; the training loop saves at its current step and exits.
"""

import contextlib
import pathlib
import signal
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from sonew_pax.train_state import TrainState

STEP_PREFIX = "checkpoint"
CORRUPT_SUFFIX = ".corrupt"
PARTIAL_SUFFIX = ".partial"
ORBAX_TMP_MARKER = ".orbax-checkpoint-tmp"


def checkpoint_dir(model_dir: str | pathlib.Path, step: int) -> pathlib.Path:
    """Where the checkpoint of ``step`` lives."""
    return pathlib.Path(model_dir) / f"{STEP_PREFIX}_{step}"


def _free_name(path: pathlib.Path, suffix: str) -> pathlib.Path:
    """A free name ``<path><suffix>`` (or ``<suffix>-1``, ``-2``, ...) next to ``path``."""
    candidate = path.with_name(path.name + suffix)
    index = 0
    while candidate.exists():
        index += 1
        candidate = path.with_name(f"{path.name}{suffix}-{index}")
    return candidate


class Checkpoints:
    """The run's checkpoints in ``model_dir`` (an orbax CheckpointManager underneath).

    Args:
      model_dir: the run directory.
      keep: how many of the newest checkpoints to keep (None: all).
      async_save: write in a background thread (the arrays are copied to host before ``save``
        returns, so the next step may reuse their buffers).
    """

    def __init__(
        self, model_dir: str | pathlib.Path, keep: int | None = None, async_save: bool = True
    ):
        self.model_dir = pathlib.Path(model_dir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            step_prefix=STEP_PREFIX,
            create=True,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(
            self.model_dir, options=options, item_names=("state", "data")
        )

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending."""
        return sorted(self._manager.all_steps())

    def save(self, state: TrainState, data_state: dict[str, Any]) -> bool:
        """Saves ``state`` at its step with the data position; False if that step is on disk."""
        step = int(state.step)
        if step in self._manager.all_steps():
            return False
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
            ),
            force=True,
        )
        return True

    def _set_aside_partial_saves(self) -> None:
        """Reports saves that never finished (killed mid-write) and renames them ``.partial``.

        Orbax would otherwise delete such a directory when it saves that step again.
        """
        if jax.process_index() != 0:
            return
        for path in sorted(self.model_dir.glob(f"{STEP_PREFIX}_*{ORBAX_TMP_MARKER}*")):
            name = path.name.split(ORBAX_TMP_MARKER)[0]
            target = _free_name(path.with_name(name), PARTIAL_SUFFIX)
            path.rename(target)
            logging.warning("Unfinished checkpoint save %s ignored; moved to %s.", path, target)

    def restore_latest(self, target: TrainState) -> tuple[TrainState, dict[str, Any]] | None:
        """The newest checkpoint that restores, onto ``target``'s shapes and shardings.

        Args:
          target: ShapeDtypeStructs with shardings (`StateLayout.abstract_with_shardings`).

        Returns:
          (state, data position), or None when there is no checkpoint.

        Raises:
          RuntimeError: when checkpoints exist but none restores (e.g. a different model): that
            is a configuration error, not corruption, and nothing is renamed.
        """
        self._set_aside_partial_saves()
        failed: list[tuple[int, Exception]] = []
        for step in reversed(self.steps()):
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
                    ),
                )
            except Exception as error:
                logging.warning(
                    "Checkpoint %s is corrupt or incomplete (%s: %s); trying the previous one.",
                    checkpoint_dir(self.model_dir, step),
                    type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "",
                )
                failed.append((step, error))
                continue
            self._quarantine([s for s, _ in failed])
            return TrainState(*restored.state), restored.data
        if failed:
            step, error = failed[0]
            raise RuntimeError(
                f"no checkpoint in {self.model_dir} restores; the newest, "
                f"{checkpoint_dir(self.model_dir, step)}, fails with: {error}"
            ) from error
        return None

    def _quarantine(self, steps: list[int]) -> None:
        """Renames unreadable checkpoints aside (never deleting them); their steps get redone."""
        if steps and jax.process_index() == 0:
            for step in steps:
                path = checkpoint_dir(self.model_dir, step)
                target = _free_name(path, CORRUPT_SUFFIX)
                path.rename(target)
                logging.warning("Moved unreadable checkpoint %s to %s.", path, target)
        if steps and jax.process_count() > 1:
            multihost_utils.sync_global_devices("sonew_pax.checkpoints.quarantine")
        if steps:
            self._manager.reload()

    def reached_preemption(self, step: int) -> bool:
        """Whether all processes agree a preemption notice arrived (multi-process runs)."""
        return jax.process_count() > 1 and self._manager.reached_preemption(step)

    def close(self) -> None:
        """Waits for pending writes and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


class StopSignal:
    """Turns SIGTERM into a flag the training loop polls (single-process runs).

    In multi-process runs JAX's preemption service handles SIGTERM and the loop asks
    `Checkpoints.reached_preemption`, so that every process stops at the same step.
    """

    def __init__(self):
        self.received = False

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        logging.warning("Received signal %d: saving a checkpoint and stopping.", signum)
        self.received = True

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignal"]:
        """Handles SIGTERM while the block runs; restores the previous handler after it."""
        if jax.process_count() > 1:
            yield self
            return
        previous = signal.signal(signal.SIGTERM, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)
