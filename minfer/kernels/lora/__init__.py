"""Batched multi-LoRA products for serving many adapters at once (Punica's SGMV, S-LoRA's layout): each token of a
step goes through its own adapter's low-rank update, added in place to the base layer's output.

``lora_meta.py``: the step's grouping of tokens by adapter slot (``LoraMeta``, built once a step, read by every
layer), the shard geometry and the shape checks (torch only); ``lora.py``: the shrink and expand kernels;
``lora_ref.py``: their torch reference, also the path on a machine without Triton (torch only); ``lora_ops.py``:
``add_lora``, the one call a layer makes (kernels or reference). Like the other kernel packages, this ``__init__``
imports nothing, so a torch-only caller never loads Triton.
"""
