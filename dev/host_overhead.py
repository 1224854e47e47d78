"""Host cost of one engine step, with the model's device work taken out.

On a GPU, a decode step of a small model at a large batch takes a few milliseconds of device time,
and ``LLMEngine.step()`` spends about as long on the host (scheduling, building inputs, launching,
reading the draws, stops and outputs). With async scheduling the two overlap, so any host time
above the device time is lost throughput (and at batch 1 the host time is the step time). This
script measures that host time on the CPU: a tiny random-weight checkpoint, whose forward and LM
head are replaced by stubs that return preallocated tensors of the right shapes, so what remains
is the engine's own Python and the small torch ops around the model (uploads, sampling).

Pure-decode steps take the CUDA-graph path as on the GPU: a ``DecodeGraphs`` with no captured
graph copies the inputs into its static buffers and calls the (stubbed) forward in place of a
replay. Sampling is workload A's (temperature 0.6, ignore_eos), over a narrow stub vocabulary so
that the noise and argmax cost what a kernel launch would, not what a CPU pass over 150k logits would.

N requests (workload A's prompt lengths: 100-1024 random ids; max_tokens 2000) are added and
stepped until every prompt is prefilled; then K steady-state decode steps are timed, in total and
per phase of ``step()`` (schedule, launch, complete).

Usage:
    python dev/host_overhead.py [--num-seqs 256] [--steps 200] [--repeats 5] [--stream] [--no-async]
                                       [--cprofile]
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch

from minfer.benchmark import shapes
from minfer.config import EngineConfig, cdiv
from minfer.engine.cuda_graphs import DecodeGraphs
from minfer.engine.llm_engine import LLMEngine
from minfer.outputs import RequestOutputKind
from minfer.sampling_params import SamplingParams

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512,
            tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
            bos_token_id=0, eos_token_id=1)
MAX_TOKENS = 2000
MAX_PROMPT = 1024


def stub_config(num_seqs: int, async_scheduling: bool) -> EngineConfig:
    """The tiny checkpoint's engine config, with KV blocks for ``num_seqs`` sequences of the longest length."""
    shapes.SHAPES["host-overhead-tiny"] = TINY
    path = shapes.write_random_checkpoint("host-overhead-tiny", Path(tempfile.gettempdir()) / "minfer-host-overhead",
                                          dtype=torch.float32)
    max_len = MAX_PROMPT + MAX_TOKENS
    return EngineConfig(model=str(path), skip_tokenizer_init=True, device="cpu", max_model_len=max_len,
                        max_num_seqs=max(num_seqs, 1), num_kv_blocks=num_seqs * cdiv(max_len, 16) + 16,
                        async_scheduling=async_scheduling)


def stub_model(engine: LLMEngine, stub_vocab: int) -> None:
    """Replace the engine's forward and LM head by stubs returning preallocated tensors, and its decode graphs by
    an uncaptured ``DecodeGraphs`` over them (``server_overhead.py`` also applies it inside a replica process)."""
    config, runner = engine.config, engine.runner
    model = runner.model
    hidden = torch.zeros(config.max_num_batched_tokens, TINY["hidden_size"])
    logits = torch.zeros(config.max_num_seqs, stub_vocab)
    model.forward = lambda ids, positions, meta: hidden[:len(ids)]  # nn.Module.__call__ finds it first
    model.compute_logits = lambda h, float32=True, out=None: logits[:len(h)]
    import minfer.engine.cuda_graphs as cuda_graphs  # the staging kernel would run in Triton's interpreter
    from minfer.kernels.stage_inputs import stage_decode_inputs_ref

    cuda_graphs.stage_decode_inputs = stage_decode_inputs_ref
    runner.graphs = DecodeGraphs(model, config.max_num_seqs, cdiv(config.max_model_len, 16), 16, runner.device)


def build_engine(num_seqs: int, stream: bool, async_scheduling: bool, stub_vocab: int) -> LLMEngine:
    config = stub_config(num_seqs, async_scheduling)
    engine = LLMEngine(config, RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)  # DELTA: a server's
    stub_model(engine, stub_vocab)
    return engine


def time_phases(engine: LLMEngine) -> dict[str, float]:
    """Wrap schedule / _launch / _complete with timers; returns the dict of seconds they fill."""
    phases = {"schedule": 0.0, "launch": 0.0, "complete": 0.0}

    def timed(name: str, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[name] += time.perf_counter() - t0
        return wrapper

    for obj, attr, name in ((engine.scheduler, "schedule", "schedule"), (engine, "_launch", "launch"),
                            (engine, "_complete", "complete")):
        fn = getattr(obj, attr)
        setattr(obj, attr, timed(name, getattr(fn, "__wrapped__", fn)))
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of --steps steps; the best is reported")
    ap.add_argument("--stream", action="store_true",
                    help="delta outputs every step, as the server")
    ap.add_argument("--no-async", action="store_true", help="async_scheduling=False")
    ap.add_argument("--stub-vocab", type=int, default=64)
    ap.add_argument("--cprofile", action="store_true", help="print cProfile top-25 (cumulative and tottime)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = build_engine(args.num_seqs, args.stream, not args.no_async, args.stub_vocab)
    rng = random.Random(0)
    for i in range(args.num_seqs):
        ids = [rng.randrange(2, TINY["vocab_size"]) for _ in range(rng.randint(100, MAX_PROMPT))]
        engine.add_request(str(i), {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=MAX_TOKENS))
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    assert len(sched.running) == args.num_seqs, "every sequence should be decoding"
    runs = []  # (ms/step, phases) per repeat: this machine's noise is large, the best run is the measure
    prof = cProfile.Profile() if args.cprofile else None
    for _ in range(1 if prof else args.repeats):
        phases = time_phases(engine)
        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        for _ in range(args.steps):
            engine.step()
        if prof is not None:
            prof.disable()
        runs.append(((time.perf_counter() - start) * 1e3 / args.steps, phases))
    ms, phases = min(runs, key=lambda r: r[0])
    print(f"{args.num_seqs} seqs, {args.steps} decode steps, async={not args.no_async}, stream={args.stream}: "
          f"{ms:.3f} ms/step{' (under cProfile)' if prof else ''} (best of {len(runs)}; all: "
          f"{' '.join(f'{r[0]:.3f}' for r in runs)})")
    print("  per phase: " + ", ".join(f"{k} {v * 1e3 / args.steps:.3f} ms" for k, v in phases.items()))
    if prof is not None:
        for key in ("cumulative", "tottime"):
            pstats.Stats(prof).sort_stats(key).print_stats(25)


if __name__ == "__main__":
    main()
