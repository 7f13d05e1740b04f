"""SONew's hyper-parameters: one frozen, typed :class:`SONewConfig`, its defaults and its checks.

:func:`sonew_pax.optim.sonew.scale_by_sonew` and :func:`sonew_pax.optim.sonew.sonew` keep
optax's explicit keyword arguments (gin binds them, ``optax.inject_hyperparams`` injects them);
each builds a :class:`SONewConfig` from them (:meth:`SONewConfig.of`), which checks every value
once, and the step (:mod:`sonew_pax.optim.engine`, ``pointwise``, the kernels) reads it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax

if TYPE_CHECKING:
    from sonew_pax.optim.kernels.config import KernelConfig

Graft = Literal["adam", "none"]
Damping = Literal["absolute", "mean", "max"]
Implementation = Literal["auto", "xla", "pallas"]
GRAFTS = get_args(Graft)
DAMPINGS = get_args(Damping)
IMPLEMENTATIONS = get_args(Implementation)
# A number, or the array ``optax.inject_hyperparams`` makes of it (traced inside ``jit``).
Number = float | jax.Array
# The widest band accepted. The banded solve is unrolled (``solve``: ``O(band^3)`` operations per
# element, traced and compiled as such), so compile time grows at least as ``band^3``: wider bands
# are refused rather than left to compile without bound.
MAX_BAND = 16
# Defaults. ``eps`` is relative: each tensor's diagonal is damped by ``eps`` times the mean of its
# bias-corrected diagonal ``d_hat`` (``damping="mean"``), so its best value does not follow the
# gradients' squared scale as an absolute one does. 0.1 is the value chosen across the LMs and the
# MNIST autoencoder with only the learning rate tuned (the sweeps: benchmarks/README.md,
# docs/performance.md). ``gamma`` is the relative Schur-complement tolerance of Algorithm 3:
# ``1 - rho^2 <= 1e-4`` (|correlation| > 0.99995) is within ~1e3 float32 roundings of zero, so
# such edges are dropped rather than trusted.
DEFAULT_EPS = 0.1
DEFAULT_DAMPING = "mean"
DEFAULT_GRAFT_LAG = False
DEFAULT_GAMMA = 1e-4


@dataclasses.dataclass(frozen=True, kw_only=True)
class SONewConfig:
    """SONew's hyper-parameters, checked when built.

    Each field is the argument of :func:`sonew_pax.optim.sonew.scale_by_sonew` of the same name,
    with its default, and is documented there. The numbers may be arrays (traced under
    ``optax.inject_hyperparams`` and inside ``jit``; the kernels rebuild a config from their
    scalar inputs): only concrete values are range-checked. ``band`` and ``stack_by_shape`` are
    structural (they set the state's shapes and layout). Inside the step, ``eps`` is one tensor's
    damping (:meth:`with_eps`): with ``damping="absolute"`` as given, else relative to the
    tensor's diagonal (``engine._damped``).

    Raises:
      ValueError: a value out of range or not among its options, naming its field.
    """

    b1: Number = 0.9
    b2: Number = 0.95
    eps: Number = DEFAULT_EPS
    band: int | jax.Array = 1
    gamma: Number = DEFAULT_GAMMA
    graft: Graft = "adam"
    graft_eps: Number = 1e-8
    precondition_1d: bool = False
    stats_dtype: jax.typing.DTypeLike = "float32"
    mu_dtype: jax.typing.DTypeLike | None = None
    offdiag_dtype: jax.typing.DTypeLike | None = None
    implementation: Implementation = "auto"
    graft_lag: bool = DEFAULT_GRAFT_LAG
    kernel_config: KernelConfig | None = None
    damping: Damping = DEFAULT_DAMPING
    stacked_axes: Any = None
    stack_by_shape: bool = False
    stack_dtype: jax.typing.DTypeLike | None = None

    def __post_init__(self) -> None:
        _check_choice("graft", self.graft, GRAFTS)
        _check_choice("damping", self.damping, DAMPINGS)
        if self.graft_lag and self.graft != "adam":
            raise ValueError(f"graft_lag=True needs graft='adam', got graft={self.graft!r}.")
        check_fraction("b1", self.b1)
        check_fraction("b2", self.b2)
        for name in ("eps", "gamma", "graft_eps"):
            check_nonnegative(name, getattr(self, name))
        if not isinstance(self.stack_by_shape, bool):
            raise ValueError(
                f"stack_by_shape must be a bool, got {self.stack_by_shape!r}: it decides the "
                "state's layout. Under optax.inject_hyperparams, keep it static: "
                "static_args=('stack_by_shape',)."
            )
        if self.stack_dtype is not None:
            if not self.stack_by_shape:
                raise ValueError(
                    f"stack_dtype={self.stack_dtype!r} sets the dtype of stack_by_shape's copy "
                    "of the gradients: it needs stack_by_shape=True."
                )
            if not jnp.issubdtype(as_dtype(self.stack_dtype), jnp.floating):
                raise ValueError(f"stack_dtype must be a float dtype, got {self.stack_dtype!r}.")
        _check_choice("implementation", self.implementation, IMPLEMENTATIONS)
        static_band(self.band)
        mu, stats, offdiag = self.dtypes
        check_decay_resolution("b1", self.b1, "m", mu)
        check_decay_resolution("b2", self.b2, "d", stats)
        check_decay_resolution("b2", self.b2, "e", offdiag)

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> SONewConfig:
        """The config of a public entry point's arguments.

        Args:
          arguments: a mapping holding every field's value by name, and possibly more (the
            entry point's ``locals()``, whose other arguments are not hyper-parameters).

        Returns:
          The checked :class:`SONewConfig`.
        """
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})

    def with_eps(self, eps: Number) -> SONewConfig:
        """This config with ``eps`` replaced by one tensor's damping, unchecked: the engine's
        relative damping (``engine._damped``) is infinite until the tensor's first step."""
        damped = copy.copy(self)
        object.__setattr__(damped, "eps", eps)
        return damped

    @property
    def relative(self) -> bool:
        """Whether the damping is relative to each tensor's diagonal (not ``"absolute"``)."""
        return self.damping != "absolute"

    @property
    def dtypes(self) -> tuple[np.dtype, np.dtype, np.dtype]:
        """The storage dtypes of ``(m, d, e)``: ``mu_dtype``, ``stats_dtype``, ``offdiag_dtype``,
        the unset ones ``stats_dtype``."""
        stats = as_dtype(self.stats_dtype)
        return tuple(  # type: ignore[return-value]
            stats if dtype is None else as_dtype(dtype)
            for dtype in (self.mu_dtype, self.stats_dtype, self.offdiag_dtype)
        )


def _check_choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    """Raises ``ValueError`` unless ``value`` is one of ``options``."""
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}.")


