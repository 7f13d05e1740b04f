"""Every tuning choice of the kernels, as one frozen value passed in."""

from __future__ import annotations

import dataclasses

Tile = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How the Pallas kernels tile and launch a model's update.

    Hashable and immutable: it is part of the static configuration of every compiled kernel, so
    two configurations never share a cached launch. Build one to tune (benchmarks) or to force a
    code path (tests); ``sonew(..., kernel_config=...)`` passes it through. The default's tuning
    is in docs/performance.md.

    A tile is ``(rows, cols, num_warps)``: a program handles ``rows x cols`` of a tensor's 2-D
    view (axis 0 by the rest) on ``num_warps`` warps; rows and columns are powers of 2.

    Attributes:
      diagonal_tile: the diagonal step's tile.
      scan_tile: band 1's scan: a program covers the tile in ``scan_stack`` walks of ``rows /
        scan_stack`` rows, one under another. Its halo copies are ``2 / rows`` of the state.
      scan_stack: walks per scan program. More walks share the program's halo rows; each walk
        stays short (the chain is serial within a walk).
      scan_ahead: rows a scan walk loads ahead of the one it computes: their loads are in flight
        while it computes, at the cost of registers (fewer resident warps).
      scan_lanes: the scan shortens its walks (halving ``rows``, doubling warps) until a tensor
        has this many walks times columns to spread over the GPU ...
      scan_min_walk: ... or its walks are this short.
      banded_tile: bands ``b >= 2``: one lane per column walks its chunk of ``rows`` rows from
        ``b`` rows above to ``2b - 1`` below; longer chunks walk fewer rows twice and copy fewer
        halo rows (``(3b - 1) / rows`` of the state), shorter ones give more programs.
      banded_programs: bands ``b >= 2`` halve their rows (down to ``banded_min_rows``) on tensors
        with fewer programs than this ...
      banded_min_rows: ... or rows this short.
      group_elements: tensors of one shape with fewer elements share launches, enough to reach
        this many elements together (a small tensor's walk waits on its first loads; together they
        fill the GPU as one larger tensor does) ...
      max_group: ... at most this many per launch (each adds a branch to the compiled kernel).
      max_banded_group: the same for bands ``b >= 2``, whose walk is long to compile.
      max_band: the widest band the kernels take (their walk keeps ``(2b - 1) b`` correlations
        in registers); wider bands run on XLA.
      fma: whether the banded walk's multiply-adds are fused (one rounding each) on NVIDIA GPUs.
      concurrent: whether the caller compiles the update so that its independent kernels may run
        at the same time (``CONCURRENT_OPTIONS``); bands ``b >= 2`` then walk
        ``concurrent_banded_tile`` chunks on every tensor (the launches fill the GPU together).
      concurrent_banded_tile: see ``concurrent``.
      halo_group: state arrays per halo launch (each is a kernel argument and a branch).
      halo_cols: columns per halo program.
      stack_tile: ``(elements, num_warps)``: a program of ``kernels.stack`` (``stack_by_shape``'s
        copy of the gradients into stacks) copies that many contiguous elements of one member.
      stack_group: members per launch of that copy (each is a kernel argument and a branch).
      max_offset: the largest flat offset the kernels index (int32): a tensor (with its band
        off-diagonals) or a halo buffer beyond it is refused or split.
      platform: the kernels' target: ``"gpu"`` (Triton kernels, bands 0 to ``max_band``) or
        ``"tpu"`` (Mosaic kernels, ``kernels.tpu``, bands 1 to ``max_band``; band 0 runs on XLA,
        which is at its floor there);
        ``None``: ``"tpu"`` on a TPU backend, else ``"gpu"`` (on a CPU in Pallas' interpreter).
      tpu_block: ``(rows, cols)``: the TPU kernel's largest block (``tpu.block_shape``); its
        inputs, outputs and temporaries stay in VMEM, larger blocks pay the per-program cost
        fewer times.
      tpu_banded_block: the same for bands ``b >= 2``, whose solve holds ``O(b^2)`` values of
        the block's size (plus ``tpu.banded_halo`` rows on each side) in VMEM.
      interpret: whether the kernels run in Pallas' interpreter; ``None``: off their platform's
        backend. ``False`` lowers them for their platform on any host (``jax.export``).
    """

    diagonal_tile: Tile = (8, 128, 8)
    scan_tile: Tile = (64, 64, 2)
    scan_stack: int = 4
    scan_ahead: int = 1
    scan_lanes: int = 2**18
    scan_min_walk: int = 8
    banded_tile: Tile = (64, 128, 4)
    banded_programs: int = 512
    banded_min_rows: int = 32
    group_elements: int = 2**22
    max_group: int = 4
    max_banded_group: int = 1
    max_band: int = 4
    fma: bool = True
    concurrent: bool = False
    concurrent_banded_tile: Tile = (256, 128, 4)
    halo_group: int = 64
    halo_cols: int = 512
    stack_tile: tuple[int, int] = (1024, 4)
    stack_group: int = 64
    max_offset: int = 2**31 - 1
    platform: str | None = None
    tpu_block: tuple[int, int] = (256, 512)
    tpu_banded_block: tuple[int, int] = (128, 128)
    interpret: bool | None = None

    def __post_init__(self):
        """Rejects values the kernels cannot compile or that make no sense, naming the field."""
        tiles = ("diagonal_tile", "scan_tile", "banded_tile", "concurrent_banded_tile")
        for name in tiles:
            tile = getattr(self, name)
            if len(tile) != 3 or not all(_power_of_2(x) for x in tile):
                raise ValueError(
                    f"KernelConfig.{name} = {tile!r}: want (rows, cols, num_warps), each a power "
                    "of 2 (Triton's block shapes and warp counts)"
                )
        if len(self.stack_tile) != 2 or not all(_power_of_2(x) for x in self.stack_tile):
            raise ValueError(
                f"KernelConfig.stack_tile = {self.stack_tile!r}: want (elements, num_warps), "
                "each a power of 2"
            )
        for name in ("scan_stack", "halo_cols"):
            if not _power_of_2(getattr(self, name)):
                raise ValueError(
                    f"KernelConfig.{name} = {getattr(self, name)!r}: want a power of 2"
                )
        counts = (
            "scan_lanes",
            "scan_min_walk",
            "banded_programs",
            "banded_min_rows",
            "group_elements",
            "max_group",
            "max_banded_group",
            "halo_group",
            "stack_group",
            "max_offset",
        )
        for name in counts:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"KernelConfig.{name} = {getattr(self, name)!r}: want an int >= 1")
        if self.interpret not in (None, True, False):
            raise ValueError(
                f"KernelConfig.interpret = {self.interpret!r}: want True, False or None"
            )
        if self.platform not in (None, "gpu", "tpu"):
            raise ValueError(
                f"KernelConfig.platform = {self.platform!r}: want 'gpu', 'tpu' or None"
            )
        for name in ("tpu_block", "tpu_banded_block"):
            rows, cols = getattr(self, name)
            if rows % 16 or cols % 128 or rows < 16 or cols < 128:
                raise ValueError(
                    f"KernelConfig.{name} = {getattr(self, name)!r}: want (rows, cols), "
                    "multiples of 16 and 128 (a TPU's tiles)"
                )
        for name in ("scan_ahead", "max_band"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"KernelConfig.{name} = {getattr(self, name)!r}: want an int >= 0")


def _power_of_2(x: object) -> bool:
    """Whether ``x`` is a positive int power of 2."""
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


# An executable's compile options (``jax.jit(..., compiler_options=...)``) under which XLA may run
# its independent GPU kernels at the same time, every update one command buffer. XLA's buffer
# assignment then keeps apart buffers that a serial order would share (more temporaries), so it
# is opt-in: pair it with ``KernelConfig(concurrent=True)``.
CONCURRENT_OPTIONS = {
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    "xla_gpu_graph_min_graph_size": 1,
}

# The configuration every kernel function takes unless given one.
DEFAULT = KernelConfig()
