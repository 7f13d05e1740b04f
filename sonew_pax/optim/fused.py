"""The SONew step of a tensor as Pallas kernels (GPU, Triton), state in place.

XLA compiles the band-1 step (``pointwise``'s functions on chain shifts) into several passes over
memory and, where a fusion that writes the new state also reads its neighbours' old state, copies
that state array once more (``sonew._banded_step`` shifts the new moments, so only ``e`` is left
to copy). Here:

* **the halo kernel** first copies, for band b, the first ``2b - 1`` and last ``b`` rows of
  every row chunk of ``m``, ``d`` and ``e`` into halo rows (:func:`gather_halos`,
  :func:`band_halo_rows`; for band 1 the first and last row, ``2 / rows`` of the state). These
  are the rows a program reads from its neighbours' chunks (and, at the top and bottom of the
  tensor, the wrapped chain neighbours, :func:`chain_neighbour`); reading the copies, no program
  depends on when another one overwrites its rows. One launch serves many same-shaped tensors;
* **the step kernel** tiles the 2-D view of the tensor (:func:`tile_view`: axis 0 by the rest,
  the chain running down the columns) in ``rows x cols`` tiles. A program reads its tile of
  ``g``, ``m``, ``d`` (and ``e``), the rows just above and below it (the state's from the halo
  input), and writes the direction ``u``, per tile the partial norms of Adam's direction and of
  ``u`` as ``(max |x|, sum (x / max)^2)`` pairs (safe from overflow and underflow, like
  ``chain.norms``), and the new state **in place**;
* band 1 runs, by default, **the scan kernel** (``BAND1_KERNEL = "scan"``): each lane of a
  program walks down a few rows of one column (``SCAN_STACK`` walks per program, one under
  another), carrying the previous row's per-position quantities (``pointwise.vertex``), so it
  reads each array once and computes each vertex and edge once where the tile kernel
  (``BAND1_KERNEL = "tile"``) reads three rows and recomputes: the LM set's update takes 13% less
  device time on an H100 (results/profile_update_scan.json). The walks of a program read each
  other's edge rows before a barrier, so only the program's edges need halo rows (on an H100
  the halo copies went from 0.49 to 0.14 ms of the LM set's update,
  results/profile_update_scan_stack.json);
* bands ``b >= 2`` run **the banded walk** (:func:`_band_scan_kernel`): one lane per column walks
  its chunk from ``b`` rows above to ``2b - 1`` below, solving each vertex's ``b x b`` window
  with ``solve``'s functions for Algorithm 3's cut test, and once more, truncated, only where a
  vertex of its window cut the chain (in a row of the program); it reads other chunks' rows from
  the halo kernel's copies. Band 4 of the LM set takes 4.9x AdamW's device time on an H200
  (5.0x with the halo rows gathered by XLA), against XLA's 11.7x
  (results/update_speed_band_halo.json, results/update_speed_band4_kernel.json), and 3.85x on
  an H100 (results/update_speed_v16_h100.json; 3.9x without fused multiply-adds, :data:`FMA`;
  4.1x solving every window twice, results/profile_update_band4_reuse_solve.json). Not the
  bytes bound it: on a 1024 x 1024 tensor's launch the walk holds 128 registers per thread, its
  grid fills 0.48 of a wave (12% occupancy), and the DRAM runs at 27% of its peak while each
  warp waits 3.5 cycles per instruction on the walk's dependent arithmetic
  (results/ncu_band4_h100.json; its ~500 instructions per row, a third of them integer:
  addresses, masks and moves; results/ncu_band4_sass_h100.json, results/ncu_band4_fma_h100.json);
* **XLA** then merges the tiles' norm pairs (``sonew._graft_ratios``, a few reductions for all
  tensors of a shape) and computes ``u * ||adam|| / ||u||``, fused with weight decay, the
  learning rate and ``optax.apply_updates``;
* or, with **the fused apply** (:class:`Apply`: SONew's ``apply`` when the graft ratio is known
  before the step, ``graft_lag``), the step kernel reads the parameters too and writes them in
  place instead of ``u``; XLA only merges the norm pairs into the next step's ratios.

Same-shaped tensors below 4M elements share step launches (:func:`group_update`, up to 4 per
launch, a branch per tensor): a small tensor's walk waits on its first loads before any row is
computed, and together they fill the GPU as one larger tensor does (on an H100 the LM set's
update took 5.03 ms of device time instead of 5.25, results/profile_update_group.json). Bands
``b >= 2`` launch one tensor at a time by default (``_MAX_BANDED_GROUP``: their walk is long to
compile). The launches of different tensors touch different buffers, so XLA may run them at the
same time: under ``XLA_FLAGS="--xla_gpu_command_buffer_scheduling_mode=CONCURRENT
--xla_gpu_graph_min_graph_size=1"`` (:func:`concurrent_launches`) the launches fill the GPU
together, and bands ``b >= 2`` walk longer row chunks (``CONCURRENT_BANDED_TILE``). The LM set's
band-4 update then kept an H100 busy 9.09 ms (the union of the kernels' intervals, ``span_ms``),
2.88x AdamW's 3.16, against 13.38 and 3.85x without the flags
(results/update_speed_v19_concurrent_band4_h100.json, results/update_speed_v16_h100.json); the
results are the same bit for bit (tests/test_command_buffers.py, run on an H100). Flags are the
process's: :func:`concurrent_jit` asks for the same schedule for one executable alone (its
compile options), e.g. the update's or the trainer's step (``train.concurrent_launches``): the
band-4 update then took 8.83 ms, 2.80x AdamW's 3.16 under the same jit
(results/update_speed_v22_concurrent_jit_h100.json). Under the CONCURRENT mode XLA's buffer
assignment keeps apart buffers that serial order would share: AdamW's 350m train step needs 30.0
GiB of temporaries instead of 26.7 (it peaked at 34.2 GiB instead of 30.9;
``--xla_gpu_graph_min_graph_size=1`` alone changes nothing;
results/train_step_concurrent_h100.json), so it stays opt-in (``concurrent_jit``,
``train.concurrent_launches``, or ``CONCURRENT_LAUNCHES=1`` in launch/slurm_gpu.sbatch for the
whole process).

fp32 tridiag moves about 32 B/param in the step kernel and 12 in XLA's pass (36 in all with the
fused apply), against 28 for a fused AdamW, with a few halo launches per model. The math is
``pointwise``'s and ``solve``'s, the same functions the XLA path runs, so results agree to float
rounding (the norms are summed in another order).
``interpret=True`` runs the kernels in Pallas' interpreter (any backend; the tests use it on CPU).

Only tensors that live whole on the device take this path (sharded ones need halos from other
devices, which the XLA path exchanges), with fewer than ``2**31`` elements (int32 offsets), and
for bands ``2 <= b <= MAX_KERNEL_BAND`` with at least ``2b`` rows along axis 0
(:func:`supported`).
"""

from __future__ import annotations

import contextvars
import functools
import math
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sonew_pax.optim import fma, pointwise, solve
from sonew_pax.optim.chain import ChainLayout, Program, edges_of, halo_width, run
from sonew_pax.optim.fma import madd

