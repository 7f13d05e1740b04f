"""LM convergence: steps tridiagonal SONew needs to reach AdamW's final held-out loss.

The paper's LLM comparison at a size one GPU runs in minutes, through the trainer's own pieces:
`sonew_pax.trainer.Trainer` (its train step with `make_optimizer`'s global-norm clipping 1.0, its
evaluation, its state initialiser) on one device, the model of ``configs/models/<--model>.gin``
and an embedded corpus of `sonew_pax.data` (``--source``: the Shakespeare plays,
``shakespeare+kjv`` with the King James Bible, or ``python_code`` for 100M+ models), as bytes or,
with ``--spm_vocab N``, a SentencePiece vocabulary of N pieces (the model's vocab_size follows).

Protocol:

* The same data for every run of a seed (``--seeds``): its training batches (on the device) and
  initial parameters; the same held-out batches, steps and schedule shape (warmup, then cosine to
  0.1x the peak, as ``runs/pretrain.gin``) for all.
* Optimizers (`sonew_pax.optimizers`): ``adamw`` (b1 0.9, b2 0.95, weight decay 0.1 on
  matrices); ``adafactor``, the paper's (`adafactor_unfactored`); ``muon`` (AdamW's b1, b2 on the
  embedding, output and norms; optax's float32 Newton-Schulz iteration), ``muon_bf16`` (the same
  with the iteration and momentum in bfloat16, as the reference runs it; no rates unless asked);
  ``sonew_tridiag`` (band 1, Adam grafting, weight decay 0.1, b2 ``--sonew_b2``). Each sweeps its
  peak learning rates (``--lrs_<name>``), SONew its ``eps`` too (``--sonew_eps``: every learning
  rate with every eps). One compiled step per optimizer: the peak (and SONew's eps) is optimizer
  state (``optax.inject_hyperparams``).
* SONew's damping is the library's unless ``--sonew_damping`` says otherwise: ``"mean"``, where
  ``eps`` is relative, a fraction of the mean of each tensor's bias-corrected diagonal at the
  previous step (default 0.1; 1e-2 to 3e-1 are worth a sweep), the same across models. With
  ``absolute``, ``eps`` is added as given, on the scale of the squared gradients, and its best
  value moves with the model (1e-9 for the 14M byte model, 1e-10 for the 134M one;
  docs/optimizer.md): about nine orders of magnitude below the relative one, so such a value with
  the default damping leaves the diagonal practically undamped.
* Held-out loss at step 0, every ``--eval_every`` steps and at the end. Best setting per
  optimizer: lowest final held-out loss averaged over the seeds every setting has run, reported
  with its curves averaged over all the seeds it has run (re-runs from more seeds merge in).
* Metric: the first step at which SONew's (mean) eval curve reaches AdamW's final held-out loss
  (interpolated between evaluations), over the same for AdamW; also per seed
  (`benchmarks.convergence_report`, which also writes the tables and plots).

Runs go round-robin over the optimizers, middle learning rates (and eps values) first, every seed
of a setting one after the other; the outputs are rewritten after every run, so a sweep cut short
still compares like with like.

Outputs: ``--out`` (default ``benchmarks/results/lm_convergence.json``; its format:
`benchmarks.convergence_report`) and beside it ``<name>.md`` and ``<name>.png``.

Usage: ``python -m benchmarks.lm_convergence`` (GPU defaults); ``--model tiny`` for CPU;
``--sonew_eps 1e-2,3e-2,1e-1`` sweeps SONew's relative eps, ``--sonew_damping absolute
--sonew_eps 1e-10,1e-9,1e-8`` the absolute one; ``--seeds 0,1,2`` runs every setting from each
seed; ``--merge A.json B.json`` merges results of other seeds or settings; ``--processes N`` runs
the sweep in N processes, one per GPU (``--shard k/N`` each), and merges their runs;
``--runs adamw:5e-4:1,sonew:1e-3:0`` runs exactly those settings (a table's missing runs);
``--deadline_s S`` starts no run that would end past S seconds (a machine's time limit);
``--compilation_cache DIR`` keeps the compiled init, step and evaluation of each optimizer in
JAX's persistent cache, so that a later sweep on the same machine skips their compiles;
``--plot_only`` redraws the PNG and markdown from an existing JSON.
"""

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common, train_step
from benchmarks import convergence_report as report
from benchmarks.convergence_report import BASELINE, CANDIDATE, OPTIMIZERS
from sonew_pax import data, metrics, optim, optimizers, partitioning, train_state
from sonew_pax.models import Transformer, count_params
from sonew_pax.optim.config import DAMPINGS
from sonew_pax.trainer import CacheHits, Trainer, persistent_compilation_cache

