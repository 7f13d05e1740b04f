"""How a run's checkpoints lie in MODEL_DIR: the names of complete, unfinished, set-aside and
corrupt saves, and the files that say a save finished.

``checkpoint_<step>/`` is a complete save; orbax writes it first as
``checkpoint_<step>.orbax-checkpoint-tmp*`` and renames it (local) or, on object stores, writes it
in place and adds a commit file last. A save found unfinished at start is renamed
``checkpoint_<step>.partial``; one that cannot be restored is set aside as ``.corrupt``.
"""

import json
import os

from etils import epath

from sonew_pax import paths

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


def step_of(path: epath.Path) -> int | None:
    """The step of a ``checkpoint_<step>`` directory, also under a suffix (``.partial``,
    orbax's temporary marker); None for other names."""
    step = path.name.removeprefix(f"{STEP_PREFIX}_").split(".")[0]
    return int(step) if step.isdigit() else None


def free_name(path: epath.Path, suffix: str) -> epath.Path:
    """A free name ``<path><suffix>`` (or ``<suffix>-1``, ``-2``, ...) next to ``path``."""
    candidate = path.with_name(path.name + suffix)
    index = 0
    while candidate.exists():
        index += 1
        candidate = path.with_name(f"{path.name}{suffix}-{index}")
    return candidate
