"""The launches of one batch-1 decode step, in order: Triton kernels by name and torch operators, on the CPU.

A CUDA-graph replay of the step runs these kernels; the host work around it (staging, sampling) launches the rest.
Counting them on the CPU (Triton's interpreter, the engine's Triton ops) says whether a change added launches to the
step without a GPU: run it in two trees and diff the lists. It drives only public API (``LLM``, ``llm_engine.step``),
so an older tree runs it too (``PYTHONPATH=old_tree python dev/step_launches.py``).

Usage: python dev/step_launches.py [--layers 2] [--out launches.txt]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from minfer import LLM, SamplingParams

# llama-3.2-1b's structure (tied head, llama3 rope scaling, GQA 4:1), tiny
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=256,
              num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
              max_position_embeddings=2048, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}, torch_dtype="float32")


class Recorder(TorchDispatchMode):
    """Torch operators (dispatched) and Triton kernels (interpreted launches), in launch order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.events.append(f"aten {func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def write_checkpoint(folder: Path, layers: int) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in CONFIG.items() if k != "architectures"},
                                  num_hidden_layers=layers)
    config.architectures = CONFIG["architectures"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    config.save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the ordered list here (one launch a line)")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (bfloat16: the GPU runs')")
    ap.add_argument("--constexprs", action="store_true", help="list each Triton launch's compile-time arguments")
    args = ap.parse_args()
    path = write_checkpoint(Path(tempfile.mkdtemp()), args.layers)
    llm = LLM(str(path), dtype=args.dtype, skip_tokenizer_init=True, device="cpu", attention_backend="triton",
              max_model_len=256,
              num_kv_blocks=32, max_num_seqs=4)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": list(range(2, 40))},
                       SamplingParams(max_tokens=8, temperature=0.6, seed=0, ignore_eos=True))
    for _ in range(4):  # the prompt, then decodes (async scheduling: the steady state after a couple)
        engine.step()
    recorder, detail = Recorder(), args.constexprs
    launch = interpreter.GridExecutor.__call__

    def recorded(self, *a, **kw):  # noqa: ANN001, ANN202
        bound = dict(zip(self.arg_names, a)) | kw
        consts = ",".join(f"{k}={bound[k]}" for k in self.constexprs if k in bound) if detail else ""
        recorder.events.append(f"triton {self.fn.__name__}" + (f" [{consts}]" if consts else ""))
        with torch.utils._python_dispatch._disable_current_modes():
            return launch(self, *a, **kw)

    interpreter.GridExecutor.__call__ = recorded
    with recorder:
        engine.step()
    interpreter.GridExecutor.__call__ = launch
    events = recorder.events
    counts = Counter(e.split()[0] for e in events)
    events_by_name = [e.split(" [")[0] for e in events]
    print(f"one batch-1 decode step, {args.layers} layers: {len(events)} launches ({dict(counts)})")
    for name, n in Counter(events_by_name).most_common():
        print(f"{n:5d}  {name}")
    if args.out:
        Path(args.out).write_text("\n".join(events) + "\n")
    print(json.dumps({"launches": len(events), **counts}))


if __name__ == "__main__":
    main()