SOURCES = ("shakespeare", "shakespeare+kjv", "python_code")
LRS = "3.5e-4,5e-4,7e-4,1e-3,1.4e-3"  # every optimizer's optimum inside (benchmarks/README.md)
B1, B2 = 0.9, 0.95
DEFAULT_SONEW_EPS = optim.DEFAULT_EPS  # the library's defaults (sonew's docstring)
MUON = {"beta": B2, "consistent_rms": 0.2, "weight_decay": 0.1, "adam_b1": B1, "adam_b2": B2}
HYPERPARAMS = {
    "adamw": {"b1": B1, "b2": B2, "eps": 1e-8, "weight_decay": 0.1},
    "adafactor": {"factored": False, "decay": "adam (bias-corrected)", "b1": B1, "b2": B2,
                  "eps": 1e-30, "clipping_threshold": 1.0, "weight_decay": 1e-3},
    "muon": MUON,
    "muon_bf16": {**MUON, **train_step.MUON_VARIANTS["muon_bf16"]},  # as train_step's row
    "sonew_tridiag": {"band": 1, "b1": B1, "b2": B2, "eps": DEFAULT_SONEW_EPS, "graft": "adam",
                      "weight_decay": 0.1},
}  # fmt: skip
CLIP_NORM = 1.0

# Each optimizer's factory, and the entries of HYPERPARAMS that only describe it (the JSON keeps
# them) rather than being its arguments.
FACTORIES = {"adamw": optimizers.adamw, "adafactor": optimizers.adafactor_unfactored,
             "muon": optimizers.muon, "muon_bf16": optimizers.muon,
             "sonew_tridiag": optimizers.sonew}  # fmt: skip
DESCRIPTIVE = ("factored", "decay")
# Optimizers a sweep runs only at the rates ``--lrs_<name>`` or ``--runs`` give: Muon with the
# reference's bfloat16 Newton-Schulz iteration is a second Muon row, not a default cost.
OPT_IN = ("muon_bf16",)


# ---------------------------------------------------------------------------------- optimizers


def hyperparameters(
    sonew_eps: float | list[float] = DEFAULT_SONEW_EPS,
    sonew_b2: float = B2,
    sonew_damping: str = optim.DEFAULT_DAMPING,
    sonew_graft_lag: bool = optim.DEFAULT_GRAFT_LAG,
    **sonew_options: Any,
) -> dict[str, dict]:
    """Every optimizer's hyperparameters besides the learning rate; SONew's ``eps`` is ``sonew_eps``
    (the JSON's config records the list of swept values), its ``b2`` ``sonew_b2``, its ``damping``
    ``sonew_damping`` and its ``graft_lag`` ``sonew_graft_lag``. Each of ``sonew_options``
    (``offdiag_dtype``, ``stack_by_shape``, ``stack_dtype``) is a further ``sonew`` argument, set
    only where not None: left to the library, it stays out of the JSON, and results of sweeps that
    never set it still merge with these."""
    hp = {name: dict(values) for name, values in HYPERPARAMS.items()}
    hp[CANDIDATE]["eps"] = list(sonew_eps) if isinstance(sonew_eps, list | tuple) else sonew_eps
    hp[CANDIDATE]["b2"] = sonew_b2
    hp[CANDIDATE]["damping"] = sonew_damping
    hp[CANDIDATE]["graft_lag"] = sonew_graft_lag
    hp[CANDIDATE].update({k: v for k, v in sonew_options.items() if v is not None})
    return hp


def hyperparameters_of(args: argparse.Namespace, sonew_eps: float | None = None) -> dict:
    """`hyperparameters` of the command line's ``--sonew_*`` flags; SONew's ``eps`` is
    ``sonew_eps`` where given, else the list ``--sonew_eps`` sweeps."""
    return hyperparameters(
        args.sonew_eps if sonew_eps is None else sonew_eps,
        args.sonew_b2,
        args.sonew_damping,
        args.sonew_graft_lag,
        offdiag_dtype=args.sonew_offdiag_dtype,
        stack_by_shape=args.sonew_stack_by_shape,
        stack_dtype=args.sonew_stack_dtype,
    )


