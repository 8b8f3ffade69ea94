"""Batch-1 decode latency of a gin-configured model: flags -> terra.benchmarks.decode_speed."""

from terra import gin_utils
from terra.benchmarks import decode_speed

if __name__ == "__main__":
    gin_utils.run_cli(decode_speed.main)
