"""optax's own contrib test suite, run against ``sonew``.

optax tests every optimizer in ``optax.contrib`` with one shared suite
(``optax/contrib/_common_test.py``, shipped in optax's wheel): extra arguments, convergence on
four targets, ``inject_hyperparams``, dtype preservation, ``MultiSteps``, state shape, dtype and
sharding stability, and schedules as learning rates. Its tests are parametrised by module-level
lists of optimizers, read when its test class is defined. This module runs the installed suite's
own source with those lists holding SONew alone, at each band from diagonal to pentadiagonal,
and collects its ``ContribTest`` class under pytest.

One change to the suite's text: ``band`` joins its list of hyperparameters that
``inject_hyperparams`` cannot inject (muon's ``ns_steps``, galore's ``rank``, ...). Like those it
sets the optimizer state's shapes, so a jitted ``init`` sees an injected ``band`` only as a
tracer; ``tests/test_optax_contract.py`` checks that ``sonew`` then says so by name.
"""

import inspect

import optax
import pytest

contrib_suite = pytest.importorskip("optax.contrib._common_test")

# The suite's list of hyperparameters it binds with ``static_args``; ``band`` is appended.
UNINJECTABLE = "'update_proj_gap']"
SONEW_UNDER_TEST = [
    {"opt_name": "sonew", "opt_kwargs": {"learning_rate": 1e-2, "band": band}} for band in (0, 1, 2)
]


def _factory(opt_name):
    """The suite's optimizer lookup, with ``sonew`` added."""
    if opt_name == "sonew":
        from sonew_pax.optim import sonew

        return sonew
    return getattr(optax.contrib, opt_name, None) or getattr(optax, opt_name)


def _suite_namespace() -> dict:
    """The installed suite's module namespace with SONew as its only optimizer under test."""
    source = inspect.getsource(contrib_suite)
    head, separator, tests = source.partition("class ContribTest(")
    assert separator and tests.count(UNINJECTABLE) == 1, "optax's suite changed its layout"
    namespace = {"__name__": __name__}
    exec(compile(head, contrib_suite.__file__, "exec"), namespace)
    main = [dict(entry, wrapper_name=None, wrapper_kwargs=None) for entry in SONEW_UNDER_TEST]
    namespace.update(
        _MAIN_OPTIMIZERS_UNDER_TEST=tuple(main),
        _ALL_OPTIMIZERS_UNDER_TEST=tuple(main),
        _get_opt_factory=_factory,
    )
    tests = tests.replace(UNINJECTABLE, "'update_proj_gap', 'band']")
    exec(compile(separator + tests, contrib_suite.__file__, "exec"), namespace)
    return namespace


ContribTest = _suite_namespace()["ContribTest"]