def base_factory(name: str, hp: dict):
    """The trainer-style factory ``(schedule, *, mesh, param_specs, stacked_axes) -> tx`` of
    optimizer ``name`` with hyperparameters ``hp`` (one entry of `hyperparameters`)."""
    if name not in FACTORIES:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")
    return functools.partial(
        FACTORIES[name], **{k: v for k, v in hp.items() if k not in DESCRIPTIVE}
    )


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


def build_trainer(name: str, config, mesh, args: argparse.Namespace) -> Trainer:
    """The Trainer of optimizer ``name``: the unit-peak schedule of the run's length, the peak
    (and SONew's eps, starting at the first ``--sonew_eps`` value) injected into the optimizer
    state (`hyperparams_in_state`). Its dropout stream is the first seed's (the benchmark's models
    have no dropout)."""
    shape = optimizers.learning_rate_schedule(
        peak_value=1.0,
        warmup_steps=min(args.warmup_steps, args.steps),
        decay=args.decay,
        total_steps=args.steps,
        end_factor=args.end_factor,
    )
    hp = hyperparameters_of(args, args.sonew_eps[0])[name]
    eps = hp.pop("eps") if name == CANDIDATE else None  # SONew's eps is set per run
    return Trainer(
        Transformer(config),
        hyperparams_in_state(base_factory(name, hp), eps),
        shape,
        mesh,
        partitioning.logical_axis_rules(),
        (args.batch_size, args.seq_len),
        args.seeds[0],
    )


# ---------------------------------------------------------------------------------- the runs


def train_run(
    trainer: Trainer,
    name: str,
    lr: float,
    train: list[dict],
    held_out: list[dict],
    eval_every: int,
    eps: float | None = None,
    seed: int = 0,
) -> dict:
    """Trains one run of optimizer ``name`` from ``seed``'s parameters, one step per batch of
    ``train`` (``seed``'s), evaluating on ``held_out`` at step 0, every ``eval_every`` steps and
    at the end.

    Args:
      trainer: the optimizer's Trainer (`build_trainer`).
      name: the optimizer, as the JSON names it.
      lr: the peak learning rate.
      train: the training batches, on the device.
      held_out: the held-out batches, on the device.
      eval_every: steps between evaluations.
      eps: SONew's damping; None for the other optimizers.
      seed: the seed of the initial parameters.

    Returns:
      The run: its setting, eval curve, final and least held-out loss and timings. It stops early
      (``diverged``) when the held-out loss is not finite.
    """
    steps, label = len(train), report.run_name(name, lr, eps, seed)
    start = time.perf_counter()
    state = jax.block_until_ready(set_hyperparams(trainer.init_state(seed), peak=lr, eps=eps))
    init_s = time.perf_counter() - start  # the initialiser's compile and run
    initial = trainer.evaluate(state.params, held_out)["eval_loss"]
    first_eval_s = time.perf_counter() - start  # and the evaluation's compile and run
    curve = {"step": [0], "eval_loss": [_finite_or_none(initial)], "train_loss": [None]}
    losses, diverged, eval_seconds = [], False, 0.0
    for step in range(1, steps + 1):
        state, step_metrics = trainer.step(state, train[step - 1])
        losses.append(step_metrics["loss"])
        if step == 1:  # compiled and run: the step time is measured from here
            jax.block_until_ready(losses)
            first_step_s, timed_from = time.perf_counter() - start, time.perf_counter()
            progress = metrics.Progress(steps, train[0]["inputs"].size, eval_every, start_step=1)
        if not progress.due(step):
            continue
        jax.block_until_ready(state)  # the steps so far are done: evaluation is timed apart
        eval_start = time.perf_counter()
        eval_loss = trainer.evaluate(state.params, held_out)["eval_loss"]
        eval_seconds += time.perf_counter() - eval_start
        train_loss, losses = float(np.mean(jax.device_get(losses))), []
        curve["step"].append(step)
        curve["eval_loss"].append(_finite_or_none(eval_loss))
        curve["train_loss"].append(_finite_or_none(train_loss))
        print(f"  [{label}] {progress.line(step, train_loss)} | eval {eval_loss:.4f}", flush=True)
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
        "optimizer": name,
        "learning_rate": lr,
        "eps": eps,
        "seed": seed,
        "final_eval_loss": None if diverged else curve["eval_loss"][-1],
        "min_eval_loss": min(finite) if finite else None,
        "diverged": diverged,
        "steps": done,
        "seconds": seconds,
        "first_step_s": first_step_s,
        "first_eval_s": first_eval_s,
        "init_s": init_s,
        "ms_per_step": ms,
        "curve": curve,
    }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


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


