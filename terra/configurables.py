"""Every module that registers gin configurables, imported in one place.

gin refuses new registrations once a config is finalized ("Attempted to add a new configurable
after the config was locked"), so whatever parses a config (the command lines, ``terra.load``,
``terra.build``) imports all of them first; importing any terra module afterwards, in any
order, then registers nothing new. ``tests/test_package_structure.py`` checks that this list
is complete.
"""

import importlib

CONFIGURABLE_MODULES = (
    "terra.layers",
    "terra.models",
    "terra.parallel.mesh",
    "terra.data",
    "terra.training",
    "terra.evaluation",
)


def import_all() -> None:
    """Import every module that registers configurables (idempotent)."""
    for name in CONFIGURABLE_MODULES:
        importlib.import_module(name)
