"""terra: Scaling Transformers and Terraformer in JAX/Flax.

Importing the package is cheap: ``terra.load``, ``terra.build`` and ``terra.InteractiveModel``
(the Python API, ``terra.api``) import JAX, Flax, gin and the data pipeline on first use.
"""

__version__ = "0.2.0"
__all__ = ["InteractiveModel", "build", "load"]


def __getattr__(name):
    if name in __all__:
        from terra import api

        return getattr(api, name)
    raise AttributeError(f"module 'terra' has no attribute {name!r}")
