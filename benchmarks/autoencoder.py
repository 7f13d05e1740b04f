"""The SONew paper's MNIST autoencoder benchmark (Table 1, appendix Tables 9-10 and 13).

Setup (as in the paper): a dense 784-1000-500-250-30-250-500-1000-784 autoencoder, tanh on every
hidden layer except the 30-unit code layer (linear), glorot-uniform kernels, zero biases. Loss:
sigmoid binary cross-entropy of the output logits against the input pixels (in [0, 1]), summed over
the 784 pixels and averaged over the batch. Batch 1000, 100 epochs over the 60,000 MNIST training
images, reshuffled every epoch (the order depends only on (seed, epoch)). Learning rate: linear
warm-up from 0 over the first 5 epochs, then linear decay to 0 at the end, evaluated at every step
(60 steps per epoch). Reported: the loss on the full training set after training.

Optimizers and the paper's tuned hyperparameters (appendix "Optimal hyperparams for Autoencoder
Benchmark", tables (a) float32 and (b) bfloat16), mapped to optax / `sonew_pax.optim.sonew`:

- sgd: `optax.sgd(lr)`. The table also lists β1, β2, ε for SGD; plain SGD has no such parameters
  (the search covered all four for every optimizer), so they are unused.
- momentum: `optax.sgd(lr, momentum=β1)` (heavy ball); β2, ε unused.
- nesterov: `optax.sgd(lr, momentum=β1, nesterov=True)`; β2, ε unused.
- adagrad: `optax.adagrad(lr, eps=ε)` with optax's `initial_accumulator_value=0.1`; optax adds ε
  inside the square root. β1, β2 unused. The paper names neither the initial accumulator nor where
  ε sits; these are optax's defaults, as a JAX user of the paper's time would have run it.
- rmsprop: `optax.rmsprop(lr, decay=β2, eps=ε, momentum=β1)`, no bias correction, ε inside the
  square root (optax's default; at ε = 1e-10 the placement is immaterial). β1 is read as momentum:
  the tuned lr (4.61e-4) times 1/(1-β1) = 4.6e-3 matches Adam's tuned 3.75e-3, which it would not
  without momentum.
- adam: `optax.adam(lr, b1=β1, b2=β2, eps=ε)`: bias-corrected, ε outside the square root.
- sonew_diag / sonew_tridiag / sonew_band4 / sonew_band10: `sonew(lr, b1=β1, b2=β2, eps=ε,
  band=0|1|4|10, graft="adam", graft_eps=1e-8)`. Our `eps` is an absolute damping added to the
  bias-corrected diagonal of H (the paper's H_0 = εI). The paper gives one ε per optimizer and no
  graft ε: the Adam-graft ε keeps the authors' JAX code's default 1e-8 (`--sonew_graft_eps eps`
  ties it to ε instead). Caveat: the authors' tridiagonal code (init2winit `tds`) adds ε relative
  to each tensor's max absolute row sum of H (ε·||H||_∞) by default, while their banded code adds
  it absolutely. This script's default, `--sonew_damping absolute`, adds the paper's ε as given,
  so the paper's ε may mean a different damping here; `--sweep` scans ε over 8 decades for that
  reason. `--sonew_damping mean --sonew_eps default` runs `sonew()`'s own default instead: ε 0.1
  relative to the mean of each tensor's bias-corrected diagonal. The paper gives no
  hyperparameters for band-10: band-4's are used. No weight decay anywhere (the paper has none).
- sonew_tridiag_lag: sonew_tridiag with `graft_lag=True` (each step scaled by the previous step's
  graft ratio; the first update is zero) and tridiag's hyperparameters: does the lag cost loss?

bfloat16 variant (`--dtype bfloat16`): parameters, activations, gradients and the optax optimizers'
states are bfloat16 (optax initialises states in the parameter dtype; every step stores them back in
their initial dtype); the loss reduction is float32 and SONew keeps its statistics in float32
(`stats_dtype`, per the project's numerics rule). float32 runs use full-precision matmuls by default
(`--matmul_precision highest`; the paper's V100 has no TF32).

Speed: the data lives on the device and a whole epoch is one jitted `lax.scan`. Several runs of one
optimizer (seeds via `--vmap_seeds`, or the lr × ε grid of `--sweep`) are `jax.vmap`ped into one
program. Reported seconds exclude compilation (reported separately) and are per program: divide by
`vmapped_runs` for a vmapped program.

Outputs: a printed table; JSON at `--out` (default `benchmarks/results/autoencoder[_bf16][_sweep]
.json`) `{"device", "date", "config", "rows": [{"optimizer", "dtype", "train_loss", "seconds",
"paper_train_loss", hyperparameters, "curve", ...}]}`; next to it a loss-curve plot (`.png`) and a
markdown table against the paper's numbers (`.md`).

Usage: `python -m benchmarks.autoencoder --optimizers all [--dtype bfloat16] [--sweep]`.
"""

