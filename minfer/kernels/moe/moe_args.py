"""The fused MoE kernels' launch configs, which path a step takes, and the argument checks (``moe.py`` and
``moe_decode.py`` launch; this module decides how and refuses what they cannot run)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._utils import check_dtype, next_pow2
from ..gemm.gemv_config import STREAM_STAGES


@dataclass(frozen=True)
class MoeConfig:
    """Tile of both grouped GEMMs: ``block_m`` rows of one expert (the padding unit), ``block_n`` output
    columns (gate/up: ``block_n // 2`` gate columns and the same up columns, two dots), ``block_k`` deep;
    ``group_m`` m-blocks swept together per n-tile (L2 reuse of a weight tile when an expert has several
    blocks), warps, pipelining depth."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


# (largest mean rows per expert = T * top_k / E, config), first match wins. The key is rows per expert, not
# tokens, because that is what sizes the m-tile: qwen3-30b-a3b (top 8 of 128) has 1 row per expert at
# T=16, mixtral-8x7b (top 2 of 8) has 4. Chosen with ``benchmarks/bench_moe.py --sweep`` on the H200 (the
# figures are in RESULTS.md): up to 16 rows an expert one 16-row block (a weight stream), then tiles that
# grow toward compute-bound GEMM shapes.
MOE_CONFIGS: tuple[tuple[float, MoeConfig], ...] = (
    (16, MoeConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4)),
    (64, MoeConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4)),
    (float("inf"), MoeConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3)),
)


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """The launch config for ``num_tokens`` tokens routed to ``top_k`` of ``num_experts``: the first
    ``MOE_CONFIGS`` bucket holding the mean rows per expert."""
    rows = num_tokens * top_k / num_experts
    return next(cfg for max_rows, cfg in MOE_CONFIGS if rows <= max_rows)


