"""sonew_pax: SONew for JAX and a T5X-style LM trainer that runs it sharded."""

__version__ = "0.1.0"
