"""``sonew`` keeps optax's contract: ``inject_hyperparams``, Python-number and ``None`` leaves,
0-d parameters, bounded bands, errors that name the problem."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sonew_pax.optim import MAX_BAND, scale_by_sonew, sonew
from tests.sonew_reference import DenseSONew

# Small hyperparameters shared by the optimizer and the dense reference.
HYPER = dict(b1=0.9, b2=0.95, eps=1e-3, gamma=1e-4, graft_eps=1e-8)


def _close(a, b, tol=1e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=tol, atol=tol), a, b)


def _grads(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=jnp.shape(p)), jnp.float32), params)


def _run(tx, params, steps, init=None, update=None):
    """``steps`` updates of ``tx`` from ``params`` on seeded gradients: the last updates and the
    state."""
    state = (init or tx.init)(params)
    for step in range(steps):
        updates, state = (update or tx.update)(_grads(params, step), state, params)
    return updates, state


@pytest.mark.parametrize("band", [0, 1, 2])
def test_inject_hyperparams_matches_the_plain_optimizer(band):
    """Under ``optax.inject_hyperparams`` (jitted init and update, ``band`` static as optax keeps
    the structural arguments of its own optimizers), the updates and the inner state equal the
    plain optimizer's; with ``band`` injected, a concrete init reads it and the jitted update
    reads it from the state's shapes."""
    factory = functools.partial(sonew, band=band)
    params = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
    plain = factory(learning_rate=1e-2)
    expected, state = _run(plain, params, 2, jax.jit(plain.init), jax.jit(plain.update))
    static = optax.inject_hyperparams(factory, static_args=("band",))(learning_rate=1e-2)
    injected = optax.inject_hyperparams(factory)(learning_rate=1e-2)
    for tx, init in ((static, jax.jit(static.init)), (injected, injected.init)):
        updates, inject_state = _run(tx, params, 2, init, jax.jit(tx.update))
        _close(updates, expected)
        _close(inject_state.inner_state, state)
    with pytest.raises(ValueError, match="static_args=\\('band',\\)"):
        jax.jit(injected.init)(params)


def test_dtype_defaults_are_not_injected_as_schedules():
    """``inject_hyperparams`` calls callables as schedules: the dtype defaults are not callables,
    so they stay out of the hyperparameters, and bf16 parameters keep float32 statistics."""
    params = {"w": jnp.ones((3, 2), jnp.bfloat16)}
    state = optax.inject_hyperparams(sonew)(learning_rate=1e-2).init(params)
    assert not {"stats_dtype", "mu_dtype", "offdiag_dtype"} & set(state.hyperparams)
    sonew_state = state.inner_state[0]
    assert sonew_state.d["w"].dtype == sonew_state.m["w"].dtype == jnp.float32


def test_band_past_the_limit_is_refused():
    sonew(1e-2, band=MAX_BAND)
    with pytest.raises(ValueError, match=f"band must be at most {MAX_BAND}"):
        sonew(1e-2, band=MAX_BAND + 1)


def _reference_updates(params, steps, **kwargs):
    """The dense float64 reference's updates after ``steps`` steps on :func:`_grads`."""
    numpy_params = {k: np.asarray(p, np.float64) for k, p in params.items()}
    reference = DenseSONew(lr=1e-2, weight_decay=0.0, **HYPER, **kwargs)
    for step in range(steps):
        grads = {k: np.asarray(g, np.float64) for k, g in _grads(params, step).items()}
        updates = reference.step(grads, numpy_params)
    return updates


def test_band_is_clamped_to_the_chain(x64):
    """A chain of ``n`` elements keeps ``n - 1`` off-diagonals whatever wider band is asked; the
    update is the dense reference's at the asked band (a complete graph: ``X = H^{-1}``)."""
    params = {"w": jnp.ones((2, 2)), "v": jnp.ones((5, 3))}
    kwargs = dict(band=6, graft="none", damping="absolute")
    tx = sonew(1e-2, **HYPER, **kwargs, implementation="xla")
    updates, state = _run(tx, params, 3)
    assert state[0].e["w"].shape == (3, 2, 2)  # 4 elements: 3 off-diagonals
    assert state[0].e["v"].shape == (6, 5, 3)
    _close(updates, _reference_updates(params, 3, **kwargs))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("band", [0, 2])
def test_zero_d_parameter_is_a_chain_of_one(band, implementation, x64):
    """With ``precondition_1d`` a 0-d parameter is preconditioned as a chain of one element, as the
    dense reference does, beside a matrix; with Adam grafting its update is Adam's."""
    params = {"s": jnp.asarray(0.5), "w": jnp.ones((4, 2))}
    kwargs = dict(band=band, graft="none", damping="absolute", precondition_1d=True)
    tx = sonew(1e-2, **HYPER, **kwargs, implementation=implementation)
    updates, state = _run(tx, params, 3)
    assert isinstance(state[0].e["s"], optax.MaskedNode)
    _close(updates, _reference_updates(params, 3, **kwargs))
    grafted = sonew(1e-2, **HYPER, precondition_1d=True, damping="absolute")
    adam = optax.adam(1e-2, HYPER["b1"], HYPER["b2"], eps=HYPER["graft_eps"])
    _close(_run(grafted, params, 3)[0]["s"], _run(adam, params, 3)[0]["s"])


def test_python_number_and_none_leaves_are_accepted_as_adamw_does():
    """A Python float leaf steps as a 0-d array (Adam's direction: it has fewer than 2
    dimensions) and a ``None`` leaf stays ``None``, as in ``optax.adamw``."""
    params = {"f": 1.5, "n": None, "w": jnp.ones((3, 2))}
    grads = {"f": 0.25, "n": None, "w": jnp.full((3, 2), 0.5)}
    kwargs = dict(b1=HYPER["b1"], b2=HYPER["b2"], weight_decay=0.1)
    tx = sonew(1e-2, **kwargs, graft_eps=HYPER["graft_eps"])
    adamw = optax.adamw(1e-2, **kwargs, eps=HYPER["graft_eps"])
    updates, _ = tx.update(grads, tx.init(params), params)
    expected, _ = adamw.update(grads, adamw.init(params), params)
    assert jax.tree.structure(updates) == jax.tree.structure(expected)
    assert updates["n"] is None
    _close(updates["f"], expected["f"])


@pytest.mark.parametrize("stack_by_shape", [False, True])
def test_gradient_of_another_shape_names_the_path_and_both_shapes(stack_by_shape):
    params = {"w": jnp.ones((2, 3))}
    tx = sonew(1e-2, stack_by_shape=stack_by_shape)
    with pytest.raises(ValueError, match=r"(?=.*\['w'\])(?=.*\(3, 2\))(?=.*\(2, 3\))"):
        tx.update({"w": jnp.ones((3, 2))}, tx.init(params), params)


@pytest.mark.parametrize("factory", [sonew, scale_by_sonew])
def test_signature_shows_no_kernel_config_repr(factory):
    """``help(sonew)`` shows the signature: its defaults are short (``None``: the default
    config)."""
    signature = str(inspect.signature(factory))
    assert "KernelConfig(" not in signature
    assert inspect.signature(factory).parameters["kernel_config"].default is None


def test_a_constant_schedule_equals_its_rate():
    """``learning_rate`` takes an optax schedule (``optax.ScalarOrSchedule``)."""
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones((2,))}
    scheduled = sonew(optax.constant_schedule(1e-3), damping="absolute")
    _close(_run(scheduled, params, 3)[0], _run(sonew(1e-3, damping="absolute"), params, 3)[0])
