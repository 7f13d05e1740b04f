"""Where a run's numbers go: TensorBoard events, ``metrics.jsonl`` and a progress line.

Layout under MODEL_DIR: ``train/`` and ``eval/`` hold TensorBoard event files; ``metrics.jsonl``
has one JSON object per training step (``step``, ``loss``, ``learning_rate``, ``grad_norm``; the
steps that evaluated add ``eval_loss`` and ``eval_perplexity``). Only process 0 writes; other
processes get a writer that does nothing.
"""

import json
import math
import pathlib
import time
from collections.abc import Mapping

from absl import logging
from tensorboardX import SummaryWriter

METRICS_FILE = "metrics.jsonl"


def truncate_jsonl(path: pathlib.Path, last_step: int) -> None:
    """Keeps only the well-formed lines of ``path`` whose step is at most ``last_step``.

    A resumed run calls this with its restored step, so the lines a killed run wrote after its last
    checkpoint (and any half-written final line) are replaced by the resumed run's, and the file
    reads like one uninterrupted run.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", math.inf) <= last_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


class MetricsWriter:
    """TensorBoard and JSONL output of one run (a no-op unless ``enabled``, i.e. on process 0)."""

    def __init__(self, model_dir: str | pathlib.Path, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        if not enabled:
            return
        model_dir = pathlib.Path(model_dir)
        truncate_jsonl(model_dir / METRICS_FILE, resume_step)
        self._jsonl = open(model_dir / METRICS_FILE, "a")  # noqa: SIM115 (closed in close())
        self._train = SummaryWriter(str(model_dir / "train"))
        self._eval = SummaryWriter(str(model_dir / "eval"))

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """One step's scalars: a JSONL line; ``eval_*`` to eval/, the rest to train/ events."""
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in scalars.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        for name, value in record.items():
            if name == "step":
                continue
            if name.startswith("eval_"):
                self._eval.add_scalar(name.removeprefix("eval_"), value, step)
            else:
                self._train.add_scalar(name, value, step)

    def flush(self) -> None:
        """Pushes everything written so far to disk."""
        if self.enabled:
            self._jsonl.flush()
            self._train.flush()
            self._eval.flush()

    def close(self) -> None:
        """Flushes and closes all files."""
        if self.enabled:
            self._jsonl.close()
            self._train.close()
            self._eval.close()


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


class Progress:
    """Logs ``step, loss, steps/s, tokens/s, ETA`` every ``every`` steps.

    Rates are measured over the steps since the previous line, so compilation only slows the first.
    """

    def __init__(self, total_steps: int, tokens_per_step: int, every: int, start_step: int = 0):
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.every = max(every, 1)
        self._last_step = start_step
        self._last_time = time.perf_counter()

    def due(self, step: int) -> bool:
        """Whether ``step`` gets a progress line (every ``every`` steps, and the last)."""
        return step % self.every == 0 or step == self.total_steps

    def line(self, step: int, loss: float) -> str:
        """The progress line for ``step``; resets the rate window."""
        now = time.perf_counter()
        steps_per_s = (step - self._last_step) / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = step, now
        eta = (self.total_steps - step) / max(steps_per_s, 1e-9)
        return (
            f"step {step}/{self.total_steps} | loss {loss:.4f} | {steps_per_s:.2f} steps/s | "
            f"{steps_per_s * self.tokens_per_step:,.0f} tokens/s | ETA {format_duration(eta)}"
        )

    def log(self, step: int, loss: float) -> None:
        """Emits the progress line for ``step`` through the logging module."""
        logging.info(self.line(step, loss))