def _concrete(value: Any) -> np.ndarray | None:
    """``value`` as a NumPy array when it is a number or a concrete array; None when it is traced
    (inside ``jit`` or ``optax.inject_hyperparams``' update) or not numeric."""
    if isinstance(value, jax.core.Tracer) or callable(value):
        return None
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        return None
    return array if np.issubdtype(array.dtype, np.number) else None


def check_fraction(name: str, value: Any) -> None:
    """Raises ``ValueError`` unless every concrete entry of ``value`` lies in ``[0, 1)``."""
    array = _concrete(value)
    if array is not None and not np.all((array >= 0) & (array < 1)):
        raise ValueError(f"{name} must lie in [0, 1), got {value!r}.")


def check_nonnegative(name: str, value: Any) -> None:
    """Raises ``ValueError`` unless every concrete entry of ``value`` is finite and ``>= 0``."""
    array = _concrete(value)
    if array is not None and not np.all(np.isfinite(array) & (array >= 0)):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}.")


def check_decay_resolution(name: str, decay: Any, state: str, dtype: np.dtype) -> None:
    """Raises ``ValueError`` when a moving average kept in ``dtype`` cannot follow ``decay``.

    Each step moves the average by ``1 - decay`` of itself. Rounding to nearest moves a value by
    up to half a unit in its last place, ``finfo(dtype).eps / 2`` of it (2^-8 for bfloat16): a
    smaller step can round back to where it was, so the average stops forgetting (bfloat16 with
    ``b2 = 0.999``). A traced ``decay`` is not checked.

    Args:
      name: the decay's argument name (``"b1"``, ``"b2"``).
      decay: its value.
      state: the state it decays (``m``, ``d``, ``e``), named in the error.
      dtype: that state's storage dtype.
    """
    array = _concrete(decay)
    if array is None or not jnp.issubdtype(dtype, jnp.floating):
        return
    rounding = float(jnp.finfo(dtype).eps) / 2
    if np.any(1 - array < rounding):
        raise ValueError(
            f"{name}={decay!r} moves {state} by {1 - float(np.max(array)):.2g} of itself per step, "
            f"less than {jnp.dtype(dtype).name}'s rounding ({rounding:.2g}): stored in it, "
            f"{state} can stop decaying. Store {state} in float32 or use "
            f"{name} <= {1 - rounding:.4g}."
        )


