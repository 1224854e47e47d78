"""The multi-LoRA shrink / expand kernels against the plain per-token math, and the torch reference against it too.

Under the Triton interpreter at tiny shapes (in_features 48 or 256, ranks up to 16, shards of 32, 16 and 16
columns), kept to a few seconds for the whole file. The truth is computed token by token in float64 from each
adapter's unpadded matrices (:func:`per_token`), independent of both the stacks' layout and the grouping.

Tolerances (relative Frobenius error of the whole output, whose base part is as large as the LoRA part):
- float32: 1e-5; only the order of float32 sums differs (seen: ~1e-7).
- float16: 2e-3, bfloat16: 1e-2: the output's one rounding, to nearest in torch and on GPUs, toward zero under
  the interpreter (kernel_testlib); the intermediate stays float32 in both paths, so nothing else rounds.
A token without an adapter keeps its base output bit for bit, in every dtype.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testlib import seed_per_case  # noqa: F401 (autouse: a fresh seed per case)

from minfer.kernels.lora.lora import default_split_k, lora_expand, lora_shrink, max_blocks
from minfer.kernels.lora.lora_meta import LoraMeta, build_lora_meta, shard_layout, stacked_rows
from minfer.kernels.lora.lora_ops import add_lora
from minfer.kernels.lora.lora_ref import lora_expand_ref, lora_shrink_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
QKV = (32, 16, 16)  # three shards of different widths, as q, k, v under grouped-query attention

Adapter = list[tuple[torch.Tensor, torch.Tensor]]  # per shard (A [r, in], B [size, r]), unpadded


def make_adapters(ranks: list[int | None], in_features: int, sizes: tuple[int, ...],
                  dtype: torch.dtype) -> list[Adapter | None]:
    """One adapter per slot (None: an empty slot), values exact in ``dtype``, the product about unit size."""
    out: list[Adapter | None] = []
    for r in ranks:
        if r is None:
            out.append(None)
            continue
        out.append([((torch.randn(r, in_features) / in_features ** 0.5).to(dtype),
                     (torch.randn(size, r) / r ** 0.5).to(dtype)) for size in sizes])
    return out


def stack(adapters: list[Adapter | None], max_rank: int, sizes: tuple[int, ...], in_features: int,
          dtype: torch.dtype, empty: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot stacks (layouts: lora_meta.py), ranks zero-padded to max_rank; an empty slot filled with
    ``empty`` (NaN: a kernel that reads it poisons its output)."""
    a = torch.zeros(len(adapters), len(sizes), max_rank, in_features, dtype=dtype)
    b = torch.zeros(len(adapters), sum(sizes), max_rank, dtype=dtype)
    for slot, adapter in enumerate(adapters):
        if adapter is None:
            a[slot], b[slot] = empty, empty
            continue
        for s, ((sa, sb), row) in enumerate(zip(adapter, stacked_rows(sizes))):
            a[slot, s, :sa.shape[0]] = sa
            b[slot, row:row + sizes[s], :sb.shape[1]] = sb
    return a, b


def per_token(base: torch.Tensor, x: torch.Tensor, adapters: list[Adapter | None], slots: torch.Tensor,
              sizes: tuple[int, ...], offsets: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unbatched math in float64: each token through its own adapter's unpadded matrices."""
    cols = shard_layout(sizes, offsets)[1]
    out = base.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < len(adapters):
            for (a, b), col, size in zip(adapters[slot], cols, sizes):
                out[t, col:col + size] += (x[t].double() @ a.double().t()) @ b.double().t()
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output: an empty slot's weights were read, or a row unwritten"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_case(slots: list[int], ranks: list[int | None], dtype: torch.dtype, in_features: int = 48,
             max_rank: int = 16, sizes: tuple[int, ...] = QKV, split_k: int | None = None,
             block_m: int | None = None) -> None:
    """Kernels (empty slots NaN) and reference (empty slots zero) against the per-token truth."""
    token_slots = torch.tensor(slots, dtype=torch.int32)
    adapters = make_adapters(ranks, in_features, sizes, dtype)
    x = torch.randn(len(slots), in_features).to(dtype)
    base = torch.randn(len(slots), sum(sizes)).to(dtype)
    meta = build_lora_meta(token_slots, len(ranks))
    truth = per_token(base, x, adapters, token_slots, sizes)
    none = ~((token_slots >= 0) & (token_slots < len(ranks)))

    out = base.clone()
    a, b = stack(adapters, max_rank, sizes, in_features, dtype, empty=float("nan"))
    buf = lora_shrink(x, a, meta, split_k=split_k, block_m=block_m)
    lora_expand(buf, b, meta, out, sizes, block_m=block_m)
    assert rel_err(out, truth) <= TOL[dtype], f"kernels: {rel_err(out, truth):.2e}"
    assert torch.equal(out[none], base[none]), "a token without an adapter was changed"

    ref_out = base.clone()
    a, b = stack(adapters, max_rank, sizes, in_features, dtype)
    ref_buf = lora_shrink_ref(x, a, meta)
    lora_expand_ref(ref_buf, b, meta, ref_out, sizes)
    assert rel_err(ref_out, truth) <= TOL[dtype], f"reference: {rel_err(ref_out, truth):.2e}"
    assert torch.equal(ref_out[none], base[none])
    # the intermediate itself, on the rows the kernel writes (it leaves the others unwritten)
    got, want = buf.sum(0)[:, ~none], ref_buf[0][:, ~none]
    if want.numel():
        assert (got - want).abs().max() <= 1e-4 * want.abs().max().clamp_min(1.0)


