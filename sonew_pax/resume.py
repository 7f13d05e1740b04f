"""Resuming a run: the checks that a run continues its checkpoint as that was trained.

`restore_or_init` restores MODEL_DIR's newest checkpoint (`checkpoints.Checkpoints`) or
initialises a new state, refusing (`checkpoints.ConfigMismatchError`) a checkpoint this run would
continue differently: other arrays, batch size or seed, or, unless `train`'s
``allow_resume_changes`` names it, one of `RESUMABLE_CHANGES` (`resume_changes`: the data source
and tokenizer the checkpoint names, the learning rates it recorded for the rest of its run,
`schedule_probes`). The refusal lists the gin settings that differ from MODEL_DIR's
``config.gin`` (`config_differences`); `record_config` writes that file and appends each run
segment's operative config to ``config-history.gin``.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import numpy as np
from absl import logging
from etils import epath

from sonew_pax import checkpoints, optimizers, paths
from sonew_pax.train_state import TrainState
from sonew_pax.trainer import Trainer

CONFIG_FILE = "config.gin"
CONFIG_HISTORY_FILE = "config-history.gin"


def record_config(model_dir: epath.Path, step: int, config: str) -> None:
    """Writes a run segment's operative ``config`` to ``config.gin`` and, when it differs from
    the last one recorded there, appends it to ``config-history.gin`` (never rewriting what
    that holds), after a line naming ``step``, where the segment starts.

    Args:
      model_dir: the run directory.
      step: the step the segment starts from.
      config: the operative gin config.
    """
    history = model_dir / CONFIG_HISTORY_FILE
    recorded = history.read_text() if history.exists() else ""
    header = "# sonew_pax: the operative config of the run segment from step "
    if recorded.rpartition(header)[2].partition("\n")[2] != config:
        paths.write_text_atomic(history, f"{recorded}{header}{step}\n{config}")
    paths.write_text_atomic(model_dir / CONFIG_FILE, config)


def gin_bindings(config: str) -> dict[str, str]:
    """``binding -> value`` of a gin config text (``config.gin``), continuation lines joined."""
    bindings: dict[str, str] = {}
    key = None
    for line in config.splitlines():
        if not line.strip() or line.startswith(("#", "import ", "from ")):
            key = None
        elif line[0].isspace() and key is not None:
            bindings[key] += " " + line.strip()
        elif " = " in line:
            key, value = line.split(" = ", 1)
            bindings[key] = value.strip().removesuffix("\\").strip()
    return bindings


def config_differences(saved: str, current: str, limit: int = 12) -> list[str]:
    """Lines naming the bindings whose value differs between two gin configs (changed values
    first, then bindings only one has), at most ``limit``; MODEL_DIR is left out."""
    before, after = gin_bindings(saved), gin_bindings(current)
    changed = [f"{k} = {before[k]} (checkpoints) / {after[k]} (this run)"
               for k in sorted(before.keys() & after.keys())
               if before[k] != after[k] and k != "MODEL_DIR"]  # fmt: skip
    only = [f"{k} = {before[k]} (checkpoints only)" for k in sorted(before.keys() - after.keys())]
    only += [f"{k} = {after[k]} (this run only)" for k in sorted(after.keys() - before.keys())]
    return (changed + only)[:limit]


# What a resumed run may continue differently from its checkpoint only when told to
# (`train`'s ``allow_resume_changes``).
RESUMABLE_CHANGES = ("learning_rate", "data_source", "tokenizer")
# How many steps of the rest of the learning-rate schedule a checkpoint records.
SCHEDULE_PROBES = 17


def schedule_probes(schedule: optimizers.Schedule, step: int, train_steps: int) -> dict[str, float]:
    """The learning rates ``schedule`` gives at `SCHEDULE_PROBES` steps spread evenly over
    ``[step, train_steps]``: the rest of the run, as a checkpoint of ``step`` records it.

    Returns:
      ``{str(step): learning rate}`` (JSON keys).
    """
    steps = np.unique(np.linspace(step, train_steps, SCHEDULE_PROBES).round().astype(int))
    return {str(s): float(schedule(int(s))) for s in steps}


def schedule_departure(
    saved: Mapping[str, float], schedule: optimizers.Schedule, train_steps: int
) -> str | None:
    """Where ``schedule`` departs from the learning rates a checkpoint recorded
    (`schedule_probes`), up to ``train_steps``: a line naming the first such step, or None."""
    for key in sorted(saved, key=int):
        step = int(key)
        if step > train_steps:
            break
        rate = float(schedule(step))
        if not math.isclose(rate, saved[key], rel_tol=1e-5, abs_tol=1e-12):
            return (
                f"the learning rate at step {step} was {saved[key]:.6g} in the run that saved "
                f"it, {rate:.6g} in this one"
            )
    return None


def resume_changes(
    restored: checkpoints.Restored,
    data_state: Mapping[str, Any],
    schedule: optimizers.Schedule,
    train_steps: int,
) -> dict[str, str]:
    """How this run would continue differently from the checkpoint it resumes.

    Args:
      restored: the checkpoint.
      data_state: this run's data state, whose ``source`` and ``tokenizer`` (when it names
        them) are compared with the checkpoint's.
      schedule: this run's learning-rate schedule, compared with the rates the checkpoint
        recorded for the rest of its run.
      train_steps: this run's TRAIN_STEPS.

    Returns:
      ``{name in RESUMABLE_CHANGES: what differs}``; what a checkpoint did not record (one
      written before it did) is not compared.
    """
    changes = {}
    for name, key in (("data_source", "source"), ("tokenizer", "tokenizer")):
        before, after = restored.data.get(key), data_state.get(key)
        if before is not None and after is not None and before != after:
            changes[name] = f"{before} in the run that saved it, {after} in this one"
    departure = schedule_departure(restored.run.get("learning_rate", {}), schedule, train_steps)
    if departure is not None:
        changes["learning_rate"] = departure
    return changes


def _mismatch(ckpts: checkpoints.Checkpoints, message: str) -> checkpoints.ConfigMismatchError:
    """`checkpoints.ConfigMismatchError` of ``message`` followed by the settings that differ
    from MODEL_DIR's ``config.gin`` (`config_differences`)."""
    saved = ckpts.model_dir / CONFIG_FILE
    lines = (
        config_differences(saved.read_text(), gin.operative_config_str()) if saved.exists() else []
    )
    if lines:
        message += f"\nSettings that differ from {saved}:\n  " + "\n  ".join(lines)
    return checkpoints.ConfigMismatchError(message)


