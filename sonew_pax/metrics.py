"""Where a run's numbers go: TensorBoard events, ``metrics.jsonl`` and a progress line.

Layout under MODEL_DIR: ``train/`` and ``eval/`` hold TensorBoard event files; ``metrics.jsonl``
has one JSON object per training step (``step``, ``loss``, ``learning_rate``, ``grad_norm``; the
steps that evaluated add ``eval_loss`` and ``eval_perplexity``); a non-finite value is written as
``null`` (JSON has no NaN) and left out of the TensorBoard events. Only process 0 writes; other
processes get a writer that does nothing.

MODEL_DIR on an object store (gs://, s3://, az://; `sonew_pax.paths`): objects cannot be appended
to, so the JSONL file and the event files are kept whole (the JSONL in memory, the events in a
local staging directory written by tensorboardX) and each upload replaces the object with the
complete file, through epath (the same backend and credentials as the checkpoints, for every
scheme; tensorboardX's own writers cover only gs:// and s3://, the latter through boto3).
Uploads happen on ``flush(force=True)`` (before every checkpoint, and at close) and otherwise at
most every ``upload_every_s`` seconds. Readers see the previous or the new object, never a part.

`ProfileWindow` traces a window of steps with ``jax.profiler`` into ``MODEL_DIR/profile/``.
"""

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Mapping

import jax
from absl import logging
from etils import epath
from tensorboardX import SummaryWriter

from sonew_pax import paths

METRICS_FILE = "metrics.jsonl"
EVENT_DIRS = ("train", "eval")


def truncate_jsonl(path: str | os.PathLike, last_step: int) -> str:
    """Keeps only the well-formed lines of ``path`` whose step is at most ``last_step``.

    A resumed run calls this with its restored step, so the lines a killed run wrote after its last
    checkpoint (and any half-written final line) are replaced by the resumed run's, and the file
    reads like one uninterrupted run. Returns the kept text ("" when there is no file).
    """
    path = paths.as_path(path)
    if not path.exists():
        return ""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", math.inf) <= last_step:
            kept.append(line)
    text = "".join(line + "\n" for line in kept)
    path.write_text(text)
    return text


class MetricsWriter:
    """TensorBoard and JSONL output of one run (a no-op unless ``enabled``, i.e. on process 0).

    Args:
      model_dir: the run directory, local or an object-store URI.
      enabled: whether this process writes.
      resume_step: lines of ``metrics.jsonl`` past this step are dropped (see `truncate_jsonl`).
      upload_every_s: object stores only: the least time between two unforced uploads.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        enabled: bool,
        resume_step: int = 0,
        upload_every_s: float = 60.0,
    ):
        self.enabled = enabled
        if not enabled:
            return
        self.model_dir = paths.model_dir(model_dir)
        self.cloud = paths.is_cloud(self.model_dir)
        self._upload_every_s = upload_every_s
        jsonl_path = self.model_dir / METRICS_FILE
        kept = truncate_jsonl(jsonl_path, resume_step)
        if self.cloud:
            self._lines = [kept]
            self._staging = tempfile.mkdtemp(prefix="sonew_pax_events_")
            self._last_upload = time.monotonic()
            event_dirs = [os.path.join(self._staging, name) for name in EVENT_DIRS]
        else:
            self._jsonl = jsonl_path.open("a")
            event_dirs = [os.fspath(self.model_dir / name) for name in EVENT_DIRS]
        self._train, self._eval = (SummaryWriter(logdir) for logdir in event_dirs)

    def _upload(self) -> None:
        """Object stores: replaces metrics.jsonl and each event file with its whole contents."""
        (self.model_dir / METRICS_FILE).write_text("".join(self._lines))
        for name in EVENT_DIRS:
            local = epath.Path(self._staging) / name
            event_files = sorted(local.glob("events*"))
            if event_files:
                (self.model_dir / name).mkdir(parents=True, exist_ok=True)
            for event_file in event_files:
                (self.model_dir / name / event_file.name).write_bytes(event_file.read_bytes())
        self._last_upload = time.monotonic()

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """One step's scalars: a JSONL line; ``eval_*`` to eval/, the rest to train/ events."""
        if not self.enabled:
            return
        values = {name: float(value) for name, value in scalars.items()}
        record = {"step": step, **{k: v if math.isfinite(v) else None for k, v in values.items()}}
        line = json.dumps(record, allow_nan=False) + "\n"
        if self.cloud:
            self._lines.append(line)
        else:
            self._jsonl.write(line)
        for name, value in values.items():
            if not math.isfinite(value):
                continue
            if name.startswith("eval_"):
                self._eval.add_scalar(name.removeprefix("eval_"), value, step)
            else:
                self._train.add_scalar(name, value, step)

    def flush(self, force: bool = True) -> None:
        """Pushes everything written so far to disk (object stores: uploads it, unless ``force``
        is False and the last upload is less than ``upload_every_s`` old)."""
        if not self.enabled:
            return
        self._train.flush()
        self._eval.flush()
        if not self.cloud:
            self._jsonl.flush()
        elif force or time.monotonic() - self._last_upload >= self._upload_every_s:
            self._upload()

    def close(self) -> None:
        """Flushes and closes all files."""
        if not self.enabled:
            return
        self._train.close()
        self._eval.close()
        if not self.cloud:
            self._jsonl.close()
            return
        try:
            self._upload()
        finally:
            shutil.rmtree(self._staging, ignore_errors=True)


