"""Checkpoints on disk: save, auto-resume onto any mesh, corrupt-checkpoint fallback, preemption.

Each checkpoint is an orbax directory ``MODEL_DIR/checkpoint_<step>/`` with two items: ``state``
(the whole `TrainState`: step, parameters, full optimizer state) and ``data`` (the training data
iterator's position, JSON). ``MODEL_DIR`` is a local path or a cloud URI (gs://, s3://, az://;
see `sonew_pax.paths`).

How a save becomes visible only when complete:
- Local (and mounted) paths: orbax writes into ``checkpoint_<step>.orbax-checkpoint-tmp*`` and
  renames it when complete (an atomic rename), so a run killed mid-save leaves no
  ``checkpoint_<step>`` behind.
- Object stores, where a rename is a copy then a delete (not atomic): orbax writes in place and
  finishes with a ``commit_success.txt`` object; a ``checkpoint_<step>`` without it is unfinished
  and not listed as a checkpoint. orbax picks this for gs://; for s3:// and az:// it is set here.

Rules kept here:
- Restores read each array straight into its target sharding, so a checkpoint written on one
  mesh or device count restores on another.
- A checkpoint that fails to restore is reported (a warning naming it), renamed to
  ``checkpoint_<step>.corrupt`` (kept for inspection, invisible to the manager), and the previous
  one is used. A save that never finished (orbax's temporary directory) is reported and renamed
  ``checkpoint_<step>.partial`` (on object stores: a ``checkpoint_<step>`` without its commit
  file). Nothing is ever deleted except by the ``keep`` limit, and no existing checkpoint is
  overwritten. On object stores these renames are copies then deletes: one cut short leaves part
  of the objects under each name, and neither name counts as a checkpoint (the ``.corrupt`` /
  ``.partial`` names are never listed; the original lacks its commit file or already failed to
  restore, and is set aside again on the next start).
- SIGTERM (preemption) sets a flag; the training loop saves at its current step and exits.
"""

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from sonew_pax import paths
from sonew_pax.train_state import TrainState

STEP_PREFIX = "checkpoint"
CORRUPT_SUFFIX = ".corrupt"
PARTIAL_SUFFIX = ".partial"
ORBAX_TMP_MARKER = ".orbax-checkpoint-tmp"
COMMIT_FILE = "commit_success.txt"
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"


def checkpoint_dir(model_dir: str | os.PathLike, step: int) -> epath.Path:
    """Where the checkpoint of ``step`` lives."""
    return paths.as_path(model_dir) / f"{STEP_PREFIX}_{step}"


def unfinished_saves(model_dir: str | os.PathLike) -> list[epath.Path]:
    """Saves that never finished: orbax's temporary directories, and on object stores the
    ``checkpoint_<step>`` directories without their commit file."""
    model_dir = paths.as_path(model_dir)
    found = list(model_dir.glob(f"{STEP_PREFIX}_*{ORBAX_TMP_MARKER}*"))
    if paths.is_cloud(model_dir):
        for path in model_dir.glob(f"{STEP_PREFIX}_*"):
            step = path.name.removeprefix(f"{STEP_PREFIX}_")
            if step.isdigit() and path.is_dir() and not (path / COMMIT_FILE).exists():
                found.append(path)
    return sorted(found, key=str)


def was_committed(path: epath.Path) -> bool:
    """Whether orbax finished writing the checkpoint ``path`` (its step metadata has a commit time).

    Orbax records the commit time after all data is written and just before the rename (local) or
    the commit file (object stores), so this holds for complete checkpoints of both kinds, e.g. one
    written through a gcsfuse mount (renamed, no commit file) now read as gs://.
    """
    try:
        metadata = json.loads((path / STEP_METADATA_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(metadata, dict) and metadata.get("commit_timestamp_nsecs") is not None


def _free_name(path: epath.Path, suffix: str) -> epath.Path:
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
        self, model_dir: str | os.PathLike, keep: int | None = None, async_save: bool = True
    ):
        self.model_dir = paths.model_dir(model_dir)
        # Object stores have no atomic rename: a commit file marks complete saves (orbax's own
        # default for gs://; set explicitly so s3:// and az:// get it too). Local: orbax's default.
        cloud_options = (
            {
                "atomicity_options": ocp.options.AtomicityOptions(
                    mode=ocp.options.AtomicityMode.COMMIT_FILE
                )
            }
            if paths.is_cloud(self.model_dir)
            else {}
        )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            step_prefix=STEP_PREFIX,
            create=True,
            enable_async_checkpointing=async_save,
            **cloud_options,
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
        for path in unfinished_saves(self.model_dir):
            if ORBAX_TMP_MARKER not in path.name and was_committed(path):
                # Complete, but saved with a rename (e.g. through gcsfuse): mark it committed
                # (a new small object; nothing existing is changed) so orbax lists it.
                (path / COMMIT_FILE).write_text(f"Checkpoint {path} committed before; marked.")
                logging.warning("Checkpoint %s had no %s; marked complete.", path, COMMIT_FILE)
                continue
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
        if paths.is_cloud(self.model_dir):
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("sonew_pax.checkpoints.set_aside")
            self._manager.reload()
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