# ------------------------------------------------------------------------------------------------ metadata
def test_meta_groups_tokens_by_slot_stably() -> None:
    slots = torch.tensor([2, -1, 0, 2, 5, 0, -1, 2], dtype=torch.int32)  # 5: past max_loras, counts as none
    meta = build_lora_meta(slots, 4)
    assert meta.slot_counts.tolist() == [2, 0, 3, 0]
    assert meta.sorted_tokens.tolist() == [2, 5, 0, 3, 7, 1, 4, 6]  # slot order, token order within; none last
    assert meta.sorted_tokens.dtype == meta.slot_counts.dtype == torch.int32
    assert max_blocks(8, 4, 16) == 1 + 4


def test_meta_refills_in_place() -> None:
    """A CUDA graph's metadata keeps its tensors: the next step's grouping is copied into them."""
    static = build_lora_meta(torch.full((6,), -1, dtype=torch.int32), 3)
    ptrs = [t.data_ptr() for t in static]
    got = build_lora_meta(torch.tensor([1, 0, 1, -1, 2, 0]), 3, out=static)
    assert got is static and [t.data_ptr() for t in static] == ptrs
    assert static.slot_counts.tolist() == [2, 2, 1] and static.sorted_tokens.tolist() == [1, 5, 0, 2, 4, 3]
    with pytest.raises(ValueError, match="holds 6 tokens"):
        build_lora_meta(torch.zeros(5, dtype=torch.int32), 3, out=static)


# ------------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ragged_batch(dtype: torch.dtype) -> None:
    """Decode-like: slots interleaved, tokens without an adapter, an empty slot (2, NaN: never read), adapter
    ranks 4, 8, 16 and 2 in a max-rank-16 stack, a slot with more tokens than a 16-row block."""
    slots = [0, 3, -1, 1, 0, 4, 3, 3, -1, 0, 1, 4] + [3] * 17 + [0, -1]
    run_case(slots, [4, 8, None, 16, 2], dtype)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_split_k(split_k: int) -> None:
    """in_features 256: two 128-wide K tiles, split in two parts, or three (one part empty: it writes zeros)."""
    run_case([1, 0, -1, 1, 1, 0], [8, 16], torch.float32, in_features=256, split_k=split_k)


def test_prefill_blocks() -> None:
    """Past 256 tokens: 64-row blocks, long runs of one slot with a few others mixed in (chunked prefill)."""
    slots = [0] * 150 + [1, -1, 2] * 10 + [1] * 120
    run_case(slots, [8, 16, 4], torch.bfloat16, sizes=(16, 16))


def test_one_token_and_no_adapter() -> None:
    run_case([2], [4, None, 8], torch.float32)
    run_case([-1, -1, -1], [4, 8], torch.float32)  # every program exits: the output is the base, untouched