def restore_or_init(
    step_fns: Trainer,
    ckpts: checkpoints.Checkpoints,
    batches: Any,
    *,
    seed: int,
    schedule: optimizers.Schedule,
    train_steps: int,
    allowed_changes: Sequence[str],
) -> tuple[TrainState, dict[str, Any]]:
    """The newest restorable checkpoint (moving ``batches`` to its position) and the trainer's
    counters saved with it, else a new state and ``{}``.

    Args:
      step_fns: the run's trainer.
      ckpts: MODEL_DIR's checkpoints.
      batches: the training data iterator.
      seed: initialises a new state.
      schedule: the run's learning-rate schedule (`resume_changes`).
      train_steps: the run's TRAIN_STEPS.
      allowed_changes: the `resume_changes` accepted (with a warning).

    Raises:
      checkpoints.ConfigMismatchError: the checkpoints hold other arrays, or this run would
        continue them with another batch size, seed, or (unless allowed) learning-rate
        schedule, data source or tokenizer; the message adds the settings that differ from the
        run's ``config.gin``.
    """
    try:
        restored = ckpts.restore_latest(step_fns.layout.abstract_with_shardings())
    except checkpoints.ConfigMismatchError as error:
        raise _mismatch(ckpts, str(error)) from None
    if restored is None:
        logging.info("Initialising a new run in %s", ckpts.model_dir)
        return step_fns.init_state(seed), {}
    path = checkpoints.checkpoint_dir(ckpts.model_dir, int(restored.state.step))
    changes = resume_changes(restored, batches.get_state(), schedule, train_steps)
    refused = {name: what for name, what in changes.items() if name not in allowed_changes}
    if refused:
        listed = "\n  ".join(f"{name}: {what}" for name, what in refused.items())
        raise _mismatch(
            ckpts,
            f"config mismatch: this run would not continue {path} as it was trained:\n  "
            f"{listed}\nRerun with the settings that wrote it (MODEL_DIR's config.gin), use a "
            f"new MODEL_DIR, or continue on purpose with "
            f"train.allow_resume_changes = {tuple(refused)!r}.",
        )
    for name, what in changes.items():
        logging.warning("Continuing %s with another %s, as allowed: %s.", path, name, what)
    try:
        batches.set_state(restored.data)
    except ValueError as error:
        raise _mismatch(
            ckpts,
            f"config mismatch: this run's data pipeline cannot continue {path}: {error}. Rerun "
            "with the BATCH_SIZE and SEED that wrote it, or use a new MODEL_DIR.",
        ) from None
    logging.info("Resumed %s from step %d", ckpts.model_dir, int(restored.state.step))
    return restored.state, restored.run
