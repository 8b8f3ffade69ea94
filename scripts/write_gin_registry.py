"""Rewrite terra/gin_config/registry.json from the configurables terra/gin_config/registration.py registers
(``make gin-registry``): run it after adding or changing a gin configurable; tests/test_cli.py
fails until the two agree."""

from terra.gin_config import registration, registry_file

if __name__ == "__main__":
    registry_file.write_registry(registration.live_registry())
    print(f"wrote {registry_file.REGISTRY_FILE}")
