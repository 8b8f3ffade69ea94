"""Decode a split from a checkpoint and score ROUGE -> terra.evaluate (same flags)."""

import sys

from terra import gin_utils
from terra.evaluate import main

if __name__ == "__main__":
    gin_utils.run_cli(lambda: main(sys.argv[1:]))
