"""Would two nano-batches a step pay on llama-3.1-8b's big decode steps? A measurement before the design.

At 256 sequences an FP8 decode step is FP8 products near the tensor cores' rate and decode attention at the
KV cache's bandwidth, one after the other (RESULTS.md, the 8B's workload A profile). Splitting the batch in two
halves on two streams lets one half's attention run beside the other half's products (NanoFlow's intra-device
parallelism), at the price of reading every weight twice. This times ``--layers`` llama-3.1-8b layers' products
(cuBLAS's row-wise FP8 ``_scaled_mm``, or the split-K kernel where the engine takes it) and decode attention
(the engine's entry: the Hopper kernel where it runs) in three CUDA graphs:

- ``whole``: the batch through each layer in order, one stream (what the engine does);
- ``halves, one stream``: the two halves one after the other (the weights' second read, no overlap);
- ``halves, two streams``: half B on a second stream, started after half A's first product, so that A's
  attention meets B's products; what overlap could give.

Only the kernels' timing counts here (the data between them is not a real layer's); each layer has its own
weights and cache so nothing stays in L2.

    python3 dev/overlap_probe.py [--batch 256] [--ctx 1024] [--kv-dtype auto|int8] [--layers 4]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import bench_graph, paged_cache, quantized_cache  # noqa: E402
from minfer.kernels.attention.decode_attention import paged_decode_attention  # noqa: E402
from minfer.kernels.attention.decode_attention_sm90 import paged_decode_attention_sm90  # noqa: E402
from minfer.kernels.attention.gluon_sm90 import sm90_available  # noqa: E402
from minfer.kernels.gemm.fp8_gemm import fp8_gemm_channel  # noqa: E402
from minfer.kernels.gemm.splitk_gemm import fp8_gemm_splitk  # noqa: E402
from minfer.kernels.quant import fp8_quant as fq  # noqa: E402
from minfer.kernels.quant import fp8_ref as fr  # noqa: E402
from minfer.ops import triton_ops  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4096, 14336, 32, 8, 128, 16
PROJ = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


class Layer:
    """One layer's FP8 weights (per-row scales) and its KV cache for ``batch`` sequences of ``ctx`` tokens."""

    def __init__(self, batch: int, ctx: int, kv_dtype: str) -> None:
        self.w = {}
        for name, (n, k) in PROJ.items():
            wq, ws = fr.quantize_fp8_ref(torch.randn(n, k, device="cuda") / k ** 0.5, None)
            self.w[name] = (wq, ws.contiguous())
        kc, vc, self.table, self.lens = paged_cache([ctx] * batch, KV_HEADS, HEAD_DIM, PAGE)
        self.scales = {}
        if kv_dtype != "auto":
            kc, vc, ks, vs = quantized_cache(kc, vc, kv_dtype)
            self.scales = dict(k_scale=ks, v_scale=vs)
        self.kc, self.vc = kc, vc


def run_layer(layer: Layer, rows: slice, acts: dict[str, tuple[torch.Tensor, torch.Tensor]],
              q: torch.Tensor) -> None:
    """One layer's four products and its attention for the sequences in ``rows``, as the engine launches them
    (the activations are fixed e4m3 inputs: only the kernels' time is of interest)."""
    attend = paged_decode_attention_sm90 if sm90_available(q.device, HEAD_DIM, PAGE) else paged_decode_attention
    splitk = triton_ops.FP8_SPLITK and rows.stop - rows.start <= triton_ops.FP8_SPLITK_MAX_ROWS
    gemm = fp8_gemm_splitk if splitk else fp8_gemm_channel  # TritonOps.fp8_linear's choice

    def product(name: str) -> torch.Tensor:
        xq, xs = acts[name]
        return gemm(xq[rows], xs[rows], *layer.w[name])

    product("qkv")
    attend(q[rows], layer.kc, layer.vc, layer.table[rows], layer.lens[rows], HEAD_DIM ** -0.5, **layer.scales)
    product("o")
    product("gate_up")
    product("down")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--kv-dtype", default="auto", help="auto (bf16) or int8 / fp8_e4m3")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    b = args.batch
    layers = [Layer(b, args.ctx, args.kv_dtype) for _ in range(args.layers)]
    acts = {name: fq.quantize_fp8(torch.randn(b, k, device="cuda", dtype=torch.bfloat16), None)
            for name, (_, k) in PROJ.items()}
    q = torch.randn(b, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    whole, half_a, half_b = slice(0, b), slice(0, b // 2), slice(b // 2, b)

    def sequential() -> None:
        for layer in layers:
            run_layer(layer, whole, acts, q)

    def halves_one_stream() -> None:
        for layer in layers:
            run_layer(layer, half_a, acts, q)
            run_layer(layer, half_b, acts, q)

    def halves_two_streams() -> None:
        main_stream = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        first = torch.cuda.Event()
        rest_a = iter(layers)
        run_layer(next(rest_a), half_a, acts, q)  # A ahead by a layer: its attention meets B's products
        first.record(main_stream)
        side.wait_event(first)
        with torch.cuda.stream(side):
            for layer in layers:
                run_layer(layer, half_b, acts, q)
        for layer in rest_a:
            run_layer(layer, half_a, acts, q)
        main_stream.wait_stream(side)

    lines = [f"{torch.cuda.get_device_name()}: llama-3.1-8b layers x {args.layers}, batch {b} x {args.ctx} tokens, "
             f"KV {args.kv_dtype}, FP8 products (split-K up to {triton_ops.FP8_SPLITK_MAX_ROWS} rows: "
             f"{triton_ops.FP8_SPLITK})", "| schedule | µs a layer | against the whole batch |", "|---|---|---|"]
    t_whole = bench_graph(sequential) * 1e3 / args.layers
    for name, fn in (("whole batch, one stream", sequential), ("halves, one stream", halves_one_stream),
                     ("halves, two streams", halves_two_streams)):
        t = t_whole if fn is sequential else bench_graph(fn) * 1e3 / args.layers
        lines.append(f"| {name} | {t:.1f} | {t_whole / t:.2f}× |")
        print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