def checked_learning_rate(learning_rate: optax.ScalarOrSchedule) -> optax.ScalarOrSchedule:
    """``learning_rate``, checked finite and ``>= 0`` (a negative rate would ascend).

    A number or concrete array is checked here; a schedule is wrapped so that each value it
    returns outside ``jit`` is checked when it is computed (inside ``jit`` its values are traced;
    the trainer checks the rate it logs).
    """
    if not callable(learning_rate):
        check_nonnegative("learning_rate", learning_rate)
        return learning_rate

    def checked(count: Any) -> Any:
        value = learning_rate(count)
        check_nonnegative(f"learning_rate (the schedule's value at step {count})", value)
        return value

    return checked


def static_band(band: Any) -> int | None:
    """``band`` as a Python int; ``None`` when traced.

    ``optax.inject_hyperparams`` turns every numeric argument, ``band`` included, into an array.
    A concrete array is accepted; a traced one is fine inside ``update``, which reads the band
    from the state's shapes.
    """
    if isinstance(band, jax.core.Tracer):
        return None  # under jit; ``update`` reads the band from the state's shapes
    value = np.asarray(band)
    if value.shape or value.dtype == bool or not np.issubdtype(value.dtype, np.number):
        raise ValueError(f"band must be an int (0 diag, 1 tridiag, b banded), got {band!r}.")
    if value != np.round(value) or value < 0:
        raise ValueError(f"band must be an int >= 0 (0 diag, 1 tridiag, b banded), got {band!r}.")
    if value > MAX_BAND:
        raise ValueError(
            f"band must be at most {MAX_BAND}, got {band!r}: the banded solve is unrolled, and "
            "its compile time grows at least as band^3."
        )
    return int(value)


def usable_band(band: int, shape: tuple[int, ...], stack: int = 0) -> int:
    """The band a tensor of ``shape`` (its first ``stack`` axes stacking tensors) can use.

    A chain of ``n`` elements has ``n - 1`` off-diagonals: with ``band >= n - 1`` its graph is
    complete and the LogDet solution is ``H^{-1}`` whatever the band, so wider bands would only
    store zeros. A 0-d tensor is a chain of one element (band 0).

    Args:
      band: the band asked for.
      shape: the tensor's shape.
      stack: how many leading axes of ``shape`` stack tensors, each a chain of its own.

    Returns:
      ``min(band, n - 1)`` for chains of ``n >= 1`` elements, 0 for empty ones.
    """
    return min(band, max(math.prod(shape[stack:]) - 1, 0))


def as_dtype(dtype: Any) -> np.dtype:
    """A dtype from a dtype-like, or from the array ``optax.inject_hyperparams`` makes of one (it
    treats callables such as ``jnp.float32`` as schedules and calls them; the defaults are
    strings, which it leaves alone)."""
    return jnp.dtype(getattr(dtype, "dtype", dtype))
