"""The multi-LoRA kernels on a GPU at llama-3.1-8b's layer shapes (``pytest -m gpu``), in bfloat16.

The CPU suite (test_lora_kernels.py) runs the kernels in Triton's interpreter at tiny shapes; here they run
compiled, with the launchers' real choices at real sizes: split-K from the H200's 132 multiprocessors, 16-row
blocks up to 256 tokens and 64-row blocks past them, the expand's shard tiles laid end to end for qkv.

The layers (in_features, shard widths): qkv (4096; 4096, 1024, 1024), o (4096; 4096), gate_up (4096; 14336,
14336), down (14336; 4096), eight slots. Stacks of max rank 8 hold rank-8 adapters; stacks of max rank 16 mix
rank-16 and rank-8 adapters (the padding is zero: exact). Decode steps (T = 1, 8, 64, 256) draw each token's slot
among six adapters and -1 (no adapter); the last two slots are empty, filled with NaN in the kernels' stacks, so a
kernel that read them would poison its output. A prefill step (T = 2048) is a few long runs of one slot, as
chunked prompts are, with a run of tokens without an adapter between them.

The truth is the torch reference (``add_lora(..., use_triton=False)``) in float64 on the same bfloat16 values
(empty slots zero there: it multiplies every slot). Tolerance: relative Frobenius error 5e-3 of the whole output.
The kernels round once, to nearest, when the delta is added (at most 2^-9 = 2.0e-3 of an element); the products
are bfloat16 x bfloat16 into float32 (exact products) and float32 in tf32x3 (float32-level error), so nothing else
comes near. Rows without an adapter must keep their base output bit for bit.

The CUDA graph check builds the step's grouping into static buffers (``build_lora_meta(..., out=meta)``), captures
the shrink and the expand once, then refills the slots (all one adapter, none, all eight, skewed, random) and the
inputs, and replays: each replay must equal an eager call on the same inputs bit for bit (the same kernels and
launch; no atomics). A variant captures the grouping too, which fails at capture if it synced with the host.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testlib import rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse fixture)

from minfer.kernels.lora.lora import lora_expand, lora_shrink
from minfer.kernels.lora.lora_meta import LoraMeta, build_lora_meta, stacked_rows
from minfer.kernels.lora.lora_ops import add_lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fused layer: (in_features, shard widths) of llama-3.1-8b (hidden 4096, 32 / 8 heads of 128, MLP 14336)
LAYERS: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
MAX_LORAS = 8
USED = 6  # slots 0..5 hold adapters; 6 and 7 are empty
DECODE_TOKENS = [1, 8, 64, 256]
PREFILL_TOKENS = 2048
TOL = 5e-3
DT = torch.bfloat16
DEVICE = "cuda"  # the helpers' device (they run on the CPU too, in the interpreter at small shapes)

Stacks = tuple[torch.Tensor, torch.Tensor]


def slot_ranks(max_rank: int) -> list[int | None]:
    """Each slot's adapter rank (None: empty). Max rank 16 mixes rank 16 and rank 8 (zero-padded) adapters."""
    ranks: list[int | None] = [max_rank if max_rank == 8 or s % 2 == 0 else 8 for s in range(USED)]
    return ranks + [None] * (MAX_LORAS - USED)