import argparse
import functools
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import common, mnist_data
from sonew_pax import metrics, optim

LAYER_SIZES = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
CODE_LAYER = 3  # index of the dense layer producing the 30-unit code: no activation after it

# The optimizers besides SONew's variants: optax's, from (schedule, β1, β2, ε).
OPTAX = {
    "sgd": lambda lr, b1, b2, eps: optax.sgd(lr),
    "nesterov": lambda lr, b1, b2, eps: optax.sgd(lr, momentum=b1, nesterov=True),
    "momentum": lambda lr, b1, b2, eps: optax.sgd(lr, momentum=b1),
    "adagrad": lambda lr, b1, b2, eps: optax.adagrad(lr, eps=eps),
    "rmsprop": lambda lr, b1, b2, eps: optax.rmsprop(lr, decay=b2, eps=eps, momentum=b1),
    "adam": lambda lr, b1, b2, eps: optax.adam(lr, b1=b1, b2=b2, eps=eps),
}
# SONew rows: their `sonew` keyword arguments besides the hyperparameters and the graft.
SONEW_VARIANTS = {
    "sonew_diag": {"band": 0},
    "sonew_tridiag": {"band": 1},
    "sonew_tridiag_lag": {"band": 1, "graft_lag": True},
    "sonew_band4": {"band": 4},
    "sonew_band10": {"band": 10},
}
OPTIMIZERS = (*OPTAX, *SONEW_VARIANTS)
WITHOUT_EPS = ("sgd", "nesterov", "momentum")

# The paper's tuned (β1, β2, ε, lr); band-10 has none in the paper and reuses band-4's, the
# lagged tridiag row uses tridiag's.
_HP32 = {
    "sgd": (0.99, 0.91, 8.37e-9, 1.17e-2),
    "nesterov": (0.914, 0.90, 3.88e-10, 5.74e-3),
    "adagrad": (0.95, 0.90, 9.96e-7, 1.82e-2),
    "momentum": (0.9, 0.99, 1e-5, 6.89e-3),
    "rmsprop": (0.9, 0.9, 1e-10, 4.61e-4),
    "adam": (0.9, 0.94, 1.65e-6, 3.75e-3),
    "sonew_diag": (0.88, 0.95, 4.63e-6, 1.18e-3),
    "sonew_tridiag": (0.9, 0.96, 1.3e-6, 8.60e-3),
    "sonew_band4": (0.88, 0.95, 1.5e-3, 5.53e-3),
}
_HP16 = {
    "sgd": (0.96, 0.98, 2.80e-2, 1.35e-2),
    "nesterov": (0.914, 0.945, 8.48e-9, 6.19e-3),
    "adagrad": (0.95, 0.93, 2.44e-5, 2.53e-2),
    "momentum": (0.9, 0.99, 0.1, 7.77e-3),
    "rmsprop": (0.9, 0.9, 2.53e-10, 4.83e-4),
    "adam": (0.9, 0.94, 3.03e-10, 3.45e-3),
    "sonew_diag": (0.9, 0.95, 4.07e-6, 8.50e-3),
    "sonew_tridiag": (0.83, 0.954, 1.78e-6, 7.83e-3),
    "sonew_band4": (0.9, 0.96, 1.52e-6, 4.53e-3),
}
PAPER_HPARAMS = {
    dtype: {
        name: dict(zip(("b1", "b2", "eps", "learning_rate"), v, strict=True))
        for name, v in {
            **table,
            "sonew_tridiag_lag": table["sonew_tridiag"],
            "sonew_band10": table["sonew_band4"],
        }.items()
    }
    for dtype, table in (("float32", _HP32), ("bfloat16", _HP16))
}
# The paper's final training losses (Tables 9 and 10; band-10 from Table 13, float32 only).
PAPER_LOSS = {
    "float32": {"sgd": 67.654, "nesterov": 59.087, "adagrad": 54.393, "momentum": 58.651,
                "rmsprop": 53.330, "adam": 53.591, "sonew_diag": 53.025, "sonew_tridiag": 51.723,
                "sonew_band4": 51.357, "sonew_band10": 51.226},
    "bfloat16": {"sgd": 80.454, "nesterov": 72.975, "adagrad": 68.854, "momentum": 70.053,
                 "rmsprop": 53.743, "adam": 54.328, "sonew_diag": 53.29, "sonew_tridiag": 51.937,
                 "sonew_band4": 51.84},
}  # fmt: skip


