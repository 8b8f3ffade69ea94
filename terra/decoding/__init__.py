"""The decode contract (jitted prefill and single-token step), sampling, generation and beam search."""

from terra.decoding.beam_search import BeamSearchResult, beam_search
from terra.decoding.decode_session import DecodeSession
from terra.decoding.decode_step import IncrementalDecoder
from terra.decoding.generate import generate
from terra.decoding.sampling import filter_logits, sample_next_token

__all__ = [
    "BeamSearchResult",
    "DecodeSession",
    "IncrementalDecoder",
    "beam_search",
    "filter_logits",
    "generate",
    "sample_next_token",
]