# (rows, cols, num_warps) of the diagonal step: the view's rows x cols per program and its warps,
# the fastest of the tiles benchmarks/kernel_speed.py tried on an 8192 x 8192 tensor.
TILE = (8, 128, 8)
# Band 1's scan: a program covers ``rows x cols`` of the view in ``SCAN_STACK`` walks of ``rows /
# SCAN_STACK`` rows, one under another; the chain is serial, so a small tensor gets shorter walks
# (rows halved, down to walks of ``_SCAN_MIN_WALK``) until it has ``_SCAN_LANES`` walks times
# columns to spread over the GPU. Stacking walks in a program makes its halo rows 2 / rows of the
# state, not 2 / walk. Each halving of the rows doubles the warps (the threads stay).
SCAN_TILE = (64, 64, 2)
SCAN_STACK = 4
_SCAN_LANES = 2**18
_SCAN_MIN_WALK = 8
# Tensors of one shape below ``_GROUP_ELEMENTS`` elements share launches (``group_update``), up to
# ``_MAX_GROUP`` per launch.
_GROUP_ELEMENTS = 2**22
_MAX_GROUP = 4
# Bands >= 2: each tensor of a launch adds a copy of the long walk to the compiled kernel. On an
# H100 the LM set's band-4 update took 13.03 ms of device time with 2 per launch (its 1M-element
# tensors in 32-row chunks, 512 programs a launch) against 13.38 with 1, but its profiling
# process 150 s against 126, most of it compiling; with 4 (64-row chunks) it had not compiled
# after 236 s (results/profile_update_band4_group2.json, results/profile_update_band4_group1.json).
# 2.6% of the update does not pay for the compile: one tensor per launch. With one loop instead of
# three (a third of the code, below) 4 per launch compiled as fast as 1, and took 9% off that
# kernel's update, 17.58 -> 15.98 ms, the 4M-element tensors unchanged: that loop costs more than
# grouping saves (results/profile_update_band4_v17_experiments.json). Launching the tensors'
# kernels concurrently fills the GPU without copies of the walk: see the module docstring.
_MAX_BANDED_GROUP = 1
# Rows the scan loads ahead of the one it computes (their loads in flight while it computes). On
# an H100 the LM set's update took 6.66 ms of device time with 1, 6.77 with 2 and 7.15 with 3
# (results/profile_update_scan_ahead.json): more rows in registers leave room for fewer warps.
SCAN_AHEAD = 1
# Bands b >= 2 (``_band_scan_kernel``): (rows, cols, num_warps), rows halved (down to
# ``_BANDED_MIN_ROWS``) on tensors with fewer than ``_BANDED_PROGRAMS`` programs. A walk reads
# 3b - 1 rows around its chunk, and the halo copies are (3b - 1) / rows of the state, so its
# chunks are longer than band 1's. On an H200 (band 4, graft_lag, the LM set's update:
# results/profile_update_band4_tiles.json) 64 rows were fastest on its 4M-element tensors (512
# programs), 32 on its 1M-element ones; 64 columns on 2 warps were within 1% of 128 on 4, and
# 16 rows were slower. On an H100 (results/profile_update_band4_min_rows.json) 16-row chunks on
# the 1M-element tensors took 14.64 ms against 14.28 (their halo copies are 11/16 of the state);
# 64 x 64 x 2 tiles (on which the 1M-element tensors keep 32 rows) 14.12, 1% faster, as close as
# on the H200: the tile stays. Later, on an H100 (results/profile_update_band4_v17_experiments.json,
# against 13.37-13.40 ms): one warp of 32 columns per program (2048 programs wanted) 15.55, its
# 1M-element launches 6% faster but its 4M-element ones 37% slower; two columns per thread
# (64 x 256 x 4) 13.75.
BANDED_TILE = (64, 128, 4)
_BANDED_PROGRAMS = 512
_BANDED_MIN_ROWS = 32
# Bands >= 2 when XLA may run the tensors' launches at the same time (:func:`concurrent_launches`):
# the launches fill the GPU together, so a tensor's chunks need not be short enough to fill it
# alone, and longer chunks walk fewer rows twice ((rows + 3b - 1) / rows) and copy fewer halo
# rows ((3b - 1) / rows of the state). On an H100 the LM set's band-4 update kept the device busy
# 9.47 ms with 128-row chunks on every tensor, 10.18 with 64 (the 1M-element tensors' 32 raised
# to 64) and 10.79 with ``BANDED_TILE``'s defaults; AdamW 3.15 (--warmup 2 --iters 3;
# results/profile_update_band4_concurrent_chunks.json). Later, on one H100: 256 rows 9.01 ms,
# 128 9.47, 512 10.65 (too few programs per launch to overlap well), AdamW 3.153-3.155
# (results/profile_update_band4_concurrent_rows.json).
CONCURRENT_BANDED_TILE = (256, 128, 4)
# The XLA flag under which a GPU executable's independent kernels may overlap (with
# ``--xla_gpu_graph_min_graph_size=1``, so that every update is one command buffer).
CONCURRENT_FLAG = "--xla_gpu_command_buffer_scheduling_mode"
# The same as one executable's compile options (XLA's debug options, which ``jax.jit``'s
# ``compiler_options`` override per compilation): :func:`concurrent_jit`.
CONCURRENT_OPTIONS = {
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    "xla_gpu_graph_min_graph_size": 1,
}
# True while :func:`concurrent_jit` traces its function.
_CONCURRENT_SCOPE = contextvars.ContextVar("sonew_concurrent_launches", default=False)
# The widest band the kernel takes. Its walk keeps (2b - 1) b correlations in registers and
# factors two b x b windows per element: on an H200 band 4's kernel beat XLA (the autoencoder's
# 100 epochs in 6.36 s against 7.91), band 10's lost (36.2 s against 18.9, after minutes of
# compiling; results/autoencoder_band10_pallas.json). Wider bands stay on XLA.
MAX_KERNEL_BAND = 4
# Whether the banded walk's multiply-adds (``fma.madd``) are fused, one rounding each (``fma``;
# the interpreter computes them as written whatever this says). On an H100 the LM set's band-4
# update took 13.39 ms of device time fused against 13.60 (results/profile_update_fma.json,
# results/profile_update_fma_off.json). The other kernels stay unfused: fused, the band-1 scan's
# update took 5.37 ms against 5.01 (its 4M-element launches 12% longer; unlike the walk's one
# element per thread, its blocks hold four, whose loads and stores the one-element assembly may
# no longer vectorise: not measured).
FMA = True
_MAX_SIZE = 2**31 - 1
# The numbers of ``pointwise.Hyper``, the bias corrections and :class:`Apply`'s scalars common to
# all tensors, packed into one input array (padded to a power of 2, as Triton's blocks must be):
# the same array for every tensor of an update, which XLA builds once.
_SCALARS = ("b1", "b2", "eps", "gamma", "graft_eps", "bc1", "bc2")
_APPLY_SCALARS = ("weight_decay", "scale")


def concurrent_launches() -> bool:
    """Whether the executable being traced may run its independent GPU kernels at the same time:
    it is :func:`concurrent_jit`'s, or this process's ``XLA_FLAGS`` say so for every executable
    (the last :data:`CONCURRENT_FLAG` given is ``CONCURRENT``)."""
    if _CONCURRENT_SCOPE.get():
        return True
    modes = re.findall(rf"{CONCURRENT_FLAG}=(\w+)", os.environ.get("XLA_FLAGS", ""))
    return bool(modes) and modes[-1].upper() == "CONCURRENT"


def concurrent_jit(fun: Callable, **jit_kwargs: Any) -> Callable:
    """``jax.jit(fun, **jit_kwargs)`` whose executable may run independent GPU kernels at the same
    time (:data:`CONCURRENT_OPTIONS` as its ``compiler_options``), with SONew's kernels traced
    for that (:func:`concurrent_launches`: bands >= 2 walk ``CONCURRENT_BANDED_TILE`` chunks).

    The process-wide ``XLA_FLAGS`` do the same for every executable; this confines the cost to
    one. Under the concurrent schedule XLA's buffer assignment keeps apart the buffers of kernels
    that may overlap: AdamW's 350m train step needed 30.0 GiB of temporaries instead of 26.7
    (results/train_step_memory_flags_h100.json). Jitting only the step that runs SONew's update
    leaves every other executable (evaluation, initialisation) as it was. Other backends ignore
    the options.
    """
    options = {**CONCURRENT_OPTIONS, **(jit_kwargs.pop("compiler_options", None) or {})}

    @functools.wraps(fun)
    def traced(*args, **kwargs):
        token = _CONCURRENT_SCOPE.set(True)
        try:
            return fun(*args, **kwargs)
        finally:
            _CONCURRENT_SCOPE.reset(token)

    return jax.jit(traced, compiler_options=options, **jit_kwargs)


