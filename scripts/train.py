"""Pretrain or fine-tune from gin files -> terra.train (same flags)."""

import sys

from terra import gin_utils
from terra.train import main

if __name__ == "__main__":
    gin_utils.run_cli(lambda: main(sys.argv[1:]))
