"""Causal attention's implementations side by side: forward + backward time and error.

For each shape (``--shapes``: batch x length x heads x kv_heads x head_dim) and each
implementation that runs on this backend (`sonew_pax.models.attention`: "xla" everywhere,
"cudnn" on GPUs, "splash" on TPUs), times one jitted forward and backward pass (the gradient of
a fixed random projection of the output with respect to queries, keys and values) on
``--dtype`` inputs, the median of ``--iters``, and compares output and gradients with the
reference form on the same inputs upcast to float32 (``rel_err``: the largest of
``|x - ref| / |ref|`` over the output and the three gradients).

Output: a table, and ``--out`` (default ``benchmarks/results/attention.json``)
``{"device", "date", "config", "rows": [{"shape", "implementation", "fwd_bwd_ms",
"speedup_vs_xla", "rel_err"}]}``.

Usage: ``python -m benchmarks.attention [--shapes 8x1024x16x16x64,8x1024x16x4x64]``.
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks import common
from sonew_pax.models import attention

COLUMNS = ("shape", "implementation", "fwd_bwd_ms", "speedup_vs_xla", "rel_err")


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8x1024x16x4x64"`` -> (batch, length, heads, kv_heads, head_dim)."""
    shape = tuple(int(part) for part in text.split("x"))
    if len(shape) != 5:
        raise argparse.ArgumentTypeError(f"a shape is BxTxHxKxD, got {text!r}")
    return shape


def random_inputs(shape: tuple[int, ...], dtype, seed: int = 0):
    """Queries, keys, values and the output's cotangent, N(0, 1), in ``dtype``."""
    batch, length, heads, kv_heads, head_dim = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    q_shape, kv_shape = (batch, length, heads, head_dim), (batch, length, kv_heads, head_dim)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    draws = zip(keys, shapes, strict=True)
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in draws]


def forward_backward(implementation: str):
    """``(q, k, v, cotangent) -> (output, dq, dk, dv)`` through ``implementation``."""
    attend = functools.partial(attention.causal_attention, implementation=implementation)

    def run(q, k, v, cotangent):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v), q, k, v)
        return (out, *vjp(cotangent.astype(out.dtype)))

    return jax.jit(run)


def relative_error(results, reference) -> float:
    """The largest ``‖x - ref‖ / ‖ref‖`` over paired arrays, in float32."""
    errors = [
        jnp.linalg.norm((x.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel())
        for x, r in zip(results, reference, strict=True)
    ]
    return float(max(errors))


def measure(shape, implementation: str, dtype, args) -> dict:
    """One row: time and error of ``implementation`` at ``shape``."""
    inputs = random_inputs(shape, dtype)
    reference = forward_backward("xla")(*[x.astype(jnp.float32) for x in inputs])
    run = forward_backward(implementation)
    results = jax.block_until_ready(run(*inputs))
    median, _, _ = common.time_steps(lambda _: run(*inputs), None, args.warmup, args.iters)
    return {
        "shape": "x".join(map(str, shape)),
        "implementation": implementation,
        "fwd_bwd_ms": median,
        "rel_err": relative_error(results, reference),
    }


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    p = common.argument_parser(__doc__)
    p.add_argument(
        "--shapes",
        type=lambda text: [parse_shape(s) for s in text.split(",")],
        default=[(8, 1024, 16, 16, 64), (8, 1024, 16, 4, 64)],
        help="comma-separated BxTxHxKxD (batch, length, heads, kv_heads, head_dim)",
    )
    common.add_model_args(p, dtype="bfloat16")
    common.add_timing_args(p, warmup=3, iters=20)
    common.add_out_arg(p, "attention")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Measures every shape and implementation, prints the table, writes and returns the JSON."""
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    fast = attention.FAST_KERNELS.get(jax.default_backend())
    implementations = ["xla", *([fast] if fast else [])]
    rows = []
    for shape in args.shapes:
        shape_rows = [measure(shape, name, dtype, args) for name in implementations]
        for row in shape_rows:
            row["speedup_vs_xla"] = shape_rows[0]["fwd_bwd_ms"] / row["fwd_bwd_ms"]
        rows += shape_rows
    result = {
        "device": common.device_name(),
        "date": common.utc_date(),
        "config": {"dtype": args.dtype, "warmup": args.warmup, "iters": args.iters},
        "rows": rows,
    }
    common.write_json(args.out, result)
    print(f"\n{result['device']}, {args.dtype}, forward + backward, median of {args.iters}\n")
    print(common.format_table(rows, COLUMNS))
    return result


if __name__ == "__main__":
    main()
