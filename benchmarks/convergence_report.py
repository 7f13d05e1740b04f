"""LM convergence results: summaries, steps-to-reach, merging, plots and markdown.

`benchmarks.lm_convergence` runs the sweeps and writes each result through `write_outputs`:
``{"device", "code", "date", "params", "config", "rows", "runs"}``, where

* ``runs`` has one entry per (optimizer, learning rate, eps, seed): ``{"optimizer",
  "learning_rate", "eps", "seed", "final_eval_loss", "min_eval_loss", "diverged", "steps",
  "seconds", "first_step_s", "first_eval_s", "init_s", "cache_hits", "compile_s", "ms_per_step",
  "curve": {"step", "eval_loss", "train_loss"}}`` (``eps``: SONew's damping, null for the others;
  ``first_eval_s``: of ``first_step_s``, the state's init and the step-0 evaluation, compiles
  included, and ``init_s`` the init alone; ``cache_hits``: executables loaded from the persistent
  compilation cache; ``compile_s``: the run's seconds of tracing, lowering and compiling;
  ``ms_per_step`` excludes evaluations; a merged result's runs also name their ``device`` and
  ``code``, the result's `common.code_fingerprint`; older runs lack ``init_s``, ``cache_hits``,
  ``compile_s`` and ``code``);
* ``rows`` has one per optimizer, its best setting (`summary_rows`): ``{"optimizer",
  "learning_rate", "eps", "final_eval_loss", "steps_to_adamw_final", "steps_ratio_vs_adamw", ...,
  "ms_per_step", "seconds_ratio_vs_adamw", "lr_at_grid_edge", "eps_at_grid_edge", ...}``
  (``seconds_ratio_vs_adamw``: ``steps_ratio_vs_adamw`` times the step-time ratio, both times
  from one card and one code, `timing_group`).

Beside the JSON, ``.md`` holds the tables and ``.png`` the held-out loss against steps (each
optimizer's best run bold, its sweep faint) and against seconds of training steps. Older results
lack ``eps`` or ``seed`` (``config["seed"]`` instead of ``config["seeds"]``); every reader here
accepts them.
"""

import copy
import textwrap
from pathlib import Path

import numpy as np

from benchmarks import common

OPTIMIZERS = ("adamw", "adafactor", "muon", "muon_bf16", "sonew_tridiag")
BASELINE = "adamw"
CANDIDATE = "sonew_tridiag"
ROW_COLUMNS = (
    "optimizer",
    "learning_rate",
    "eps",
    "final_eval_loss",
    "steps_to_adamw_final",
    "steps_ratio_vs_adamw",
    "steps_to_adafactor_final",
    "steps_ratio_vs_adafactor",
    "ms_per_step",
    "seconds_ratio_vs_adamw",
    "lr_at_grid_edge",
    "eps_at_grid_edge",
    "seeds",
    "steps_ratio_vs_adamw_per_seed",
)
RUN_COLUMNS = (
    "optimizer",
    "learning_rate",
    "eps",
    "seed",
    "final_eval_loss",
    "min_eval_loss",
    "ms_per_step",
)
COLORS = {
    "adamw": "tab:blue",
    "adafactor": "tab:green",
    "muon": "tab:purple",
    "muon_bf16": "tab:pink",
    "sonew_tridiag": "tab:red",
}

# What must agree between results merged (`merge_results`): the protocol, not the grid or seeds.
SAME_CONFIG = ("model", "dtype", "tokenizer", "source", "steps", "batch_size", "seq_len",
               "eval_every", "eval_batches", "schedule", "clip_norm", "layers")  # fmt: skip


def run_name(name: str, lr: float, eps: float | None = None, seed: int | None = None) -> str:
    """``name lr=<lr>`` (and `` eps=<eps>`` for SONew, `` seed=<seed>`` when given): a run in
    logs and plot labels."""
    text = f"{name} lr={lr:g}" + ("" if eps is None else f" eps={eps:g}")
    return text + ("" if seed is None else f" seed={seed}")


def run_key(run: dict) -> tuple:
    """(optimizer, learning_rate, eps) of a run or row (eps None where absent: older JSON)."""
    return run["optimizer"], run["learning_rate"], run.get("eps")


