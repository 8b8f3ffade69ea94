"""Print a model config's parameter count from abstract shapes: flags -> terra."""

from terra import gin_utils
from terra.benchmarks import param_count

if __name__ == "__main__":
    gin_utils.run_cli(param_count.main)
