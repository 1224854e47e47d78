"""The Hopper prefill kernel builds for sm_90a with the installed Triton, here without a GPU (Gluon has no
interpreter, so this is what the CPU can check): Gluon's API moves between Triton releases, and a build
failure would otherwise surface only on a Hopper GPU. The compiled code must use the machinery the kernel is
built around: TMA bulk copies, warpgroup MMA, register reallocation between partitions, and shared memory
within the 227 KB a block may take.

Each build runs in a child process without TRITON_INTERPRET: under the interpreter Triton's own helpers that
Gluon calls become interpreted functions, which the Gluon compiler refuses.
"""

import json
import os
import subprocess
import sys

import pytest

SMEM_LIMIT = 232448  # bytes a Hopper block may use


def build(head_dim: int, page: int, kv: str) -> dict:
    """Compile the kernel for (head_dim, page, cache format) and report what its code holds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from minfer.kernels import prefill_attention_sm90 as sm90

    gl = sm90.gl
    lay16 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    lay8 = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    quant = kv != "bf16"
    rows = min(page, sm90.BLOCK_N)
    desc = lambda dt, r, lay: f"tensordesc<{dt}[{r}, {sm90.HALF}],{lay!r}>"  # noqa: E731
    kv_desc = desc({"int8": "i8", "fp8_e4m3": "fp8e4nv"}[kv], rows, lay8) if quant else desc("bf16", rows, lay16)
    sig = dict(q_desc=desc("bf16", sm90.BLOCK_M // 2, lay16), k_desc=kv_desc, v_desc=kv_desc,
               KS="*fp16" if quant else "*bf16", VS="*fp16" if quant else "*bf16", BT="*i32", QSL="*i32",
               CL="*i32", O="*bf16", scale_log2e="fp32", stride_btb="i32", stride_ot="i32", stride_oh="i32")
    consts = dict(GROUP=4, HEAD_DIM=head_dim, PAGE=page, NUM_KV_HEADS=8, BLOCK_M=sm90.BLOCK_M,
                  BLOCK_N=sm90.BLOCK_N, STAGES=sm90.QUANT_STAGES if quant else sm90.STAGES,
                  CODE_STAGES=sm90.CODE_STAGES, QUANT=quant, CONVERT_Q=quant, CONVERT_ROWS=sm90.CONVERT_ROWS,
                  CONSUMER_REGS_Q=sm90.QUANT_REGS[0], PRODUCER_REGS_Q=sm90.QUANT_REGS[1],
                  CONVERTER_REGS_Q=sm90.QUANT_REGS[2], num_warps=4)
    names = list(sig) + list(consts)
    src = GluonASTSource(sm90._prefill_sm90_kernel, {**sig, **{k: "constexpr" for k in consts}},
                         {(names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kernel.asm["ptx"]
    return dict(shared=kernel.metadata.shared, sm90a=".target sm_90a" in ptx, wgmma="wgmma.mma_async" in ptx,
                tma="cp.async.bulk.tensor" in ptx, setmaxnreg="setmaxnreg" in ptx)


@pytest.mark.parametrize("head_dim,page,kv", [(128, 16, "bf16"), (64, 256, "bf16"), (128, 16, "int8"),
                                              (128, 32, "fp8_e4m3")])
def test_the_hopper_prefill_kernel_builds(head_dim: int, page: int, kv: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, str(head_dim), str(page), kv], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["sm90a"] and got["wgmma"] and got["tma"] and got["setmaxnreg"], got
    tiles = 2 * 128 * head_dim * 2  # at least one K and one V tile of 16-bit values
    assert tiles <= got["shared"] <= SMEM_LIMIT, got


if __name__ == "__main__":
    print(json.dumps(build(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])))
