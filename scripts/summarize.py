"""Summarize your own documents with a trained checkpoint -> terra.summarize (same flags)."""

import sys

from terra import gin_utils
from terra.summarize import main

if __name__ == "__main__":
    gin_utils.run_cli(lambda: main(sys.argv[1:]))