PROFILE_DIR = "profile"


class ProfileWindow:
    """Traces steps ``start .. start + count - 1`` of a run with ``jax.profiler`` into
    ``MODEL_DIR/profile/`` (TensorBoard's profile plugin or Perfetto read it), on this process
    only when ``enabled`` (process 0: one trace per run). ``steps`` is ``(start, count)`` or None
    (off); steps are numbered as in metrics.jsonl (step ``s`` is the ``s``-th update).

    The loop calls `before` with the step it is about to run and `after` with the step it ran and
    that step's outputs, which the window waits for before it stops, so the trace holds the
    window's device work whole.
    """

    def __init__(self, steps: tuple[int, int] | None, model_dir: epath.Path, enabled: bool):
        self.first, self.last = (0, -1) if steps is None else (steps[0], steps[0] + steps[1] - 1)
        self.directory = model_dir / PROFILE_DIR
        self.enabled = enabled and steps is not None
        self.active = False

    def before(self, step: int) -> None:
        """Starts the trace when ``step`` opens the window."""
        if self.enabled and step == self.first:
            jax.profiler.start_trace(os.fspath(self.directory))
            self.active = True
            logging.info("Profiling steps %d to %d into %s", self.first, self.last, self.directory)

    def after(self, step: int, outputs: object) -> None:
        """Stops the trace once ``step``, the window's last, has finished on the device."""
        if self.active and step >= self.last:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stops a trace still running (a run that ended or failed inside the window)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m05s"``; ``65`` -> ``"1m05s"``; ``7`` -> ``"7s"``."""
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


# Peak dense bf16 FLOP/s of one device, by a part of jax's ``device_kind`` (first match wins).
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device of ``device_kind`` (`PEAK_BF16_FLOPS`); None if
    unknown (MFU is then not reported)."""
    return next((flops for part, flops in PEAK_BF16_FLOPS if part in device_kind), None)


class Progress:
    """Logs ``step, loss, steps/s, tokens/s (per device), MFU, ETA`` every ``every`` steps.

    Rates are measured over the steps since the previous line, so compilation only slows the first.
    MFU (model FLOPs utilisation) is ``tokens/s per device * flops_per_token / peak`` when both are
    known (`sonew_pax.models.flops_per_token`, `peak_flops`).
    """

    def __init__(
        self,
        total_steps: int,
        tokens_per_step: int,
        every: int,
        start_step: int = 0,
        devices: int = 1,
        flops_per_token: float | None = None,
        peak_flops_per_device: float | None = None,
    ):
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.every = max(every, 1)
        self.devices = devices
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_device
        self._last_step = start_step
        self._last_time = time.perf_counter()
        self.window: dict[str, float] = {}

    def due(self, step: int) -> bool:
        """Whether ``step`` gets a progress line (every ``every`` steps, and the last)."""
        return step % self.every == 0 or step == self.total_steps

    def line(self, step: int, loss: float) -> str:
        """The progress line for ``step``; resets the rate window, whose rates it keeps in
        ``window`` (``tokens_per_sec_per_device`` and, when known, ``mfu``)."""
        now = time.perf_counter()
        steps_per_s = (step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = step, now
        eta = (self.total_steps - step) / max(steps_per_s, 1e-9)
        tokens_per_s = steps_per_s * self.tokens_per_step
        per_device = tokens_per_s / self.devices
        self.window = {"tokens_per_sec_per_device": per_device}
        mfu = ""
        if self.flops_per_token and self.peak:
            self.window["mfu"] = per_device * self.flops_per_token / self.peak
            mfu = f" | MFU {self.window['mfu']:.1%}"
        return (
            f"step {step}/{self.total_steps} | loss {loss:.4f} | {steps_per_s:.2f} steps/s | "
            f"{tokens_per_s:,.0f} tokens/s ({per_device:,.0f}/device){mfu} | "
            f"ETA {format_duration(eta)}"
        )

    def log(self, step: int, loss: float) -> dict[str, float]:
        """Emits the progress line for ``step`` through the logging module; returns its rates
        (``window``) for the step's metrics."""
        logging.info(self.line(step, loss))
        return dict(self.window)