def max_blocks(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the m-blocks of the grouped GEMMs: ``sum_e ceil(count_e / block_m)`` over the experts
    with rows, at most ``(T*top_k + min(E, T*top_k) * (block_m - 1)) // block_m``."""
    rows = num_tokens * top_k
    return (rows + min(num_experts, rows) * (block_m - 1)) // block_m


# The decode kernels (``moe_decode.py``) take steps of at most this many tokens: CUDA-graph buckets 1..8, and a
# short prompt chunk. They read an expert's rows once per (token, expert) pair, where the grouped GEMMs read them
# once per expert: equal HBM traffic while a repeat read hits L2 (the pairs of one tile run side by side), but the
# MXFP4 expansion and the float32 products are paid per pair. Measured on an H200 (``dev/moe_decode_sweep.py``;
# benchmarks/RESULTS.md, "Performance round"): for MXFP4 experts the decode kernels win up to 8 tokens; for float
# experts at one token only, the grouped GEMMs at 8.
DECODE_MAX_TOKENS = 8
DECODE_MAX_TOKENS_FLOAT = 1


def use_moe_decode(num_tokens: int, mxfp4: bool = True) -> bool:
    """Whether a step of ``num_tokens`` tokens takes the decode kernels rather than the grouped GEMMs (``mxfp4``:
    the experts are MXFP4 codes; float experts take them at one token)."""
    return 0 < num_tokens <= (DECODE_MAX_TOKENS if mxfp4 else DECODE_MAX_TOKENS_FLOAT)


@dataclass(frozen=True)
class MoeDecodeConfig:
    """Launch config of the decode kernels: ``block_n_gate_up`` gate rows (and as many up rows) per program of
    the gate/up kernel, ``block_n_down`` output rows per program of the down kernel (each times top_k experts'
    rows), ``tile`` the weight elements one K step of a program loads (its K depth is ``tile`` over its rows, a
    power of two), warps, the K loop's pipelining depth (``gemm/gemv_config.STREAM_STAGES``); ``expert_loop``: the
    down kernel takes a token's experts one after another (a ``[block_n_down, K step]`` tile each) rather than all
    in one ``[top_k, block_n_down, K step]`` tile."""

    block_n_gate_up: int = 8
    block_n_down: int = 4
    tile: int = 8192
    num_warps: int = 4
    num_stages: int = 1
    expert_loop: bool = False


def moe_decode_config(weight_bytes: float, h: int, i: int, device: torch.device) -> MoeDecodeConfig:
    """The decode config for weights of ``weight_bytes`` a value (MXFP4: 0.5) in an ``h``-wide layer of ``i``-wide
    experts. On a GPU the row counts keep a T=1 step's grid at several programs an SM on the smallest layer
    (qwen3-30b-a3b: 8 pairs x 96 gate/up tiles, 512 down tiles on the H200's 132 SMs); the tile, 8192 values (16 KiB
    of bfloat16, 4 KiB of MXFP4 codes, whose expansion to float32 is what fills the registers), is the batch-1
    GEMV's (``gemm/gemv_config.py``: 4 rows x 2048); float32 weights take half. Elsewhere the kernels run in
    Triton's interpreter, where a program costs milliseconds of Python whatever its size: one program a pair and
    one a token, each a single K step, at the small layers that run there. Float experts: the down kernel takes a
    token's experts one after another, 4096-value tiles (at top 8 one ``[top_k, rows, K step]`` tile leaves too few
    bytes in flight per expert); MXFP4 keeps the one tile. The choices are the fastest measured by
    ``dev/moe_decode_sweep.py`` (benchmarks/RESULTS.md, "Performance round")."""
    if device.type != "cuda":
        return MoeDecodeConfig(min(next_pow2(i), 256), min(next_pow2(h), 256), tile=1 << 16)
    if weight_bytes < 1:
        return MoeDecodeConfig(num_stages=STREAM_STAGES)
    return MoeDecodeConfig(tile=2048 if weight_bytes >= 4 else 4096, num_stages=STREAM_STAGES, expert_loop=True)


def decode_block_k(k: int, rows: int, tile: int, mxfp4: bool) -> int:
    """K depth of a decode program's step: ``tile`` values over ``rows`` rows, a power of two, no deeper than K
    needs, at least one MXFP4 scale group (32) or 16."""
    per_row = max(1, tile // rows)
    return max(32 if mxfp4 else 16, min(next_pow2(k), 1 << (per_row.bit_length() - 1)))


def check_moe_args(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   top_k: int, scale_gate_up: torch.Tensor | None, scale_down: torch.Tensor | None,
                   bias_gate_up: torch.Tensor | None, bias_down: torch.Tensor | None) -> tuple[int, int, int, int]:
    """(T, H, E, I) of a valid call; a clear error otherwise."""
    check_dtype("x", x)
    if x.dim() != 2 or router_logits.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"expected x [T, H], router_logits [T, E], w_gate_up [E, 2I, H], w_down [E, H, I], got "
                         f"{list(x.shape)}, {list(router_logits.shape)}, {list(w_gate_up.shape)}, "
                         f"{list(w_down.shape)}")
    t, h = x.shape
    e, two_i, _ = w_gate_up.shape
    i = two_i // 2
    mxfp4 = scale_gate_up is not None
    pack = 2 if mxfp4 else 1  # MXFP4: two codes a byte along K
    if (router_logits.shape != (t, e) or w_gate_up.shape != (e, 2 * i, h // pack)
            or w_down.shape != (e, h, i // pack) or two_i % 2):
        raise ValueError(f"inconsistent MoE shapes: x {list(x.shape)}, router_logits {list(router_logits.shape)}, "
                         f"w_gate_up {list(w_gate_up.shape)}, w_down {list(w_down.shape)}"
                         + (" (MXFP4: [E, 2I, H // 2], [E, H, I // 2] bytes)" if mxfp4 else ""))
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    weights = [w_gate_up, w_down] + ([scale_gate_up, scale_down] if mxfp4 else [])
    if mxfp4:
        if h % 32 or i % 32:
            raise ValueError(f"MXFP4 experts need H and I multiples of 32 (a scale per 32), got H {h}, I {i}")
        if any(w is None or w.dtype != torch.uint8 for w in weights):
            raise TypeError("MXFP4 experts: w_gate_up, w_down, scale_gate_up and scale_down must all be uint8")
        if scale_gate_up.shape != (e, 2 * i, h // 32) or scale_down.shape != (e, h, i // 32):
            raise ValueError(f"MXFP4 scales must be [E, 2I, H // 32] and [E, H, I // 32], got "
                             f"{list(scale_gate_up.shape)} and {list(scale_down.shape)}")
    elif scale_down is not None:
        raise ValueError("scale_down without scale_gate_up: MXFP4 experts need both")
    elif w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise TypeError(f"expert weights must be x's dtype {x.dtype}, got {w_gate_up.dtype} and {w_down.dtype}")
    for name, bias, shape in (("bias_gate_up", bias_gate_up, (e, 2 * i)), ("bias_down", bias_down, (e, h))):
        if bias is not None and (bias.shape != shape or not bias.is_floating_point()):
            raise ValueError(f"{name} must be a float [{', '.join(map(str, shape))}], got {bias.dtype} "
                             f"{list(bias.shape)}")
        weights += [bias] if bias is not None else []
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be floating point, got {router_logits.dtype}")
    if not x.is_contiguous() or not all(w.is_contiguous() for w in weights):
        raise ValueError("x and the experts' weights, scales and biases must be contiguous")
    if router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must have a contiguous last dimension, got strides {router_logits.stride()}")
    return t, h, e, i
