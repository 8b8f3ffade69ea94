"""terra: Scaling Transformers and Terraformer in JAX/Flax.

Importing the package is cheap; submodules pull in JAX, Flax and gin when used.
"""

__version__ = "0.1.0"
