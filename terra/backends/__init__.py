"""Decode backends: the primitives a layer's decode step is written in (products of float or narrow
weights, row gathers, attention over a KV cache or a whole input, the sparse layers' fused steps) and, per platform,
what runs them: a native call on the CPU (``cpu``, over ``native_kernels``), XLA everywhere else
(``xla``). Layers import this package only; a new backend is a module here and an entry in
``primitives.BACKENDS``. See ``docs/architecture.md``, "Decode backends"."""

from terra.backends.primitives import (
    LSHDecodeCache,
    SparseAttentionWeights,
    SparseFeedForwardWeights,
    attention_in_query_chunks,
    blocked_attention,
    cache_attention,
    cache_logits,
    cache_weighted_values,
    cached_attention,
    fused_feed_forward_rows,
    gathered_rows_product,
    gathered_rows_sum,
    input_major_product,
    look_up_rows,
    lsh_bucket_attention,
    lsh_chunk_attention,
    lsh_hash,
    module_convolution,
    output_major_product,
    slice_rows,
    sparse_attention_step,
    sparse_feed_forward_step,
    take_rows,
    write_after_read,
)
from terra.backends.xla import MASK_VALUE
from terra.quantization.quantized import as_float

__all__ = [
    "LSHDecodeCache",
    "MASK_VALUE",
    "SparseAttentionWeights",
    "SparseFeedForwardWeights",
    "as_float",
    "attention_in_query_chunks",
    "blocked_attention",
    "cache_attention",
    "cache_logits",
    "cache_weighted_values",
    "cached_attention",
    "fused_feed_forward_rows",
    "gathered_rows_product",
    "gathered_rows_sum",
    "input_major_product",
    "look_up_rows",
    "lsh_bucket_attention",
    "lsh_chunk_attention",
    "lsh_hash",
    "module_convolution",
    "output_major_product",
    "slice_rows",
    "sparse_attention_step",
    "sparse_feed_forward_step",
    "take_rows",
    "write_after_read",
]
