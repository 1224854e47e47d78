"""Linear attention (Qwen3.5's Gated DeltaNet): the depthwise causal conv and the gated delta rule over a flat
varlen step, each sequence's state in its slot of the engine's state cache. ``gated_delta_ref.py`` holds the torch
references (HF's arithmetic), ``causal_conv.py`` and ``gated_delta.py`` the Triton kernels. Imports nothing, so a
torch-only caller never loads Triton."""
