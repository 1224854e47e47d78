"""The Hopper attention kernels build for sm_90a with the installed Triton, here without a GPU (Gluon has no
interpreter, so this is what the CPU can check): Gluon's API moves between Triton releases, and a build
failure would otherwise surface only on a Hopper GPU. The compiled code must use the machinery the kernels are
built around: TMA bulk copies, warpgroup MMA, register reallocation between partitions, and shared memory
within the 227 KB a block may take (the decode kernel: half of it, so that two programs share an SM). Sliding
windows, soft-capping and attention sinks are compile-time variants of each kernel: they are built here too.

Each build runs in a child process without TRITON_INTERPRET: under the interpreter Triton's own helpers that
Gluon calls become interpreted functions, which the Gluon compiler refuses.
"""

import functools
import json
import os
import subprocess
import sys

import pytest

SMEM_LIMIT = 232448  # bytes a Hopper block may use
CODES = {"int8": "i8", "fp8_e4m3": "fp8e4nv", "fp8_e5m2": "fp8e5"}


def _descriptor(dtype: str, rows: int, layout) -> str:
    return f"tensordesc<{dtype}[{rows}, 64],{layout!r}>"


def _compile(fn, sig: dict, consts: dict, maxnreg: int | None = None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: sig.get(name, "constexpr") for name in fn.arg_names}  # in the kernel's order
    names = list(signature)
    src = GluonASTSource(fn, signature, {(names.index(k),): v for k, v in consts.items()})
    options = {"num_warps": 4, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _sinks(sig: dict, consts: dict, sinks: bool) -> None:
    """The sinks' pointer (bf16, the model dtype) in the signature, or None among the constexprs."""
    if sinks:
        sig["SINKS"] = "*bf16"
    else:
        consts["SINKS"] = None
    consts["HAS_SINKS"] = sinks


def build_prefill(head_dim: int, page: int, kv: str, window: int = 0, softcap: float = 0.0, sinks: bool = False):
    from minfer.kernels.attention import prefill_attention_sm90 as sm90

    gl = sm90.gl
    lay16 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    lay8 = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    quant = kv != "bf16"
    rows = min(page, sm90.BLOCK_N)
    kv_desc = _descriptor(CODES[kv], rows, lay8) if quant else _descriptor("bf16", rows, lay16)
    sig = dict(q_desc=_descriptor("bf16", sm90.BLOCK_M // 2, lay16), k_desc=kv_desc, v_desc=kv_desc,
               KS="*fp16" if quant else "*bf16", VS="*fp16" if quant else "*bf16", BT="*i32", QSL="*i32",
               CL="*i32", O="*bf16", scale_log2e="fp32", stride_btb="i32", stride_ot="i32", stride_oh="i32")
    consts = dict(GROUP=4, HEAD_DIM=head_dim, PAGE=page, NUM_KV_HEADS=8, BLOCK_M=sm90.BLOCK_M,
                  BLOCK_N=sm90.BLOCK_N, STAGES=sm90.QUANT_STAGES if quant else sm90.STAGES,
                  CODE_STAGES=sm90.CODE_STAGES, QUANT=quant, CONVERT_Q=quant, CONVERT_ROWS=sm90.CONVERT_ROWS,
                  CONSUMER_REGS_Q=sm90.QUANT_REGS[0], PRODUCER_REGS_Q=sm90.QUANT_REGS[1],
                  CONVERTER_REGS_Q=sm90.QUANT_REGS[2], WINDOW=window, SOFTCAP=softcap, num_warps=4)
    _sinks(sig, consts, sinks)
    return _compile(sm90._prefill_sm90_kernel, sig, consts)


def build_decode(head_dim: int, page: int, kv: str, window: int = 0, softcap: float = 0.0, sinks: bool = False,
                 group: int = 4, direct: bool = False):
    from minfer.kernels.attention import decode_attention_sm90 as sm90
    from minfer.kernels.attention import decode_attention_sm90_8bit as sm90_8bit

    gl = sm90.gl
    rows = min(page, sm90.BLOCK_N)
    sig = dict(Q="*bf16")
    consts = dict(GROUP=group, NPAD=8 if group <= 8 else 16, HEAD_DIM=head_dim, PAGE=page, BLOCK_N=sm90.BLOCK_N,
                  DIRECT=direct, WINDOW=window, SOFTCAP=softcap, num_warps=4)
    if kv == "bf16":
        lay = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        sig.update(k_desc=_descriptor("bf16", rows, lay), v_desc=_descriptor("bf16", rows, lay))
        consts.update(STAGES=sm90.STAGES)
        kernel, maxnreg = sm90._decode_sm90_kernel, sm90.MAX_REGS
    else:
        codes = gl.NVMMASharedLayout(swizzle_byte_width=head_dim, element_bitwidth=8, rank=2)
        scales = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        code_desc = f"tensordesc<{CODES[kv]}[{rows}, {head_dim}],{codes!r}>"
        scale_desc = f"tensordesc<fp16[1, {rows}],{scales!r}>"
        sig.update(kv_desc=code_desc, vv_desc=code_desc, ks_desc=scale_desc, vs_desc=scale_desc)
        consts.update(NUM_KV_HEADS=8, STAGES=sm90_8bit.STAGES, CONVERT_Q=True)
        kernel, maxnreg = sm90_8bit._decode_sm90_8bit_kernel, sm90_8bit.MAX_REGS
    sig.update(BT="*i32", CL="*i32", O="*bf16", MID_O="*fp32", MID_LSE="*fp32", scale_log2e="fp32", stride_qb="i32",
               stride_qh="i32", stride_btb="i32", stride_ob="i32", stride_oh="i32", num_splits="i32")
    _sinks(sig, consts, sinks)
    return _compile(kernel, sig, consts, maxnreg)


def build(kernel: str, head_dim: int, page: int, kv: str, window: int = 0, softcap: float = 0.0,
          sinks: bool = False) -> dict:
    """Compile a kernel for (head_dim, page, cache format, window, cap, sinks) and report what its code holds."""
    import triton  # noqa: F401 - before minfer.kernels, which turns the interpreter on where no GPU is present

    compiled = (build_prefill if kernel == "prefill" else build_decode)(head_dim, page, kv, window, softcap, sinks)
    ptx = compiled.asm["ptx"]
    return dict(shared=compiled.metadata.shared, sm90a=".target sm_90a" in ptx, wgmma="wgmma.mma_async" in ptx,
                tma="cp.async.bulk.tensor" in ptx, setmaxnreg="setmaxnreg" in ptx, local=".local" in ptx,
                exp2=ptx.count("ex2.approx"),
                loads={width: ptx.count(f"ld.shared.{width} ") + ptx.count(f"ld.shared.{width}\t")
                       for width in ("v4.b32", "v2.b16", "b32", "b16", "b8")})


@functools.lru_cache(maxsize=None)  # a build the module's tests share (the cap test's) compiles once
def _child(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Plain, then (window, cap) variants: a window inside a page, a cap alone, a window past a 128-key tile on pages
# twice the tile, both over an 8-bit cache.
@pytest.mark.parametrize("head_dim,page,kv,window,softcap", [
    (128, 16, "bf16", 0, 0.0), (64, 256, "bf16", 0, 0.0), (128, 16, "int8", 0, 0.0), (128, 32, "fp8_e4m3", 0, 0.0),
    (128, 16, "bf16", 37, 0.0), (128, 16, "bf16", 0, 50.0), (64, 256, "bf16", 200, 30.0), (128, 16, "int8", 21, 50.0),
    (128, 32, "fp8_e4m3", 37, 0.0)])
def test_the_hopper_prefill_kernel_builds(head_dim: int, page: int, kv: str, window: int, softcap: float) -> None:
    got = _child("prefill", str(head_dim), str(page), kv, str(window), str(softcap))
    assert got["sm90a"] and got["wgmma"] and got["tma"] and got["setmaxnreg"], got
    tiles = 2 * 128 * head_dim * 2  # at least one K and one V tile of 16-bit values
    assert tiles <= got["shared"] <= SMEM_LIMIT, got


@pytest.mark.parametrize("head_dim,page,kv,window,softcap", [
    (128, 16, "bf16", 0, 0.0), (64, 128, "bf16", 0, 0.0), (128, 16, "int8", 0, 0.0), (128, 64, "fp8_e5m2", 0, 0.0),
    (64, 32, "fp8_e4m3", 0, 0.0), (128, 16, "bf16", 37, 0.0), (128, 16, "bf16", 0, 50.0), (64, 128, "bf16", 5, 30.0),
    (128, 16, "int8", 21, 50.0), (64, 32, "fp8_e4m3", 37, 0.0)])
def test_the_hopper_decode_kernel_builds(head_dim: int, page: int, kv: str, window: int, softcap: float) -> None:
    got = _child("decode", str(head_dim), str(page), kv, str(window), str(softcap))
    assert got["sm90a"] and got["wgmma"] and got["tma"] and got["setmaxnreg"], got
    tiles = 2 * 64 * head_dim * (2 if kv == "bf16" else 1)  # at least one 64-key K and V tile
    assert tiles <= got["shared"] <= SMEM_LIMIT // 2, got


def test_the_8bit_decode_kernel_reads_codes_in_wide_loads() -> None:
    """The 8-bit decode kernel's register operands come from the TMA's slot in wide loads, which is what its dim
    reorderings are for: per tile, four 16-byte loads of K codes and sixteen 4-byte loads of V codes a thread
    (in the prologue's tile and the loop's), not byte by byte. The one byte load is the partitions' state."""
    got = _child("decode", "128", "16", "int8")
    assert got["loads"]["v4.b32"] >= 2 * 4, got
    assert got["loads"]["b32"] >= 2 * 16, got
    assert got["loads"]["b8"] <= 1, got


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_the_cap_is_compiled_in_only_when_set(kernel: str) -> None:
    """The cap costs one exp2 per score: a capped build has more of them than the plain one, and a windowed
    build (its flag alone set) exactly as many (a flag whose ``if`` never compiled in would pass every other
    check here)."""
    plain, capped, windowed = (_child(kernel, "128", "16", "bf16", w, c) for w, c in
                               (("0", "0.0"), ("0", "50.0"), ("37", "0.0")))
    assert capped["exp2"] > plain["exp2"] == windowed["exp2"], (plain, capped, windowed)


# Sinks (gpt-oss) with a window over a 16-bit cache, and with a window and a cap (which real models do not combine)
# over an 8-bit one (the 8-bit decode kernel, prefill's converter): variants of builds above, compiled once.
SINK_BUILDS = [(128, 16, "bf16", 37, 0.0), (128, 16, "int8", 21, 50.0)]


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
@pytest.mark.parametrize("head_dim,page,kv,window,softcap", SINK_BUILDS)
def test_the_sink_variants_build(kernel: str, head_dim: int, page: int, kv: str, window: int, softcap: float) -> None:
    """Each kernel's sink variant builds with the machinery of the others, within the same shared memory, and costs
    exp2s beyond the plain build's: the sink's term per row (a flag whose ``if`` never compiled in would pass every
    other check)."""
    got = _child(kernel, str(head_dim), str(page), kv, str(window), str(softcap), "1")
    assert got["sm90a"] and got["wgmma"] and got["tma"] and got["setmaxnreg"], got
    plain = _child(kernel, str(head_dim), str(page), kv, str(window), str(softcap))
    assert got["shared"] == plain["shared"] and got["exp2"] > plain["exp2"], (got, plain)


if __name__ == "__main__":
    print(json.dumps(build(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                           *(int(sys.argv[5]), float(sys.argv[6])) if len(sys.argv) > 5 else (),
                           *(sys.argv[7] == "1",) if len(sys.argv) > 7 else ())))
