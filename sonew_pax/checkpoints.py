"""Checkpoints on disk: save, auto-resume onto any mesh, corrupt-checkpoint fallback, preemption.

Each checkpoint is an orbax directory ``MODEL_DIR/checkpoint_<step>/`` with three items: ``state``
(the whole `TrainState`: step, parameters, full optimizer state), ``data`` (the training data
iterator's position, JSON) and ``manifest`` (JSON: each array's dtype and checksum, and the
trainer's own counters; checkpoints written before it existed have none and still restore).
``MODEL_DIR`` is a local path or a cloud URI (gs://, s3://, az://; see `sonew_pax.paths`).

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
- A save that fails (a write error in orbax's background thread, e.g. a full disk or a file-size
  limit) is found when its write ends: at the next step in single-process runs (`save_failed`),
  at the next save or at `close` otherwise. Once all of its writes have ended (orbax reports the
  first failed one while the others still write), its unfinished directory is removed (the run
  that wrote it knows it failed) and the save is retried at once with the state of that moment,
  waiting ``backoff_s``, then twice as long, ..., up to ``retries`` times; `SaveError` then stops
  the run. So a failure loses at most the steps since the previous successful save, and the
  ``keep`` limit deletes an old checkpoint only once a newer one is complete. ``.partial``
  directories of steps up to a complete checkpoint are removed once it is written (their steps
  have been redone): failed attempts do not pile up.
- Integrity: ``save`` records each array's checksum and finiteness (`integrity.fingerprint`,
  computed on device, independent of the mesh). A state with a non-finite array is never saved
  (`NonFiniteStateError`), so the ``keep`` limit never rotates a finite checkpoint out for a
  non-finite one. At restore the checksums are computed again on the restored arrays: a mismatch
  (bytes changed on disk after the save) or a non-finite array makes the checkpoint corrupt,
  handled as above.
- A checkpoint whose arrays differ in name or shape from the run's (another model or optimizer
  in the same MODEL_DIR) is a configuration error (`ConfigMismatchError`, listing the
  differences), found from orbax's metadata before any array is read; nothing is renamed.
- SIGTERM (preemption) and SIGINT (Ctrl-C) set a flag (`signals.StopSignal`); the training loop
  saves at its current step and exits. A second SIGINT raises KeyboardInterrupt (stop without
  saving). In multi-process runs `Checkpoints.reached_preemption` picks the step.
- Readers of a run's parameters (sampling, export: `Checkpoints.restore_params`) only read: they
  check the same checksums, skip a checkpoint that fails and rename nothing.
"""

import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from sonew_pax import integrity, paths
from sonew_pax.checkpoint_layout import (
    COMMIT_FILE,
    CORRUPT_SUFFIX,
    ORBAX_TMP_MARKER,
    PARTIAL_SUFFIX,
    STEP_PREFIX,
    checkpoint_dir,
    free_name,
    step_of,
    unfinished_saves,
    was_committed,
)
from sonew_pax.errors import RunError
from sonew_pax.train_state import PyTree, TrainState

ITEMS = ("state", "data", "manifest")
T = TypeVar("T")
# How many differing arrays a config-mismatch message lists.
MISMATCH_LINES = 12
# How many times MODEL_DIR is listed when a checkpoint vanishes while it is (a reader beside a
# trainer whose ``keep`` limit deletes one checkpoint per save: the next listing is whole).
LISTING_ATTEMPTS = 3


class NonFiniteStateError(RunError):
    """A state to be saved holds NaN or infinity."""


class SaveError(RunError):
    """A checkpoint could not be written, retries included."""


class ConfigMismatchError(RunError):
    """The checkpoints in MODEL_DIR were written by a run with other arrays (model or optimizer)."""


class Restored(NamedTuple):
    """What `Checkpoints.restore_latest` returns.

    Attributes:
      state: the `TrainState`, on the target's shardings.
      data: the data iterator's position.
      run: the trainer's counters saved with it (``{}`` for checkpoints that have none).
    """

    state: TrainState
    data: dict[str, Any]
    run: dict[str, Any]


