"""Weight products the torch matmul does not serve well: batch-1 matrix-vector products with fused RMSNorm /
SwiGLU prologues over bf16 or e4m3 weights (``gemv.py``, its launch configs in ``gemv_config.py``) and the FP8
GEMMs of batched steps (``fp8_gemm.py``: the block-scaled Triton GEMM, the row-wise ``_scaled_mm`` call)."""
