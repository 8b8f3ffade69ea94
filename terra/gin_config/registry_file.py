"""The names gin can configure in terra and their parameters, stored as a file so that a command
checks ``--gin.Configurable.param=VALUE`` overrides before importing anything heavy.

gin learns terra's configurables when ``terra/gin_config/registration.py`` is imported, and that imports
TensorFlow and JAX (seconds: docs/commands.md). ``registry.json`` beside this module lists
every configurable that module registers, its selector with its parameter names (``null`` where
it takes ``**kwargs``); a test checks that it equals the live list
(``terra.gin_config.registration.live_registry``), another that the list is what gin knows, and ``make gin-registry``
(``scripts/write_gin_registry.py``) rewrites it after a configurable is added or changed. This
module imports nothing of terra's, so the commands' early checks and the run-config check
(``terra/run_config.py``) read the registry without the library.
"""

import functools
import inspect
import json
import os
from typing import Dict, List, Optional

REGISTRY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "registry.json")


def parameters(fn) -> Optional[List[str]]:
    """The parameter names gin may bind on ``fn`` (sorted); None where it takes ``**kwargs``."""
    try:
        found = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in found):
        return None
    return sorted(p.name for p in found if p.kind != p.VAR_POSITIONAL and p.name != "self")


def stored_registry() -> Dict[str, Optional[List[str]]]:
    with open(REGISTRY_FILE, encoding="utf-8") as f:
        return json.load(f)


def write_registry(registry: Dict[str, Optional[List[str]]]) -> None:
    with open(REGISTRY_FILE, "w", encoding="utf-8") as f:
        f.write(json.dumps(registry, indent=1) + "\n")


@functools.lru_cache(maxsize=1)
def _stored_selectors() -> tuple:
    return tuple(stored_registry())


def full_selector(selector: str) -> Optional[str]:
    """The stored registry's selector gin resolves ``selector`` to (``adafactor`` ->
    ``terra.training.adafactor``; a scope, ``MODEL/TransformerConfig``, names the same
    configurable); None for a name terra does not have, or has twice."""
    selector = selector.rsplit("/", 1)[-1]
    matches = [full for full in _stored_selectors() if full == selector or full.endswith("." + selector)]
    return matches[0] if len(matches) == 1 else None
