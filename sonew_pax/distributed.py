"""Multi-process start-up: which processes form this run, and joining them with `jax.distributed`.

JAX runs one process per host (or per GPU), each driving its local devices; `jax.distributed`
connects them through a coordinator on process 0. `initialize` decides how to start from, in
order of precedence:

1. The flags ``--coordinator_address``, ``--process_count``, ``--process_index``.
2. Environment variables, field by field (the first one set wins):

   - coordinator: ``COORDINATOR_ADDRESS``, ``JAX_COORDINATOR_ADDRESS``,
     ``MASTER_ADDR`` + ``MASTER_PORT`` (torchrun / many SLURM scripts);
   - process count: ``PROCESS_COUNT``, ``WORLD_SIZE``, ``SLURM_NTASKS``;
   - process index: ``PROCESS_INDEX``, ``RANK``, ``SLURM_PROCID``.

   Under SLURM without a coordinator, JAX derives one from the job's node list.
3. Cloud TPU: a host with TPU chips calls ``jax.distributed.initialize()`` without arguments;
   JAX reads the slice's workers from the TPU VM metadata (single-host slices work too).
4. Otherwise: a single process, nothing to initialise.

CPU-only multi-process runs (tests, ``launch/local_multiprocess.sh``) use gloo collectives. A peer
that never arrives makes every process fail after ``timeout_s`` with a message saying what to
check, rather than hang.
"""

import contextlib
import dataclasses
import os
import pathlib
import sys
import threading
from collections.abc import Iterator, Mapping

import jax
from absl import logging

# TPU chips are PCI devices with Google's vendor id and one of these device ids (v3, v4, v5p,
# v5e, v6e, 7x; Google's virtual NIC shares the vendor id, so the device id matters).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
COORDINATOR_VARS = ("COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")
PROCESS_COUNT_VARS = ("PROCESS_COUNT", "WORLD_SIZE", "SLURM_NTASKS")
PROCESS_INDEX_VARS = ("PROCESS_INDEX", "RANK", "SLURM_PROCID")
DEFAULT_TIMEOUT_S = 300
# JAX's own initialization timeout is set this much later than ours, so ours reports first.
JAX_TIMEOUT_GRACE_S = 30
TIMEOUT_EXIT_CODE = 3


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """How this process joins the run.

    Attributes:
      mode: ``"single"`` (no initialisation), ``"explicit"`` (coordinator, count and index
        known, or left to JAX's SLURM detection when None) or ``"cloud_tpu"`` (JAX
        auto-detects everything).
      coordinator_address: ``host:port`` of process 0, or None.
      process_count: number of processes, or None (auto-detected).
      process_index: this process's index, or None (auto-detected).
    """

    mode: str
    coordinator_address: str | None = None
    process_count: int | None = None
    process_index: int | None = None