def expected_seconds(runs: list[dict], name: str) -> float | None:
    """How long a run of optimizer ``name`` should take: its longest finished run's seconds less
    that run's compiling (``compile_s``: this process has its programs now), else the longest
    finished run's of any optimizer, compiling included; None before the first run."""
    same = [run["seconds"] - run.get("compile_s", 0.0) for run in runs if run["optimizer"] == name]
    return max(same or [run["seconds"] for run in runs], default=None)


def sweep_order(args: argparse.Namespace) -> list[tuple[str, float, float | None, int]]:
    """The sweep's (optimizer, lr, eps, seed) runs: ``--runs`` in its order (SONew's at each
    ``--sonew_eps``), else every setting of `run_order` from each of ``--seeds``."""
    eps = {CANDIDATE: args.sonew_eps}
    if args.runs:
        return [(name, lr, e, seed) for name, lr, seed in args.runs for e in eps.get(name, [None])]
    return [
        (*setting, seed) for setting in run_order(learning_rates(args), eps) for seed in args.seeds
    ]


def learning_rates(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each optimizer's peak learning rates (``--lrs_<name>``)."""
    return {name: getattr(args, f"lrs_{name}") for name in OPTIMIZERS}


def build_result(
    runs: list[dict], args: argparse.Namespace, params: int, tokenizer: str, eval_tokens: int
) -> dict:
    """The JSON object for the runs finished so far (``tokenizer``: `tokenizer_name`;
    ``eval_tokens``: the held-out tokens of an evaluation)."""
    lrs = learning_rates(args)
    schedule = {"warmup_steps": args.warmup_steps, "decay": args.decay,
                "end_factor": args.end_factor}  # fmt: skip
    hp = hyperparameters_of(args)
    config = {
        "model": args.model, "dtype": args.dtype, "tokenizer": tokenizer, "source": args.source,
        "data": "embedded corpus, held-out = last 5% of every document", "steps": args.steps,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "eval_every": args.eval_every,
        "eval_batches": args.eval_batches, "eval_tokens": eval_tokens, "schedule": schedule,
        "clip_norm": CLIP_NORM, "seeds": args.seeds, "learning_rates": lrs, "layers": args.layers,
        "hyperparameters": hp, "jax": jax.__version__,
    }  # fmt: skip
    return {
        "device": common.device_name(),
        "code": common.code_fingerprint(),
        "date": common.utc_date(),
        "params": params,
        "config": config,
        "rows": report.summary_rows(runs, lrs, {CANDIDATE: args.sonew_eps}, args.seeds),
        "runs": runs,
    }


def run_processes(argv: list[str], args: argparse.Namespace) -> dict:
    """``--processes N``: the sweep in N child processes at once, one per GPU, each timing its
    steps alone on it (`common.run_shards`); their runs merged into ``--out``."""
    shards = common.run_shards("lm_convergence", argv, args.processes, args.out)
    result = report.merge_results(shards)
    report.write_outputs(result, args.out)
    print(common.format_table(result["rows"], report.ROW_COLUMNS), flush=True)
    return result


# --------------------------------------------------------------------------------------- main


def _on_off(text: str) -> bool:
    """``on`` / ``off`` as a bool."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _distinct(convert: Callable[[str], Any]) -> Callable[[str], list]:
    """An argparse type: a non-empty comma list of distinct values >= 0, each ``convert``ed."""

    def parse(text: str) -> list:
        try:
            values = [convert(x) for x in text.split(",") if x.strip()]
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if not values or any(not v >= 0 for v in values) or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"expected distinct values >= 0, got {text!r}")
        return values

    return parse


def _runs(text: str) -> list[tuple[str, float, int]]:
    """``--runs``: a non-empty comma list of distinct ``OPTIMIZER:LR:SEED`` settings as
    (optimizer, lr, seed); ``sonew`` names SONew, as in ``--lrs_sonew``."""
    names = {("sonew" if name == CANDIDATE else name): name for name in OPTIMIZERS}
    runs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, *values = item.split(":")
        try:
            lr, seed = float(values[0]), int(values[1])
            if name not in names or len(values) != 2 or not lr > 0 or seed < 0:
                raise ValueError
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(
                f"expected OPTIMIZER:LR:SEED (OPTIMIZER one of {', '.join(names)}, LR > 0, "
                f"SEED >= 0), got {item!r}"
            ) from None
        runs.append((names[name], lr, seed))
    if not runs or len(set(runs)) != len(runs):
        raise argparse.ArgumentTypeError(f"expected distinct settings, got {text!r}")
    return runs


def _vocab_size(text: str) -> int:
    """``--spm_vocab``: 0 (bytes) or a vocabulary of at least 2 pieces."""
    try:
        value = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if value < 0 or value == 1:
        raise argparse.ArgumentTypeError(f"expected 0 (bytes) or a size >= 2, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    common.add_model_args(
        p, model="small", dtype="float32", layers=True, batch_size=32, seq_len=256
    )
    p.add_argument("--steps", type=common.int_at_least(1), default=1500)
    p.add_argument("--seeds", type=_distinct(int), default="0", help="comma-separated seeds")
    p.add_argument("--source", default="shakespeare", choices=SOURCES, help="embedded corpus")
    p.add_argument("--spm_vocab", type=_vocab_size, default=0, help="0: bytes; N: N spm pieces")
    p.add_argument(
        "--spm_sample_chars",
        type=int,
        default=data.DataConfig.spm_sample_chars,
        help="characters the vocabulary is trained on (python_code: 20000000)",
    )
    p.add_argument("--eval_every", type=common.int_at_least(1), default=100)
    p.add_argument("--eval_batches", type=int, default=16, help="held-out batches per evaluation")
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--decay", default="cosine", choices=optimizers.SCHEDULE_KINDS)
    p.add_argument("--end_factor", type=float, default=0.1)
    for name in OPTIMIZERS:
        flag = "sonew" if name == CANDIDATE else name
        p.add_argument(
            f"--lrs_{flag}",
            dest=f"lrs_{name}",
            type=common.float_list,
            default="" if name in OPT_IN else LRS,
            help=f"comma-separated peak learning rates of {name}",
        )
    p.add_argument(
        "--sonew_eps",
        type=_distinct(float),
        default=f"{DEFAULT_SONEW_EPS:g}",
        help="comma-separated values of SONew's eps, each run at every learning rate",
    )
    p.add_argument("--sonew_damping", default=optim.DEFAULT_DAMPING, choices=DAMPINGS)
    p.add_argument(
        "--sonew_graft_lag", type=_on_off, default=optim.DEFAULT_GRAFT_LAG, metavar="on|off"
    )
    p.add_argument("--sonew_b2", type=float, default=B2, help="SONew's decay of d and e")
    p.add_argument(
        "--sonew_stack_by_shape",
        type=_on_off,
        metavar="on|off",
        help="SONew's stack_by_shape (default: the library's, off; the trainer's gin sets on)",
    )
    p.add_argument(
        "--sonew_offdiag_dtype",
        choices=("float32", "bfloat16"),
        help="storage dtype of SONew's off-diagonal statistics e (default: the library's)",
    )
    p.add_argument(
        "--sonew_stack_dtype",
        choices=("float32", "bfloat16"),
        help="dtype of SONew's stacked copy of the gradients (stack_by_shape; default: theirs)",
    )
    p.add_argument("--out", type=Path, default=common.RESULTS / "lm_convergence.json")
    p.add_argument("--plot_only", action="store_true", help="redraw --out's PNG and markdown")
    p.add_argument("--processes", type=common.int_at_least(1), default=1, help="N: on GPUs 0..N-1")
    p.add_argument("--shard", type=common.shard_arg, help="K/N: every N-th setting from the K-th")
    p.add_argument(
        "--deadline_s",
        type=float,
        default=math.inf,
        help="start no run that its optimizer's longest finished run says would end past this "
        "many seconds from the sweep's start, data loading included (a machine's time limit: a "
        "run cut short is lost)",
    )
    p.add_argument(
        "--compilation_cache",
        help="JAX's persistent compilation cache directory: a later sweep on the same machine "
        "loads the programs an earlier one compiled (init, step and evaluation of each optimizer)",
    )
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge these results into --out")
    p.add_argument(
        "--runs",
        type=_runs,
        help="comma-separated OPTIMIZER:LR:SEED: exactly these runs, in this order, instead of "
        "the --lrs_* grids from each of --seeds (a table's missing runs, the best rate's second "
        "seed), e.g. sonew:1e-3:0,adamw:5e-4:1",
    )
    args = p.parse_args(argv)
    if args.runs:  # the grids and seeds the results record are those of the runs
        for name in OPTIMIZERS:
            lrs = (lr for optimizer, lr, _ in args.runs if optimizer == name)
            setattr(args, f"lrs_{name}", list(dict.fromkeys(lrs)))
        args.seeds = list(dict.fromkeys(seed for *_, seed in args.runs))
    return args


def main(argv=None) -> dict:
    """Runs every (optimizer, lr[, eps], seed) of this process's share, writing the outputs after
    each (or, with ``--merge`` or ``--plot_only``, rewrites them from results); returns them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.processes > 1:
        return run_processes(argv, args)
    if args.plot_only or args.merge:
        results = [json.loads(Path(path).read_text()) for path in args.merge or [args.out]]
        result = report.merge_results(results) if args.merge else results[0]
        report.write_outputs(result, args.out)
        print(common.format_table(result["rows"], report.ROW_COLUMNS), flush=True)
        return result
    start = time.perf_counter()  # --deadline_s counts from here
    config = model_config(args)
    tokenizer = tokenizer_name(args, config.vocab_size)  # not per run: see model_config
    tokenizer_s = time.perf_counter() - start
    mesh = partitioning.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    trainers = {name: build_trainer(name, config, mesh, args) for name in OPTIMIZERS}
    place = trainers[BASELINE].global_batch  # every trainer's batches are laid out alike
    train, held_out = {}, None
    for seed in args.seeds:
        batches, held_out = load_batches(args, seed)
        train[seed] = [place(batch) for batch in batches]
    eval_tokens = int(sum(batch["weights"].sum() for batch in held_out))
    held_out = [place(batch) for batch in held_out]
    params = count_params(trainers[BASELINE].layout.abstract.params)
    print(
        f"{args.model}: {params:,} params; {args.steps} steps x {args.batch_size}x{args.seq_len}; "
        f"held-out {eval_tokens:,} tokens; data ready in {time.perf_counter() - start:.1f}s "
        f"(the tokenizer in {tokenizer_s:.1f}s)",
        flush=True,
    )
    order = sweep_order(args)
    if args.shard is not None:
        k, n = args.shard
        order = order[k::n]

    def save(runs: list[dict]) -> dict:
        result = build_result(runs, args, params, tokenizer, eval_tokens)
        report.write_outputs(result, args.out)
        return result

    with persistent_compilation_cache(args.compilation_cache):
        result = sweep(order, trainers, train, held_out, args, start, save)
    if result is None:
        print("no run finished: nothing written", flush=True)
        return {}
    print(common.format_table(result["rows"], report.ROW_COLUMNS), flush=True)
    print(f"total {time.perf_counter() - start:.1f}s; wrote {args.out}", flush=True)
    return result


def sweep(
    order: list[tuple[str, float, float | None, int]],
    trainers: dict[str, Trainer],
    train: dict[int, list[dict]],
    held_out: list[dict],
    args: argparse.Namespace,
    start: float,
    save: Callable[[list[dict]], dict],
) -> dict | None:
    """Trains the (optimizer, lr, eps, seed) runs of ``order`` one after another, calling
    ``save`` with the runs so far after each (each run with ``cache_hits``, the executables it
    loaded from the persistent compilation cache, and ``compile_s``, its seconds of tracing,
    lowering and compiling), until the next would end past
    ``--deadline_s`` from ``start``; returns what the last ``save`` returned (None: no run)."""
    runs, result = [], None
    for name, lr, eps, seed in order:
        label = report.run_name(name, lr, eps, seed)
        expected = expected_seconds(runs, name)
        left = args.deadline_s - (time.perf_counter() - start)
        if expected is not None and expected > left:
            print(f"stopping before {label}: a run takes about {expected:.0f}s, {left:.0f}s of "
                  "--deadline_s are left", flush=True)  # fmt: skip
            break
        print(f"{label} (run {len(runs) + 1}/{len(order)})", flush=True)
        with CacheHits() as hits, common.compile_seconds() as compiling:
            run = train_run(
                trainers[name], name, lr, train[seed], held_out, args.eval_every, eps, seed
            )
        run["cache_hits"], run["compile_s"] = hits.count, sum(compiling.values())
        print(
            f"  -> final eval {run['final_eval_loss']}, {run['seconds']:.1f}s (first step "
            f"{run['first_step_s']:.1f}s: init {run['init_s']:.1f}s, first evaluation "
            f"{run['first_eval_s'] - run['init_s']:.1f}s; {run['compile_s']:.1f}s compiling, "
            f"{run['cache_hits']} programs from the compilation cache; "
            f"{run['ms_per_step']:.1f} ms/step)",
            flush=True,
        )
        runs.append(run)
        result = save(runs)
    return result


if __name__ == "__main__":
    main()