def _listed(list_checkpoints: Callable[[], T]) -> T:
    """``list_checkpoints()`` (orbax listing MODEL_DIR), tried again, up to `LISTING_ATTEMPTS`
    times, when a checkpoint vanishes while it reads their metadata."""
    for _ in range(LISTING_ATTEMPTS - 1):
        try:
            return list_checkpoints()
        except (FileNotFoundError, NotADirectoryError) as error:
            logging.warning("A checkpoint vanished while listed (%s); listing again.", error)
    return list_checkpoints()


def _first_line(error: Exception) -> str:
    """``TypeName: first line of the message`` (orbax's errors can run to many lines)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _writers_started(before: set[threading.Thread]) -> list[threading.Thread]:
    """The threads started since ``before`` (a `threading.enumerate` snapshot) that are orbax
    futures: orbax runs each write of a save in a thread that is its own future (``result()``
    waits for the write to end: orbax's `Future` protocol). The worker threads of the pools it
    also starts are not futures and wait for work until the process ends."""
    return [
        thread
        for thread in threading.enumerate()
        if thread not in before and callable(getattr(thread, "result", None))
    ]


class Checkpoints:
    """The run's checkpoints in ``model_dir`` (an orbax CheckpointManager underneath).

    Args:
      model_dir: the run directory.
      keep: how many of the newest checkpoints to keep (None: all); an old one is deleted only
        once a newer one is complete.
      async_save: write in a background thread (the arrays are copied to host before ``save``
        returns, so the next step may reuse their buffers).
      retries: how many times a failed save is tried again before `save` raises `SaveError`.
      backoff_s: the wait before the first retry; each next one waits twice as long.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        keep: int | None = None,
        async_save: bool = True,
        retries: int = 0,
        backoff_s: float = 1.0,
    ):
        self.model_dir = paths.model_dir(model_dir)
        self._keep = keep
        self._retries = retries
        self._backoff_s = backoff_s
        self._pending: int | None = None  # the step whose background write has not been checked
        self._failure: Exception | None = None  # why the last checked write failed
        self._failed_steps: set[int] = set()  # failed saves whose files are not yet removed
        self._writers: list[threading.Thread] = []  # the last save's, for `_join_writers`
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
            max_to_keep=None,  # `_prune`: only after the newer save is known to be complete
            step_prefix=STEP_PREFIX,
            create=True,
            enable_async_checkpointing=async_save,
            **cloud_options,
        )
        self._manager = _listed(
            lambda: ocp.CheckpointManager(self.model_dir, options=options, item_names=ITEMS)
        )

    def _reload(self) -> None:
        """Lists MODEL_DIR's checkpoints again (orbax keeps a list)."""
        _listed(self._manager.reload)

    def describe_newest(self) -> str:
        """Where a stopped run resumes from, in words (for error messages)."""
        steps = self.steps()
        if not steps:
            return "There is no checkpoint yet."
        return f"The newest checkpoint is {checkpoint_dir(self.model_dir, steps[-1])}."

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending."""
        return sorted(self._manager.all_steps())

    def save(
        self,
        state: TrainState,
        data_state: dict[str, Any],
        run: dict[str, Any] | None = None,
        *,
        wait: bool = False,
    ) -> bool:
        """Saves ``state`` at its step with the data position and the trainer's counters ``run``
        (JSON); False if that step is on disk.

        The write runs in the background unless ``wait`` is set or the previous save failed
        (then this one is its retry): those are waited for, and retried on failure as the class
        docstring says.

        Raises:
          NonFiniteStateError: an array of ``state`` holds NaN or infinity; nothing is written.
          SaveError: the save and its ``retries`` failed; no directory of theirs is left.
        """
        self._settle()
        retrying = self._failure is not None
        self._failure = None
        step = int(state.step)
        if step in self._manager.all_steps():
            return False
        manifest = self._manifest(step, state, run)
        items = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            manifest=ocp.args.JsonSave(manifest),
        )
        waits = [self._backoff_s * 2**k for k in range(self._retries)]
        for attempt, delay in enumerate([0.0, *waits]):
            if attempt:
                logging.warning(
                    "Retrying the save of step %d in %.1f s (retry %d of %d).",
                    step, delay, attempt, self._retries,
                )  # fmt: skip
                time.sleep(delay)
                self._remove_failed()
            error = self._write(step, items, wait=wait or retrying or attempt > 0)
            if error is None:
                return True
        raise SaveError(
            f"could not save the checkpoint of step {step} in {self.model_dir} "
            f"({self._retries + 1} attempts): {_first_line(error)}. {self.describe_newest()} "
            "Free space or fix the storage, then rerun to resume from it."
        ) from error

    def _manifest(self, step: int, state: TrainState, run: dict[str, Any] | None) -> dict:
        """The ``manifest`` item of ``state`` (module docstring).

        Raises:
          NonFiniteStateError: an array of ``state`` holds NaN or infinity.
        """
        prints = integrity.fingerprint(state)
        bad = [name for name, (_, _, finite) in prints.items() if not finite]
        if bad:
            raise NonFiniteStateError(
                f"step {step}: the state is not finite ({len(bad)} arrays hold NaN or inf: "
                f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}); not saved. "
                + self.describe_newest()
            )
        return {
            "arrays": {name: {"dtype": d, "checksum": c} for name, (d, c, _) in prints.items()},
            "run": dict(run or {}),
        }

    def _write(self, step: int, items: ocp.args.Composite, wait: bool) -> Exception | None:
        """Starts orbax's save of ``items`` at ``step``; with ``wait``, also waits for it.

        Returns:
          Why the write failed (its directory removed), or None: written, or still writing.
        """
        before = set(threading.enumerate())
        try:
            self._manager.save(step, args=items, force=True)
        except Exception as error:  # the part before the background thread: mkdir, metadata
            logging.error("Checkpoint save at step %d failed: %s", step, _first_line(error))
            self._writers = _writers_started(before)
            self._reclaim_failed(step)
            return error
        self._writers = _writers_started(before)
        self._pending = step
        if wait:
            self._settle()
        return self._failure

    def save_failed(self) -> bool:
        """Whether the background write of the previous save ended in failure (its directory
        removed); without waiting. The next `save` is then its retry.

        Checked only in single-process runs: processes would otherwise see the write end at
        different steps. Multi-process runs find a failure at the next `save` or at `close`.
        """
        if self._pending is None or jax.process_count() > 1:
            return False
        if self._manager.is_saving_in_progress():
            return False
        self._settle()
        return self._failure is not None

    def _settle(self) -> None:
        """Waits for the pending background write, if any, and sets `_failure` to how it
        ended: on success (None) applies the ``keep`` limit and removes superseded partial
        saves; on failure (the error) waits for the write's other writers and removes its
        directory."""
        step, self._pending = self._pending, None
        if step is None:
            return
        self._failure = None
        try:
            self._manager.wait_until_finished()
            self._reload()
            if step not in self._manager.all_steps():
                raise OSError(f"{checkpoint_dir(self.model_dir, step)} is missing after its save")
        except Exception as error:
            logging.error("Checkpoint save at step %d failed: %s", step, _first_line(error))
            self._failure = error
            self._reclaim_failed(step)
            return
        self._writers = []  # all ended: orbax waited for each
        self._prune()
        self._remove_partials(up_to=step)
        self._remove_failed()

    def _prune(self) -> None:
        """Deletes the oldest complete checkpoints beyond ``keep``."""
        if self._keep is not None:
            for step in self.steps()[: -self._keep]:
                self._manager.delete(step)

    def _reclaim_failed(self, step: int) -> None:
        """Notes that the save of ``step`` failed, waits for its writers (`_join_writers`) and
        removes what it left (`_remove_failed`)."""
        self._join_writers()
        if jax.process_index() == 0:  # the process that removes them (`_remove_failed`)
            self._failed_steps.add(step)
        self._remove_failed()
        self._reload()

    def _join_writers(self) -> None:
        """Waits until every writer thread of the last save has ended; their errors are only
        logged (the save's failure is already known).

        Orbax waits for a save's items one by one and stops at the first that fails, while the
        other items' writers go on writing into the save's temporary directory (recreating
        parts of it). Removing that directory, or retrying the save (orbax writes the retry into
        the same temporary directory, removing it first), while they run races with them: the
        retry fails with their errors (a file not found, a directory not empty) instead of its
        own, and files reappear after the removal. Waiting costs the time the failed save takes
        to write its other items.
        """
        writers, self._writers = self._writers, []
        for writer in writers:
            try:
                writer.result()
            except Exception as error:
                logging.info("A writer of the failed save ended with %s", _first_line(error))

    def _remove_failed(self) -> None:
        """Removes the unfinished directories of failed saves (process 0; none is pending, and
        their writers have ended: `_join_writers`).

        A directory that cannot be removed (an error from the storage) is tried again after each
        retry's wait, after each complete save and at `close` (and, after a restart, is set
        aside as ``.partial`` and removed once its step is saved).
        """
        if jax.process_index() != 0:
            return
        left: set[int] = set()
        for path in unfinished_saves(self.model_dir):
            step = step_of(path)
            if step in self._failed_steps:
                try:
                    path.rmtree()
                except OSError as error:
                    logging.info("Removing %s later: %s", path, error)
                    left.add(step)
                    continue
                logging.warning("Removed %s, left by the failed save.", path)
        self._failed_steps = left

    def _remove_partials(self, up_to: int) -> None:
        """Removes the ``.partial`` directories (saves that never finished, set aside at
        start) of steps up to ``up_to``, now redone by a complete checkpoint (process 0)."""
        if jax.process_index() != 0:
            return
        for path in self.model_dir.glob(f"{STEP_PREFIX}_*{PARTIAL_SUFFIX}*"):
            step = step_of(path)
            if step is not None and step <= up_to:
                try:
                    path.rmtree()
                except OSError as error:  # tried again after the next save
                    logging.warning("Could not remove %s: %s", path, error)
                    continue
                logging.info("Removed %s: step %d is saved.", path, up_to)

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
            target = free_name(path.with_name(name), PARTIAL_SUFFIX)
            path.rename(target)
            logging.warning("Unfinished checkpoint save %s ignored; moved to %s.", path, target)

    def restore_latest(self, target: TrainState) -> Restored | None:
        """The newest checkpoint that restores intact, onto ``target``'s shapes and shardings.

        Args:
          target: ShapeDtypeStructs with shardings (`StateLayout.abstract_with_shardings`).

        Returns:
          A `Restored`, or None when there is no checkpoint.

        Raises:
          ConfigMismatchError: a checkpoint holds other arrays than ``target`` (another model or
            optimizer); nothing is renamed.
          RuntimeError: checkpoints exist but none restores; nothing is renamed.
        """
        self._set_aside_partial_saves()
        if paths.is_cloud(self.model_dir):
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("sonew_pax.checkpoints.set_aside")
            self._reload()
        failed: list[tuple[int, Exception]] = []
        for step in reversed(self.steps()):
            try:
                self._check_config(step, target)
                restored = self._restore_intact(step, target)
            except ConfigMismatchError:
                raise
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
            return restored
        if failed:
            step, error = failed[0]
            raise RuntimeError(
                f"no checkpoint in {self.model_dir} restores; the newest, "
                f"{checkpoint_dir(self.model_dir, step)}, fails with: {error}"
            ) from error
        return None

    def _check_config(self, step: int, target: Any) -> None:
        """Raises `ConfigMismatchError` when checkpoint ``step``'s arrays (orbax's metadata) differ
        in name or shape from ``target``'s, a `TrainState` or a dict of some of its fields (then
        only those are compared). Unreadable metadata raises as corruption does."""
        path = checkpoint_dir(self.model_dir, step) / "state"
        saved = integrity.shapes(ocp.StandardCheckpointHandler().metadata(path))
        if isinstance(target, dict):
            saved = {name: shape for name, shape in saved.items() if name.split("/")[0] in target}
        differences = integrity.describe_mismatch(saved, integrity.shapes(target))
        if differences:
            listed = "\n  ".join(differences[:MISMATCH_LINES])
            more = len(differences) - MISMATCH_LINES
            raise ConfigMismatchError(
                f"config mismatch: {checkpoint_dir(self.model_dir, step)} was written by a run "
                f"with another model or optimizer ({len(differences)} arrays differ):\n  "
                f"{listed}" + (f"\n  ... and {more} more" if more > 0 else "") + "\n"
                f"Use a new MODEL_DIR for this configuration, or the configuration that wrote "
                f"{self.model_dir} (its config.gin)."
            )

    def _restore_intact(self, step: int, target: TrainState) -> Restored:
        """Restores checkpoint ``step`` and checks it against its manifest (module docstring).

        Raises:
          ValueError: an array's checksum differs from the one saved, or an array is not finite.
        """
        has_manifest = (checkpoint_dir(self.model_dir, step) / "manifest").exists()
        items = {"state": ocp.args.StandardRestore(target), "data": ocp.args.JsonRestore()}
        if has_manifest:
            items["manifest"] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        state = TrainState(*restored.state)
        integrity.verify(state, restored.manifest if has_manifest else {})
        run = restored.manifest.get("run", {}) if has_manifest else {}
        return Restored(state, restored.data, run)

    def restore_params(self, target: PyTree) -> tuple[int, PyTree]:
        """The parameters of the newest checkpoint that restores intact, onto ``target``'s shapes
        and shardings, read-only: nothing in MODEL_DIR is renamed or written (a run may be saving
        there meanwhile), so a checkpoint that fails is only skipped, with a warning.

        A running trainer's ``keep`` limit may delete the checkpoint being read: the previous
        one is tried, and once all listed have failed, the directory is listed again for
        checkpoints saved meanwhile.

        Args:
          target: the parameters' ShapeDtypeStructs with shardings.

        Returns:
          ``(step, params)``.

        Raises:
          ConfigMismatchError: the checkpoint holds other parameters than ``target``.
          RunError: MODEL_DIR holds no checkpoint, or none restores.
        """
        tried: set[int] = set()
        while steps := [step for step in self.steps() if step not in tried]:
            for step in reversed(steps):
                tried.add(step)
                try:
                    return step, self._restore_params_intact(step, target)
                except ConfigMismatchError:
                    raise
                except Exception as error:
                    path = checkpoint_dir(self.model_dir, step)
                    logging.warning(
                        "Checkpoint %s %s (%s); trying the previous one.",
                        path,
                        "does not restore" if path.exists() else "was deleted while read",
                        _first_line(error),
                    )
            self._reload()
        if not tried:
            raise RunError(f"no checkpoint in {self.model_dir}")
        raise RunError(f"no checkpoint in {self.model_dir} restores (warnings above say why)")

    def _restore_params_intact(self, step: int, target: PyTree) -> PyTree:
        """The parameters alone of checkpoint ``step``, checked against its manifest."""
        wanted = {"params": target}
        self._check_config(step, wanted)
        has_manifest = (checkpoint_dir(self.model_dir, step) / "manifest").exists()
        state = ocp.args.PyTreeRestore(
            item=wanted,
            restore_args=ocp.checkpoint_utils.construct_restore_args(wanted),
            partial_restore=True,
        )
        items = {"state": state}
        if has_manifest:
            items["manifest"] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        integrity.verify(restored.state, restored.manifest if has_manifest else {})
        return restored.state["params"]

    def _quarantine(self, steps: list[int]) -> None:
        """Renames unreadable checkpoints aside (never deleting them); their steps get redone."""
        if steps and jax.process_index() == 0:
            for step in steps:
                path = checkpoint_dir(self.model_dir, step)
                target = free_name(path, CORRUPT_SUFFIX)
                path.rename(target)
                logging.warning("Moved unreadable checkpoint %s to %s.", path, target)
        if steps and jax.process_count() > 1:
            multihost_utils.sync_global_devices("sonew_pax.checkpoints.quarantine")
        if steps:
            self._reload()

    def reached_preemption(self, step: int) -> bool:
        """Whether all processes agree a preemption notice arrived (multi-process runs)."""
        return jax.process_count() > 1 and self._manager.reached_preemption(step)

    def close(self) -> None:
        """Waits for the pending write (a failure is logged, its directory removed: `save` with
        ``wait`` is how a caller learns of it) and releases the manager."""
        self._settle()
        try:
            self._manager.close()
        except Exception:
            if self._failure is None:
                raise
        self._remove_failed()
        for step in self._failed_steps:
            logging.warning(
                "The failed save of step %d left files that could not be removed.", step
            )