def _first_env(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, value)`` of the first of ``names`` set (non-empty) in ``environ``."""
    for name in names:
        if environ.get(name):
            return name, environ[name]
    return None


def _env_int(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    """The first of ``names`` set in ``environ``, as an int; a non-integer is an error."""
    found = _first_env(environ, names)
    if found is None:
        return None
    name, value = found
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _env_coordinator(environ: Mapping[str, str]) -> str | None:
    """The coordinator ``host:port`` from the environment, or None."""
    found = _first_env(environ, COORDINATOR_VARS)
    if found is not None:
        return found[1]
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        return f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    return None


def has_tpu_chips(sysfs: str | pathlib.Path = "/sys/bus/pci/devices") -> bool:
    """Whether this host has Cloud TPU chips attached (read from sysfs; no network, no JAX)."""
    for device in pathlib.Path(sysfs).glob("*"):
        try:
            vendor = (device / "vendor").read_text().strip()
            device_id = (device / "device").read_text().strip()
        except OSError:
            continue
        if vendor == GOOGLE_PCI_VENDOR and device_id in TPU_PCI_DEVICES:
            return True
    return False


def resolve(
    coordinator_address: str | None,
    process_count: int | None,
    process_index: int | None,
    environ: Mapping[str, str] | None = None,
    on_tpu: bool | None = None,
) -> ProcessGroup:
    """Decides how this process starts from flags, then environment, then hardware.

    Args:
      coordinator_address, process_count, process_index: the flags (None when unset).
      environ: the environment (default ``os.environ``).
      on_tpu: whether this host has TPU chips (default: `has_tpu_chips`).

    Raises:
      ValueError: a multi-process run with no process index, no coordinator (outside SLURM), an
        index outside ``[0, count)``, or a non-integer environment variable; the message names
        the flags and variables that would fix it.
    """
    environ = os.environ if environ is None else environ
    coordinator = coordinator_address or _env_coordinator(environ)
    count = process_count if process_count is not None else _env_int(environ, PROCESS_COUNT_VARS)
    index = process_index if process_index is not None else _env_int(environ, PROCESS_INDEX_VARS)
    if count is not None and count > 1:
        _check_explicit(coordinator, count, index, in_slurm="SLURM_JOB_ID" in environ)
        return ProcessGroup("explicit", coordinator, count, index)
    if count is not None and count < 1:
        raise ValueError(f"process count must be at least 1, got {count}")
    if on_tpu if on_tpu is not None else has_tpu_chips():
        return ProcessGroup("cloud_tpu")
    return ProcessGroup("single", process_count=1, process_index=0)


def _check_explicit(coordinator: str | None, count: int, index: int | None, in_slurm: bool) -> None:
    """Fails early, saying what to set, when an explicit multi-process start lacks a piece."""
    if index is None:
        raise ValueError(
            f"{count} processes but no process index: pass --process_index or set one of "
            f"{', '.join(PROCESS_INDEX_VARS)}"
        )
    if not 0 <= index < count:
        raise ValueError(f"process index {index} is not in [0, {count})")
    if coordinator is None and not in_slurm:
        raise ValueError(
            f"{count} processes but no coordinator address: pass --coordinator_address=HOST:PORT "
            f"(process 0's host) or set {' or '.join(COORDINATOR_VARS)} or MASTER_ADDR and "
            "MASTER_PORT"
        )


def use_gloo_cpu_collectives() -> None:
    """Cross-process collectives for CPU devices go through gloo (over TCP)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize(
    coordinator_address: str | None = None,
    process_count: int | None = None,
    process_index: int | None = None,
    timeout_s: int | None = None,
) -> ProcessGroup:
    """Joins this process to the run (see the module docstring); call before any JAX computation.

    Args:
      coordinator_address, process_count, process_index: the flags (None when unset).
      timeout_s: seconds to wait for every process to reach the coordinator (default: the
        ``DISTRIBUTED_TIMEOUT_S`` environment variable, else 300). When they have not all
        arrived by then, the process prints what to check and exits with `TIMEOUT_EXIT_CODE`
        (JAX's own timeout aborts the interpreter, so a watchdog thread fires first).

    Returns:
      The `ProcessGroup` used.

    Raises:
      ValueError: see `resolve`.
    """
    group = resolve(coordinator_address, process_count, process_index)
    if group.mode == "single":
        return group
    if timeout_s is None:
        timeout_s = _env_int(os.environ, ("DISTRIBUTED_TIMEOUT_S",)) or DEFAULT_TIMEOUT_S
    if group.mode == "explicit":
        use_gloo_cpu_collectives()
    logging.info("Joining a multi-process run: %s (timeout %d s)", group, timeout_s)
    known = None not in (group.coordinator_address, group.process_count, group.process_index)
    with _deadline(timeout_s, _timeout_message(group, timeout_s)):
        jax.distributed.initialize(
            coordinator_address=group.coordinator_address,
            num_processes=group.process_count,
            process_id=group.process_index,
            initialization_timeout=timeout_s + JAX_TIMEOUT_GRACE_S,
            # Fully specified: no cluster detection, which under SLURM would narrow each process
            # to one GPU; this process keeps every device it sees (CUDA_VISIBLE_DEVICES decides).
            cluster_detection_method="deactivate" if known else None,
        )
        logging.info(  # the device count waits for every process's devices: inside the deadline
            "Process %d of %d; %d local devices, %d in all.",
            jax.process_index(),
            jax.process_count(),
            jax.local_device_count(),
            jax.device_count(),
        )
    return group


def _exit_with(message: str) -> None:
    """Prints ``message`` to stderr and ends the process at once (from any thread)."""
    sys.stderr.write(f"ERROR: {message}\n")
    sys.stderr.flush()
    os._exit(TIMEOUT_EXIT_CODE)


@contextlib.contextmanager
def _deadline(timeout_s: float, message: str) -> Iterator[None]:
    """Ends the process with ``message`` unless the block finishes within ``timeout_s``."""
    timer = threading.Timer(timeout_s, _exit_with, args=(message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _timeout_message(group: ProcessGroup, timeout_s: int) -> str:
    """The error text when the processes do not all join: who waited for what, what to check."""
    if group.mode == "cloud_tpu":
        who = "this TPU worker"
        hint = "start the same command on every worker of the slice (--worker=all)"
    else:
        who = f"process {group.process_index} of {group.process_count}"
        hint = (
            "start all processes with the same process count and coordinator address, give each "
            "a distinct index, and make sure process 0's host:port is reachable from every host"
        )
    return (
        f"jax.distributed: {who} timed out after {timeout_s} s waiting for the other processes "
        f"at coordinator {group.coordinator_address or '(auto-detected)'}: a peer never arrived "
        f"or the coordinator is unreachable. Check: {hint}."
    )