def make_stacks(in_features: int, sizes: tuple[int, ...], max_rank: int) -> tuple[Stacks, Stacks]:
    """(kernels' stacks with the empty slots NaN, the reference's with them zero), layouts of lora_meta.py.
    A ~ 1/sqrt(in), B ~ 1/sqrt(rank): the delta is about as large as the unit base output, so a dropped or
    misplaced delta shows in the whole output's error."""
    a = torch.zeros(MAX_LORAS, len(sizes), max_rank, in_features, device=DEVICE, dtype=DT)
    b = torch.zeros(MAX_LORAS, sum(sizes), max_rank, device=DEVICE, dtype=DT)
    for slot, rank in enumerate(slot_ranks(max_rank)):
        if rank is None:
            continue
        for s, (size, row) in enumerate(zip(sizes, stacked_rows(sizes))):
            a[slot, s, :rank] = (torch.randn(rank, in_features, device=DEVICE) / in_features ** 0.5).to(DT)
            b[slot, row:row + size, :rank] = (torch.randn(size, rank, device=DEVICE) / rank ** 0.5).to(DT)
    poisoned_a, poisoned_b = a.clone(), b.clone()
    poisoned_a[USED:], poisoned_b[USED:] = float("nan"), float("nan")
    return (poisoned_a, poisoned_b), (a, b)


def decode_slots(num_tokens: int) -> torch.Tensor:
    """Each token's slot drawn among the adapters and -1; at T >= 8 every adapter and -1 appear at least once."""
    slots = torch.randint(-1, USED, (num_tokens,), dtype=torch.int32)
    if num_tokens >= USED + 1:
        slots[torch.randperm(num_tokens)[:USED + 1]] = torch.arange(-1, USED, dtype=torch.int32)
    return slots.to(DEVICE)


def prefill_slots(num_tokens: int) -> torch.Tensor:
    """A few long runs: 40% slot 3, 5% without an adapter, 35% slot 0, 20% slot 5 (uneven lengths: partial
    64-row blocks at each run's end)."""
    cuts = [0, int(0.40 * num_tokens) + 7, int(0.45 * num_tokens) + 3, int(0.80 * num_tokens) - 5, num_tokens]
    slots = torch.empty(num_tokens, dtype=torch.int32)
    for slot, lo, hi in zip((3, -1, 0, 5), cuts, cuts[1:]):
        slots[lo:hi] = slot
    return slots.to(DEVICE)


def truth(base: torch.Tensor, x: torch.Tensor, ref_stacks: Stacks, meta: LoraMeta,
          sizes: tuple[int, ...]) -> torch.Tensor:
    """The reference in float64 on the same values (the torch path, every slot multiplied)."""
    out = base.double()
    a, b = ref_stacks
    add_lora(out, x.double(), a.double(), b.double(), meta, sizes, use_triton=False)
    return out


def check_step(layer: str, slots: torch.Tensor, max_rank: int, split_k: int | None = None) -> None:
    """One layer's step: the kernels against the float64 reference, rows without an adapter untouched."""
    in_features, sizes = LAYERS[layer]
    kernel_stacks, ref_stacks = make_stacks(in_features, sizes, max_rank)
    num_tokens = slots.numel()
    x = torch.randn(num_tokens, in_features, device=DEVICE).to(DT)
    base = torch.randn(num_tokens, sum(sizes), device=DEVICE).to(DT)
    meta = build_lora_meta(slots, MAX_LORAS)
    out = base.clone()
    buf = lora_shrink(x, kernel_stacks[0], meta, split_k=split_k)
    lora_expand(buf, kernel_stacks[1], meta, out, sizes)
    err = rel_err(out, truth(base, x, ref_stacks, meta, sizes))  # also fails on a NaN: an empty slot was read
    assert err <= TOL, f"{layer} T={num_tokens} max_rank={max_rank} split_k={split_k}: rel err {err:.2e}"
    none = slots < 0
    assert torch.equal(out[none], base[none]), "a token without an adapter was changed"


@pytest.mark.parametrize("max_rank", [8, 16])
@pytest.mark.parametrize("num_tokens", DECODE_TOKENS)
@pytest.mark.parametrize("layer", list(LAYERS))
def test_decode_step(layer: str, num_tokens: int, max_rank: int) -> None:
    check_step(layer, decode_slots(num_tokens), max_rank)


@pytest.mark.parametrize("max_rank", [8, 16])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_prefill_step(layer: str, max_rank: int) -> None:
    check_step(layer, prefill_slots(PREFILL_TOKENS), max_rank)