def init_params(key, dtype) -> list[dict]:
    """Glorot-uniform kernels `(fan_in, fan_out)` (flax Dense layout) and zero biases."""
    keys = jax.random.split(key, len(LAYER_SIZES) - 1)
    init = jax.nn.initializers.glorot_uniform()
    return [
        {
            "kernel": init(k, (n_in, n_out), jnp.float32).astype(dtype),
            "bias": jnp.zeros(n_out, dtype),
        }
        for k, n_in, n_out in zip(keys, LAYER_SIZES[:-1], LAYER_SIZES[1:], strict=True)
    ]


def forward(params: list[dict], x: jax.Array) -> jax.Array:
    """Output logits of the autoencoder for images `x` [B, 784], in the parameters' dtype."""
    h = x.astype(params[0]["kernel"].dtype)
    last = len(params) - 1
    for i, layer in enumerate(params):
        h = h @ layer["kernel"] + layer["bias"]
        if i not in (CODE_LAYER, last):
            h = jnp.tanh(h)
    return h


def loss_sum(params: list[dict], x: jax.Array) -> jax.Array:
    """Sigmoid cross-entropy summed over pixels and over the batch, in float32."""
    logits = forward(params, x).astype(jnp.float32)
    return optax.sigmoid_binary_cross_entropy(logits, x).sum()


def loss_fn(params: list[dict], x: jax.Array) -> jax.Array:
    """The training loss: cross-entropy summed over the 784 pixels, averaged over the batch."""
    return loss_sum(params, x) / x.shape[0]


def full_loss(params: list[dict], data: jax.Array, chunk: int) -> jax.Array:
    """The loss over all of `data`, evaluated in chunks of `chunk` images."""
    n_chunks = data.shape[0] // chunk
    body = data[: n_chunks * chunk].reshape(n_chunks, chunk, -1)
    total = jax.lax.map(lambda x: loss_sum(params, x), body).sum()
    tail = data[n_chunks * chunk :]
    if tail.shape[0]:
        total = total + loss_sum(params, tail)
    return total / data.shape[0]


