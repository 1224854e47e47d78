"""Multi-LoRA serving on the GPU (issue 39): what the adapters cost a layer, and what they cost end to end.

    python3 benchmarks/bench_lora.py adapters --shape llama-3.1-8b     # write (and load-check) random adapters
    python3 benchmarks/bench_lora.py kernels --shape llama-3.1-8b      # add_lora against the layer's base GEMM
    python3 benchmarks/bench_lora.py engine --shape llama-3.1-8b       # workload A and batch 1, LoRA off / on
    python3 benchmarks/bench_lora.py engine --tiny --num-prompts 16    # the same on a tiny stand-in (CPU smoke)

Each part prints a markdown table and writes it under $OUT (default /tmp/minfer-out), with the figures as JSON.

``adapters`` writes PEFT LoRA folders (adapter_config.json + adapter_model.safetensors with PEFT's tensor names)
for the shape, without peft: rank 16, alpha 32, on q/k/v/o/gate/up/down of every layer, A ~ N(0, 0.02) and
B ~ N(0, 0.01) (PEFT starts B at zero, which would hide a path that skips the adapter: with these the update is
about 8% of each projection's output, so greedy tokens change and activations stay finite on random weights).
Each folder is read back through ``minfer.lora.load_adapter``, the engine's own check.

``kernels`` times ``add_lora`` (shrink + expand) for each fused layer (qkv, o, gate_up, down) at T = 1, 8, 64, 256
tokens over 1 and 8 adapters (round robin), against ``torch.nn.functional.linear`` of the same layer: the ratio is
the layer's LoRA overhead. Both are replayed from CUDA graphs (decode steps run as graphs in the engine, so launch
gaps are not the kernels' cost), cycling over enough copies of the weights and stacks to leave L2 (60 MB) behind,
as 32 layers do. The step's grouping (``build_lora_meta``) is timed apart: a step builds it once for all layers.

``engine`` runs BENCHMARKS.md's workload A on random weights (``load_format="dummy"``) with LoRA off, then in an
engine with ``enable_lora=True, max_loras=8``: no adapter on any request, one adapter on every request, eight
adapters round robin; output tok/s and the ratio to LoRA off in the same call (targets: one adapter >= 90%,
eight >= 85%). Then batch-1 decode, LoRA off against one adapter (target >= 90%), with the greedy tokens compared:
LoRA enabled without an adapter should write LoRA off's tokens, an adapter should change them.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minfer.benchmark.shapes import shape_checkpoint, shape_config, write_shape_config
from minfer.benchmark.workload import BENCH_MAX_MODEL_LEN, fixed_workload, workload_a
from minfer.lora import FUSED_LAYERS, PROJECTIONS, BaseLinears, LoRARequest, load_adapter
from minfer.lora.layout import module_group
from minfer.model.registry import model_config
from minfer.sampling_params import SamplingParams

OUT = Path(os.environ.get("OUT", "/tmp/minfer-out"))
SHAPES_DIR = Path("/tmp/minfer-shapes")
ADAPTERS_DIR = Path("/tmp/minfer-lora")
RANK, STD_A, STD_B = 16, 0.02, 0.01
ALPHA = 2 * RANK  # scaling alpha / r = 2, as adapter_config writes it at any rank
# a small stand-in with the shape's layout, for a CPU smoke run of every part
TINY = dict(layers=2, overrides=dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     intermediate_size=512, vocab_size=4096))
TARGETS = {"one": 0.90, "eight": 0.85}  # workload A, share of LoRA off's output tok/s
BATCH1_TARGET = 0.90
HBM_BYTES_PER_S = 4.22e12


def _table(name: str, header: list[str], rows: list[list], data: Any = None) -> None:
    """Print a markdown table and write it (and ``data`` as JSON, for RESULTS.md) under $OUT."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"lora_{name}.md").write_text(text + "\n")
    if data is not None:
        (OUT / f"lora_{name}.json").write_text(json.dumps(data, indent=1))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shape_config_of(shape: str, tiny: bool) -> dict[str, Any]:
    """The shape's config.json contents, or its tiny stand-in's."""
    return shape_config(shape, **(TINY if tiny else {}))


