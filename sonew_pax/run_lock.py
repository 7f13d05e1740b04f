"""One run per MODEL_DIR: a lock file that names its holder, with recovery after a crash.

Two runs writing one MODEL_DIR interleave ``metrics.jsonl``, write two TensorBoard event files and
save checkpoints of two different trajectories under one name space. `RunLock` makes the second
run stop at start, naming the first.

The lock is ``MODEL_DIR/run.lock``, a small JSON file (``host``, ``pid``, ``started``,
``heartbeat``) created exclusively (``O_CREAT | O_EXCL``, atomic on local and network
filesystems). The holder rewrites ``heartbeat`` every ``heartbeat_s`` seconds from a daemon
thread, so that a lock left by a process that died (``kill -9``, a lost node) can be told from a
live one:

- same host, and the holder's pid is not running: stale (the run crashed); taken over at once;
- any host: stale once its heartbeat is older than ``stale_after_s`` (another host cannot be asked
  whether the pid lives, and on this one the pid may have been reused).

A stale lock is renamed ``run.lock.stale-<time>`` (kept, for the record) and a new one created;
two runs that race for the same stale lock both go through the exclusive create, so one wins.

Only process 0 of a multi-process run holds the lock: the processes are one run.

On object stores (gs://, s3://, az://) there is no exclusive create: the lock is written, then
read back after a pause, and a run that finds another's lock stops. That catches a second run
started later, not two started within the same second.
"""

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from sonew_pax import paths
from sonew_pax.errors import RunError

LOCK_FILE = "run.lock"


class RunLockedError(RunError):
    """MODEL_DIR is in use by another run."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock: host name, process id, start time and last heartbeat (Unix seconds)."""

    host: str
    pid: int
    started: float
    heartbeat: float

    @classmethod
    def me(cls) -> "Holder":
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), now, now)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Holder | None":
        """The holder in ``text``; None when the file is not a lock this module wrote."""
        try:
            fields = json.loads(text)
            return cls(str(fields["host"]), int(fields["pid"]), *map(float, (
                fields["started"], fields["heartbeat"])))  # fmt: skip
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"pid {self.pid} on host {self.host} (started {started}, last heartbeat "
            f"{time.time() - self.heartbeat:.0f} s ago)"
        )


def _pid_running(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


# A lock file that does not parse is taken for one being written by a starting run until it is
# this old (its writer needs microseconds), then for the remains of a crash.
UNREADABLE_GRACE_S = 10.0


def is_stale(holder: Holder | None, stale_after_s: float, age_s: float) -> bool:
    """Whether a lock may be taken over (module docstring): ``holder`` as read from the file
    (None: it does not parse), the file ``age_s`` seconds old. An unreadable file is stale once
    older than `UNREADABLE_GRACE_S` (half-written by a crash, not by a run starting now)."""
    if holder is None:
        return age_s > UNREADABLE_GRACE_S
    if holder.host == socket.gethostname() and not _pid_running(holder.pid):
        return True
    return time.time() - holder.heartbeat > stale_after_s


class RunLock:
    """The lock on one run directory (module docstring); use as a context manager.

    Args:
      model_dir: the run directory (local path or URI); created if missing.
      stale_after_s: a lock held from another host whose heartbeat is older than this is stale.
      heartbeat_s: how often the holder refreshes its heartbeat.

    Raises (on entering):
      RunLockedError: another live run holds the lock; the message names it.
    """

    def __init__(
        self, model_dir: str | os.PathLike, stale_after_s: float = 600.0, heartbeat_s: float = 60.0
    ):
        self.path = lock_path(model_dir)
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self._holder: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _create(self, holder: Holder) -> bool:
        """Writes the lock if none exists; False if one does."""
        if paths.is_cloud(self.path):
            if self.path.exists():
                return False
            self.path.write_text(holder.to_json())
            time.sleep(1.0)  # let a concurrent writer's upload land before reading back
            return Holder.from_json(self.path.read_text()) == holder
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as file:
            file.write(holder.to_json())
        return True

    def _read(self) -> Holder | None:
        try:
            return Holder.from_json(self.path.read_text())
        except FileNotFoundError:
            return None

    def acquire(self) -> None:
        """Takes the lock (module docstring) and starts the heartbeat."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        holder = Holder.me()
        for _ in range(3):  # a stale lock set aside may be re-taken by a racing run first
            if self._create(holder):
                self._holder = holder
                self._thread = threading.Thread(target=self._beat, daemon=True)
                self._thread.start()
                return
            current = self._read()
            try:
                age_s = time.time() - self.path.stat().mtime
            except FileNotFoundError:
                continue  # released meanwhile
            if not is_stale(current, self.stale_after_s, age_s):
                raise RunLockedError(
                    f"{self.path.parent} is in use by another run: "
                    f"{current.describe() if current else 'unknown holder'}. Wait for it to "
                    f"finish or stop it; if it is dead and its host cannot say so, remove "
                    f"{self.path}."
                )
            aside = self.path.with_name(f"{LOCK_FILE}.stale-{time.time():.0f}")
            with contextlib.suppress(FileNotFoundError):
                self.path.rename(aside)
                logging.warning(
                    "Took over the lock of a run that is gone (%s); the old lock is %s.",
                    current.describe() if current else "unreadable",
                    aside,
                )
        raise RunLockedError(f"could not take the lock {self.path}: other runs keep taking it.")

    def _is_mine(self, holder: Holder | None) -> bool:
        return holder is not None and (holder.host, holder.pid, holder.started) == (
            self._holder.host,
            self._holder.pid,
            self._holder.started,
        )

    def _beat(self) -> None:
        """Rewrites the heartbeat until released, while the lock is still this run's (errors are
        logged, not raised)."""
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self._is_mine(self._read()):
                    logging.warning("The run lock %s was taken by another run.", self.path)
                    return
                holder = dataclasses.replace(self._holder, heartbeat=time.time())
                paths.write_text_atomic(self.path, holder.to_json())
            except OSError as error:
                logging.warning("Could not refresh the run lock %s: %s", self.path, error)

    def release(self) -> None:
        """Stops the heartbeat and removes the lock, if it is still this run's."""
        if self._holder is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._is_mine(self._read()):
            self.path.unlink()
        self._holder = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


@contextlib.contextmanager
def held(model_dir: str | os.PathLike, **kwargs) -> Iterator[RunLock | None]:
    """`RunLock` on process 0 (one multi-process run is one run); every process raises
    `RunLockedError` when process 0 could not take it, so none is left waiting for the others."""
    lock = RunLock(model_dir, **kwargs) if jax.process_index() == 0 else None
    refused: RunLockedError | None = None
    if lock is not None:
        try:
            lock.acquire()
        except RunLockedError as error:
            refused = error
    if jax.process_count() > 1:
        flag = multihost_utils.broadcast_one_to_all(np.int32(refused is not None))
        if int(flag) and refused is None:
            raise RunLockedError(f"{lock_path(model_dir)} is held by another run (process 0 says).")
    if refused is not None:
        raise refused
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def lock_path(model_dir: str | os.PathLike) -> epath.Path:
    """Where the lock of ``model_dir`` lives."""
    return paths.as_path(model_dir) / LOCK_FILE
