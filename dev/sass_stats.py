"""Compile a decode-attention variant for sm_90 on any machine (no GPU needed) and count its SASS.

A kernel's instruction count per main-loop iteration, its registers and its opcode mix tell,
before any GPU time is spent, whether a variant removes the work it means to remove (e.g. the
byte-wise shared-memory loads of an 8-bit V tile, or the int8 → float conversions). Uses the
ptxas/nvdisasm that ship inside Triton's NVIDIA backend; the device's Triton version may
schedule differently, so the GPU timing stays the judge.

    python dev/sass_stats.py                     # bf16 and int8 caches, the shipped kernel
    python dev/sass_stats.py --kv int8 --dump    # also print the main loop's SASS
    python dev/sass_stats.py --kv int8,fp8_e4m3,fp8_e5m2 --check   # the 8-bit loop's structure (a test)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
                 not_aligned: tuple[str, ...] = (), maxnreg: int | None = None):
    """Compile ``fn`` for sm_90 (PDL launch allowed) and return Triton's compiled kernel.

    Pointers and integer arguments are marked divisible by 16, as Triton specialises them at a real
    launch (our strides are multiples of 16), except those in ``not_aligned`` (the kernel's
    ``do_not_specialize`` list): without the hint loads are not vectorised.
    """
    names = [n for n in fn.arg_names if n in signature]  # Triton reads the signature in argument order
    signature = {n: signature[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n] != "constexpr" and not signature[n].startswith("fp") and n not in not_aligned}
    src = ASTSource(fn, signature, constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _run_on_cubin(kernel, tool: str, *flags: str) -> str:
    """stdout of one of Triton's bundled CUDA tools run on the kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    try:
        return subprocess.run([os.path.join(BIN, tool), *flags, path], check=True, capture_output=True,
                              text=True).stdout
    finally:
        os.unlink(path)


def sass_of(kernel) -> str:
    return _run_on_cubin(kernel, "nvdisasm", "-c")


def registers(kernel) -> str:
    """Registers, local memory (spills) and shared memory per thread block, from cuobjdump."""
    out = _run_on_cubin(kernel, "cuobjdump", "-res-usage")
    m = re.search(r"REG:(\d+).*?SHARED:(\d+) LOCAL:(\d+)", out)
    return f"{m.group(1)} regs, local {m.group(3)} B, static shared {m.group(2)} B" if m else out.strip()


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def main_loop(sass: str) -> list[tuple[int, str, str]]:
    """Instructions of the largest backward-branch range (the hot loop), as (address, opcode, line)."""
    insns, labels = [], {}
    for line in sass.splitlines():
        lab = re.match(r"\s*\.?(L_x_\d+|\.L_x_\d+):", line)
        if lab:
            labels[lab.group(1).lstrip(".")] = len(insns)
            continue
        m = _INSN.search(line)
        if m:
            insns.append((int(m.group(1), 16), m.group(3), line.strip()))
    best = (0, 0)
    for i, (_, op, line) in enumerate(insns):
        if not op.startswith("BRA"):
            continue
        t = re.search(r"`\(\.?(L_x_\d+)\)", line)
        if t and t.group(1) in labels and labels[t.group(1)] <= i:
            start = labels[t.group(1)]
            if i - start > best[1] - best[0]:
                best = (start, i + 1)
    return insns[best[0]:best[1]]


def report(name: str, kernel, dump: bool) -> collections.Counter:
    """Print the kernel's registers and main-loop opcode mix; return the mix (opcode → count, plus
    ``"byte LDS"`` for byte-wise shared-memory loads)."""
    loop = main_loop(sass_of(kernel))
    ops = collections.Counter(op.split(".")[0] for _, op, _ in loop)
    ops["byte LDS"] = sum(1 for _, op, _ in loop if op.startswith(("LDS.U8", "LDS.S8")))
    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(14) if op != "byte LDS")
    print(f"{name}: {registers(kernel)}\n  loop {len(loop)} insns, byte LDS {ops['byte LDS']}: {top}")
    if dump:
        print("\n".join(line for _, _, line in loop))
    return ops


def check_8bit_loop(kv: str, ops: collections.Counter) -> list[str]:
    """What the 8-bit decode loop must not do (``--check``): gather V byte by byte from shared memory,
    or convert codes with the quarter-rate I2F/F2F instructions; int8 must use the integer MMA."""
    problems = [f"{kv}: {ops[op]} {op}" for op in ("byte LDS", "I2F", "F2F") if ops[op]]
    if kv == "int8" and not ops["IMMA"]:
        problems.append("int8: Q·Kᵀ is not on the integer MMA (no IMMA)")
    return problems


def decode_variants(kv: str):
    """(name, kernel fn, signature, constexprs, warps, stages) of the shipped split kernel, llama-3.1-8b
    heads (group 4, head dim 128), bf16 q, the device default config for the cache format."""
    import torch

    from minfer.kernels.attention import decode_attention as da
    from minfer.kernels.quant.kv_quant import KV_QUANT_FORMATS

    fmt = KV_QUANT_FORMATS.get(kv)
    code = "bf16" if fmt is None else "i8" if fmt.is_int else "u8"
    sig = {"Q": "*bf16", "K": f"*{code}", "V": f"*{code}", "KS": "*fp16", "VS": "*fp16", "BT": "*i32",
           "CL": "*i32", "O": "*bf16", "MID_O": "*fp32", "MID_LSE": "*fp32", "scale_log2e": "fp32"}
    for a in ("stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_btb", "stride_ob",
              "stride_oh", "num_splits"):
        sig[a] = "i32"
    cuda = torch.device("cuda")  # a device object only: nothing is allocated
    cfg = da.default_config(cuda, 128, torch.bfloat16, None if fmt is None else fmt.dtype)
    quant = fmt is not None
    const = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, PAGE=16, BLOCK_N=cfg.block_n, DIRECT=True,
                 DOT_PREC="tf32", UPCAST=False, QUANT=quant, F16=quant, F16_KIND=fmt.f16_kind if quant else -1,
                 Q8=quant and fmt.is_int, ASM=quant, COLUMN_SUMS=cfg.column_sums, PDL=True, WINDOW=0,
                 SOFTCAP_LOG2=0.0, SINKS=None, HAS_SINKS=False)
    for k in const:
        sig[k] = "constexpr"
    yield f"shipped {kv} {cfg}", da._decode_split_kernel, sig, const, cfg.num_warps, cfg.num_stages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="bf16,int8", help="comma list: bf16, int8, fp8_e4m3, fp8_e5m2")
    ap.add_argument("--dump", action="store_true", help="print the main loop's SASS")
    ap.add_argument("--check", action="store_true", help="exit 1 if an 8-bit loop has byte-wise shared loads, "
                    "I2F/F2F conversions, or (int8) no integer MMA")
    args = ap.parse_args()
    problems = []
    for kv in args.kv.split(","):
        for name, fn, sig, const, warps, stages in decode_variants(kv):
            ops = report(name, compile_sm90(fn, sig, const, warps, stages, ("stride_btb", "num_splits")), args.dump)
            if kv != "bf16":
                problems += check_8bit_loop(kv, ops)
    if args.check and problems:
        sys.exit("SASS check failed: " + "; ".join(problems))


if __name__ == "__main__":
    main()