def base_linears(shape: str, tiny: bool) -> BaseLinears:
    """The shape's projections as the adapter loader checks them."""
    return BaseLinears.from_model_config(model_config(shape_config_of(shape, tiny)))


def model_dir(shape: str, tiny: bool) -> str:
    """A config-only folder: the engine draws the random weights itself (``load_format="dummy"``)."""
    if tiny:
        return str(write_shape_config(shape, SHAPES_DIR / f"{shape}-lora-tiny-dummy", **TINY))
    return str(shape_checkpoint(shape, SHAPES_DIR, "dummy"))


# ------------------------------------------------------------------------------------------------ adapters
def adapter_config(shape: str, rank: int) -> dict[str, Any]:
    """What PEFT's ``LoraConfig.save_pretrained`` writes for a plain LoRA (the fields the loader reads, and the
    usual ones it must tolerate)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": shape, "r": rank,
            "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(PROJECTIONS), "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True}


def write_adapter(folder: Path, shape: str, base: BaseLinears, seed: int, rank: int = RANK) -> Path:
    """One random adapter in PEFT's format: ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A
    .weight [rank, in]`` and ``lora_B.weight [out, rank]``, bfloat16. Drawn on the GPU when there is one; the
    config is written last (a folder with it is complete, and reused when it matches)."""
    config, weights = adapter_config(shape, rank), folder / "adapter_model.safetensors"
    done, metadata = folder / "adapter_config.json", {"format": "pt", "minfer_seed": str(seed)}
    if done.is_file() and json.loads(done.read_text()) == config and weights.is_file():
        with safe_open(str(weights), framework="pt") as f:
            if f.metadata() == metadata:
                return folder
    folder.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for (layer, module), (n_in, n_out) in sorted(base.shapes().items()):
        name = f"base_model.model.model.layers.{layer}.{module_group(module)}.{module}"
        for side, shape_, std in (("A", (rank, n_in), STD_A), ("B", (n_out, rank), STD_B)):
            draw = torch.randn(shape_, generator=gen, device=device) * std
            tensors[f"{name}.lora_{side}.weight"] = draw.to(torch.bfloat16).cpu().contiguous()
    save_file(tensors, str(weights), metadata=metadata)  # the seed in the file: PEFT warns of unknown config keys
    done.write_text(json.dumps(config, indent=2))
    return folder


def write_adapters(shape: str, n: int, tiny: bool = False, check: bool = False) -> list[Path]:
    """``n`` adapters for the shape (seeds 1..n); ``check``: each read back by the engine's loader."""
    base = base_linears(shape, tiny)
    tag = f"{shape}-tiny" if tiny else shape
    folders = [write_adapter(ADAPTERS_DIR / f"{tag}-r{RANK}-{k}", shape, base, seed=k + 1) for k in range(n)]
    if check:
        for folder in folders:
            adapter = load_adapter(folder, base, RANK)
            assert adapter.rank == RANK and len(adapter.modules) == len(base.shapes()), folder
            assert all(math.isclose(w.scaling, ALPHA / RANK) for w in adapter.modules.values()), folder
    return folders


def adapters_part(shape: str, n: int, tiny: bool) -> None:
    start = time.perf_counter()
    folders = write_adapters(shape, n, tiny, check=True)
    size = sum((f / "adapter_model.safetensors").stat().st_size for f in folders) / n / 2**20
    _table(f"adapters_{shape}{'-tiny' if tiny else ''}",
           ["adapters", "rank / alpha", "MiB each", "written + load-checked in s"],
           [[n, f"{RANK} / {ALPHA}", f"{size:.1f}", f"{time.perf_counter() - start:.1f}"]])


