"""SONew as optax transformations: :func:`scale_by_sonew` and the full optimizer :func:`sonew`.

Per tensor with gradient ``g`` at step ``t`` (paper Algorithm 1 with the authors' exponential
moving averages, bias correction and Adam grafting):

    m   <- b1 m + (1 - b1) g                      first moment
    d   <- b2 d + (1 - b2) g^2                    diagonal of H (also Adam's second moment)
    e_k <- b2 e_k + (1 - b2) g * g_{+k}           k-th off-diagonal of H, k = 1..band
    H    = banded(d / (1 - b2^t) + delta,  e / (1 - b2^t))
           delta = eps mean(d_{t-1} / (1 - b2^(t-1)))    (default; damping="absolute": eps)
    X    = L D L^T = argmin -log det X + Tr(X H)  over band-``band`` matrices (Theorem 2, Alg. 3)
    u    = X m / (1 - b1^t)
    a    = m_hat / (sqrt(d_hat) + graft_eps)      Adam direction
    u   <- u ||a|| / ||u||                        per-tensor grafting (``graft="adam"``)

With ``graft_lag=True`` the last line uses the previous step's ratio instead,
``u_t <- u_t r_{t-1}`` with ``r_t = ||a_t|| / ||u_t||`` stored in the state (``r_0 = 0``): the
scale no longer waits for a reduction over the same step's directions, so the GPU kernels can
apply the update in their one pass over memory (``apply``, :mod:`sonew_pax.optim.transform`).
Through ``update`` and ``optax.apply_updates`` the lag saves nothing.

The damping ``delta`` is relative to the tensor's own diagonal at the previous step (infinite at
the first step: the update is zero), so ``eps`` keeps its meaning across gradient scales and model
sizes. ``g_{+k}`` is the ``k``-th successor along the tensor's chain (Fortran order, see
``chain.py``): one chain per tensor. A parameter that stacks tensors on leading axes (the layer
axis of flax's ``nn.scan``) says so in ``stacked_axes``: each of its stacked tensors then has a
chain, a damping and a graft ratio of its own, as if it were a parameter alone. Every state array
has its parameter's shape (the off-diagonals are stacked on a leading ``band`` axis; the
damping's statistics are one small replicated array), so the state is sharded exactly like the
parameters; with ``mesh`` and ``param_specs`` the update runs under ``jax.shard_map`` and equals
the unsharded update. The step itself is :mod:`sonew_pax.optim.engine`'s.

References:
  Devvrit, Duvvuri, Anil, Gupta, Hsieh, Dhillon: "A Computationally Efficient Sparsified Online
  Newton Method" (NeurIPS 2023): Algorithm 1 (the update), Theorems 1 and 2 (the tridiagonal and
  banded LogDet solutions), Algorithm 3 (the numerically stable banded solve).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from sonew_pax.optim import dispatch, pointwise, sharding
from sonew_pax.optim import grouping as grouping_lib
from sonew_pax.optim import kernels as pallas
from sonew_pax.optim.chain import ChainLayout
from sonew_pax.optim.config import (
    Damping,
    Graft,
    Implementation,
    Number,
    SONewConfig,
    check_nonnegative,
    checked_learning_rate,
    static_band,
    usable_band,
)
from sonew_pax.optim.dispatch import preconditioned
from sonew_pax.optim.engine import ApplyArgs, make_step
from sonew_pax.optim.kernels import KernelConfig
from sonew_pax.optim.slots import slot_count
from sonew_pax.optim.state import (
    ScaleBySONewDampedState,
    ScaleBySONewLagState,
    ScaleBySONewState,
    StackedByShapeState,
)
from sonew_pax.optim.transform import GradientTransformationWithApply, scaled


def _check_real_floats(tree: Any, what: str) -> None:
    """Raises ``TypeError`` naming the first leaf of ``tree`` that is not a real float array.

    SONew's statistics and direction are real: an integer parameter would have its update
    truncated, a complex one its imaginary part dropped.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.floating):
            continue
        hint = (
            "split it into real and imaginary parts, which SONew updates as two real tensors"
            if jnp.issubdtype(dtype, jnp.complexfloating)
            else "leave it out of the optimizer (optax.masked / optax.set_to_zero)"
        )
        raise TypeError(
            f"SONew updates real floating-point {what} only, but {what[:-1]} "
            f"{jax.tree_util.keystr(path)} has dtype {dtype}: {hint}."
        )


def _as_arrays(tree: Any) -> Any:
    """``tree`` with every leaf an array (optax's transformations take Python numbers too)."""
    return jax.tree.map(jnp.asarray, tree)


