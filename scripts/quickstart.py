"""The quick start behind `make run`: flags -> terra.quickstart."""

from terra import gin_utils
from terra import quickstart

if __name__ == "__main__":
    gin_utils.run_cli(quickstart.main)
