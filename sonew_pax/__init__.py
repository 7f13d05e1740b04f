"""sonew_pax: SONew for JAX and a T5X-style LM trainer that runs it sharded.

``sonew_pax.optim`` (the optimizer) needs jax, optax and numpy only; the trainer's modules need the
``[trainer]`` extra. Importing this package imports neither.
"""

__version__ = "0.1.0"