def _check_shapes(updates: Any, moments: Any) -> None:
    """Raises ``ValueError`` naming the first gradient whose shape is not its parameter's (that of
    its first moment ``moments``, which ``init`` made in the parameter's shape)."""
    expected = jax.tree.structure(updates).flatten_up_to(moments)
    for (path, g), m in zip(jax.tree_util.tree_leaves_with_path(updates), expected, strict=True):
        if jnp.shape(g) != jnp.shape(m):
            raise ValueError(
                f"The gradient {jax.tree_util.keystr(path)} has shape {jnp.shape(g)}, but its "
                f"parameter had shape {jnp.shape(m)} at init."
            )


State = ScaleBySONewState | ScaleBySONewLagState | ScaleBySONewDampedState
# The defaults of the entry points' arguments: the config's.
_DEFAULT = SONewConfig()


def scale_by_sonew(
    b1: Number = _DEFAULT.b1,
    b2: Number = _DEFAULT.b2,
    eps: Number = _DEFAULT.eps,
    band: int = _DEFAULT.band,
    gamma: Number = _DEFAULT.gamma,
    graft: Graft = _DEFAULT.graft,
    graft_eps: Number = _DEFAULT.graft_eps,
    precondition_1d: bool = _DEFAULT.precondition_1d,
    stats_dtype: jax.typing.DTypeLike = _DEFAULT.stats_dtype,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    mu_dtype: jax.typing.DTypeLike | None = _DEFAULT.mu_dtype,
    offdiag_dtype: jax.typing.DTypeLike | None = _DEFAULT.offdiag_dtype,
    implementation: Implementation = _DEFAULT.implementation,
    graft_lag: bool = _DEFAULT.graft_lag,
    kernel_config: KernelConfig | None = _DEFAULT.kernel_config,
    damping: Damping = _DEFAULT.damping,
    stacked_axes: Any = _DEFAULT.stacked_axes,
    stack_by_shape: bool = _DEFAULT.stack_by_shape,
    stack_dtype: jax.typing.DTypeLike | None = _DEFAULT.stack_dtype,
) -> optax.GradientTransformationExtraArgs:
    """SONew preconditioning with Adam grafting (no learning rate, no weight decay).

    Args:
      b1: decay of the first moment ``m``.
      b2: decay of the banded second-moment statistics ``d`` and ``e``.
      eps: damping added to the bias-corrected diagonal of ``H``: by default relative to the
        tensor's diagonal, or as given (``damping``).
      band: ``0`` diag-SONew, ``1`` tridiag-SONew (Theorem 1), ``b`` banded (Theorem 2), at most
        :data:`MAX_BAND`. A tensor whose chain has ``n <= band`` elements keeps ``n - 1``
        off-diagonals (:func:`usable_band`): its graph is complete already. Structural (it sets
        the state's shapes): ``init`` needs it concrete, so under ``optax.inject_hyperparams``
        either pass it in ``static_args`` or call ``init`` outside ``jit``; ``update`` reads it
        from the state.
      gamma: Algorithm 3's tolerance: the chain is cut after vertex ``j`` when its Schur
        complement is ``<= gamma * H_jj`` (or undefined / not finite).
      graft: ``"adam"`` rescales each tensor's direction to the norm of Adam's; ``"none"``.
      graft_eps: epsilon of the Adam direction used for grafting.
      precondition_1d: precondition tensors with fewer than 2 dimensions too (otherwise they take
        the Adam direction).
      stats_dtype: dtype of ``d`` (float32 even for bf16 parameters), and of ``m`` and ``e``
        unless ``mu_dtype`` / ``offdiag_dtype`` say otherwise. The arithmetic runs in it, or in
        float32 where it is narrower: bf16 statistics are stored in bf16, computed in float32.
        Any dtype-like; the default is a string because ``optax.inject_hyperparams`` calls
        callables such as ``jnp.float32`` as schedules (pass strings under it, as for
        ``mu_dtype`` and ``offdiag_dtype``, or list them in ``static_args``).
      mesh: a ``jax.sharding.Mesh``; with ``param_specs``, the update runs under ``shard_map``,
        each device on its block of every tensor (halos from the neighbouring shards), and
        equals the single-device update.
      param_specs: the parameters' layout on ``mesh``: a pytree of ``PartitionSpec`` (or
        ``None``) matching the parameters, or of ``NamedSharding`` (then ``mesh`` may be
        omitted); ``specs_of(params)`` reads it from placed parameters. ``init`` checks it
        against concrete parameters (a ``ValueError`` names one laid out otherwise).

        Without ``mesh``: on a mesh with Explicit axes the arrays' types carry their layout and
        the update runs sharded as above with it; elsewhere (one device, or an Auto mesh, whose
        layout ``jit`` decides) it runs on whole tensors, and ``jit`` may gather sharded ones.
        Either way ``init`` creates each state array where its parameter lives (and by
        ``param_specs`` where given), the scalars replicated.
      mu_dtype: storage dtype of the first moment ``m`` (e.g. ``jnp.bfloat16``); ``None``
        means ``stats_dtype``. ``m`` is updated in the arithmetic's dtype and rounded when stored.
      offdiag_dtype: storage dtype of the off-diagonal statistics ``e`` (e.g. ``jnp.bfloat16``);
        ``None`` means ``stats_dtype``. The diagonal ``d`` always stays in ``stats_dtype``: the
        correlations ``rho = e / sqrt(d_j d_{j+1})`` tolerate bf16 rounding of ``e`` (a relative
        1e-3 of each entry), but Adam's and SONew's ``1 / d`` scaling should not see it. With
        both in bf16, tridiag state is 2 + 4 + 2 = 8 bytes per parameter instead of 12.
      implementation: ``"auto"`` (default): on GPU, the step of every tensor (or, under
        ``mesh``, every shard) as Pallas (Triton) kernels that update the state in place
        (``kernels``; on a sharded tensor each device runs them on its block, its chain
        neighbours exchanged with the other shards), when ``mesh`` is given or the process has
        one device (without a mesh, several devices' arrays may be sharded by the caller's
        ``jit``, which cannot partition a kernel); XLA elsewhere: bands above
        ``kernel_config.max_band``, and blocks with fewer rows along axis 0 than the step reads
        beyond them (``2b - 1`` for bands ``b >= 2``). ``"xla"``: never the kernels;
        ``"pallas"``: the kernels wherever they apply, also off GPU (in Pallas' interpreter:
        slow, for tests). Results agree to float rounding.
      graft_lag: with ``graft="adam"``, scale each tensor's step-``t`` direction by the graft
        ratio ``||adam|| / ||u||`` of step ``t - 1`` (one number per tensor, kept in the state,
        which is then a :class:`ScaleBySONewLagState`) instead of step ``t``'s own, so the scale
        does not wait for the step's norms. The ratio starts at 0, so the first update is zero
        (one extra warm-up step: only the moments accumulate). Tensors that take Adam's direction
        are unaffected. It is what lets the kernels apply the update (module docstring); its
        cost in loss is measured in docs/performance.md.
      kernel_config: how the kernels tile and launch (``kernels.KernelConfig``); ``None``:
        ``kernels.DEFAULT`` (its tuning: docs/performance.md).
      damping: how ``eps`` damps the diagonal: ``"mean"`` (default) adds ``eps`` times the mean
        of the tensor's bias-corrected diagonal ``d_hat``; ``"absolute"`` adds ``eps`` itself (its
        best value follows the gradients' squared scale, so it changes with the model); ``"max"``
        times its largest entry (the paper's analysis takes the damping proportional to the
        gradients' bound, Theorem 3). A relative damping makes the grafted update independent
        of the gradients' scale. The statistic is the previous step's (a lag of one step), kept
        in the state (a :class:`ScaleBySONewDampedState`, one array): each step's norm pairs,
        which the grafting norms' reduction and all-reduce merge, give it for the next step, so
        it costs no pass over memory and no message of its own. The first step, with no
        statistic yet, has an infinite damping: its direction is zero and only the moments
        accumulate (as a tensor's steps until its first nonzero gradient). A non-finite gradient
        entry makes the tensor's later updates non-finite everywhere.
      stacked_axes: how many leading axes of each parameter stack tensors, as flax's ``nn.scan``
        stacks a layer's parameters over the layers (MaxText's and T5X's ``scan_layers``):
        ``None`` (default: none), an int for every parameter, a pytree prefix of the parameters
        holding ints (or bools: ``True`` is 1), or a function of the parameters returning one.
        Structural: with ``optax.inject_hyperparams`` pass it in ``static_args``. Each
        stacked tensor is preconditioned as a parameter of its own (its chain, damping and graft
        ratio; the state keeps a number per stacked tensor), so a stacked model's update equals
        the unstacked one's, and its step is traced and fused once per stack, not once per
        tensor (compile times: docs/performance.md). The stacked axes
        may not be sharded. On GPU a stack runs the kernels vectorized over its tensors.
      stack_by_shape: store the state of the parameters that share a shape, dtype, stacking and
        layout stacked, and step each such set as one stack (``stacked_axes``'s way), which makes
        a model that keeps its layers apart compile, launch and dispatch its update as a stacked
        one does; each step stacks their gradients (a copy of ``g``) (:mod:`grouping`). The
        update equals the unstacked one; the state is a :class:`grouping.StackedByShapeState`.
        ``apply`` then adds the update as ``optax.apply_updates`` would (no fused apply).
        Structural: with ``optax.inject_hyperparams`` pass it in ``static_args``.
      stack_dtype: with ``stack_by_shape``, the dtype of each step's stacked copy of the
        gradients (``None``: theirs), which the stacks' step then reads. A 16-bit float halves
        the copy's writes and the step's reads of ``g``, and the kernels write such stacks' ``u``
        in it too (:func:`engine.make_step`). A model that computes in bfloat16 gets bfloat16
        values as the gradients of the weights it casts to bfloat16 (the backward's matmuls
        produce them), so a bfloat16 copy of those is exact; other gradients, and those clipping
        has scaled, are rounded to it (a relative ``2^-9``).

    Returns:
      A :class:`~sonew_pax.optim.transform.GradientTransformationWithApply`: an
      ``optax.GradientTransformationExtraArgs`` whose ``apply(updates, state, params, *, scale=1,
      weight_decay=0, mask=None)`` returns ``params + (u + weight_decay * params) * scale`` (the
      decay only where ``mask``, as ``optax.add_decayed_weights``'s, is True) and the new state.
      Where the kernels know the graft ratio before the step (``graft_lag=True``, or
      ``graft="none"``) they write the parameters in place in the step's pass instead of writing
      ``u``; elsewhere XLA adds ``u`` as ``optax.apply_updates`` would.

    Raises:
      ValueError: a hyperparameter out of range (concrete values, arrays included), naming it;
        from ``update``, a gradient whose shape is not its parameter's, naming its path and both
        shapes.
      TypeError: from ``init`` and ``update``: a parameter or gradient that is not a real
        floating-point array (integer, bool, complex), naming its path.

    As optax's transformations, ``init`` and ``update`` take Python numbers as leaves (0-d
    arrays) and ``None`` leaves (empty subtrees, left ``None``).

    Non-finite gradients. One rule for every band, on both implementations: a non-finite entry of
    a tensor's gradient makes that tensor's update non-finite at the entries within ``band`` chain
    positions of it (``2 band + 1`` entries; the entry alone for the diagonal) when
    ``graft="none"``, and everywhere in the tensor with Adam grafting (the norms that scale it
    are taken over the whole tensor; with ``graft_lag`` from the next step on, as the ratio that
    carries them is the next step's). Nothing is silently zeroed. The state keeps the non-finite
    values (``m``, ``d`` at the entry, ``e`` on its ``2 band`` edges), so the tensor's later
    updates stay non-finite: the trainer stops, or skips such a step before the optimizer sees it
    (``train.non_finite``). Tensors with a 0-size dimension get an empty update.

    References:
      Devvrit, Duvvuri, Anil, Gupta, Hsieh, Dhillon, "A Computationally Efficient Sparsified
      Online Newton Method", NeurIPS 2023: Algorithm 1 (the update; ``d`` and ``e`` are the
      moving averages of ``H_t``'s nonzeros, eq. ``sparseupdate``); the LogDet subproblem (eq.
      ``gensubprob``) and its closed forms ``X = L D L^T``: Theorem 1 (``band=1``, eq.
      ``explsolntridiag``: ``L_{j+1,j} = -H_{j+1,j} / H_{j+1,j+1}`` and
      ``1 / D_jj = H_jj - H_{j+1,j}^2 / H_{j+1,j+1}``), Theorem 2 (``band=b``, eq.
      ``explsolnbanded``; Algorithm 2) and Algorithm 3, the numerically stable variant, which
      cuts the chain where the Schur complement is ``<= gamma * H_jj``. The damping's scale:
      Theorem 3 (regret bound). Grafting: Agarwal et al., "Disentangling Adaptive Gradient
      Methods from Learning Rates" (2020).
    """
    return _scale_by_sonew(SONewConfig.of(locals()), mesh, param_specs)