@pytest.mark.parametrize("split_k", [1, 16])
def test_split_k_extremes(split_k: int) -> None:
    """down's 14336 inputs in one part, and in the most parts the launcher allows (896 columns each)."""
    check_step("down", decode_slots(8), 16, split_k=split_k)


def test_add_lora_on_a_strided_output() -> None:
    """q and v only, into a qkv output's columns (k's untouched), through ``add_lora``."""
    in_features, (q, k, v) = LAYERS["qkv"]
    sizes, offsets = (q, v), (0, q + k)
    kernel_stacks, ref_stacks = make_stacks(in_features, sizes, 16)
    slots = decode_slots(64)
    x = torch.randn(64, in_features, device=DEVICE).to(DT)
    base = torch.randn(64, q + k + v, device=DEVICE).to(DT)
    meta = build_lora_meta(slots, MAX_LORAS)
    out = base.clone()
    add_lora(out, x, *kernel_stacks, meta, sizes, offsets)
    want = base.double()
    add_lora(want, x.double(), ref_stacks[0].double(), ref_stacks[1].double(), meta, sizes, offsets,
             use_triton=False)
    assert rel_err(out, want) <= TOL
    assert torch.equal(out[:, q:q + k], base[:, q:q + k])


# ------------------------------------------------------------------------------------------------ CUDA graphs
def replay_cases(num_tokens: int) -> list[tuple[str, torch.Tensor]]:
    """The slots each replay gets: the grid was sized from shapes alone, so every pattern must fit it."""
    t = num_tokens
    skewed = torch.zeros(t, dtype=torch.int32)
    skewed[-1] = USED - 1  # one slot takes every token but the last
    cases = [("one adapter", torch.full((t,), 2, dtype=torch.int32)),
             ("none", torch.full((t,), -1, dtype=torch.int32)),
             ("round robin", torch.arange(t, dtype=torch.int32) % USED),
             ("skewed", skewed),
             ("random", decode_slots(t))]
    return [(case, slots.to(DEVICE)) for case, slots in cases]


@pytest.mark.parametrize("meta_in_graph", [False, True], ids=["meta_outside", "meta_captured"])
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
@pytest.mark.parametrize("layer", ["qkv", "down"])
def test_cuda_graph_replays_new_slots(layer: str, num_tokens: int, meta_in_graph: bool) -> None:
    in_features, sizes = LAYERS[layer]
    kernel_stacks, ref_stacks = make_stacks(in_features, sizes, 16)
    x = torch.randn(num_tokens, in_features, device=DEVICE).to(DT)
    base = torch.randn(num_tokens, sum(sizes), device=DEVICE).to(DT)
    token_slots = decode_slots(num_tokens)  # the graph's static input when it builds the grouping itself
    meta = build_lora_meta(token_slots, MAX_LORAS)  # static buffers, refilled in place
    out = torch.empty_like(base)

    def step() -> None:
        if meta_in_graph:
            build_lora_meta(token_slots, MAX_LORAS, out=meta)
        out.copy_(base)
        add_lora(out, x, *kernel_stacks, meta, sizes)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for case, slots in replay_cases(num_tokens):
        if meta_in_graph:
            token_slots.copy_(slots)
        else:
            build_lora_meta(slots, MAX_LORAS, out=meta)
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(DT))
        base.copy_(torch.randn_like(base, dtype=torch.float32).to(DT))
        graph.replay()
        eager = base.clone()
        add_lora(eager, x, *kernel_stacks, build_lora_meta(slots, MAX_LORAS), sizes)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"{layer} T={num_tokens} {case}: the replay differs from an eager call"
        err = rel_err(out, truth(base, x, ref_stacks, build_lora_meta(slots, MAX_LORAS), sizes))
        assert err <= TOL, f"{layer} T={num_tokens} {case}: rel err {err:.2e}"
