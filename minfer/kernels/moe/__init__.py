"""The mixture-of-experts block: the fused Triton path (``moe.py``: routing and grouping by expert, the gate/up
and down grouped GEMMs, the top-k sum, its config table) and its torch reference (``moe_ref.py``, torch only)."""
