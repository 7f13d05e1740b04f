"""SONew's step as Pallas (Triton) kernels on GPU, the state updated in place.

XLA compiles the band-1 step into several passes over memory. Here one kernel reads each array
once and writes the direction (or, with the fused apply, the parameters) and the new state in
place:

* a tensor is a 2-D view (``geometry.tile_view``: axis 0 by the rest), the chain running down
  its columns; programs tile the view in row chunks;
* **band 0** (``diagonal``) is elementwise; **band 1** (``scan``) walks a few rows per lane,
  carrying the previous row's vertex, so every vertex and edge is computed once; **bands b >= 2**
  (``banded``) walk a column's chunk from ``b`` rows above to ``2b - 1`` below, solving each
  vertex's ``b x b`` window with ``solve``'s functions (Algorithm 3's cut test, and a truncated
  solve only where a window cut the chain);
* a chunk reads the rows it needs from the chunks beside it from **halo copies** taken before the
  step (``halo.gather_halos``, a few launches per model), and every chain neighbour beyond the
  view (the wrap into the next column, or a neighbouring shard's rows) from its **edges**
  (``halo.kernel_edges``), built for all tensors of one layout at once: the same kernels run on a
  whole tensor and on each shard's block, whose edges come from the other shards in one
  collective-permute per mesh axes and direction;
* each program writes per-tile norm pairs of Adam's direction and of ``u``; XLA merges them into
  the graft ratios (and, sharded, across shards in one ``psum``: ``chain.merge_shards``);
* tensors of one shape share launches (``launch.group_update``) so that small ones fill the GPU;
  ``stack_by_shape`` copies their gradients into its stacks with ``stack``, at a copy's bandwidth.

The math is ``pointwise``'s and ``solve``'s, the functions the XLA path runs, so both agree to
float rounding. Every tuning choice is a field of :class:`KernelConfig`. ``interpret=True`` runs
the kernels in Pallas' interpreter on any backend (the tests use it on CPU).
"""

from sonew_pax.optim.kernels import tpu
from sonew_pax.optim.kernels.config import CONCURRENT_OPTIONS, DEFAULT, KernelConfig
from sonew_pax.optim.kernels.geometry import (
    default_tile,
    launch_group,
    local_shape,
    supported,
    tile_view,
)
from sonew_pax.optim.kernels.halo import Edges, Halo, band_halo_rows, gather_halos, kernel_edges
from sonew_pax.optim.kernels.launch import group_update, launch_key, leaf_update
from sonew_pax.optim.kernels.program import Apply
from sonew_pax.optim.kernels.stack import stack, stackable

__all__ = [
    "CONCURRENT_OPTIONS",
    "DEFAULT",
    "Apply",
    "Edges",
    "Halo",
    "KernelConfig",
    "band_halo_rows",
    "default_tile",
    "gather_halos",
    "group_update",
    "kernel_edges",
    "launch_group",
    "launch_key",
    "leaf_update",
    "local_shape",
    "stack",
    "stackable",
    "supported",
    "tile_view",
    "tpu",
]
