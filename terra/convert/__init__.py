"""Converting checkpoints of the paper's own code (Trax) into terra run directories.

:func:`convert_trax_checkpoint` is the Python entry point; ``terra-convert trax`` and
``python -m terra.cli.convert trax`` the command line. :mod:`~terra.convert.trax_file` reads the
weight file, :mod:`~terra.convert.trax_arguments` maps the Trax constructor arguments onto
terra's gin, :mod:`~terra.convert.trax_layout` maps every array onto a terra parameter.
"""

__all__ = ["convert_trax_checkpoint"]


def __getattr__(name):
    if name == "convert_trax_checkpoint":
        from terra.convert.trax import convert_trax_checkpoint

        return convert_trax_checkpoint
    raise AttributeError(f"module 'terra.convert' has no attribute {name!r}")
