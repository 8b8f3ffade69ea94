"""Reproduce the paper's claims at small scale -> terra.reproduce (same arguments)."""

import sys

from terra import gin_utils
from terra.reproduce.__main__ import main

if __name__ == "__main__":
    gin_utils.run_cli(lambda: main(sys.argv[1:]))
