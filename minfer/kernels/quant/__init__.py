"""Number formats: the FP8 (e4m3) activation format (``fp8_ref.py``: constants and torch references, torch
only; ``fp8_quant.py``: activations to e4m3, alone or fused into add+RMSNorm and SwiGLU) and the 8-bit KV cache
formats (``kv_quant.py``: formats and torch reference, torch only; ``quant.py``: the Triton helpers the store and
attention kernels quantize and dequantize with)."""
