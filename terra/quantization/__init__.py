"""Weight-only quantization for decoding (the paper's §7 future work): int8 with per-row float32
scales and bfloat16 stored as its 16 bits, read by products that widen the narrow weights block by
block in cache. Training is unchanged; see ``docs/decode_speed.md``."""

from terra.quantization.quantized import (
    WEIGHTS_DTYPES,
    QuantizedTensor,
    check_weights_dtype,
    dequantize,
    dequantize_params,
    quantize,
    quantize_leaf,
    quantize_params,
)

__all__ = [
    "WEIGHTS_DTYPES",
    "QuantizedTensor",
    "check_weights_dtype",
    "dequantize",
    "dequantize_params",
    "quantize",
    "quantize_leaf",
    "quantize_params",
]
