"""Rewrite terra/gin_registry.json from the configurables terra/configurables.py registers
(``make gin-registry``): run it after adding or changing a gin configurable; tests/test_cli.py
fails until the two agree."""

from terra import configurables, gin_registry

if __name__ == "__main__":
    gin_registry.write_registry(configurables.live_registry())
    print(f"wrote {gin_registry.REGISTRY_FILE}")
