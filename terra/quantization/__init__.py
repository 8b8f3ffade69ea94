"""Weight-only quantization for decoding (the paper's §7 future work): int8 with per-row float32
scales and bfloat16 stored as its 16 bits, the data types the decode primitives of
``terra.backends`` read in place. Training is unchanged; see ``docs/decode_speed.md``."""

from terra.quantization.quantized import (
    WEIGHTS_DTYPES,
    QuantizedTensor,
    check_weights_dtype,
    dequantize,
    dequantize_params,
    quantize,
    quantize_compiled,
    quantize_leaf,
    quantize_params,
    weights_dtype_of,
)

__all__ = [
    "WEIGHTS_DTYPES",
    "QuantizedTensor",
    "check_weights_dtype",
    "dequantize",
    "dequantize_params",
    "quantize",
    "quantize_compiled",
    "quantize_leaf",
    "quantize_params",
    "weights_dtype_of",
]