def lr_schedule(peak, steps_per_epoch: int, epochs: int, warmup_epochs: float):
    """Linear warm-up from 0 over `warmup_epochs`, then linear decay to 0 at the last step."""
    total = epochs * steps_per_epoch
    warmup = min(round(warmup_epochs * steps_per_epoch), total - 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        up = step / max(warmup, 1)
        down = (total - step) / (total - warmup)
        return peak * jnp.clip(jnp.where(step < warmup, up, down), 0.0, 1.0)

    return schedule


def make_tx(
    name: str,
    hp: dict,
    schedule,
    graft_eps: float | str = 1e-8,
    implementation: str = "xla",
    damping: str = "absolute",
) -> optax.GradientTransformation:
    """The transformation ``name`` (`OPTAX`, or `optim.sonew` for `SONEW_VARIANTS`).

    Args:
      name: one of `OPTIMIZERS`.
      hp: ``b1``, ``b2`` and ``eps`` (may be traced).
      schedule: the learning rate, a number or a schedule.
      graft_eps: SONew's Adam-graft ε: a number, or "eps" for ``hp["eps"]``.
      implementation: SONew's: "xla" or "pallas" (the GPU kernels).
      damping: SONew's: "absolute" (ε as given), "mean" or "max" (relative to the diagonal).

    Returns:
      The optax transformation.
    """
    b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
    if name not in SONEW_VARIANTS:
        return OPTAX[name](schedule, b1, b2, eps)
    return optim.sonew(
        schedule,
        b1=b1,
        b2=b2,
        eps=eps,
        graft="adam",
        graft_eps=eps if graft_eps == "eps" else float(graft_eps),
        implementation=implementation,
        damping=damping,
        **SONEW_VARIANTS[name],
    )


def train_step(tx: optax.GradientTransformation, params, opt_state, x: jax.Array):
    """One update on the images ``x``: ``(params, opt_state, loss)``. The optimizer state keeps
    its dtypes: traced (vmapped) float32 hyperparameters would promote bfloat16 states."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, new_state = tx.update(grads, opt_state, params)
    new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, opt_state)
    return optax.apply_updates(params, updates), new_state, loss


def init_run(run_tx, dtype, hp: dict):
    """One run's parameters (from its seed) and optimizer state (``run_tx(hp)``'s)."""
    params = init_params(jax.random.PRNGKey(hp["seed"]), dtype)
    return params, run_tx(hp).init(params)


def train_epoch(run_tx, data: jax.Array, batch_size: int, params, opt_state, hp: dict, epoch):
    """One pass of `train_step` over ``data`` in minibatches, in an order that depends only on
    the run's seed and ``epoch``.

    Args:
      run_tx: a run's hyperparameters -> its transformation (`run_optimizer`'s).
      data: the training images, [N, 784].
      batch_size: images per step (the remainder of an epoch is left out).
      params: the parameters.
      opt_state: the optimizer state.
      hp: the run's ``seed``, ``learning_rate`` and ``eps``.
      epoch: the epoch's index.

    Returns:
      ``(params, opt_state, mean minibatch loss)``.
    """
    tx = run_tx(hp)
    steps = data.shape[0] // batch_size
    order = jax.random.permutation(
        jax.random.fold_in(jax.random.PRNGKey(hp["seed"]), epoch), data.shape[0]
    )

    def step(carry, idx):
        params, opt_state, loss = train_step(tx, *carry, data[idx])
        return (params, opt_state), loss

    batches = order[: steps * batch_size].reshape(steps, batch_size)
    (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), batches)
    return params, opt_state, losses.mean()


class Compiled(NamedTuple):
    """One optimizer's programs over a batch of runs (the leading axis of every argument)."""

    init: Callable  # hps -> (params, opt_state)
    epoch: Callable  # (params, opt_state, hps, epoch) -> (params, opt_state, mean losses)
    evaluate: Callable  # params -> loss on the whole training set
    seconds: float  # compile time


