"""Benchmarks of SONew and the trainer, each a module run from the repository root as
``python -m benchmarks.<name>`` (``update_speed``, ``profile_update``, ``kernel_speed``,
``sharded_update``, ``scaling``, ``train_step``, ``autoencoder``, ``lm_convergence``,
``lowering``, ``compile_cache``); see ``benchmarks/README.md``.

Shared modules: ``common`` (flags, timing, JSON, tables), ``updates`` (the optimizer rows and
their donated update), ``device_trace`` (a profiler trace's device time), ``lm_shapes`` (the
LM-shaped tensor set) and ``mnist_data`` (offline MNIST).
"""