# ------------------------------------------------------------------------------------------------ kernels
def time_calls(calls: list[Callable[[], None]], device: str, iters: int) -> float:
    """Median µs of one call. On CUDA: one graph of at least 32 calls cycling over ``calls`` (each on its own
    copy of the weights), replayed ``iters`` times between events; elsewhere the calls eagerly."""
    for call in calls:  # compile and warm up outside the capture
        call()
    if device != "cuda":
        start = time.perf_counter()
        for i in range(iters):
            calls[i % len(calls)]()
        return (time.perf_counter() - start) / iters * 1e6
    reps = math.ceil(32 / len(calls)) * len(calls)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def _copies(nbytes: int, device: str) -> int:
    """Copies of one operand set whose round trip leaves L2 (4 x 60 MB on an H200); one off the GPU."""
    return min(64, max(2, math.ceil((240 << 20) / nbytes))) if device == "cuda" else 1


def kernels_part(shape: str, tokens: list[int], adapters: list[int], max_loras: int, device: str, tiny: bool,
                 iters: int) -> None:
    from minfer.kernels.lora.lora_meta import build_lora_meta
    from minfer.kernels.lora.lora_ops import add_lora

    base, dtype = base_linears(shape, tiny), torch.bfloat16 if device == "cuda" else torch.float32
    use_triton = device == "cuda"
    rows, data, totals = [], [], {}
    for fused, shards in FUSED_LAYERS.items():
        n_in = base.features(0, shards[0])[0]
        sizes = tuple(base.features(0, m)[1] for m in shards)
        w_bytes = sum(sizes) * n_in * 2
        weights = [torch.randn(sum(sizes), n_in, device=device).to(dtype) for _ in range(_copies(w_bytes, device))]
        stack_bytes = max_loras * RANK * (len(sizes) * n_in + sum(sizes)) * 2
        stacks = [((torch.randn(max_loras, len(sizes), RANK, n_in, device=device) * STD_A).to(dtype),
                   (torch.randn(max_loras, sum(sizes), RANK, device=device) * STD_B).to(dtype))
                  for _ in range(_copies(stack_bytes, device))]
        for t in tokens:
            x = torch.randn(t, n_in, device=device).to(dtype)
            out = torch.empty(t, sum(sizes), device=device, dtype=dtype)
            base_us = time_calls([lambda w=w: torch.mm(x, w.t(), out=out) for w in weights], device, iters)
            for n in adapters:
                slots = torch.arange(t, device=device, dtype=torch.int32) % n
                meta = build_lora_meta(slots, max_loras)
                lora_us = time_calls([lambda s=s: add_lora(out, x, s[0], s[1], meta, sizes, use_triton=use_triton)
                                      for s in stacks], device, iters)
                used = min(n, t)  # adapters the step reads; x read, out read and written
                moved = used * stack_bytes / max_loras + 2 * t * (n_in + 2 * sum(sizes))
                rows.append([fused, t, n, f"{base_us:.1f}", f"{lora_us:.1f}", f"{lora_us / base_us:.3f}",
                             f"{moved / (lora_us * 1e-6) / 1e9:,.1f}"])
                data.append(dict(layer=fused, tokens=t, adapters=n, base_us=base_us, lora_us=lora_us))
                total = totals.setdefault((t, n), [0.0, 0.0])
                total[0], total[1] = total[0] + base_us, total[1] + lora_us
    for t in tokens:  # a whole decoder layer's four products
        for n in adapters:
            b, lo = totals[(t, n)]
            rows.append(["all four", t, n, f"{b:.1f}", f"{lo:.1f}", f"{lo / b:.3f}", "—"])
    tag = shape + ("-tiny" if tiny else "")
    _table(f"kernels_{tag}", ["layer", "tokens", "adapters", "base linear µs", "add_lora µs", "LoRA / base",
                              "LoRA GB/s"], rows, data)
    print(f"(GB/s: the adapters' stacks read, x read, the output read and written; H200 HBM "
          f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s)")
    grouping = []
    for t in tokens:  # the grouping a step builds once for all layers, timed as a graph replays it
        slots = torch.arange(t, device=device, dtype=torch.int32) % max(adapters)
        try:
            grouping.append([t, f"{time_calls([lambda: build_lora_meta(slots, max_loras)], device, iters):.1f}"])
        except RuntimeError as e:  # a host sync fails the capture: the finding, not a crash of the part
            grouping.append([t, f"not capturable: {str(e).splitlines()[0][:80]}"])
    _table(f"grouping_{tag}", ["tokens", "build_lora_meta µs (once a step)"], grouping)