def _scale_by_sonew(
    config: SONewConfig,
    mesh: jax.sharding.Mesh | None,
    param_specs: Any,
    unpacked: bool = False,
) -> GradientTransformationWithApply:
    """:func:`scale_by_sonew` of a checked ``config``, on ``mesh`` with ``param_specs``;
    ``unpacked``: its stacks are parameters packed by shape, unpacked after the step
    (``stack_by_shape``, :func:`engine.make_step`)."""
    mesh, param_specs = sharding.as_specs(param_specs, mesh)
    if (mesh is None) != (param_specs is None):
        raise ValueError("mesh and param_specs must be given together (or both left None).")
    if config.stack_by_shape:
        return _stacked_by_shape(config, mesh, param_specs)
    concrete_band = static_band(config.band)
    mu_dtype, stats_dtype, offdiag_dtype = config.dtypes

    def init_fn(params: optax.Params) -> State:
        if concrete_band is None:
            raise ValueError(
                "band must be a concrete int when the state is initialised: it decides the "
                "state's shapes. Under optax.inject_hyperparams, keep it static: "
                "inject_hyperparams(sonew, static_args=('band',)), or call init outside jit."
            )
        params = _as_arrays(params)
        _check_real_floats(params, "parameters")
        # Each state array is created where its parameter lives (as optax's follow the
        # parameters), or by mesh and param_specs; the scalars replicated on that mesh.
        placed, scalar = sharding.state_shardings(params, mesh, param_specs)
        where = jax.tree.unflatten(jax.tree.structure(params), placed)
        stacks = sharding.stack_counts(config.stacked_axes, params)

        def off_diagonals(p: jax.Array, at: Any, stack: int) -> Any:
            band = usable_band(concrete_band, jnp.shape(p), stack)
            if band == 0 or not preconditioned(jnp.ndim(p) - stack, config.precondition_1d):
                return optax.MaskedNode()
            return sharding.zeros_beside(p, offdiag_dtype, at, band=band)

        like = lambda dtype: lambda p, at: sharding.zeros_beside(p, dtype, at)  # noqa: E731
        state = ScaleBySONewState(
            count=sharding.zeros((), jnp.int32, scalar),
            m=jax.tree.map(like(mu_dtype), params, where),
            d=jax.tree.map(like(stats_dtype), params, where),
            e=jax.tree.map(off_diagonals, params, where, stacks),
        )
        # graft_lag's ratios and a relative damping's statistics: one number per preconditioned
        # tensor each (per stacked tensor), in one array (a scalar per tensor would be one small
        # kernel each).
        layouts = [
            ChainLayout.unsharded(jnp.shape(p), k)
            for p, k in zip(jax.tree.leaves(params), jax.tree.leaves(stacks), strict=True)
        ]
        count = slot_count(layouts, config.precondition_1d)
        ratio = sharding.zeros((count,), stats_dtype, scalar) if config.graft_lag else None
        if config.relative:
            return ScaleBySONewDampedState(
                *state, ratio, sharding.zeros((count,), stats_dtype, scalar)
            )
        return ScaleBySONewLagState(*state, ratio) if config.graft_lag else state

    def advance(updates, state, apply: ApplyArgs | None, gradient_scale):
        _check_real_floats(updates, "gradients")
        _check_shapes(updates, state.m)
        # XLA fuses the product into the step's reads, as it does optax's clip.
        updates = scaled(updates, _compute_scale(gradient_scale, stats_dtype))
        count = optax.safe_int32_increment(state.count)
        t = count.astype(stats_dtype)
        corrections = tuple(1 - jnp.asarray(b, stats_dtype) ** t for b in (config.b1, config.b2))
        step = make_step(config, mesh, param_specs, unpacked)
        # Not lagged: no ratios, so every tensor grafts with its own step's ratio.
        ratio = state.ratio if config.graft_lag else None
        diag = state.diag if config.relative else None
        out, m, d, e, ratio, diag = step(
            updates, state.m, state.d, state.e, ratio, diag, corrections, apply
        )
        if config.relative:
            return out, ScaleBySONewDampedState(count, m, d, e, ratio, diag)
        if config.graft_lag:
            return out, ScaleBySONewLagState(count, m, d, e, ratio)
        return out, ScaleBySONewState(count, m, d, e)

    def update_fn(
        updates: optax.Updates,
        state: State,
        params: optax.Params | None = None,
        *,
        gradient_scale: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, State]:
        del params, extra_args
        return advance(_as_arrays(updates), state, None, gradient_scale)

    def apply_fn(
        updates: optax.Updates,
        state: State,
        params: optax.Params,
        *,
        scale: Any = 1.0,
        weight_decay: Any = 0.0,
        mask: Any = None,
        gradient_scale: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Params, State]:
        del extra_args
        updates, params = _as_arrays((updates, params))
        numbers = (jnp.asarray(x, stats_dtype) for x in (scale, weight_decay))
        apply = ApplyArgs(params, *numbers, _decay_flags(mask, params))
        return advance(updates, state, apply, gradient_scale)

    return GradientTransformationWithApply(init_fn, update_fn, apply_fn)