def default_tile(band: int, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The (rows, cols, num_warps) a band's kernel runs with on a tensor of ``shape`` unless told:
    ``TILE`` (band 0), or for the walking kernels (band 1's scan, bands >= 2) ``SCAN_TILE`` or
    ``BANDED_TILE`` with fewer rows on small tensors (shorter walks: for the scan, until it has
    ``_SCAN_LANES`` walks times columns; for bands >= 2, ``_BANDED_PROGRAMS`` programs in a
    launch of :func:`launch_group` tensors); for bands >= 2 under :func:`concurrent_launches`,
    ``CONCURRENT_BANDED_TILE`` on every tensor."""
    num_rows, num_cols = tile_view(shape)
    if band >= 2 and concurrent_launches():
        return CONCURRENT_BANDED_TILE
    if band >= 2:
        rows, cols, num_warps = BANDED_TILE
        tensors = launch_group(shape, band)
        while rows > _BANDED_MIN_ROWS and (
            tensors * pl.cdiv(num_cols, cols) * pl.cdiv(num_rows, rows) < _BANDED_PROGRAMS
        ):
            rows //= 2
    elif band == 1:
        rows, cols, num_warps = SCAN_TILE
        while rows > _SCAN_MIN_WALK * scan_stack(rows) and (
            num_cols * pl.cdiv(num_rows, rows // scan_stack(rows)) < _SCAN_LANES
        ):
            rows //= 2
            # Half as many lanes on twice as many warps: the threads stay (down to one lane each).
            num_warps = min(2 * num_warps, max(num_warps, scan_stack(rows) * cols // 32))
    else:
        return TILE
    return rows, cols, num_warps


def launch_group(shape: tuple[int, ...], band: int) -> int:
    """How many tensors of ``shape`` :func:`group_update` launches together: enough to reach
    ``_GROUP_ELEMENTS`` elements, at most ``_MAX_GROUP`` (each adds a branch to the compiled
    kernel); for bands >= 2 at most ``_MAX_BANDED_GROUP`` (their kernel is long to compile)."""
    limit = _MAX_BANDED_GROUP if band >= 2 else _MAX_GROUP
    return max(1, min(limit, _GROUP_ELEMENTS // max(1, math.prod(shape))))


def launch_key(g: jax.Array, m: jax.Array, d: jax.Array, e: Any, apply: Apply | None) -> tuple:
    """What the tensors of one :func:`group_update` launch share: ``(shape, band, dtypes of g
    and the state, apply)``, ``apply`` being ``None`` or the parameters' ``(dtype, decayed)``."""
    band = 0 if not hasattr(e, "shape") else e.shape[0]
    dtypes = tuple(jnp.dtype(x.dtype) for x in (g, m, d, *([e] if band else [])))
    fused_apply = None if apply is None else (jnp.dtype(apply.params.dtype), bool(apply.decayed))
    return g.shape, band, dtypes, fused_apply


def scan_stack(rows: int) -> int:
    """How many walks the band-1 scan stacks in a program of ``rows`` rows: ``SCAN_STACK``, at
    most ``rows`` (a walk of one row)."""
    return min(SCAN_STACK, rows)


def local_shape(layout: ChainLayout) -> tuple[int, ...]:
    """The shape of one shard of a tensor of ``layout`` (the whole tensor when unsharded)."""
    return tuple(n // k for n, k in zip(layout.shape, layout.shards, strict=True))


def supported(layout: ChainLayout, band: int) -> bool:
    """Whether a kernel computes this tensor's step on each device's block (:func:`local_shape`):
    int32-indexable (its ``band`` off-diagonals too); for bands >= 2 up to ``MAX_KERNEL_BAND``.
    The block needs as many rows along axis 0 as the step reads beyond it (``chain.halo_width``:
    one for band 1, ``2 band - 1`` for bands >= 2), so its edges come from its chain neighbours'
    blocks (:func:`kernel_edges`); thinner shards take the XLA path."""
    shape = local_shape(layout)
    size = math.prod(shape)
    if not 0 < max(band, 1) * size <= _MAX_SIZE or band > MAX_KERNEL_BAND:
        return False
    return shape[0] >= max(halo_width(band))


class Edges(NamedTuple):
    """Where one tensor's ``edges`` input lives (:func:`kernel_edges`): in a flat ``buffer`` of
    the edges of several tensors of one layout, ``(tensors, 3 + b, 3b - 1, C)``, as tensor
    ``index``."""

    buffer: jax.Array
    index: int


def kernel_edges(
    gs: list[jax.Array],
    ms: list[jax.Array],
    ds: list[jax.Array],
    es: list[Any],
    layout: ChainLayout,
) -> Program:
    """An exchange program returning the :class:`Edges` of band-``b`` step kernels on the local
    blocks of tensors of one ``layout`` and dtypes: the chain neighbours beyond the view's first
    and last rows (``chain.edges_of``, ``chain.halo_width``: ``b`` rows above, ``2b - 1`` below,
    one each for band 1) of ``g``, ``m``, ``d`` and ``e``'s ``b`` off-diagonals, in ``d``'s dtype
    (the kernels' arithmetic), per tensor as ``(3 + b, 3b - 1, C)``: the rows above, then those
    below, of array ``0`` (``g``), ``1`` (``m``), ``2`` (``d``) and ``3 + k`` (``e[k]``) of the
    view (:func:`tile_view`).

    For a tensor whole on the device these are a column's neighbours at the wraps between columns
    (zero at the chain's ends); for a shard, the neighbouring shards' rows. The slabs of all the
    tensors go through one program, stacked: a model's update builds its edges in a few
    operations per layout, not per tensor, and sharded, they travel with every other layout's
    (``chain.run`` of ``chain.parallel`` programs).
    """
    band = es[0].shape[0]
    before, after = halo_width(band)
    compute = ds[0].dtype
    rows = ds[0].shape[0]
    arrays = [
        y.astype(compute)
        for g, m, d, e in zip(gs, ms, ds, es, strict=True)
        for y in (g[None], m[None], d[None], e)
    ]

    def rows_of(start: int, stop: int) -> jax.Array:
        return jnp.concatenate([lax.slice_in_dim(y, start, stop, axis=1) for y in arrays])

    pre, post = yield from edges_of(rows_of(rows - before, rows), rows_of(0, after), layout)
    buffer = jnp.concatenate([pre, post], axis=1).reshape(-1)
    return [Edges(buffer, k) for k in range(len(gs))]


def tile_view(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D row-major view ``(R, C)`` the kernels tile: axis 0 by the rest (``(n, 1)`` for 1-D).

    The chain runs down each column of the view (``+-C`` in memory) and wraps from the bottom of
    one column to the top of the next column in Fortran order of the trailing axes: the kernels
    read those wrapped neighbours, like every neighbour beyond the view's first and last rows,
    from their ``edges`` input (:func:`kernel_edges`).
    """
    return shape[0], math.prod(shape[1:])


def _chunk_rows(i, rows: int, num_rows: int):
    """First and last row of the view in row chunk ``i``."""
    return i * rows, jnp.minimum((i + 1) * rows, num_rows) - 1


class Halo(NamedTuple):
    """Where one state array's halo rows live: a flat ``buffer`` that holds the halo rows of
    several same-shaped arrays (:func:`gather_halos`), this one's from sub-array ``index`` on, in
    row chunks of ``rows``. A sub-array is one ``R x C`` view (:func:`tile_view`): ``m`` and
    ``d`` have one, ``e`` one per off-diagonal. Its halo rows (:func:`band_halo_rows`: ``3b - 1``
    per chunk, for band 1 the chunk's first and last row) start at ``sub * chunks * (3b - 1) *
    C``."""

    buffer: jax.Array
    index: int
    rows: int


def _halo_rows(i, rows: int, num_rows: int, band: int) -> tuple[jax.Array, jax.Array]:
    """The rows of the view in chunk ``i``'s halo slots, as :func:`band_halo_rows`, as a vector
    over the slots padded to a power of two, and which of its entries are slots."""
    first, last = _chunk_rows(i, rows, num_rows)
    head, span = 2 * band - 1, 3 * band - 1
    slot = jnp.arange(pl.next_power_of_2(span), dtype=jnp.int32)
    tail = jnp.maximum(last - band + 1 + slot - head, first)
    return jnp.where(slot < head, jnp.minimum(first + slot, last), tail), slot < span


def _halo_kernel(*refs, view, rows, cols, band, subs):
    """Program ``(s, i, j)`` copies column block ``j`` of chunk ``i``'s halo rows of sub-array
    ``s`` (input ``k`` holds sub-arrays ``k subs`` to ``(k + 1) subs - 1``; a branch per input:
    the refs are static) into its slots, all slots in one masked load and store of a block of
    ``next_pow2(3b - 1)`` rows. (Unrolled row by row, band 4's halo programs were four to five
    times a banded walk's Triton IR: the LM set's update lowered 1.50 MB of Triton bytecode in 9.7
    s on a CPU, now 0.50 MB in 3.5 s; results/lowering_cpu_v22.json.)"""
    *inputs, out_ref = refs
    num_rows, num_cols = view
    size, chunks, span = num_rows * num_cols, pl.cdiv(num_rows, rows), 3 * band - 1
    s, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c = j * cols + jnp.arange(cols, dtype=jnp.int32)
    sources, slots = _halo_rows(i, rows, num_rows, band)
    mask = slots[:, None] & (c < num_cols)[None, :]
    slot = jnp.arange(sources.shape[0], dtype=jnp.int32)
    at = ((s * chunks + i) * span + slot[:, None]) * num_cols + c[None, :]
    # A masked lane's address would be another slot's: on a GPU it stores nothing, but the
    # interpreter stores a masked block by writing every lane back, in an order its device does
    # not fix. Out of range, the interpreter drops it.
    at = jnp.where(mask, at, out_ref.shape[0])
    for k, ref in enumerate(inputs):

        @pl.when(s // subs == k)
        def _copy(ref=ref, first=k * subs):
            offsets = (s - first) * size + sources[:, None] * num_cols + c[None, :]
            plgpu.store(out_ref.at[at], plgpu.load(ref.at[offsets], mask=mask), mask=mask)


# Inputs per halo launch (each is a kernel argument and a branch of ``_halo_kernel``).
_HALO_GROUP = 64
_HALO_COLS = 512


def gather_halos(
    arrays: list[jax.Array],
    rows: int | None = None,
    *,
    band: int = 1,
    shapes: list[tuple[int, ...]] | None = None,
    interpret: bool = False,
) -> list[Halo]:
    """The halo rows (:func:`band_halo_rows`) of band-``band`` state arrays, read before the step
    kernels overwrite them in place.

    Array ``k`` is the state of a parameter of ``shapes[k]`` (default: its own shape): ``m``,
    ``d``, or ``e`` of ``band`` off-diagonals stacked in front. Arrays of one view shape, dtype
    and number of sub-arrays share launches (up to ``_HALO_GROUP`` arrays each), so a model's
    update adds a few small kernels, not one per tensor. Those launches are of equal size (a
    short last one repeats its last array), so the buffers of such arrays all have one shape:
    the step kernels of one tensor shape, which take the buffers as inputs, are then one
    program (:func:`_step_call`), not one per combination of buffer sizes (the LM set's band-4
    update, lowered for CUDA on a CPU: 4 banded walks to compile instead of 12, 9.7 s of
    tracing and lowering instead of 18.3; tridiag: 4 scans instead of 10;
    ``benchmarks/lowering.py``, results/lowering_cpu_v21.json against _v20). ``rows`` is the step
    kernel's row chunk (default: :func:`default_tile`'s for each view). Returns one
    :class:`Halo` per array, in order.
    """
    shapes = shapes or [x.shape for x in arrays]
    groups: dict[tuple, list[int]] = {}
    for k, (x, shape) in enumerate(zip(arrays, shapes, strict=True)):
        view = tile_view(shape)
        groups.setdefault((view, jnp.dtype(x.dtype), x.size // math.prod(view)), []).append(k)
    halos: list[Halo | None] = [None] * len(arrays)
    for (view, dtype, subs), members in groups.items():
        rows_here = rows or default_tile(band, view)[0]
        one = subs * (3 * band - 1) * pl.cdiv(view[0], rows_here) * view[1]  # an array's halo
        most = min(_HALO_GROUP, max(1, _MAX_SIZE // one))  # arrays per int32-indexed buffer
        per = pl.cdiv(len(members), pl.cdiv(len(members), most))
        cols = min(_HALO_COLS, pl.next_power_of_2(view[1]))
        gather = _halo_call(view, dtype, rows_here, cols, band, subs, per, interpret)
        for first in range(0, len(members), per):
            part = [arrays[k].reshape(-1) for k in members[first : first + per]]
            # A short last launch repeats its last array: every launch, and so every buffer, is
            # the same (see the docstring).
            buffer = gather(*part, *part[-1:] * (per - len(part)))
            for position, k in enumerate(members[first : first + per]):
                halos[k] = Halo(buffer, position * subs, rows_here)
    return halos


@functools.cache
def _halo_call(
    view: tuple[int, int],
    dtype,
    rows: int,
    cols: int,
    band: int,
    subs: int,
    count: int,
    interpret: bool,
) -> Callable:
    """:func:`gather_halos`' launch for ``count`` arrays of ``subs`` sub-arrays each of one
    ``view`` and ``dtype`` (programs of ``cols`` columns), jitted and cached (as
    :func:`_step_call`): its launches lower to one Triton module."""
    num_rows, num_cols = view
    chunks, span = pl.cdiv(num_rows, rows), 3 * band - 1
    gather = pl.pallas_call(
        _bind(_halo_kernel, "sonew_halo", view=view, rows=rows, cols=cols, band=band, subs=subs),
        grid=(count * subs, chunks, pl.cdiv(num_cols, cols)),
        out_shape=jax.ShapeDtypeStruct((count * subs * span * chunks * num_cols,), dtype),
        interpret=interpret,
        # Triton's parameters select Triton: without them jax 0.10 lowers for Mosaic GPU, whose
        # copies reject these rows (tests/test_fused.py lowers both for CUDA).
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4),
        name="sonew_halo",
    )
    return jax.jit(gather)


def _across_chunks(i, c, num_rows: int, num_cols: int, rows: int, step: int) -> tuple:
    """The chain neighbours of row chunk ``i``'s first row (``step=-1``, above) or last row
    (``step=1``, below) in columns ``c``: ``(offset, halo, edge)``.

    Inside the view the neighbour is the previous / next chunk's edge row: ``offset`` is its flat
    offset and ``halo`` its place in the halo rows (:class:`Halo`, relative to the array's start),
    which hold the state as it was before this step. At the view's top and bottom (``edge``) it
    is row 0 (above) or 1 (below) of the band-1 ``edges`` input (:func:`kernel_edges`).
    """
    first, last = _chunk_rows(i, rows, num_rows)
    row = first - 1 if step < 0 else last + 1
    edge = i == 0 if step < 0 else last == num_rows - 1
    row = jnp.clip(row, 0, num_rows - 1)
    slot = 2 * (row // rows) + (1 if step < 0 else 0)
    return row * num_cols + c, slot * num_cols + c, edge


class Apply(NamedTuple):
    """The fused apply of one tensor: the kernel writes ``params`` in place with
    ``pointwise.apply_update(params, u, ratio, decay, scale)`` instead of writing ``u``, where
    ``decay`` is ``weight_decay`` if ``decayed`` else 0.

    ``ratio`` is the graft ratio known before the step (a scalar array: ``graft_lag``'s, or 1
    without grafting), the kernel's own input, which XLA passes without a copy; ``weight_decay``
    and ``scale`` (the factor of the sum, ``-lr`` in ``sonew``) are the same for every tensor;
    ``decayed`` is static."""

    params: jax.Array
    ratio: Any
    weight_decay: Any
    scale: Any
    decayed: bool


def _numbers(scalars_ref, graft: str) -> tuple[pointwise.Hyper, tuple]:
    """``pointwise.Hyper`` and the bias corrections from the kernels' scalar input."""
    values = {name: scalars_ref[k] for k, name in enumerate(_SCALARS)}
    hyper = pointwise.Hyper(
        **{k: values[k] for k in _SCALARS[:5]}, graft=graft, precondition_1d=True
    )
    return hyper, (values["bc1"], values["bc2"])


def _output(scalars_ref, ratio_ref, u, p, decayed: bool):
    """What the kernel writes in ``u``'s place: ``u``, or with the fused apply (``p`` read, not
    ``None``) the new parameter (:class:`Apply`)."""
    if p is None:
        return u
    weight_decay, scale = (scalars_ref[len(_SCALARS) + k] for k in range(len(_APPLY_SCALARS)))
    decay = weight_decay if decayed else 0
    return pointwise.apply_update(p, u, ratio_ref[0], decay, scale)


def _write_parts(parts_ref, i, j, pairs) -> None:
    """Program ``(i, j)``'s norm pairs of Adam's direction and of ``u`` from per-lane pairs
    ``(scale, sum (x / scale)^2)``: rescaled to the largest scale and added (as
    ``chain.merge_norm_parts``). The scale is at least the smallest normal number
    (:func:`_scale_floor`)."""
    for k, (scales, sums) in enumerate(pairs):
        top = jnp.maximum(jnp.max(scales), _scale_floor(scales.dtype))
        ratio = scales * (1 / top)
        parts_ref[2 * k, i, j] = top
        parts_ref[2 * k + 1, i, j] = jnp.sum(sums * ratio * ratio)


def _scale_floor(dtype) -> Any:
    """The smallest scale of the kernels' norm pairs: the smallest normal number of ``dtype``.

    The kernels multiply by ``1 / scale`` (one division per pair, not per element). GPUs keep
    subnormal numbers, whose reciprocals overflow: a scale of ``|x| < 2^-128`` made a norm
    ``inf * 0 = NaN`` and the tensor's graft ratio 0, its update zero (the MNIST autoencoder's
    first layer, whose rarely lit pixels' moments decay into subnormals, lost its update at ~20%
    of the steps after epoch 29 in the scan kernel). From a normal scale ``1 / scale`` is finite,
    and ``(x / scale)^2`` of smaller ``x`` underflows harmlessly.
    """
    return jnp.finfo(dtype).tiny


def _running_pair(pair, x, valid):
    """The per-lane pair ``(scale, sum (x / scale)^2)`` with ``|x|`` added where ``valid``; the
    scale starts at :func:`_scale_floor`."""
    scale, total = pair
    x = jnp.where(valid, jnp.abs(x), 0)
    new = jnp.maximum(scale, x)
    inverse = 1 / new
    ratio, scaled = scale * inverse, x * inverse
    return new, madd(scaled, scaled, total * ratio * ratio)


def _scan_kernel(
    scalars_ref,
    g_ref,
    m_ref,
    d_ref,
    e_ref,
    halo_m,
    halo_d,
    halo_e,
    starts_ref,
    edge_ref,
    *refs,
    shape,
    graft,
    rows,
    cols,
    stack,
    ahead,
    apply,
    decayed,
    interpret,
    program,
):
    """Band 1 walking down a ``rows x cols`` block of the view: ``stack`` walks of ``rows /
    stack`` rows one under another, one lane per walk and column, all a row at a time.

    Each lane carries the previous row's :func:`pointwise.vertex` and the ``(l, z)`` of the edge
    above, so every array is read once and every vertex and edge computed once, with
    ``pointwise.tridiagonal_step``'s float operations. A walk needs the pre-step state of the row
    above its first and below its last: at the block's top and bottom, the neighbouring blocks'
    rows, from the halo copies; between two walks of the block, each other's edge rows, which
    every lane reads before a barrier and no lane writes before it; at the view's top and bottom,
    the ``edges`` input (:func:`kernel_edges`). So the halo copies are ``2 /
    rows`` of the state while each walk stays short (the chain is serial: a lane's walk of ``w``
    rows waits on about ``w`` row loads, and on the LM set's 1M-element tensors walks of 8 rows
    took 14% less time than walks of 16). Rows up to ``r + ahead + 1`` are loaded while row ``r``
    is computed: loading each row as it came, the walk waited on memory (the LM set's update took
    18% more device time on an H100 than with ``ahead=1``). After the barrier a lane writes only
    rows it has read (``stack x cols`` must cover the warps' lanes: no lane's element is
    another's). With ``apply`` (:class:`Apply`) ``p_ref`` is read with the other arrays and
    ``out_ref`` takes the new parameters, else ``u``.
    """
    p_ref, ratio_ref = refs[:2] if apply else (None, None)
    out_ref, m_out, d_out, e_out, parts_ref = refs[2:] if apply else refs
    num_rows, num_cols = tile_view(shape)
    i, j = program
    c = j * cols + jnp.arange(cols, dtype=jnp.int32)[None, :]
    in_cols = c < num_cols
    hyper, corrections = _numbers(scalars_ref, graft)
    compute = d_ref.dtype
    block_first, block_last = _chunk_rows(i, rows, num_rows)
    # Each walk's first and last row, (stack, 1); a walk below the view's last row is empty
    # (first > last: it reads and writes nothing).
    first = block_first + (rows // stack) * jnp.arange(stack, dtype=jnp.int32)[:, None]
    last = jnp.minimum(first + rows // stack - 1, block_last)
    walking = in_cols & (first <= last)
    top, bottom = first == block_first, last == block_last
    above, halo_above, edge_above = _across_chunks(i, c, num_rows, num_cols, rows, -1)
    below, halo_below, edge_below = _across_chunks(i, c, num_rows, num_cols, rows, 1)
    m0, d0, e0, edge0 = (starts_ref[k] for k in range(4))

    def read(ref, at, mask):
        return plgpu.load(ref.at[at], mask=mask, other=0).astype(compute)

    def row(r) -> tuple[pointwise.Raw, jax.Array, jax.Array | None]:
        """Row ``r``'s raw values, edge statistic and parameters (``None`` without ``apply``);
        zeros past the walk's last row."""
        at, mask = r * num_cols + c, in_cols & (r <= last)
        raw = pointwise.Raw(read(g_ref, at, mask), read(m_ref, at, mask), read(d_ref, at, mask))
        p = None if p_ref is None else read(p_ref, at, mask)
        return raw, read(e_ref, at, mask), p

    def neighbour(r, outer, at, halo, edge, slot) -> Callable:
        """A reader of row ``r`` next to each walk: where ``outer`` (the block's edge) the chain
        neighbour at offset ``at``, the state from its halo copy (at ``halo``; ``g`` is
        read-only: its rows are their own halo), or beyond the view (``edge``) row ``slot`` of
        the ``edges`` input; elsewhere the block's row ``r``."""
        inner, outer = walking & ~outer, walking & outer
        beyond, within = outer & edge, outer & ~edge
        own = r * num_cols + c
        at, halo = (jnp.broadcast_to(x, own.shape) for x in (at, halo))

        def value(k, ref, halo_ref=None, start=0):
            """Array ``k`` of the edges (0 ``g``, 1 ``m``, 2 ``d``, 3 ``e``) read from ``ref``."""
            if halo_ref is None:
                far = read(ref, at, within)
            else:
                far = read(halo_ref, start + halo, within)
            edge_at = jnp.broadcast_to(edge0 + (2 * k + slot) * num_cols + c, own.shape)
            far = jnp.where(beyond, read(edge_ref, edge_at, beyond), far)
            return jnp.where(inner, read(ref, own, inner), far)

        return value

    def vertex(raw):
        return pointwise.vertex(raw, corrections, hyper)

    up = neighbour(first - 1, top, above, halo_above, edge_above, 0)
    down = neighbour(last + 1, bottom, below, halo_below, edge_below, 1)
    raw_above = pointwise.Raw(up(0, g_ref), up(1, m_ref, halo_m, m0), up(2, d_ref, halo_d, d0))
    e_above = up(3, e_ref, halo_e, e0)
    below_raw = pointwise.Raw(
        down(0, g_ref), down(1, m_ref, halo_m, m0), down(2, d_ref, halo_d, d0)
    )
    raw_first, e_first, p_first = row(first)
    queue = tuple(row(first + k) for k in range(1, ahead + 1))
    if not interpret:
        # Every lane has read the edge rows of the walks next to its own before any overwrites.
        plgpu.debug_barrier()
    here = vertex(raw_first)
    _, lower, z = pointwise.edge(e_above, vertex(raw_above), here, corrections, hyper)
    zero = jnp.zeros((stack, cols), compute)

    def body(k, carry):
        here, e_here, p_here, above, queue, pairs = carry
        r = first + k
        valid = in_cols & (r <= last)
        # Rows r + 1 ... r + ahead were loaded in earlier iterations; row r + ahead + 1 is loaded
        # now, so its latency hides behind arithmetic (the stores below may alias the loads:
        # nothing reorders them).
        (raw_next, e_next, p_next), queue = queue[0], (*queue[1:], row(r + ahead + 1))
        next_raw = pointwise.Raw(
            *(jnp.where(r == last, b, x) for b, x in zip(below_raw, raw_next, strict=True))
        )
        after = vertex(next_raw)
        e_new, lower, z = pointwise.edge(e_here, here, after, corrections, hyper)
        u = here.scale * (z + above[0] * above[1])  # tridiagonal_step's expression
        adam = pointwise.adam_direction(here.m, here.d, corrections, hyper)
        at = r * num_cols + c
        out = _output(scalars_ref, ratio_ref, u, p_here, decayed)
        for ref, x in ((out_ref, out), (m_out, here.m), (d_out, here.d), (e_out, e_new)):
            plgpu.store(ref.at[at], x.astype(ref.dtype), mask=valid)
        pairs = tuple(_running_pair(p, x, valid) for p, x in zip(pairs, (adam, u), strict=True))
        return after, e_next, p_next, (lower, z), queue, pairs

    floor = jnp.full((stack, cols), _scale_floor(compute), compute)
    init = (here, e_first, p_first, (lower, z), queue, ((floor, zero),) * 2)
    *_, pairs = jax.lax.fori_loop(0, rows // stack, body, init)
    _write_parts(parts_ref, i, j, pairs)


def band_halo_rows(num_rows: int, rows: int, band: int) -> list[int]:
    """The rows of the view whose pre-step state the band-``b`` walks of other chunks read: per
    row chunk of ``rows``, its first ``2b - 1`` rows (read by the walk of the chunk above) and its
    last ``b`` (read by the chunk below), in this order (a chunk shorter than that repeats its
    last or first row: those slots are never read)."""
    out = []
    for first in range(0, num_rows, rows):
        last = min(first + rows, num_rows) - 1
        out += [min(first + s, last) for s in range(2 * band - 1)]
        out += [max(last - band + 1 + s, first) for s in range(band)]
    return out


def _band_scan_kernel(
    scalars_ref,
    g_ref,
    m_ref,
    d_ref,
    e_ref,
    halo_m,
    halo_d,
    halo_e,
    starts_ref,
    edge_ref,
    *refs,
    shape,
    band,
    graft,
    rows,
    cols,
    apply,
    decayed,
    program,
):
    """Band ``b >= 2`` (Theorem 2, Algorithm 3) walking down a ``rows x cols`` block of the view.

    Each lane owns a column and walks the chain from ``b`` rows above its chunk to ``2b - 1``
    rows below it (the rows beyond the view's top and bottom come from the ``edges`` input,
    :func:`kernel_edges`).
    On reading row ``t`` it computes, with ``solve``'s and ``pointwise``'s float operations:

    * ``t``'s moments and :func:`pointwise.vertex`, and the new statistics and correlations
      ``rho_k`` of the edges ``(t - k, t)``, ``k = 1..b`` (:func:`pointwise.correlation`): the
      last entries of ``C`` that vertex ``t - b``'s window needs;
    * Algorithm 3's cut test of vertex ``t - b`` on its full window (``solve.window_cut``);
    * the truncated factor of vertex ``i = t - 2b + 1``, whose window's cuts are now all known
      (``solve.truncated_factor``), and its ``z_i = D_ii (w_i + sum_p L_{i+1+p,i} w_{i+1+p})``.
      Where no lane of the program has a cut in its window, the truncated solve is the full
      one (the masks are exact ones): the walk queues the last ``b - 1`` full solves and takes
      vertex ``i``'s (``solve.window_factor``), the truncated solve running under a
      ``lax.cond`` on the program's largest cut. A repeated gradient with ``|g| >> eps`` (every
      window singular) takes the second solve in every row; the demo LM's band-4 statistics
      at step 300 (configs/tiny.gin) cut no edge;
    * ``u_i = s_i (z_i + sum_p L_{i, i-1-p} z_{i-1-p})``, as ``solve.apply``; each factored
      vertex adds its terms to the ``b`` sums of the vertices below it, so the walk carries ``b``
      sums instead of the last ``b`` columns of ``L`` and their ``z``.

    Rows are read once per walk (the ``3b - 1`` rows around a chunk by two walks), every vertex
    and window solved once. The state is updated in place; the walk reads the state of other
    chunks' rows from the halo copies (:func:`band_halo_rows`), taken before the step. With
    ``apply`` (:class:`Apply`) the kernel reads ``p_ref`` at row ``i`` and writes the new
    parameters there (in place) instead of ``u``.
    """
    p_ref, ratio_ref = refs[:2] if apply else (None, None)
    out_ref, m_out, d_out, e_out, parts_ref = refs[2:] if apply else refs
    b = band
    num_rows, num_cols = tile_view(shape)
    size = num_rows * num_cols
    i, j = program
    c = j * cols + jnp.arange(cols, dtype=jnp.int32)
    in_cols = c < num_cols
    hyper, corrections = _numbers(scalars_ref, graft)
    compute = d_ref.dtype
    first, last = _chunk_rows(i, rows, num_rows)
    span = 3 * b - 1  # halo rows per chunk, and the edges' rows (b above, 2b - 1 below)
    halo_size = pl.cdiv(num_rows, rows) * span * num_cols  # one sub-array's halo rows
    # Each array's first halo element, and the tensor's first edges element.
    m0, d0, e0, edge0 = (starts_ref[k] for k in range(4))

    def locate(t):
        """The walk's row ``t``: ``(offset, halo, edge, beyond, ok)``, its flat offset, that of
        its copy in the halo rows, that of its column in array 0 of the ``edges``, whether it is
        beyond the view (then only ``edge`` is a place), and whether the walk reads it: within
        ``b`` rows above the chunk or ``2b - 1`` below it (the rows the chunk's outputs depend
        on)."""
        beyond = (t < 0) | (t >= num_rows)
        row = jnp.clip(t, 0, num_rows - 1)
        chunk = row // rows
        within = row - chunk * rows
        length = jnp.minimum(rows, num_rows - chunk * rows)
        slot = jnp.where(within < 2 * b - 1, within, within - length + span)
        edge_row = jnp.where(t < 0, t + b, t - num_rows + b)
        ok = in_cols & (t >= first - b) & (t <= last + 2 * b - 1)
        halo = (chunk * span + slot) * num_cols + c
        return row * num_cols + c, halo, edge_row * num_cols + c, beyond, ok

    def read(ref, at, mask):
        return plgpu.load(ref.at[at], mask=mask, other=0).astype(compute)

    def own(t):
        """Whether row ``t`` is this chunk's (the walk writes its outputs there)."""
        return (t >= first) & (t <= last)

    def from_edges(index, edge, beyond, ok):
        """Array ``index`` of the ``edges`` (0 ``g``, 1 ``m``, 2 ``d``, ``3 + k`` ``e``'s ``k``-th
        off-diagonal) at ``edge``."""
        return read(edge_ref, edge0 + index * span * num_cols + edge, ok & beyond)

    def read_state(ref, halo_ref, start, index, k, t):
        """Row ``t`` of sub-array ``k`` of ``ref`` (``e``'s ``k``-th off-diagonal; array
        ``index`` of the edges): the chunk's own rows as stored, the others' from their halo
        copies or, beyond the view, from the edges."""
        offset, halo, edge, beyond, ok = locate(t)
        stored = read(ref, k * size + offset, ok & own(t))
        copied = read(halo_ref, start + k * halo_size + halo, ok & ~own(t) & ~beyond)
        far = jnp.where(beyond, from_edges(index, edge, beyond, ok), copied)
        return jnp.where(own(t), stored, far)

    def write(ref, at, x, mask):
        plgpu.store(ref.at[at], x.astype(ref.dtype), mask=mask)

    def mine(t):
        """:func:`own` in this program's columns: where the walk writes."""
        return in_cols & own(t)

    zero = jnp.zeros((cols,), compute)

    def load(t) -> tuple[pointwise.Raw, tuple]:
        """Row ``t``'s raw values and the stored statistics of its edges from ``t - 1``, ...,
        ``t - b`` (zeros off the chain)."""
        at, _, edge, beyond, ok = locate(t)
        g = jnp.where(beyond, from_edges(0, edge, beyond, ok), read(g_ref, at, ok & ~beyond))
        raw = pointwise.Raw(
            g,
            read_state(m_ref, halo_m, m0, 1, 0, t),
            read_state(d_ref, halo_d, d0, 2, 0, t),
        )
        return raw, tuple(read_state(e_ref, halo_e, e0, 3 + k, k, t - 1 - k) for k in range(b))

    def load_own(t) -> tuple[pointwise.Raw, tuple]:
        """:func:`load` of a row ``t`` with ``t - b`` in the chunk: every value is the chunk's
        own, read as stored (without :func:`load`'s choices between the state and its halo)."""
        at = t * num_cols + c
        raw = pointwise.Raw(*(read(ref, at, in_cols) for ref in (g_ref, m_ref, d_ref)))
        e_old = (read(e_ref, k * size + at - (1 + k) * num_cols, in_cols) for k in range(b))
        return raw, tuple(e_old)

    def body(loader, t, carry):
        loaded, g_q, s_q, w_q, rho_q, solved_q, cut_q, acc_q, pairs = carry
        # Row t was loaded in the previous iteration; row t + 1's loads are in flight while
        # row t is computed (as the band-1 scan's ``ahead``).
        (raw, e_olds), loaded = loaded, loader(t + 1)
        v = pointwise.vertex(raw, corrections, hyper)
        for ref, x in ((m_out, v.m), (d_out, v.d)):
            write(ref, t * num_cols + c, x, mine(t))
        adam = pointwise.adam_direction(v.m, v.d, corrections, hyper)
        # rho_q[n][k - 1]: rho_k of position t - 2b + 1 + n (queued positions t - 2b + 1 ... t - 1).
        rho_q = [list(x) for x in rho_q]
        for dist in range(1, b + 1):
            a = pointwise.Vertex(g_q[-dist], zero, zero, s_q[-dist], zero)
            e_new, rho = pointwise.correlation(e_olds[dist - 1], a, v, corrections, hyper)
            at = (dist - 1) * size + (t - dist) * num_cols + c
            write(e_out, at, e_new, mine(t - dist))
            rho_q[-dist][dist - 1] = rho

        def window(n):
            """The window system of queued position ``n`` (``solve.window_solve``'s arguments)."""
            rows_ = [[rho_q[n + 1 + p][q] for q in range(b - 1 - p)] for p in range(b)]
            return rows_, rho_q[n]

        schur, solution, pivot = solve.window_solve(*window(b - 1))  # vertex t - b
        cut = solve.window_cut(schur, pivot, hyper.gamma)
        vertex_i = t - 2 * b + 1
        cuts = [*cut_q, cut]
        # Vertex i's window solve ran b - 1 rows ago (solved_q[0]); without cuts in its window
        # it is the truncated one. A branch on the whole program skips the second solve.
        lower, diag = jax.lax.cond(
            jnp.max(functools.reduce(jnp.maximum, cuts)) > 0,
            lambda: solve.truncated_factor(*window(0), cuts),
            lambda: solve.window_factor(*solved_q[0]),
        )
        y = w_q[0]
        for p in range(b):
            y = madd(lower[p], w_q[1 + p], y)
        z = diag * y
        # acc_q[n]: sum_p L_{i+n, i+n-1-p} z_{i+n-1-p} over the vertices factored so far.
        u = s_q[0] * (acc_q[0] + z)
        at_i = vertex_i * num_cols + c
        p_i = None if p_ref is None else read(p_ref, at_i, mine(vertex_i))
        write(out_ref, at_i, _output(scalars_ref, ratio_ref, u, p_i, decayed), mine(vertex_i))
        pairs = tuple(
            _running_pair(pair, x, mine(r))
            for pair, x, r in zip(pairs, (adam, u), (t, vertex_i), strict=True)
        )
        return (
            loaded,
            (*g_q[1:], v.g),
            (*s_q[1:], v.scale),
            (*w_q[1:], v.w),
            (*(tuple(x) for x in rho_q[1:]), (zero,) * b),
            (*solved_q[1:], (schur, tuple(solution))),
            (*cut_q[1:], cut),
            tuple(madd(lp, z, acc) for acc, lp in zip((*acc_q[1:], zero), lower, strict=True)),
            pairs,
        )

    floor = jnp.full((cols,), _scale_floor(compute), compute)
    init = (
        load(first - b),
        (zero,) * b,
        (zero,) * (2 * b - 1),
        (zero,) * (2 * b - 1),
        ((zero,) * b,) * (2 * b - 1),
        ((zero + 1, (zero,) * b),) * (b - 1),  # the solve of a window of zeros
        (zero,) * (b - 1),
        (zero,) * b,
        ((floor, zero),) * 2,
    )
    # Rows first - b ... last + 2b - 1, in three loops: the middle one loads rows t + 1 whose
    # values are all the chunk's own (most of the walk), the others choose row by row. On an H100
    # (band 4, the LM set) one loop choosing the loads by a lax.cond on t took 17.58 ms against
    # 13.37; unrolling the middle loop by 2, 15.91 against 13.40: its 4M-element launches 40%
    # longer (results/profile_update_band4_v17_experiments.json; by 2 and 3 at aa5e421:
    # results/profile_update_band4_unroll.json).
    inner, end = first + b - 1, first + rows + 2 * b - 1
    carry = jax.lax.fori_loop(first - b, inner, functools.partial(body, load), init)
    carry = jax.lax.fori_loop(
        inner, jnp.maximum(inner, last), functools.partial(body, load_own), carry
    )
    *_, pairs = jax.lax.fori_loop(
        jnp.maximum(inner, last), end, functools.partial(body, load), carry
    )
    _write_parts(parts_ref, i, j, pairs)


def _diagonal_kernel(scalars_ref, *refs, shape, graft, rows, cols, apply, decayed, program):
    """One ``rows x cols`` tile of the view: the diagonal step (band 0; with ``apply``, reading
    ``p_ref`` and writing the new parameters in ``u``'s place)."""
    inputs = 3 + 2 * apply
    g_ref, m_ref, d_ref = refs[:3]
    out_ref, m_out, d_out, parts_ref = refs[inputs:]
    p_ref, ratio_ref = refs[3:5] if apply else (None, None)
    num_rows, num_cols = tile_view(shape)
    i, j = program
    r = i * rows + jnp.arange(rows, dtype=jnp.int32)[:, None]
    c = j * cols + jnp.arange(cols, dtype=jnp.int32)[None, :]
    valid = (r < num_rows) & (c < num_cols)
    offset = r * num_cols + c
    hyper, corrections = _numbers(scalars_ref, graft)
    compute = d_ref.dtype

    def here(ref):
        return plgpu.load(ref.at[offset], mask=valid, other=0).astype(compute)

    raw = pointwise.Raw(here(g_ref), here(m_ref), here(d_ref))
    p = None if p_ref is None else here(p_ref)
    step = pointwise.diagonal_step(raw, corrections, hyper)
    out = _output(scalars_ref, ratio_ref, step.u, p, decayed)
    plgpu.store(out_ref.at[offset], out.astype(out_ref.dtype), mask=valid)
    for ref, x in ((m_out, step.m), (d_out, step.d)):
        plgpu.store(ref.at[offset], x.astype(ref.dtype), mask=valid)
    ones = jnp.ones(valid.shape, compute)
    pairs = [(jnp.where(valid, jnp.abs(x), 0), ones) for x in (step.adam, step.u)]
    _write_parts(parts_ref, i, j, pairs)


def leaf_update(
    g: jax.Array,
    m: jax.Array,
    d: jax.Array,
    e: Any,
    corrections: tuple[jax.Array, jax.Array],
    hyper: pointwise.Hyper,
    *,
    interpret: bool = False,
    tile: tuple[int, int, int] | None = None,
    halos: tuple[Halo, Halo, Halo] | None = None,
    edges: Edges | None = None,
    apply: Apply | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, Any, jax.Array | None]:
    """One tensor's diag (``e`` is ``optax.MaskedNode``), tridiag or banded (``e`` of ``band >=
    2`` off-diagonals, :func:`supported`) step.

    ``m``, ``d`` and ``e`` are updated in place (their buffers are the outputs'). ``tile`` is
    ``(rows, cols, num_warps)``: a program handles ``rows x cols`` (powers of 2) of the view
    (:func:`tile_view`) with ``num_warps`` warps; default :func:`default_tile`; a tuning knob
    (``benchmarks/kernel_speed.py``, ``benchmarks/profile_update.py``). Band 0 runs
    :func:`_diagonal_kernel`, band 1 :func:`_scan_kernel`, bands >= 2 :func:`_band_scan_kernel`.
    Returns ``(u, m, d, e, parts)``:
    the ungrafted direction in ``d``'s dtype, the new state in the stored dtypes, and per tile
    the norm pairs ``(max |x|, sum (x / max)^2)`` of Adam's direction and of ``u`` as ``(4,
    tiles)``: rows ``scale_adam, sum_adam, scale_u, sum_u`` (``None`` unless ``hyper.graft ==
    "adam"``; each row contiguous, so XLA reduces along the minor axis); see
    ``chain.merge_norm_parts``.

    Bands >= 1 read the halo rows of ``(m, d, e)`` (:func:`band_halo_rows`) from ``halos``
    (:func:`gather_halos`, which can gather those of a model's tensors in a few launches);
    default: gathered here. They read the chain neighbours beyond the view's first and last rows
    from ``edges`` (:func:`kernel_edges`: a shard's come from the other shards); default: those of
    a tensor whole on the device.

    With ``apply`` (:class:`Apply`) the kernel also reads the parameters and writes them in place,
    updated with ``u``, and returns them in ``u``'s place: 36 B/param for fp32 tridiag, where
    writing ``u`` for XLA to apply moves 44.
    """
    kwargs = dict(interpret=interpret, tile=tile, halos=[halos], edges=[edges], applies=[apply])
    (step,) = group_update([g], [m], [d], [e], corrections, hyper, **kwargs)
    return step


def group_update(
    gs: list[jax.Array],
    ms: list[jax.Array],
    ds: list[jax.Array],
    es: list[Any],
    corrections: tuple[jax.Array, jax.Array],
    hyper: pointwise.Hyper,
    *,
    interpret: bool = False,
    tile: tuple[int, int, int] | None = None,
    halos: list[tuple[Halo, Halo, Halo] | None] | None = None,
    edges: list[Edges | None] | None = None,
    applies: list[Apply | None] | None = None,
) -> list[tuple[jax.Array, jax.Array, jax.Array, Any, jax.Array | None]]:
    """:func:`leaf_update` of several tensors of one :func:`launch_key` (shape, dtypes, and all
    with or all without :class:`Apply`, of one parameter dtype and ``decayed``) in one launch:
    the grid gains an axis over the tensors and each program runs one tensor's kernel. A small
    tensor's kernel is short and its walk's first loads wait on memory before any row is
    computed; launched together, the tensors fill the GPU as one larger tensor does
    (:func:`launch_group`). Returns :func:`leaf_update`'s tuple per tensor, in order."""
    count = len(gs)
    halos = halos or [None] * count
    edges = edges or [None] * count
    applies = applies or [None] * count
    keys = set(map(launch_key, gs, ms, ds, es, applies))
    if len(keys) != 1:
        raise ValueError(f"group_update: tensors of different launch keys {sorted(map(str, keys))}")
    ((shape, band, dtypes, apply_config),) = keys
    rows, cols, num_warps = tile or default_tile(band, shape)
    kernel = "band" if band >= 2 else "scan" if band == 1 else "diagonal"
    stack = scan_stack(rows) if kernel == "scan" else 1
    if kernel != "diagonal" and (rows % stack or stack * cols < 32 * num_warps):
        raise ValueError(
            f"{kernel} kernel: {rows} rows in {stack} walks of {cols} columns for 32 x "
            f"{num_warps} lanes (one each)"
        )
    compute = ds[0].dtype
    num_rows, num_cols = tile_view(shape)
    apply = applies[0]
    numbers = [getattr(hyper, k) for k in _SCALARS[:5]] + list(corrections)
    numbers += [0] * len(_APPLY_SCALARS) if apply is None else [apply.weight_decay, apply.scale]
    numbers += [0] * (pl.next_power_of_2(len(numbers)) - len(numbers))
    scalars = jnp.stack([jnp.asarray(x, compute) for x in numbers])
    halo_size = (3 * band - 1) * pl.cdiv(num_rows, rows) * num_cols  # one sub-array's
    if band and band * halo_size > _MAX_SIZE:
        raise ValueError(
            f"band {band} on {shape} in chunks of {rows} rows: {band * halo_size} halo "
            "elements exceed int32 offsets; use longer row chunks (tile)"
        )
    inputs = [scalars]
    for g, m, d, e, halo, edge, applied in zip(gs, ms, ds, es, halos, edges, applies, strict=True):
        state = [m, d] + ([e[0]] if band == 1 else [e] if band else [])
        extra = []
        if band:
            halo = halo or gather_halos(
                state, rows, band=band, shapes=[shape] * 3, interpret=interpret
            )
            if any(h.rows != rows for h in halo):
                raise ValueError(
                    f"halos gathered in chunks of {halo[0].rows} rows, tile has {rows}"
                )
            if edge is None:
                (edge,) = run(kernel_edges([g], [m], [d], [e], ChainLayout.unsharded(shape)))
            edge_size = (3 + band) * (3 * band - 1) * num_cols  # one tensor's edges
            starts = [h.index * halo_size for h in halo] + [edge.index * edge_size]
            extra = [h.buffer for h in halo]
            extra += [jnp.array(starts, jnp.int32), edge.buffer]
        params = []
        if applied is not None:
            params = [applied.params.reshape(-1), jnp.asarray(applied.ratio, compute).reshape(1)]
        inputs += [g.reshape(-1), *(x.reshape(-1) for x in state), *extra, *params]
    step = _step_call(
        shape,
        band,
        hyper.graft,
        (rows, cols, num_warps),
        dtypes[1:],  # the state's
        kernel,
        (stack, SCAN_AHEAD) if kernel == "scan" else None,
        interpret,
        apply_config,
        len(extra),
        count,
        FMA and kernel == "band" and not interpret and _ptx(),
    )
    outputs = step(*inputs)
    per = len(outputs) // count
    steps = []
    for k, e in enumerate(es):
        u, *new_state, parts = outputs[k * per : (k + 1) * per]
        m_new, d_new = (x.reshape(shape) for x in new_state[:2])
        e_new = new_state[2].reshape(e.shape) if band else e
        parts = parts.reshape(4, -1) if hyper.graft == "adam" else None
        steps.append((u.reshape(shape), m_new, d_new, e_new, parts))
    return steps


@functools.cache
def _step_call(
    shape,
    band,
    graft,
    tile,
    state_dtypes,
    kernel,
    walks,
    interpret,
    apply,
    halo_inputs,
    count=1,
    contract=False,
) -> Callable:
    """:func:`leaf_update`'s ``kernel`` (``"diagonal"``, ``"scan"`` with ``walks = (stack, ahead)``:
    ``stack`` walks per program, each loading ``ahead`` rows ahead, or ``"band"`` for bands >= 2)
    for one static configuration (with the fused apply when ``apply`` is the parameters' ``(dtype,
    decayed)``, not ``None``; ``halo_inputs``: how many inputs come between the state and the
    parameters; ``count``: tensors per launch, :func:`group_update`; ``contract``: whether the
    kernel's ``fma.madd`` are fused multiply-adds, ``FMA``), jitted and cached: the
    tensors of one shape then call one jitted function, which JAX lowers to Triton once per
    program instead of once per tensor, and whose Triton module the program holds once (the LM
    set's update, exported for CUDA on a CPU: 3.5 s of lowering and 2.4 MB of MLIR instead of
    13.0 s and 10 MB; on an H100 with the scan kernel, 6.3 s instead of 21.8)."""
    rows, cols, num_warps = tile
    num_rows, num_cols = tile_view(shape)
    grid = (pl.cdiv(num_rows, rows), pl.cdiv(num_cols, cols))
    size, compute = math.prod(shape), state_dtypes[1]
    params_dtype, decayed = apply or (compute, False)
    outputs = [jax.ShapeDtypeStruct((size,), params_dtype)]
    sizes = (size, size, max(band, 1) * size)[: len(state_dtypes)]  # m, d and e
    outputs += [jax.ShapeDtypeStruct((n,), t) for n, t in zip(sizes, state_dtypes, strict=True)]
    outputs.append(jax.ShapeDtypeStruct((4, *grid), compute))
    # Per tensor, after the scalars: g, the state, the halo inputs and with ``apply`` the
    # parameters and their ratio. The state's inputs are its outputs' buffers; so are the
    # parameters' with ``apply``.
    inputs = 1 + len(state_dtypes) + halo_inputs + 2 * bool(apply)
    aliases = {}
    for k in range(count):
        first_in, first_out = 1 + k * inputs, k * len(outputs)
        aliases.update({first_in + 1 + n: first_out + 1 + n for n in range(len(state_dtypes))})
        if apply:
            aliases[first_in + 1 + len(state_dtypes) + halo_inputs] = first_out
    static = dict(
        shape=shape, graft=graft, rows=rows, cols=cols, apply=bool(apply), decayed=decayed
    )
    if kernel == "scan":
        body, name = _scan_kernel, "sonew_band1_scan"
        static.update(stack=walks[0], ahead=walks[1], interpret=interpret)
    elif kernel == "band":
        body, name, static["band"] = _band_scan_kernel, f"sonew_band{band}_scan", band
    else:
        body, name = _diagonal_kernel, "sonew_diagonal"
    step = pl.pallas_call(
        _bind(
            _per_tensor,
            name,
            contract=contract,
            body=body,
            count=count,
            inputs=inputs,
            static=static,
        ),
        grid=grid if count == 1 else (*grid, count),
        out_shape=outputs * count,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps),
        name=name,
    )
    return jax.jit(step)


def _ptx() -> bool:
    """Whether the kernels compile for NVIDIA GPUs, whose PTX ``fma.madd``'s assembly is (on
    ROCm's the walk's multiply-adds stay apart)."""
    return jax.devices()[0].device_kind.startswith("NVIDIA")


def _per_tensor(scalars_ref, *refs, body, count: int, inputs: int, static: dict) -> None:
    """The kernel ``body`` on one of ``count`` tensors' refs (``inputs`` inputs each after the
    shared scalars, then each one's outputs): tensor ``program_id(2)``'s, a branch per tensor
    (the refs are static). ``body`` takes the program's ``(row chunk, column block)`` as
    ``program``."""
    # Read outside the branches: inside one, Pallas' interpreter finds no program ids.
    program = pl.program_id(0), pl.program_id(1)
    if count == 1:
        body(scalars_ref, *refs, program=program, **static)
        return
    outputs = (len(refs) - count * inputs) // count
    tensor = pl.program_id(2)
    for k in range(count):

        @pl.when(tensor == k)
        def _run(k=k):
            mine = refs[k * inputs : (k + 1) * inputs]
            out = refs[count * inputs + k * outputs : count * inputs + (k + 1) * outputs]
            body(scalars_ref, *mine, *out, program=program, **static)


def _bind(kernel, name: str, contract: bool = False, **static):
    """``kernel`` with its static arguments bound, under ``name`` (as Pallas reports it), traced
    within ``fma.contracted(contract)``."""

    def bound(*refs):
        with fma.contracted(contract):
            kernel(*refs, **static)

    bound.__name__ = name
    return bound
