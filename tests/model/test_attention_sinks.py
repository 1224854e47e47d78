"""The attention layer's learned sinks (gpt-oss): a parameter of this rank's query heads in the model dtype, read from
the checkpoint's ``self_attn.sinks`` slice under tensor parallelism, and handed to the ops through the cache
protocol (``cache.sinks``): the torch ops and the Triton ones (the interpreter on the CPU) give the attention of the
kernels' reference."""
from __future__ import annotations

import pytest
import torch

from minfer.distributed import TensorParallel
from minfer.kernels.attention.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref
from minfer.model.layers.attention import Attention
from minfer.ops import AttentionMetadata, TorchOps

HEADS = 8


@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2), (3, 4)])
def test_each_rank_loads_its_heads_in_the_model_dtype(rank: int, size: int) -> None:
    full = torch.linspace(-3, 3, HEADS, dtype=torch.float32) + 1e-3  # not exact in bfloat16
    layer = Attention(HEADS // size, 1, 16, TorchOps(), sinks=True, dtype=torch.bfloat16,
                      tp=TensorParallel(rank=rank, size=size))
    layer.load_shard("sinks", full, None)
    share = HEADS // size
    assert layer.sinks.dtype == torch.bfloat16 and not layer.sinks.requires_grad
    assert torch.equal(layer.sinks, full[rank * share:(rank + 1) * share].to(torch.bfloat16))
    assert dict(layer.named_parameters()).keys() == {"sinks"}


def test_wrong_tensors_are_refused() -> None:
    plain = Attention(HEADS, 2, 16, TorchOps())
    assert plain.sinks is None and not list(plain.parameters())
    with pytest.raises(ValueError, match="no checkpoint tensor 'sinks'"):
        plain.load_shard("sinks", torch.zeros(HEADS), None)
    layer = Attention(HEADS, 2, 16, TorchOps(), sinks=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="expected"):
        layer.load_shard("sinks", torch.zeros(HEADS - 1), None)
    with pytest.raises(ValueError, match="dtype"):
        Attention(HEADS, 2, 16, TorchOps(), sinks=True)


def layer_step(ops, dtype: torch.dtype = torch.float32) -> tuple:
    """A layer with sinks over a filled paged cache, and a step of two decodes then two prompt chunks (a
    window of 9 on the layer): (layer, q, meta, lens, qsl of the chunks)."""
    page, hkv, d = 16, 2, 16
    ctx, q_lens = [5, 40, 33, 20], [1, 1, 20, 7]
    layer = Attention(HEADS, hkv, d, ops, window=9, sinks=True, dtype=dtype)
    layer.sinks.data.copy_(torch.linspace(-2, 3, HEADS))
    layer.k_cache, layer.v_cache = torch.randn(2, 16, page, hkv, d).to(dtype).unbind(0)
    table = torch.randperm(16)[:12].view(4, 3).int()
    lens = torch.tensor(ctx, dtype=torch.int32)
    qsl = torch.tensor([0] + q_lens[2:]).cumsum(0).int()
    meta = AttentionMetadata(
        slot_mapping=[torch.empty(0, dtype=torch.long)], block_tables=[table], context_lens=lens, num_decodes=2,
        block_size=page, prefill_query_start_loc=qsl, prefill_block_tables=[table[2:]], prefill_context_lens=lens[2:],
        max_prefill_query_len=max(q_lens[2:]), context_lens_host=ctx, query_lens_host=q_lens)
    q = torch.randn(sum(q_lens), HEADS, d).to(dtype)
    return layer, q, meta, lens, qsl


def ops_named(name: str):
    if name == "torch":
        return TorchOps()
    from minfer.ops.triton_ops import TritonOps

    return TritonOps(torch.device("cpu"), 16, 16)


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_the_ops_read_the_layers_sinks(ops: str) -> None:
    layer, q, meta, lens, qsl = layer_step(ops_named(ops))
    out = layer.ops.paged_attention(q, layer, meta, layer.scale)
    how = dict(window=layer.window, sinks=layer.sinks.double())
    table, kc, vc = meta.block_tables[0], layer.k_cache.double(), layer.v_cache.double()
    dec = paged_decode_attention_ref(q[:2].double(), kc, vc, table[:2], lens[:2], layer.scale, **how)
    pre = paged_prefill_attention_ref(q[2:].double(), kc, vc, table[2:], qsl, lens[2:], 20, layer.scale, **how)
    torch.testing.assert_close(out.double(), torch.cat([dec, pre]), rtol=1e-5, atol=1e-5)
    layer.sinks.data.fill_(-1e30)  # a sink that no key can match is no sink
    plain = dict(window=layer.window)
    dec = paged_decode_attention_ref(q[:2].double(), kc, vc, table[:2], lens[:2], layer.scale, **plain)
    pre = paged_prefill_attention_ref(q[2:].double(), kc, vc, table[2:], qsl, lens[2:], 20, layer.scale, **plain)
    out = layer.ops.paged_attention(q, layer, meta, layer.scale)
    torch.testing.assert_close(out.double(), torch.cat([dec, pre]), rtol=1e-5, atol=1e-5)
