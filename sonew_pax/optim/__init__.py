"""SONew (Sparsified Online Newton) for optax: diag, tridiagonal and banded, shardable.

Depends on jax and optax only.
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
from sonew_pax.optim.transform import GradientTransformationWithApply, apply_gradients, chain

__all__ = [
    "DEFAULT_DAMPING",
    "DEFAULT_EPS",
    "DEFAULT_GAMMA",
    "DEFAULT_GRAFT_LAG",
    "MAX_BAND",
    "GradientTransformationWithApply",
    "KernelConfig",
    "SONewConfig",
    "ScaleBySONewDampedState",
    "ScaleBySONewLagState",
    "ScaleBySONewState",
    "StackedByShapeState",
    "apply_gradients",
    "chain",
    "scale_by_sonew",
    "sonew",
    "specs_of",
    "stack_counts",
    "state_partition_specs",
]