# ------------------------------------------------------------------------------------------------ engine
def lora_requests(folders: list[Path], n_adapters: int, n_requests: int) -> list[LoRARequest | None]:
    """Request i runs adapter ``i % n_adapters`` (ids 1..n); None for every request when n_adapters is 0."""
    if n_adapters == 0:
        return [None] * n_requests
    return [LoRARequest(f"adapter-{i % n_adapters}", i % n_adapters + 1, str(folders[i % n_adapters]))
            for i in range(n_requests)]


def _generate(llm: Any, prompts: list[dict], params: list[SamplingParams] | SamplingParams,
              loras: list[LoRARequest | None] | None) -> list[Any]:
    """``llm.generate``; ``lora_request`` only where the run names adapters (an engine with LoRA off takes none)."""
    kw = {} if loras is None else {"lora_request": loras}
    return llm.generate(prompts, params, use_tqdm=False, **kw)


def throughput(llm: Any, prompts: list[dict], params: list[SamplingParams],
               loras: list[LoRARequest | None] | None) -> dict[str, float]:
    """Workload A's one timed ``generate`` (prefill included), after a warm-up of eight short requests with the
    run's adapters (their first load into the slots, and the prefill kernels' compiles, stay out of the time)."""
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    _generate(llm, prompts[:8], [warm] * min(8, len(prompts)), None if loras is None else loras[:8])
    _sync()
    start = time.perf_counter()
    outs = _generate(llm, prompts, params, loras)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": round(elapsed, 3), "output_tok_s": round(tokens / elapsed, 1)}


def batch1(llm: Any, prompt: dict, output_len: int, lora: LoRARequest | None,
           enabled: bool) -> tuple[float, list[int]]:
    """Decode tok/s of one greedy request (its first token excluded) and its tokens."""
    loras = [lora] if enabled else None
    _generate(llm, [prompt], SamplingParams(temperature=0, ignore_eos=True, max_tokens=16), loras)  # warm-up
    _sync()
    out = _generate(llm, [prompt], SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len), loras)[0]
    m = out.metrics
    ids = list(out.outputs[0].token_ids)
    return (len(ids) - 1) / (m.finished_time - m.first_token_time), ids


def _same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share (where an adapter first changes the output)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def engine_part(shape: str, what: list[str], tiny: bool, num_prompts: int, max_loras: int, output_len: int,
                runs: list[str]) -> None:
    from minfer import LLM

    model = model_dir(shape, tiny)
    folders = write_adapters(shape, min(8, max_loras), tiny)
    max_len = 512 if tiny else BENCH_MAX_MODEL_LEN
    common = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=max_len)
    n_adapters = {"off": None, "none": 0, "one": 1, "eight": min(8, max_loras)}
    results: dict[str, Any] = {"shape": shape + (" (tiny)" if tiny else ""), "max_loras": max_loras, "workload": {},
                               "batch1": {}}
    needs = {False: "batch1" in what or "off" in runs, True: "batch1" in what or any(r != "off" for r in runs)}
    for enabled in [e for e in (False, True) if needs[e]]:
        kw = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=RANK) if enabled else {}
        llm = LLM(model, **common, **kw)
        try:
            vocab = llm.llm_engine.model_config.vocab_size
            if "workload" in what:
                prompts, params = workload_a(num_prompts, max_len, vocab)
                for run in [r for r in runs if (r != "off") == enabled]:
                    n = n_adapters[run]
                    loras = None if n is None else lora_requests(folders, n, len(prompts))
                    results["workload"][run] = throughput(llm, prompts, params, loras)
                    print(f"  workload A, {run}: {results['workload'][run]}", flush=True)
            if "batch1" in what:
                prompt = fixed_workload(1, 128, output_len, vocab_size=vocab)[0][0]
                for run in ("none", "one") if enabled else ("off",):
                    lora = lora_requests(folders, 1, 1)[0] if run == "one" else None
                    speed, ids = batch1(llm, prompt, output_len, lora, enabled)
                    results["batch1"][run] = {"decode_tok_s": round(speed, 1), "tokens": ids}
                    print(f"  batch 1, {run}: {speed:.1f} tok/s", flush=True)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    report(shape + ("-tiny" if tiny else ""), results, num_prompts)


