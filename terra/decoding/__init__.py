"""The decode contract (jitted prefill and single-token step), sampling and generation."""

from terra.decoding.decode_step import IncrementalDecoder
from terra.decoding.generate import generate
from terra.decoding.sampling import sample_next_token

__all__ = ["IncrementalDecoder", "generate", "sample_next_token"]
