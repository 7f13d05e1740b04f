"""``XLA_FLAGS`` for the test processes: this one (``conftest.py``) and those the tests start.

The tests' programs are small and run a few steps: LLVM's optimisations cost them more compile time
than they save at run time (about a third of the suite's time), so backend level 0 skips them.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a test process with ``devices`` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
