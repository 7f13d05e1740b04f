r"""Two runs of one config, step by step: does a run on new hardware train as its reference does?

The first check on a TPU pod (``launch/tpu_pod.sh check``) trains a few steps of the run's config,
shrunk, on the slice, and the same steps on one host's CPU simulating as many devices (the same
mesh, data, seed and shardings; attention in its reference form), then compares the two runs'
``metrics.jsonl`` here: each step's loss and gradient norm. The gradient norm follows the
optimizer state, so a step whose update differs shows there one step before it shows in the loss.

    python -m sonew_pax.crosscheck RUN_DIR REFERENCE_DIR [--rtol 0.02]

Prints one line per step and exits 0 when every value agrees within ``rtol`` (relative), 1 when
one does not, 2 when a run's metrics are missing or its steps are not the other's.
"""

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from sonew_pax import paths
from sonew_pax.metrics import METRICS_FILE

# What is compared at each step, in the order printed.
COMPARED = ("loss", "grad_norm")


class Difference(NamedTuple):
    """One value of one step in both runs; ``relative`` is ``|run - reference| / |reference|``."""

    step: int
    name: str
    run: float | None
    reference: float | None
    relative: float


def read_steps(model_dir: str) -> dict[int, dict[str, float | None]]:
    """The training steps of ``model_dir``'s ``metrics.jsonl``: step -> its :data:`COMPARED` values.

    Raises:
      FileNotFoundError: the run wrote no ``metrics.jsonl`` (the message names the path).
    """
    path = paths.as_path(model_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} in {model_dir}: did the run start?")
    steps = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if all(name in record for name in COMPARED):
            steps[record["step"]] = {name: record[name] for name in COMPARED}
    return steps


def relative_difference(value: float | None, reference: float | None) -> float:
    """``|value - reference| / |reference|``; 0 when both are equal (non-finite included, stored as
    None), infinite when only one is finite."""
    if value is None or reference is None:
        return 0.0 if value is reference else math.inf
    if value == reference:
        return 0.0
    return abs(value - reference) / abs(reference) if reference else math.inf


def compare(
    run: Mapping[int, Mapping[str, float | None]],
    reference: Mapping[int, Mapping[str, float | None]],
) -> list[Difference]:
    """Each :data:`COMPARED` value of every step, in step order.

    Raises:
      ValueError: the runs logged different steps (one stopped early, or they share none); the
        message names the steps only one of them has.
    """
    if run.keys() != reference.keys():
        only_run, only_reference = sorted(run.keys() - reference), sorted(reference.keys() - run)
        raise ValueError(
            f"the runs logged different steps: only the run has {only_run[:5] or 'none'}, "
            f"only the reference {only_reference[:5] or 'none'} (did one stop early?)"
        )
    steps = sorted(run)
    if not steps:
        raise ValueError("the runs logged no training step")
    return [
        Difference(
            step,
            name,
            run[step][name],
            reference[step][name],
            relative_difference(run[step][name], reference[step][name]),
        )
        for step in steps
        for name in COMPARED
    ]


def report(differences: Sequence[Difference], rtol: float) -> str:
    """A table: one line per step and value, flagged where it is past ``rtol``."""
    lines = [f"{'step':>6}  {'value':<10} {'run':>14} {'reference':>14} {'relative':>10}"]
    for d in differences:
        flag = "  <-- past rtol" if d.relative > rtol else ""
        lines.append(
            f"{d.step:>6}  {d.name:<10} {_number(d.run):>14} {_number(d.reference):>14} "
            f"{d.relative:>10.2e}{flag}"
        )
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "non-finite" if value is None else f"{value:.7g}"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="MODEL_DIR of the run checked")
    parser.add_argument("reference_dir", help="MODEL_DIR of its reference run")
    parser.add_argument("--rtol", type=float, default=0.02, help="largest relative difference")
    args = parser.parse_args(argv)
    try:
        differences = compare(read_steps(args.run_dir), read_steps(args.reference_dir))
    except (FileNotFoundError, ValueError) as error:
        print(f"crosscheck: error: {error}", file=sys.stderr)
        return 2
    print(report(differences, args.rtol))
    worst = max(differences, key=lambda d: d.relative)
    agree = worst.relative <= args.rtol
    verdict = "agree" if agree else "DISAGREE"
    print(
        f"crosscheck: {len(differences) // len(COMPARED)} steps {verdict} within rtol "
        f"{args.rtol:g}; largest difference {worst.relative:.2e} ({worst.name}, step {worst.step})"
    )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
