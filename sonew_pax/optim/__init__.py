"""SONew (Sparsified Online Newton) for optax: diag, tridiagonal and banded, shardable.

Depends on jax and optax only. Layout, from the entry points down:

* ``sonew.py``: the optax entry points :func:`scale_by_sonew` and :func:`sonew` (``init``,
  ``update``, ``apply``); ``state.py``: their states; ``transform.py``: transformations that
  apply themselves (:func:`apply_gradients`, :func:`chain`); ``grouping.py``: ``stack_by_shape``.
* ``config.py``: :class:`SONewConfig`, the hyper-parameters (defaults and checks) that the entry
  points build from their arguments and the step reads.
* ``engine.py``: the whole-tree step (``make_step``); ``dispatch.py``: which path runs each
  tensor (GPU kernel, TPU kernel or XLA); ``slots.py``: the per-tensor numbers (graft ratios, a
  relative damping's statistics) and their places in the state; ``neighbours.py``: the rows a
  step reads beyond its block (halos, edges).
* ``pointwise.py`` (bands 0 and 1, Theorem 1) and ``solve.py`` (bands >= 2, Theorem 2 and
  Algorithm 3): the math both paths share; ``fma.py``: fused multiply-adds; ``chain.py``: a
  tensor's chain and its shifts across shards; ``sharding.py``: ``shard_map`` and the state's
  specs; ``kernels/``: the Pallas kernels.
"""

from sonew_pax.optim.config import (
    DEFAULT_DAMPING,
    DEFAULT_EPS,
    DEFAULT_GAMMA,
    DEFAULT_GRAFT_LAG,
    MAX_BAND,
    SONewConfig,
)
from sonew_pax.optim.kernels import KernelConfig
from sonew_pax.optim.sharding import specs_of, stack_counts, state_partition_specs
from sonew_pax.optim.sonew import (
    ScaleBySONewDampedState,
    ScaleBySONewLagState,
    ScaleBySONewState,
    StackedByShapeState,
    scale_by_sonew,
    sonew,
)
from sonew_pax.optim.transform import (
    GradientScaling,
    GradientTransformationWithApply,
    apply_gradients,
    chain,
    clip_by_global_norm,
)

__all__ = [
    "DEFAULT_DAMPING",
    "DEFAULT_EPS",
    "DEFAULT_GAMMA",
    "DEFAULT_GRAFT_LAG",
    "MAX_BAND",
    "GradientScaling",
    "GradientTransformationWithApply",
    "KernelConfig",
    "SONewConfig",
    "ScaleBySONewDampedState",
    "ScaleBySONewLagState",
    "ScaleBySONewState",
    "StackedByShapeState",
    "apply_gradients",
    "chain",
    "clip_by_global_norm",
    "scale_by_sonew",
    "sonew",
    "specs_of",
    "stack_counts",
    "state_partition_specs",
]