def _stacked_by_shape(
    config: SONewConfig, mesh: jax.sharding.Mesh | None, param_specs: Any
) -> GradientTransformationWithApply:
    """``scale_by_sonew(stack_by_shape=True)``: ``config``'s transformation over the parameters
    packed by their :class:`grouping.Grouping`, found from the parameters at ``init`` and kept in
    the state. ``apply`` adds the update to the unpacked parameters as the engine does where no
    kernel writes them (``pointwise.apply_update``, its numbers in ``stats_dtype``): packing the
    parameters for the kernels would copy them twice."""
    stacked_axes = config.stacked_axes

    def over(grouping: grouping_lib.Grouping) -> GradientTransformationWithApply:
        packed = dataclasses.replace(
            config, stacked_axes=list(grouping.stacks), stack_by_shape=False, stack_dtype=None
        )
        return _scale_by_sonew(packed, mesh, grouping.specs(param_specs), unpacked=True)

    def init_fn(params: optax.Params) -> StackedByShapeState:
        params = _as_arrays(params)
        _check_real_floats(params, "parameters")
        grouping = grouping_lib.grouping_of(params, stacked_axes, param_specs)
        return StackedByShapeState(over(grouping).init(grouping.pack(params)), grouping)

    def update_fn(updates, state, params=None, *, gradient_scale=None, **extra_args):
        del params, extra_args
        updates = _as_arrays(updates)
        _check_real_floats(updates, "gradients")
        grouping = state.grouping
        factor = _compute_scale(gradient_scale, config.dtypes[1])
        copy = _kernel_stack(config, mesh, param_specs, grouping, factor)
        stacked = grouping.pack(updates, config.stack_dtype, copy, factor)
        packed, inner = over(grouping).update(stacked, state.inner)
        # In the gradients' dtypes, as optax's updates are (a cast that XLA fuses into the apply).
        direction = jax.tree.map(lambda u, g: u.astype(g.dtype), grouping.unpack(packed), updates)
        return direction, StackedByShapeState(inner, grouping)

    def apply_fn(
        updates, state, params, *, scale=1.0, weight_decay=0.0, mask=None, gradient_scale=None,
        **extra,
    ):  # fmt: skip
        del extra
        params = _as_arrays(params)
        direction, state = update_fn(updates, state, gradient_scale=gradient_scale)
        scale, weight_decay = (jnp.asarray(x, config.dtypes[1]) for x in (scale, weight_decay))

        def add(p, u, decayed):
            decay = weight_decay if decayed else 0.0
            return pointwise.apply_update(p, u, 1, decay, scale).astype(p.dtype)

        return jax.tree.map(add, params, direction, _decay_flags(mask, params)), state

    return GradientTransformationWithApply(init_fn, update_fn, apply_fn)


