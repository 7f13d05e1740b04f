"""``XLA_FLAGS`` for the test processes: this one (``conftest.py``) and those the tests start.

The tests' programs are small and run a few steps, so they are compiled for compile time, not run
time: backend level 0 skips LLVM's optimisations (about a third of the suite's time), and the CPU
backend's older loop emitters compile the SONew updates' many small fusions faster than its MLIR
fusion emitters (docs/performance.md, "The test suite's compile").
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a test process with ``devices`` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