def _verdict(share: float, target: float) -> str:
    return f"≥ {target:.0%}: {'met' if share >= target else 'NOT met'}"


def report(shape: str, results: dict[str, Any], num_prompts: int) -> None:
    """The workload and batch-1 tables, each run against LoRA off in the same call, with the issue's targets."""
    names = {"off": "LoRA off", "none": "enable_lora, no adapter", "one": "1 adapter on every request",
             "eight": "8 adapters round robin"}
    work, b1 = results["workload"], results["batch1"]
    if work:
        off = work.get("off", {}).get("output_tok_s")
        rows = []
        for run, r in work.items():
            share = r["output_tok_s"] / off if off else None
            target = TARGETS.get(run)
            verdict = "—" if target is None or share is None else _verdict(share, target)
            rows.append([names[run], f"{r['output_tok_s']:,.0f}", f"{r['seconds']:.2f}",
                         "—" if share is None else f"{share:.1%}", verdict])
        _table(f"workload_{shape}", [f"workload A ({num_prompts} requests), max_loras={results['max_loras']}",
                                     "output tok/s", "wall s", "× LoRA off", "target"], rows, results["workload"])
    if b1:
        off = b1.get("off")
        rows = []
        for run, r in b1.items():
            share = r["decode_tok_s"] / off["decode_tok_s"] if off else None
            same = f"{_same_prefix(r['tokens'], off['tokens'])} / {len(r['tokens'])}" if off else "—"
            verdict = "—"
            if run == "one" and share is not None:
                verdict = _verdict(share, BATCH1_TARGET)
            rows.append([names[run], f"{r['decode_tok_s']:.1f}", "—" if share is None else f"{share:.1%}", same,
                         verdict])
        _table(f"batch1_{shape}", ["batch 1, greedy", "decode tok/s", "× LoRA off", "tokens equal to LoRA off's",
                                   "target"], rows, {k: {"decode_tok_s": v["decode_tok_s"]} for k, v in b1.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["adapters", "kernels", "engine"])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 256-wide stand-in of the shape (CPU smoke)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="kernels: the device")
    ap.add_argument("--adapters", type=int, default=8, help="adapters: how many to write")
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--tokens", default="1,8,64,256", help="kernels: step sizes, comma-separated")
    ap.add_argument("--num-adapters", default="1,8", help="kernels: adapters in a step, comma-separated")
    ap.add_argument("--iters", type=int, default=20, help="kernels: timed replays")
    ap.add_argument("--what", default="workload,batch1", help="engine: workload and/or batch1")
    ap.add_argument("--runs", default="off,none,one,eight", help="engine: workload A's runs (off none one eight)")
    ap.add_argument("--num-prompts", type=int, default=256, help="engine: workload A's first N requests")
    ap.add_argument("--output-len", type=int, default=512, help="engine: batch 1's new tokens")
    args = ap.parse_args()
    if args.part == "adapters":
        adapters_part(args.shape, args.adapters, args.tiny)
    elif args.part == "kernels":
        kernels_part(args.shape, [int(t) for t in args.tokens.split(",")],
                     [int(n) for n in args.num_adapters.split(",")], args.max_loras, args.device, args.tiny,
                     args.iters)
    else:
        engine_part(args.shape, args.what.split(","), args.tiny, args.num_prompts, args.max_loras, args.output_len,
                    args.runs.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
