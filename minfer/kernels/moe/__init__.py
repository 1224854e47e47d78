"""The mixture-of-experts block: the fused Triton path for many tokens (``moe.py``: routing and grouping by expert,
the gate/up and down grouped GEMMs, the top-k sum, its config table), the matrix-vector path for a few
(``moe_decode.py``), what both share (``moe_common.py``, ``moe_mxfp4.py``, ``moe_args.py``) and the torch reference
(``moe_ref.py``, torch only)."""
