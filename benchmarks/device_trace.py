"""A profiler trace's device time: the kernels of the steps traced, their families and span.

:func:`trace_steps` runs steps under ``jax.profiler.trace`` (Perfetto JSON) and reads the device's
kernel events back (``profile_update``'s measure, also ``update_speed``'s and ``train_step``'s
``--profile_steps``). Off GPU the trace has no device lane: no kernels, 0 ms.
"""

import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax


def device_lanes(trace: dict) -> dict[str, list[dict]]:
    """The complete events of each device lane of a Perfetto trace, by lane name.

    Device lanes are the processes named ``/device:...`` (``/device:GPU:0``); the host's are
    ``/host:...``. Events without a duration (instants, counters, metadata) are skipped.
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    lanes: dict[str, list[dict]] = {}
    for e in events:
        name = names.get(e.get("pid"), "")
        if e.get("ph") == "X" and "dur" in e and name.startswith("/device:"):
            lanes.setdefault(name, []).append(e)
    return lanes


def device_events(trace: dict) -> list[dict]:
    """Every complete event on any device lane (:func:`device_lanes`) of a Perfetto trace."""
    return [e for lane in device_lanes(trace).values() for e in lane]


def device_kernels(trace: dict) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of every :func:`device_events` event."""
    return [(e["name"], float(e["dur"])) for e in device_events(trace)]


def device_span(trace: dict) -> float:
    """Microseconds in which at least one :func:`device_events` event ran: the length of the
    union of their ``[ts, ts + dur]`` intervals."""
    return _span(device_events(trace))


def _span(events: list[dict]) -> float:
    """The length of the union of the events' ``[ts, ts + dur]`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def per_device(trace: dict, steps: int) -> list[dict]:
    """Per-step ``{"device", "busy_ms", "span_ms", "kernels", "families"}`` of each device lane,
    busiest first: a sharded step is as slow as its busiest device."""
    rows = []
    for name, events in device_lanes(trace).items():
        summary = summarize([(e["name"], float(e["dur"])) for e in events], steps)
        rows.append({"device": name, "span_ms": _span(events) / 1e3 / steps, **summary})
    rows.sort(key=lambda r: -r["busy_ms"])
    return rows


def family(name: str) -> str:
    """A kernel's name without XLA's numeric suffixes (``fusion.12`` -> ``fusion``)."""
    return re.sub(r"(\.\d+)+$", "", name)


def summarize(kernels: list[tuple[str, float]], steps: int) -> dict:
    """Per-step kernel time, count and families (largest first) of ``steps`` traced steps."""
    families: dict[str, list[float]] = {}
    for name, us in kernels:
        families.setdefault(family(name), []).append(us)
    rows = [
        {"name": k, "ms": sum(v) / 1e3 / steps, "count": len(v) / steps}
        for k, v in families.items()
    ]
    rows.sort(key=lambda r: -r["ms"])
    return {
        "busy_ms": sum(us for _, us in kernels) / 1e3 / steps,
        "kernels": len(kernels) / steps,
        "families": rows,
    }


def read_trace(directory: Path) -> dict:
    """The Perfetto trace ``jax.profiler.trace(..., create_perfetto_trace=True)`` wrote."""
    paths = sorted(directory.glob("**/perfetto_trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    with gzip.open(paths[-1], "rt") as f:
        return json.load(f)


def trace_steps(step, carry, iters: int, directory: Path | None = None) -> tuple[dict, object]:
    """``iters`` blocking calls ``carry = step(carry)`` under the profiler (the trace kept in
    ``directory``; without one, in a temporary directory removed after reading): returns
    ``({"wall_ms", "idle_ms", "busy_ms", "span_ms", "kernels", "families", "devices"}, carry)``,
    all per step; the first four over all device lanes together, ``devices`` each lane's
    (:func:`per_device`)."""
    if directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return trace_steps(step, carry, iters, Path(tmp))
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        start = time.perf_counter()
        for _ in range(iters):
            carry = jax.block_until_ready(step(carry))
        wall_ms = 1e3 * (time.perf_counter() - start) / iters
    trace = read_trace(directory)
    summary = summarize(device_kernels(trace), iters)
    summary["span_ms"] = device_span(trace) / 1e3 / iters
    summary["devices"] = per_device(trace, iters)
    return {"wall_ms": wall_ms, "idle_ms": wall_ms - summary["span_ms"], **summary}, carry