def compile_runs(run_tx, data: jax.Array, args, hps: dict) -> Compiled:
    """`init_run`, `train_epoch` (donating the state) and `full_loss`, vmapped and compiled.

    Args:
      run_tx: a run's hyperparameters -> its transformation (`run_optimizer`'s).
      data: the training images, on the device.
      args: the flags (``--dtype``, ``--batch_size``).
      hps: the runs' ``seed``, ``learning_rate`` and ``eps``, one entry per run along axis 0.

    Returns:
      The `Compiled` programs.
    """
    start = time.perf_counter()
    init = jax.vmap(functools.partial(init_run, run_tx, jnp.dtype(args.dtype)))
    params, opt_state = jax.eval_shape(init, hps)
    epoch = jax.vmap(
        functools.partial(train_epoch, run_tx, data, args.batch_size), in_axes=(0, 0, 0, None)
    )
    epoch_index = jax.ShapeDtypeStruct((), jnp.int32)
    evaluate = jax.vmap(lambda p: full_loss(p, data, args.batch_size))
    return Compiled(
        jax.jit(init).lower(hps).compile(),
        jax.jit(epoch, donate_argnums=(0, 1)).lower(params, opt_state, hps, epoch_index).compile(),
        jax.jit(evaluate).lower(params).compile(),
        time.perf_counter() - start,
    )


def run_optimizer(name: str, args, data: jax.Array, runs: list[dict]) -> list[dict]:
    """Trains all `runs` of one optimizer in one vmapped program; returns one row per run."""
    hp = PAPER_HPARAMS[args.dtype][name]
    steps = data.shape[0] // args.batch_size

    def run_tx(run: dict) -> optax.GradientTransformation:
        """A run's transformation: its schedule peaks at its learning rate, at its ε."""
        schedule = lr_schedule(run["learning_rate"], steps, args.epochs, args.warmup_epochs)
        options = (args.sonew_graft_eps, args.implementation, args.sonew_damping)
        return make_tx(name, {**hp, "eps": run["eps"]}, schedule, *options)

    hps = {
        "seed": jnp.array([r["seed"] for r in runs], jnp.uint32),
        "learning_rate": jnp.array([r["learning_rate"] for r in runs], jnp.float32),
        "eps": jnp.array([r["eps"] for r in runs], jnp.float32),
    }
    with jax.default_matmul_precision(args.matmul_precision):
        programs = compile_runs(run_tx, data, args, hps)
    params, opt_state = programs.init(hps)
    initial = programs.evaluate(params)
    jax.block_until_ready((params, opt_state))
    curve = []
    start = time.perf_counter()
    for epoch in range(args.epochs):
        params, opt_state, mean_loss = programs.epoch(params, opt_state, hps, jnp.int32(epoch))
        curve.append(mean_loss)
        print_progress(name, epoch + 1, args.epochs, mean_loss, start)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    final = np.asarray(programs.evaluate(params))
    curves = np.stack([np.asarray(c) for c in curve], axis=1)
    paper = PAPER_LOSS[args.dtype].get(name)
    return [
        {
            "optimizer": name,
            "dtype": args.dtype,
            "train_loss": float(final[i]),
            "paper_train_loss": paper,
            "seconds": seconds,
            "compile_seconds": programs.seconds,
            "vmapped_runs": len(runs),
            "initial_loss": float(initial[i]),
            **hp,
            **run,
            "curve": [float(v) for v in curves[i]],
        }
        for i, run in enumerate(runs)
    ]


def print_progress(name: str, done: int, total: int, losses, start: float) -> None:
    """One line per epoch: the lowest of the runs' mean minibatch losses (waiting for the
    epoch: one program of ``steps`` updates, so nothing is lost), seconds per epoch since
    ``start`` (a ``time.perf_counter()``) and ETA."""
    best = float(np.min(losses))
    per_epoch = (time.perf_counter() - start) / done
    print(
        f"{name} epoch {done}/{total}: loss {best:.3f} (best of "
        f"{np.size(losses)} runs), {per_epoch:.1f} s/epoch, "
        f"ETA {metrics.format_duration(per_epoch * (total - done))}",
        flush=True,
    )