# ------------------------------------------------------------------------------------ metrics


def steps_to_reach(steps, losses, target: float) -> float | None:
    """First step where the eval curve reaches ``target``, linearly interpolated; None if never."""
    previous = None
    for step, loss in zip(steps, losses, strict=True):
        if loss is not None and loss <= target:
            if previous is None or previous[1] is None:
                return float(step)
            (s0, l0), (s1, l1) = previous, (step, loss)
            return float(s0 + (s1 - s0) * (l0 - target) / (l0 - l1))
        previous = (step, loss)
    return None


def seeds_of(config: dict) -> list[int]:
    """The seeds of a result's runs (``config["seeds"]``; older results: ``[config["seed"]]``)."""
    return list(config.get("seeds") or [config.get("seed", 0)])


def mean_over_seeds(runs: list[dict], seeds: list[int]) -> list[dict]:
    """One run per (optimizer, lr, eps) that has finished every one of ``seeds``, in the order of
    the runs: its eval and training curves are the means over the seeds (evaluations at the same
    steps), ``final_eval_loss`` and ``min_eval_loss`` those of the mean curve, ``seed`` None and
    ``seeds`` the seeds averaged. It is diverged if any seed's run diverged. A run without a
    ``seed`` (older results) counts as ``seeds[0]``'s. With one seed, the runs as they are."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for run in runs:
        by_key.setdefault(run_key(run), {})[run.get("seed", seeds[0])] = run
    merged = []
    for key, per_seed in by_key.items():
        if any(seed not in per_seed for seed in seeds):
            continue
        group = [per_seed[seed] for seed in seeds]
        if len(group) == 1:
            merged.append({**group[0], "seed": seeds[0], "seeds": list(seeds)})
            continue
        diverged = any(run["diverged"] for run in group)
        length = min(len(run["curve"]["step"]) for run in group)  # a diverged seed stops early
        curve = {"step": group[0]["curve"]["step"][:length]}
        for name in ("eval_loss", "train_loss"):
            columns = zip(*(run["curve"][name][:length] for run in group), strict=True)
            curve[name] = [_mean(values) for values in columns]
        finite = [x for x in curve["eval_loss"] if x is not None]
        merged.append({
            **dict(zip(("optimizer", "learning_rate", "eps"), key, strict=True)),
            "seed": None,
            "seeds": list(seeds),
            "final_eval_loss": None if diverged else curve["eval_loss"][-1],
            "min_eval_loss": min(finite) if finite else None,
            "diverged": diverged,
            "curve": curve,
        })  # fmt: skip
    return merged


def _mean(values) -> float | None:
    """Mean of ``values``, or None if any is None (a seed without that evaluation)."""
    return None if any(v is None for v in values) else float(np.mean(values))


def best_runs(runs: list[dict]) -> dict[str, dict]:
    """The run with the lowest final held-out loss of each optimizer (diverged runs excluded)."""
    best = {}
    for run in runs:
        loss = run["final_eval_loss"]
        if loss is None:
            continue
        if run["optimizer"] not in best or loss < best[run["optimizer"]]["final_eval_loss"]:
            best[run["optimizer"]] = run
    return best


def _seeds_by_setting(runs: list[dict], default: int) -> dict[tuple, set[int]]:
    """The seeds each setting (`run_key`) of ``runs`` has run (a run without one: ``default``)."""
    have: dict[tuple, set[int]] = {}
    for run in runs:
        have.setdefault(run_key(run), set()).add(run.get("seed", default))
    return have


def sweep_seeds(runs: list[dict], seeds: list[int]) -> list[int]:
    """The seeds of ``seeds`` that every setting (`run_key`) of ``runs`` has run: those the
    settings are compared on. A sweep runs every setting from the first seed; the best settings
    may then be re-run from more (``--seeds 1`` with their rates, merged with ``--merge``)."""
    have = _seeds_by_setting(runs, seeds[0]).values()
    return [s for s in seeds if all(s in own for own in have)]


def seeds_run(runs: list[dict], key: tuple, seeds: list[int]) -> list[int]:
    """The seeds of ``seeds`` that setting ``key`` has run."""
    own = _seeds_by_setting(runs, seeds[0]).get(key, set())
    return [s for s in seeds if s in own]


def setting_mean(runs: list[dict], key: tuple, seeds: list[int]) -> dict:
    """Setting ``key``'s run averaged over ``seeds`` (`mean_over_seeds`), all of which it has
    run."""
    (run,) = mean_over_seeds([r for r in runs if run_key(r) == key], seeds)
    return run


def averaged_runs(runs: list[dict], seeds: list[int]) -> list[dict]:
    """Every setting once, its curves the mean over the seeds of ``seeds`` it has run."""
    keys = dict.fromkeys(run_key(run) for run in runs)
    return [setting_mean(runs, key, seeds_run(runs, key, seeds)) for key in keys]


def summary_rows(
    runs: list[dict],
    lrs: dict[str, list[float]],
    eps: dict[str, list[float]] | None = None,
    seeds: list[int] | None = None,
) -> list[dict]:
    """One row per optimizer: its best setting (learning rate and eps), chosen by the mean final
    held-out loss over the seeds every setting has run (`sweep_seeds`), then reported with its
    curve averaged over all the seeds it has run (``seeds``: how many); the steps that curve needs
    to reach the references' final held-out losses (AdamW's, as the metric; Adafactor's, as the
    paper compares), both curves averaged over the seeds both settings have run;
    ``ms_per_step`` (`step_ms`) and ``seconds_ratio_vs_adamw``, the wall-clock ratio at AdamW's
    final loss; ``steps_ratio_vs_adamw_per_seed``: the same ratio from each of those seeds' own
    runs; ``lr_at_grid_edge``: the best rate is the least or greatest of the grid's rates that
    have run (likewise eps). ``eps``: the swept eps values per optimizer (SONew's); ``seeds``:
    all seeds (default ``[0]``)."""
    eps, seeds = eps or {}, seeds or [0]
    chosen = best_runs(mean_over_seeds(runs, sweep_seeds(runs, seeds) or seeds[:1]))
    best = {name: run_key(run) for name, run in chosen.items()}
    times = step_ms(runs, timing_group(runs))
    rows = []
    for name in OPTIMIZERS:
        if name not in best:
            continue
        own_seeds = seeds_run(runs, best[name], seeds)
        run = setting_mean(runs, best[name], own_seeds)
        row = {
            "optimizer": name,
            "learning_rate": run["learning_rate"],
            "eps": run.get("eps"),
            "final_eval_loss": run["final_eval_loss"],
        }
        for ref in (BASELINE, "adafactor"):
            row.update(_steps_vs_best(runs, best[name], best.get(ref), ref, seeds))
        row["ms_per_step"] = times.get(name)
        row["seconds_ratio_vs_adamw"] = _seconds_ratio(row, times.get(BASELINE))
        row["seeds"] = len(own_seeds)
        row["steps_ratio_vs_adamw_per_seed"] = _ratio_per_seed(runs, best[name], best, seeds)
        ran = [r for r in runs if r["optimizer"] == name]
        grid = sorted(set(lrs.get(name, [])) & {r["learning_rate"] for r in ran})
        row["lr_at_grid_edge"] = bool(grid) and run["learning_rate"] in (grid[0], grid[-1])
        eps_grid = sorted(set(eps.get(name) or []) & {r.get("eps") for r in ran})
        row["eps_at_grid_edge"] = (
            run.get("eps") in (eps_grid[0], eps_grid[-1]) if len(eps_grid) > 1 else None
        )
        row["runs_finished"] = len(ran)
        rows.append(row)
    return rows


def _steps_vs_best(runs, key, ref_key, ref_name, seeds) -> dict:
    """`_steps_vs` of setting ``key`` against setting ``ref_key`` (None: not run yet), each
    curve averaged over the seeds both have run."""
    common = [] if ref_key is None else seeds_run(runs, ref_key, seeds)
    common = [s for s in seeds_run(runs, key, seeds) if s in common]
    if not common:
        return _steps_vs(None, None, ref_name)
    mine, ref = (setting_mean(runs, k, common) for k in (key, ref_key))
    return _steps_vs(mine, ref, ref_name)


def _ratio_per_seed(runs, key, best, seeds) -> list[float | None]:
    """``steps_ratio_vs_adamw`` from each seed's own runs of ``key`` and AdamW's best, for the
    seeds both have run ([] before AdamW has run)."""
    if BASELINE not in best:
        return []
    by_seed = {(run_key(r), r.get("seed", seeds[0])): r for r in runs}
    return [
        _steps_vs(by_seed[(key, s)], by_seed[(best[BASELINE], s)], BASELINE)[
            f"steps_ratio_vs_{BASELINE}"
        ]
        for s in seeds
        if (key, s) in by_seed and (best[BASELINE], s) in by_seed
    ]


def timing_group(runs: list[dict]) -> tuple[str, str | None] | None:
    """The (card, code) whose step times the wall-clock columns compare (a merged result's runs
    name their ``device`` and the `common.code_fingerprint` they ran, `merge_results`): of the
    pairs AdamW ran on, the one the most optimizers ran on, then the one with the most of AdamW's
    runs (a step's time does not depend on the learning rate, so one run per optimizer times it);
    ``None`` where no run names a card. Times of another card or other code are not compared:
    a change to the model's step moves every optimizer's time."""
    groups = [_group(r) for r in runs if r["optimizer"] == BASELINE and r.get("device")]
    if not groups:
        return None

    def coverage(group: tuple) -> tuple[int, int]:
        ran = {r["optimizer"] for r in runs if _group(r) == group and r.get("ms_per_step")}
        return len(ran), groups.count(group)

    return max(sorted(set(groups), key=str), key=coverage)


def _group(run: dict) -> tuple[str | None, str | None]:
    return run.get("device"), run.get("code")


def step_ms(runs: list[dict], group: tuple | None = None) -> dict[str, float]:
    """Each optimizer's median ``ms_per_step`` over its runs (every setting runs the same
    compiled step; evaluations excluded) of ``group`` (`timing_group`; ``None``: every run)."""
    times: dict[str, list[float]] = {}
    for run in runs:
        if run.get("ms_per_step") and (group is None or _group(run) == group):
            times.setdefault(run["optimizer"], []).append(run["ms_per_step"])
    return {name: float(np.median(values)) for name, values in times.items()}


def _seconds_ratio(row: dict, baseline_ms: float | None) -> float | None:
    """The wall-clock time ``row``'s optimizer needs to reach AdamW's final held-out loss, over
    AdamW's: ``steps_ratio_vs_adamw`` times the ratio of their step times."""
    ratio, ms = row[f"steps_ratio_vs_{BASELINE}"], row["ms_per_step"]
    if ratio is None or not ms or not baseline_ms:
        return None
    return ratio * ms / baseline_ms


def _steps_vs(run: dict, ref: dict | None, ref_name: str) -> dict:
    """``steps_to_<ref>_final`` and ``steps_ratio_vs_<ref>`` for ``run`` against ``ref``."""
    keys = (f"steps_to_{ref_name}_final", f"steps_ratio_vs_{ref_name}")
    if run is None or ref is None:
        return dict.fromkeys(keys)
    target = ref["final_eval_loss"]
    steps = steps_to_reach(run["curve"]["step"], run["curve"]["eval_loss"], target)
    ref_steps = steps_to_reach(ref["curve"]["step"], ref["curve"]["eval_loss"], target)
    ratio = steps / ref_steps if steps is not None and ref_steps else None
    return {keys[0]: steps, keys[1]: ratio}


# ------------------------------------------------------------------------------------ outputs


def plot(result: dict, path: Path) -> bool:
    """Eval loss vs step: each optimizer's best run bold, the rest of its sweep faint.

    Returns False (and draws nothing) when matplotlib is missing.
    """
    plt = common.pyplot("rerun with --plot_only where it is")
    if plt is None:
        return False
    best = {run_key(row) for row in result["rows"]}
    runs = averaged_runs(result["runs"], seeds_of(result["config"]))
    fig, axes = plt.subplots(1, 3, figsize=(19, 5))
    times = step_ms(result["runs"], timing_group(result["runs"]))
    for run in runs:
        if run_key(run) in best and run["optimizer"] in times:
            _plot_run(axes[2], run, True, True, seconds_per_step=times[run["optimizer"]] / 1e3)
    axes[2].set_xlabel("seconds of training steps (median step time x steps)")
    axes[2].set_title("second half against training time")
    for ax, zoom in zip(axes[:2], (False, True), strict=True):
        for run in runs:
            _plot_run(ax, run, run_key(run) in best, zoom)
        ax.set_xlabel("step")
    adamw = next((r for r in result["rows"] if r["optimizer"] == BASELINE), None)
    for ax in axes:
        if adamw is not None:
            ax.axhline(adamw["final_eval_loss"], color="gray", ls=":", lw=1)
        ax.set_ylabel(f"held-out loss (nats/{_unit(result)})")
        ax.grid(alpha=0.3)
    for ax in axes[1:]:  # the second halves
        _zoom(ax, runs, best)
    if axes[0].get_legend_handles_labels()[0]:  # none before a setting has run every seed
        axes[0].legend(fontsize=8)
    axes[0].set_title("eval loss (best run per optimizer bold, sweep faint)")
    axes[1].set_title("second half; dotted: AdamW's final loss")
    fig.suptitle(textwrap.fill(_title(result), 130), fontsize=10)  # long titles wrap, not clip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_run(ax, run: dict, is_best: bool, zoom: bool, seconds_per_step: float = 0.0) -> None:
    """One run's eval curve against steps, or with ``seconds_per_step`` against seconds."""
    scale = seconds_per_step or 1
    points = [
        (s * scale, y)
        for s, y in zip(*(run["curve"][k] for k in ("step", "eval_loss")), strict=True)
    ]
    points = [(s, y) for s, y in points if y is not None]
    if zoom:
        half = run["curve"]["step"][-1] * scale / 2
        points = [(s, y) for s, y in points if s >= half]
    if not points:
        return
    label = run_name(*run_key(run)) if is_best else None
    style = {"lw": 2.0, "alpha": 1.0} if is_best else {"lw": 0.8, "alpha": 0.3}
    ax.plot(*zip(*points, strict=True), color=COLORS.get(run["optimizer"]), label=label, **style)


def _zoom(ax, runs: list[dict], best: set) -> None:
    """y-range of the second half covering the best runs (the faint ones may leave it)."""
    ys = [
        y
        for run in runs
        if run_key(run) in best
        for s, y in zip(run["curve"]["step"], run["curve"]["eval_loss"], strict=True)
        if y is not None and s >= run["curve"]["step"][-1] / 2
    ]
    if ys:
        pad = 0.1 * (max(ys) - min(ys)) + 1e-3
        ax.set_ylim(min(ys) - pad, max(ys) + pad)


def _unit(result: dict) -> str:
    """What the loss is per: byte or token."""
    return "byte" if result["config"]["tokenizer"].startswith("byte") else "token"


def _title(result: dict) -> str:
    c = result["config"]
    seeds = seeds_of(c)
    swept = sweep_seeds(result["runs"], seeds)
    averaged = f"mean of seeds {_listed(seeds)}, " if len(seeds) > 1 else ""
    if swept != seeds:
        averaged = f"sweep from seed {_listed(swept)}, best settings over seeds {_listed(seeds)}, "
    return (
        f"{c['model']} model ({result['params'] / 1e6:.1f}M params, {c['tokenizer']} tokens), "
        f"{c.get('source', 'shakespeare')}, {averaged}"
        f"{c['steps']} steps x {c['batch_size']}x{c['seq_len']} tokens, "
        f"{result['device']}, {result['date']}"
    )


def _listed(seeds: list[int]) -> str:
    return ",".join(map(str, seeds))


def markdown(result: dict) -> str:
    """The summary table (best run per optimizer), SONew's lr x eps grid of final held-out losses
    (when several eps were run) and the table of every run."""
    return (
        f"# LM convergence\n\n{_title(result)}\n\n"
        "## Best run per optimizer\n\n"
        + common.format_table(result["rows"], ROW_COLUMNS, markdown=True)
        + _eps_grid(averaged_runs(result["runs"], seeds_of(result["config"])))
        + "\n## Every run\n\n"
        + common.format_table(result["runs"], RUN_COLUMNS, markdown=True)
    )


def _eps_grid(runs: list[dict]) -> str:
    """SONew's final held-out loss per learning rate (rows) and eps (columns), or "" when fewer
    than two eps values have runs ('-': not run yet or diverged)."""
    mine = [r for r in runs if r["optimizer"] == CANDIDATE and r.get("eps") is not None]
    eps_values = sorted({r["eps"] for r in mine})
    if len(eps_values) < 2:
        return ""
    final = {(r["learning_rate"], r["eps"]): r["final_eval_loss"] for r in mine}
    columns = ["learning_rate", *(f"eps={e:g}" for e in eps_values)]
    table = [
        {"learning_rate": lr, **{f"eps={e:g}": final.get((lr, e)) for e in eps_values}}
        for lr in sorted({r["learning_rate"] for r in mine})
    ]
    return (
        f"\n## {CANDIDATE}: final held-out loss by learning rate and eps\n\n"
        + common.format_table(table, columns, markdown=True)
    )


def merge_results(results: list[dict]) -> dict:
    """One result from several runs of `lm_convergence` with the same protocol: the shards of one
    sweep (``--processes``), other seeds of it, or more learning rates or eps values. Its grids
    and seeds are the unions of those that ran, its optimizers' hyperparameters the union of
    theirs (a result may add an optimizer, e.g. ``muon_bf16``); settings are compared on the
    seeds all of them have run and reported over all the seeds each has (`summary_rows`).
    Raises ValueError when a setting in ``SAME_CONFIG`` or the hyperparameters of an optimizer
    two results name (SONew's eps grid aside) differ, or a setting ran twice from one seed."""
    first = results[0]["config"]
    hyperparameters = {}
    for result in results:
        for name, hp in result["config"].get("hyperparameters", {}).items():
            if _without_eps(hyperparameters.setdefault(name, hp)) != _without_eps(hp):
                raise ValueError(f"cannot merge: config ['hyperparameters of {name}'] differs")
    for result in results[1:]:
        differs = [k for k in SAME_CONFIG if result["config"].get(k) != first.get(k)]
        if differs:
            raise ValueError(f"cannot merge: config {differs} differs")
    seeds, runs = [], []
    for result in results:
        own = seeds_of(result["config"])
        seeds += [s for s in own if s not in seeds]
        runs += [
            {
                **run,
                "seed": run.get("seed", own[0]),
                "device": run.get("device", result["device"]),
                "code": run.get("code", result.get("code")),
            }
            for run in result["runs"]
        ]
    seeds = [s for s in seeds if any(run["seed"] == s for run in runs)]  # a cut sweep lists more
    keys = [(*run_key(run), run["seed"]) for run in runs]
    if len(set(keys)) != len(keys):
        raise ValueError("cannot merge: a setting ran twice from one seed")
    # The grids are what ran (a diverged run counts): a file's config lists its whole grid even
    # where some of its runs are missing (a shard cut short), and a grid edge that never ran
    # must not look explored.
    lrs = {
        name: sorted({run["learning_rate"] for run in runs if run["optimizer"] == name})
        for name in OPTIMIZERS
    }
    eps = {CANDIDATE: sorted({run["eps"] for run in runs if run["optimizer"] == CANDIDATE})}
    config = {**copy.deepcopy(first), "seeds": seeds, "learning_rates": lrs}
    config.pop("seed", None)
    if hyperparameters:
        config["hyperparameters"] = copy.deepcopy(hyperparameters)
    config["hyperparameters"][CANDIDATE]["eps"] = eps[CANDIDATE]
    return {
        "device": " / ".join(sorted({run["device"] for run in runs})),
        "code": " / ".join(sorted({run["code"] for run in runs if run["code"]})) or None,
        "date": max(r["date"] for r in results),
        "params": results[0]["params"],
        "config": config,
        "rows": summary_rows(runs, lrs, eps, seeds),
        "runs": runs,
    }


def _without_eps(hyperparameters: dict | None) -> dict | None:
    """An optimizer's hyperparameters without its eps (SONew's is a swept grid)."""
    return None if hyperparameters is None else {**hyperparameters, "eps": None}


def write_outputs(result: dict, out: Path) -> None:
    """JSON, markdown and plot, each rewritten atomically."""
    common.write_json(out, result)
    common.write_text(out.with_suffix(".md"), markdown(result))
    plot(result, out.with_suffix(".png"))