def _compute_scale(gradient_scale: Any, stats_dtype: Any) -> jax.Array | None:
    """A gradient scale (``transform.GradientScaling``'s factor) in the dtype the step computes
    in; ``None`` where there is none."""
    if gradient_scale is None:
        return None
    return jnp.asarray(gradient_scale, pointwise.compute_dtype(stats_dtype))


def _kernel_stack(
    config: SONewConfig,
    mesh: jax.sharding.Mesh | None,
    param_specs: Any,
    grouping: grouping_lib.Grouping,
    scale: jax.Array | None,
) -> Callable[[int, list], jax.Array | None] | None:
    """``Grouping.pack``'s copy of the gradients into their stacks where SONew's GPU kernels run
    (``kernels.stack``: XLA's ``concatenate`` of many operands runs at a third of a copy's
    bandwidth), each times ``scale`` where given (a clip's factor: the copy reads the gradients
    unscaled, so no clipped product is written out for it), under ``shard_map`` on each
    device's blocks where a ``mesh`` is given; ``None`` elsewhere (XLA's copy)."""
    kernels = dispatch.kernels_enabled(config.implementation, mesh, config.kernel_config)
    if kernels is None or dispatch.kernel_platform(kernels) != "gpu":
        return None
    interpret = dispatch.interpreted(kernels)
    specs = grouping.specs(param_specs)
    factor = [] if scale is None else [scale]

    def stack(k: int, members: list) -> jax.Array | None:
        if not pallas.stackable(grouping.shapes[k], len(members), kernels):
            return None
        # Cast before the copy: XLA fuses the cast into each member's producer (a bf16 model's
        # float32 gradient is its matmul's bf16 output converted: the pair cancels), so the copy
        # reads the narrower dtype; a member already in memory in float32 pays one more pass.
        # With a scale, a member narrowed so is rounded once more than on XLA, unless it holds
        # values of the narrower dtype (a bf16 model's gradients).
        dtype = config.stack_dtype or members[0].dtype
        members = [x.astype(dtype) for x in members]

        def copy(*blocks):
            split = len(blocks) - len(factor)
            return pallas.stack(blocks[:split], dtype, kernels, interpret, *blocks[split:])

        if mesh is None:
            return copy(*members, *factor)
        spec = specs[k]
        in_specs = (P(*spec[1:]),) * len(members) + (P(),) * len(factor)
        return jax.shard_map(copy, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)(
            *members, *factor
        )

    return stack


