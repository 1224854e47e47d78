"""Paged attention over the KV cache: the portable Triton kernels (``prefill_attention.py``,
``decode_attention.py`` with split-K and the merge of its partials), the Hopper (sm_90) kernels in Gluon that
replace them where they apply (``prefill_attention_sm90.py``, ``decode_attention_sm90.py`` and, over 8-bit
caches, ``decode_attention_sm90_8bit.py``), and what those share (``gluon_sm90.py``: when they apply, the
build guard, rings, TMA copies, conversions). The Triton kernels are the Gluon ones' reference."""
