"""Checkpoint integrity: each array's checksum and finiteness, and the names and shapes that tell
one run's arrays from another's.

`fingerprint` computes, on device in one program, each array's checksum (two wrapping uint32 sums
of its bit patterns, one weighted by position: independent of the mesh) and whether it is finite;
`checkpoints.Checkpoints` records it in a checkpoint's manifest at the save and checks the
restored arrays against it (`verify`). `describe_mismatch` lists the arrays whose presence or shape
differs between a checkpoint and the run (`shapes`), names as `leaf_name`.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec


def leaf_name(path: tuple) -> str:
    """``opt_state/0/m/dense/kernel``: a key path as orbax's metadata and the manifest name it
    (NamedTuple fields, dict keys and sequence indices alike)."""
    parts = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _words(x: jax.Array) -> jax.Array:
    """The bit patterns of ``x`` as uint32, one per element (64-bit types: both halves mixed)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    if x.dtype.itemsize == 8:  # (..., 2) halves
        words = words[..., 0] + jnp.uint32(0x9E3779B9) * words[..., 1]
    return words


def _position(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major index, modulo 2**32."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        step = jnp.uint32(stride % 2**32)
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * step
        stride *= shape[axis]
    return index


def _fingerprint_leaves(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(checksums (n, 2) uint32, finite (n,) bool)`` of ``leaves``: the sum of each array's
    words and their sum weighted by ``2 * position + 1``, wrapping (exact, so the result does not
    depend on how the array is split); whether every element is finite."""
    sums, finite = [], []
    for x in leaves:
        words = _words(x)
        weights = 2 * _position(words.shape) + 1
        sums.append(jnp.stack([jnp.sum(words, dtype=jnp.uint32),
                               jnp.sum(words * weights, dtype=jnp.uint32)]))  # fmt: skip
        floating = jnp.issubdtype(x.dtype, jnp.inexact)
        finite.append(jnp.all(jnp.isfinite(x)) if floating else jnp.bool_(True))
    if not leaves:
        return jnp.zeros((0, 2), jnp.uint32), jnp.zeros((0,), jnp.bool_)
    return jnp.stack(sums), jnp.stack(finite)


def fingerprint(state: Any) -> dict[str, tuple[str, list[int], bool]]:
    """``name -> (dtype, [checksum, weighted checksum], finite)`` for every array of ``state``,
    computed on device in one program (`_fingerprint_leaves`); names as `leaf_name`."""
    named = jax.tree_util.tree_leaves_with_path(state)
    leaves = [leaf for _, leaf in named]
    shardings = [getattr(leaf, "sharding", None) for leaf in leaves]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    sums, finite = jax.jit(_fingerprint_leaves, out_shardings=replicated)(leaves)
    sums, finite = np.asarray(sums), np.asarray(finite)
    return {
        leaf_name(path): (str(leaf.dtype), [int(v) for v in sums[k]], bool(finite[k]))
        for k, (path, leaf) in enumerate(named)
    }


def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of every array in ``tree`` (arrays, ShapeDtypeStructs, orbax metadata)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {leaf_name(path): tuple(leaf.shape) for path, leaf in leaves}


def describe_mismatch(saved: dict[str, tuple], wanted: dict[str, tuple]) -> list[str]:
    """Lines naming every array whose presence or shape differs between a checkpoint (``saved``)
    and the run (``wanted``); empty when they agree."""
    lines = []
    for name in sorted(saved.keys() | wanted.keys()):
        if name not in wanted:
            lines.append(f"{name}: {saved[name]} in the checkpoint, not in this run")
        elif name not in saved:
            lines.append(f"{name}: {wanted[name]} in this run, not in the checkpoint")
        elif saved[name] != wanted[name]:
            lines.append(f"{name}: {saved[name]} in the checkpoint, {wanted[name]} in this run")
    return lines


def verify(state: Any, manifest: dict[str, Any]) -> None:
    """Checks every array of ``state`` (a `TrainState` or a dict of some of its fields) against
    the checksums a checkpoint's ``manifest`` recorded at the save ({} when it has none).

    Raises:
      ValueError: an array's checksum differs from the one saved, or an array is not finite.
    """
    saved = manifest.get("arrays", {})
    for name, (dtype, checksum, finite) in fingerprint(state).items():
        if not finite:
            raise ValueError(f"array {name} holds NaN or inf")
        record = saved.get(name)
        # A dtype changed since the save (orbax casts at restore) has another checksum.
        if record is not None and record["dtype"] == dtype and record["checksum"] != checksum:
            raise ValueError(f"array {name} does not match its checksum: changed on disk")