def sonew(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: Number = _DEFAULT.b1,
    b2: Number = _DEFAULT.b2,
    eps: Number = _DEFAULT.eps,
    band: int = _DEFAULT.band,
    gamma: Number = _DEFAULT.gamma,
    graft: Graft = _DEFAULT.graft,
    graft_eps: Number = _DEFAULT.graft_eps,
    weight_decay: float = 0.0,
    mask: Any = None,
    precondition_1d: bool = _DEFAULT.precondition_1d,
    stats_dtype: jax.typing.DTypeLike = _DEFAULT.stats_dtype,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    mu_dtype: jax.typing.DTypeLike | None = _DEFAULT.mu_dtype,
    offdiag_dtype: jax.typing.DTypeLike | None = _DEFAULT.offdiag_dtype,
    implementation: Implementation = _DEFAULT.implementation,
    graft_lag: bool = _DEFAULT.graft_lag,
    kernel_config: KernelConfig | None = _DEFAULT.kernel_config,
    damping: Damping = _DEFAULT.damping,
    stacked_axes: Any = _DEFAULT.stacked_axes,
    stack_by_shape: bool = _DEFAULT.stack_by_shape,
    stack_dtype: jax.typing.DTypeLike | None = _DEFAULT.stack_dtype,
) -> GradientTransformationWithApply:
    """The SONew optimizer: ``update = -lr * (u + weight_decay * param)``.

    ``u`` is :func:`scale_by_sonew`'s grafted direction; weight decay is decoupled (as in AdamW).
    The result is an optax transformation (``init``, ``update``) with ``apply(grads, state,
    params) -> (params, state)`` (``transform.GradientTransformationWithApply``; see
    ``transform.apply_gradients``): the same step, in which the GPU kernels write the parameters
    in place where the graft ratio is known before the step, i.e. with ``graft_lag=True`` (or
    ``graft="none"``): 36 B/param for fp32 tridiag instead of 44. Wrapped in another optax
    transformation (``optax.chain(clip, sonew(...))``, ``inject_hyperparams``, ``MultiSteps``)
    the result has no ``apply``, and ``apply_gradients`` runs ``update`` and
    ``optax.apply_updates`` instead: the same numbers, one more pass over the parameters
    (``optim.chain`` keeps the last transformation's ``apply``).

    Swapping it for ``optax.adamw``, mind three differences: ``b2`` defaults to 0.95 (adamw:
    0.999); ``eps`` is added to the bias-corrected second moment itself, not to its square root
    (SONew's direction is ``~ m / d``: ``eps`` is on ``g^2``'s scale); and ``graft="none"``
    leaves the direction at SONew's own scale, which needs its own learning rate (the default
    grafting gives each tensor Adam's step size, so AdamW's learning rate carries over).

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of the first moment ``m``.
      b2: decay of the banded second-moment statistics ``d`` and ``e``.
      eps: damping added to the bias-corrected diagonal of ``H``.
      band: ``0`` diag-SONew, ``1`` tridiag-SONew (Theorem 1), ``b`` banded (Theorem 2).
        At most :data:`MAX_BAND`. Structural: with ``optax.inject_hyperparams`` pass it in
        ``static_args`` (or initialise outside ``jit``).
      gamma: Algorithm 3's tolerance for cutting the chain.
      graft: ``"adam"`` (default) or ``"none"``.
      graft_eps: epsilon of the Adam direction used for grafting.
      weight_decay: decoupled weight decay, as ``optax.adamw``'s.
      mask: which parameters decay, as ``optax.adamw``'s mask (a tree of bools or a function).
      precondition_1d: precondition tensors with fewer than 2 dimensions too.
      stats_dtype: dtype of ``d`` and of the arithmetic (a string under
        ``optax.inject_hyperparams``, which calls ``jnp.float32`` as a schedule).
      mesh: the mesh the update runs on under ``shard_map`` (with ``param_specs``).
      param_specs: the parameters' ``PartitionSpec``s (or ``NamedSharding``s) on ``mesh``.
      mu_dtype: storage dtype of the first moment (optax's name); ``None``: ``stats_dtype``.
      offdiag_dtype: storage dtype of the off-diagonal statistics; ``None``: ``stats_dtype``.
      implementation: ``"auto"``, ``"xla"`` or ``"pallas"``.
      graft_lag: scale by the previous step's graft ratio (lets the kernels apply the update).
      kernel_config: how the GPU kernels tile and launch (``kernels.KernelConfig``; ``None``:
        the default one).
      damping: ``"absolute"`` (``eps`` as given), or ``eps`` relative to each tensor's
        bias-corrected diagonal at the previous step: its ``"mean"`` or ``"max"`` (the first
        update is then zero).
      stacked_axes: leading axes of the parameters that stack tensors (``nn.scan``'s layer
        axis), each then preconditioned as a parameter of its own.
      stack_by_shape: store and step the parameters of one shape (and dtype, stacking, layout)
        as one stack: the same update, compiled and launched once per shape instead of once per
        tensor, for a stacked copy of the gradients per step.
      stack_dtype: with ``stack_by_shape``, the dtype of that copy (16-bit: fewer bytes moved).

      :func:`scale_by_sonew` says more of each.

    Returns:
      A ``GradientTransformationWithApply``.

    References:
      Devvrit, Duvvuri, Anil, Gupta, Hsieh, Dhillon, "A Computationally Efficient Sparsified
      Online Newton Method", NeurIPS 2023: Algorithm 1 (SONew) with the statistics
      ``H_t = H_{t-1} + P_G(g_t g_t^T)`` (eq. ``sparseupdate``; moving averages here), and the
      LogDet subproblem ``X_t = argmin -log det X + Tr(X H_t)`` over the band's sparsity (eq.
      ``gensubprob``), solved in closed form by Theorem 1 (tridiagonal, eq. ``explsolntridiag``)
      and Theorem 2 (banded, eq. ``explsolnbanded``; Algorithm 2), made numerically stable by
      Algorithm 3 (``gamma``). Decoupled weight decay as ``optax.adamw``.

    Example::

        tx = sonew_pax.optim.sonew(1e-3, band=1, weight_decay=0.1)
        opt_state = tx.init(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # or, the parameters written by the update's kernels (with graft_lag=True):
        params, opt_state = sonew_pax.optim.apply_gradients(tx, grads, opt_state, params)
    """
    check_nonnegative("weight_decay", weight_decay)
    learning_rate = checked_learning_rate(learning_rate)
    config = SONewConfig.of(locals())
    precondition = _scale_by_sonew(config, mesh, param_specs)
    decayed = optax.add_decayed_weights(weight_decay, mask)
    rate = optax.scale_by_learning_rate(learning_rate)
    tx = optax.chain(precondition, decayed, rate)

    def apply_fn(updates, state, params, *, gradient_scale=None, **extra_args):
        del extra_args
        sonew_state, decay_state, rate_state = state
        # -lr of this step, and the schedule's next state: the rate's update of the scalar 1.
        scale, rate_state = rate.update(jnp.ones([], config.dtypes[1]), rate_state)
        params, sonew_state = precondition.apply(
            updates, sonew_state, params, scale=scale, weight_decay=weight_decay, mask=mask,
            gradient_scale=gradient_scale,
        )  # fmt: skip
        return params, (sonew_state, decay_state, rate_state)  # weight decay has no state

    return GradientTransformationWithApply(tx.init, tx.update, apply_fn)


def _decay_flags(mask: Any, params: optax.Params) -> Any:
    """Whether each parameter is decayed, as ``optax.add_decayed_weights(weight_decay, mask)``
    decays it: where ``mask`` (a tree of bools, or a prefix of one, or a function of the
    parameters that returns one; ``None``: everywhere) is True. The flags must be concrete."""
    flags = True if mask is None else mask(params) if callable(mask) else mask
    try:
        return jax.tree.map(
            lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub), flags, params
        )
    except jax.errors.ConcretizationTypeError as err:
        raise ValueError(
            "apply: the weight-decay mask must give concrete bools (as optax.masked needs), not "
            "values computed from traced parameters."
        ) from err