def sonew_eps_arg(text: str) -> str:
    """``--sonew_eps``: ``paper``, ``default`` or a positive number (checked when parsed)."""
    if text in ("paper", "default"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected paper, default or a number > 0, got {text!r}")
    return text


def runs_for(name: str, args) -> list[dict]:
    """The runs of one optimizer: the paper's lr and ε (SONew's ε from ``--sonew_eps`` unless that
    is ``paper``), or the sweep grid around them, per seed."""
    hp = PAPER_HPARAMS[args.dtype][name]
    if name in SONEW_VARIANTS and args.sonew_eps != "paper":
        # "default": the library's eps (`optim.DEFAULT_EPS`, relative with --sonew_damping mean)
        eps = optim.DEFAULT_EPS if args.sonew_eps == "default" else float(args.sonew_eps)
        hp = {**hp, "eps": eps}
    lr_factors, eps_factors = [1.0], [1.0]
    if args.sweep:
        lr_factors = common.float_list(args.sweep_lr)
        eps_factors = [1.0] if name in WITHOUT_EPS else common.float_list(args.sweep_eps)
        if name in WITHOUT_EPS:
            lr_factors = common.float_list(args.sweep_lr_only)
    return [
        {
            "seed": seed,
            "learning_rate": hp["learning_rate"] * f_lr,
            "eps": hp["eps"] * f_eps,
            "lr_factor": f_lr,
            "eps_factor": f_eps,
        }
        for seed, f_lr, f_eps in itertools.product(range(args.vmap_seeds), lr_factors, eps_factors)
    ]


ROW_COLUMNS = ("optimizer", "dtype", "seed", "learning_rate", "eps", "train_loss",
               "paper_train_loss", "seconds", "vmapped_runs")  # fmt: skip


def markdown_report(result: dict) -> str:
    """A markdown page: every run next to the paper's number, then the best run per optimizer."""
    rows = [
        {
            **r,
            "delta_vs_paper": None
            if r["paper_train_loss"] is None
            else r["train_loss"] - r["paper_train_loss"],
        }
        for r in result["rows"]
    ]
    columns = (*ROW_COLUMNS, "delta_vs_paper")
    best = {}
    for row in rows:
        if row["optimizer"] not in best or row["train_loss"] < best[row["optimizer"]]["train_loss"]:
            best[row["optimizer"]] = row
    config = ", ".join(f"{k}={v}" for k, v in result["config"].items())
    return (
        f"# MNIST autoencoder\n\nDevice: {result['device']}; date: {result['date']}.\n\n"
        f"Config: {config}.\n\nFinal loss on the full training set; `seconds` is the wall time "
        "of one program (compilation excluded), shared by its `vmapped_runs` runs.\n\n"
        f"## All runs\n\n{common.format_table(rows, columns, markdown=True)}\n"
        f"## Best run per optimizer\n\n"
        f"{common.format_table(list(best.values()), columns, markdown=True)}"
    )


def plot_curves(rows: list[dict], path: Path) -> bool:
    """Mean minibatch loss per epoch for every run: the whole run, and the second half zoomed.

    Returns False (and draws nothing) when matplotlib is missing.
    """
    plt = common.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for row in rows:
        label = f"{row['optimizer']} lr={row['learning_rate']:.3g} eps={row['eps']:.3g}"
        epochs = np.arange(1, len(row["curve"]) + 1)
        for ax in axes:
            ax.plot(epochs, row["curve"], label=label, linewidth=1)
    half = max(len(rows[0]["curve"]) // 2, 1)
    tail = [v for row in rows for v in row["curve"][half - 1 :]]
    axes[0].set_yscale("log")
    axes[1].set_xlim(half, max(len(rows[0]["curve"]), half + 1))
    axes[1].set_ylim(min(tail) - 0.5, min(max(tail), min(tail) + 20))
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.set_ylabel("train CE loss (epoch mean of minibatches)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def default_out(args) -> Path:
    """benchmarks/results/autoencoder[_bf16][_sweep].json."""
    suffix = ("_bf16" if args.dtype == "bfloat16" else "") + ("_sweep" if args.sweep else "")
    return common.RESULTS / f"autoencoder{suffix}.json"


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    p.add_argument("--optimizers", default="all", help=f"comma list of {OPTIMIZERS} or 'all'")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--warmup_epochs", type=float, default=5.0)
    common.add_model_args(p, dtype="float32", batch_size=1000)
    p.add_argument("--subset", type=int, default=None, help="use the first N training images")
    p.add_argument("--matmul_precision", default="highest", choices=("default", "high", "highest"))
    p.add_argument("--vmap_seeds", type=int, default=1, help="seeds 0..N-1, vmapped together")
    p.add_argument("--sweep", action="store_true", help="vmapped grid: lr × ε around the paper's")
    p.add_argument("--sweep_lr", default="0.5,1,2", help="lr factors of the grid")
    p.add_argument("--sweep_eps", default="1e-4,1e-2,1,1e2,1e4", help="ε factors of the grid")
    p.add_argument(
        "--sweep_lr_only",
        default="0.25,0.5,1,2,4",
        help="lr factors for optimizers without ε (sgd, momentum, nesterov)",
    )
    p.add_argument(
        "--sonew_graft_eps", default="1e-8", help="SONew's Adam-graft ε: a number, or 'eps' (= ε)"
    )
    p.add_argument(
        "--sonew_damping",
        default="absolute",
        choices=("absolute", "mean", "max"),
        help="SONew's damping: ε as given, or ε times each tensor's mean / max of diag(H)",
    )
    p.add_argument(
        "--sonew_eps",
        default="paper",
        type=sonew_eps_arg,
        help="SONew's ε: 'paper' (the paper's table, per variant), 'default' (the library's, "
        "with --sonew_damping mean: sonew()'s defaults) or a number for every variant",
    )
    p.add_argument(
        "--implementation",
        default="xla",
        choices=("xla", "pallas"),
        help="SONew's implementation (pallas: the GPU kernels)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: by dtype/sweep)")
    p.add_argument(
        "--append", action="store_true", help="keep the other optimizers' rows already in --out"
    )
    args = p.parse_args(argv)
    args.optimizers = OPTIMIZERS if args.optimizers == "all" else args.optimizers.split(",")
    unknown = set(args.optimizers) - set(OPTIMIZERS)
    if unknown:
        p.error(f"unknown optimizers {sorted(unknown)}")
    args.out = args.out or default_out(args)
    return args


def previous_rows(args, header: dict) -> list[dict]:
    """With `--append`: the rows of the other optimizers already in `--out`.

    The file must come from the same device and configuration.
    """
    if not (args.append and args.out.is_file()):
        return []
    previous = json.loads(args.out.read_text())
    if (previous["device"], previous["config"]) != (header["device"], header["config"]):
        raise SystemExit(f"--append: {args.out} has another device or configuration")
    return [r for r in previous["rows"] if r["optimizer"] not in args.optimizers]


def write_outputs(args, result: dict) -> list[str]:
    """The JSON, its markdown report and the loss-curve plot (where matplotlib is installed);
    returns the suffixes written beside the JSON."""
    common.write_json(args.out, result)
    common.write_text(args.out.with_suffix(".md"), markdown_report(result))
    plotted = plot_curves(result["rows"], args.out.with_suffix(".png"))
    return [".md", ".png"] if plotted else [".md"]


def main(argv=None) -> dict:
    """Runs the benchmark, writing the outputs after every optimizer; returns the JSON object."""
    args = parse_args(argv)
    data = jax.device_put(mnist_data.train_images(args.subset))
    config = {k: v for k, v in vars(args).items() if k not in ("optimizers", "out", "append")}
    config["train_images"] = int(data.shape[0])
    result = {"device": common.device_name(), "date": common.utc_date(), "config": config}
    result["rows"] = previous_rows(args, result)
    for name in args.optimizers:
        new_rows = run_optimizer(name, args, data, runs_for(name, args))
        print(common.format_table(new_rows, ROW_COLUMNS), flush=True)
        result["rows"] = sorted(
            result["rows"] + new_rows, key=lambda r: OPTIMIZERS.index(r["optimizer"])
        )
        result["date"] = common.utc_date()
        written = write_outputs(args, result)
    print(common.format_table(result["rows"], ROW_COLUMNS))
    print(f"wrote {args.out} (+ {', '.join(written)})")
    return result


if __name__ == "__main__":
    main()