def test_rank_padding_is_exact() -> None:
    """A rank-4 adapter in a max-rank-16 stack gives what the same adapter in a rank-4 stack gives."""
    adapters = make_adapters([4, 4], 48, QKV, torch.float32)
    x, base = torch.randn(5, 48), torch.randn(5, 64)
    meta = build_lora_meta(torch.tensor([1, 0, 1, 1, 0]), 2)
    outs = []
    for max_rank in (4, 16):
        a, b = stack(adapters, max_rank, QKV, 48, torch.float32)
        out = base.clone()
        lora_expand(lora_shrink(x, a, meta), b, meta, out, QKV)
        outs.append(out)
    assert rel_err(outs[1], outs[0]) <= 1e-6


def test_slots_select_adapters() -> None:
    """The same input through slot 0 and slot 1 gives each adapter's own output, and swapping the slots swaps
    them: a kernel that ignored the slots (or read one adapter for a whole block) fails here."""
    adapters = make_adapters([8, 8], 48, QKV, torch.float32)
    a, b = stack(adapters, 8, QKV, 48, torch.float32)
    x = torch.randn(1, 48).expand(6, 48).contiguous()
    results = []
    for slots in ([0, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1]):
        meta = build_lora_meta(torch.tensor(slots), 2)
        out = torch.zeros(6, 64)
        lora_expand(lora_shrink(x, a, meta), b, meta, out, QKV)
        assert rel_err(out, per_token(torch.zeros(6, 64), x, adapters, torch.tensor(slots), QKV)) <= 1e-5
        results.append(out)
    first, second = results
    assert (first[0] - first[1]).abs().max() > 0.1, "both adapters gave the same output"
    assert torch.allclose(first[0], second[1]) and torch.allclose(first[1], second[0])


def test_add_lora_shard_offsets_and_switch() -> None:
    """Adapters on q and v of a qkv output only (k's columns 32..47 untouched): shard_offsets place them; the
    kernels and the reference (use_triton=False) agree."""
    sizes, offsets = (32, 16), (0, 48)
    adapters = make_adapters([4, 8, 16], 48, sizes, torch.float32)
    a, b = stack(adapters, 16, sizes, 48, torch.float32)
    token_slots = torch.tensor([2, 0, -1, 1, 2, 2, 0])
    meta = build_lora_meta(token_slots, 3)
    x, base = torch.randn(7, 48), torch.randn(7, 64)
    truth = per_token(base, x, adapters, token_slots, sizes, offsets)
    for use_triton in (True, False):
        out = base.clone()
        add_lora(out, x, a, b, meta, sizes, offsets, use_triton=use_triton)
        assert rel_err(out, truth) <= 1e-5
        assert torch.equal(out[:, 32:48], base[:, 32:48])


def test_default_split_k_follows_shapes() -> None:
    cpu = torch.device("cpu")  # num_sms: 4 on the CPU
    assert default_split_k(1, 8, 1, 16, 4096, 16, 128, cpu) == 4  # 2 programs, 8 wanted
    assert default_split_k(1, 8, 1, 16, 256, 16, 128, cpu) == 1  # too short to split
    assert default_split_k(256, 8, 3, 16, 4096, 16, 128, cpu) == 1  # enough programs already


def test_shape_errors_name_the_tensor() -> None:
    a = torch.zeros(2, 3, 8, 48)
    meta = build_lora_meta(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="in_features"):
        lora_shrink(torch.zeros(4, 32), a, meta)
    with pytest.raises(ValueError, match="metadata counts 3 slots"):
        lora_shrink(torch.zeros(4, 48), a, build_lora_meta(torch.zeros(4, dtype=torch.int32), 3))
    with pytest.raises(TypeError, match="share a dtype"):
        lora_shrink(torch.zeros(4, 48, dtype=torch.bfloat16), a, meta)
    buf = lora_shrink(torch.zeros(4, 48), a, meta)
    with pytest.raises(ValueError, match="b_stack must be"):
        lora_expand(buf, torch.zeros(2, 60, 8), meta, torch.zeros(4, 64), QKV)
    with pytest.raises(ValueError, match="shards"):
        lora_expand(buf, torch.zeros(2, 48, 8), meta, torch.zeros(4, 64), (32, 16))
    with pytest.raises(ValueError, match="b_stack must have 3 dimensions"):
        lora_expand(buf, torch.zeros(2, 3, 32, 8), meta, torch.zeros(4, 64), QKV)
    with pytest.raises(ValueError, match="every shard's columns"):
        lora_expand(buf, torch.zeros(2, 64, 8), meta, torch.zeros(4, 64), QKV, (0, 32, 56))
    assert isinstance(meta, LoraMeta) and meta.max_loras == 2
