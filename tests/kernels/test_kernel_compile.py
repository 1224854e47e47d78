"""The elementwise kernels compile for sm_90 with the installed Triton, here without a GPU. The CPU suite runs
kernels in Triton's interpreter, which accepts what the compiler refuses (a kernel reading a plain module
global, say): such a kernel passed every CPU test and failed at its first launch on the H200. Each build runs
in a child process without TRITON_INTERPRET (the interpreter, once on, replaces the compiler's helpers)."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

# The MoE grouped GEMMs' common arguments (gpt-oss-20b: 32 experts; bf16 activations, MXFP4 weights, biases).
_MOE_SIG = dict(W="*u8", S="*u8", B="*bf16", OUT="*bf16", COUNTS="*i32", ROWS="*i32", E="i32", T="i32", H="i32",
                I="i32", num_pid_m="i32", stride_x="i32", stride_a="i32", stride_we="i32", stride_wn="i32",
                stride_se="i32", stride_sn="i32", stride_be="i32", stride_o="i32")
_MOE_CONSTS = dict(E_PAD=32, UPCAST=False, PRECISION="tf32", MXFP4=True, HAS_BIAS=True)
# The decode kernels' (moe_decode.py): gpt-oss-20b's MXFP4 layer (the x and activation rows read as int32 pairs),
# and qwen3-30b-a3b's bfloat16 one (128 experts, top 8)
_DECODE_SIG = dict(L="*bf16", B="*bf16", OUT="*bf16", E="i32", H="i32", I="i32", stride_x="i32", stride_xw="i32",
                   stride_a="i32", stride_aw="i32", stride_l="i32", stride_we="i32", stride_wn="i32",
                   stride_se="i32", stride_sn="i32", stride_be="i32", stride_o="i32")
_MXFP4_SIG = dict(_DECODE_SIG, W="*u8", S="*u8", X="*bf16", XW="*i32", A="*bf16", AW="*i32")
_BF16_SIG = dict(_DECODE_SIG, W="*bf16", S="*bf16", X="*bf16", XW="*bf16", A="*bf16", AW="*bf16")
_GPT_OSS_DECODE = dict(TOP_K=4, RENORM=False, TOPK_SOFTMAX=True, E_PAD=32, MXFP4=True, ROUND_W=False, HAS_BIAS=True)
_QWEN3_DECODE = dict(TOP_K=8, RENORM=True, TOPK_SOFTMAX=False, E_PAD=128, MXFP4=False, ROUND_W=False,
                     HAS_BIAS=False)

# (module, kernel, signature, constexprs) of each build: the activation codes, the norm's weight rounding, attention
# sinks
SM90_SHARED = 232448  # the most shared memory one block may take on sm_90 (227 KiB)
# what the Gated DeltaNet kernels' signatures share
_GDN_SIG = dict(K="*bf16", G="*fp32", QSL="*i32", stride_qt="i32", stride_qh="i32", stride_kt="i32", stride_kh="i32",
                stride_gt="i32", stride_bt="i32", dk="i32", dv="i32", eps="fp32")
# the multi-LoRA kernels' (kernels/lora/lora.py): bf16 activations and stacks, the float32 split-K buffer
_LORA_SHRINK_SIG = dict(X="*bf16", A="*bf16", BUF="*fp32", SORTED="*i32", COUNTS="*i32", L="i32", K="i32",
                        k_part="i32", stride_xt="i32", stride_al="i32", stride_as="i32", stride_ar="i32",
                        stride_bk="i32", stride_bs="i32", stride_bt="i32")
_LORA_EXPAND_SIG = dict(BUF="*fp32", B="*bf16", OUT="*bf16", SORTED="*i32", COUNTS="*i32", L="i32", stride_bk="i32",
                        stride_bs="i32", stride_bt="i32", stride_wl="i32", stride_wn="i32", stride_ot="i32")
# the batch-1 matrix-vector kernel (gemm/gemv.py): bf16 activations, e4m3 or bf16 weights, per-row scales
_GEMV_SIG = dict(X="*bf16", B="*bf16", Y="*bf16", R="*bf16", NW="*bf16", R_OUT="*bf16", N_OUT="*bf16", N="i32",
                 K="i32", stride_wn="i32", eps="fp32", WS="*fp32", stride_ws="i32", n_groups="i32")
_GEMV_RMS = dict(HAS_BIAS=False, EVEN_N=True, EVEN_K=True, PROLOGUE=2, HAS_RESIDUAL=True, RMS_BLOCK=4096,
                 EVEN_R=True, ONE_BLOCK=True, PDL=True)
_SPLITK_SIG = dict(A="*fp8e4nv", AS="*fp32", B="*fp8e4nv", BS="*fp32", BIAS="*bf16", C="*bf16", WS="*fp32",
                   TICKETS="*i32", M="i32", N="i32", K="i32", K_STRETCH="i32", stride_am="i32", stride_bn="i32",
                   stride_cm="i32")
BUILDS = {
    "silu": ("minfer.kernels.activation", "_act_and_mul_kernel",
             dict(X="*bf16", OUT="*bf16", stride_x="i32", stride_o="i32", inter="i32"),
             dict(ACT=0, BLOCK=1024, PDL=False)),
    "gelu_tanh": ("minfer.kernels.activation", "_act_and_mul_kernel",
                  dict(X="*bf16", OUT="*bf16", stride_x="i32", stride_o="i32", inter="i32"),
                  dict(ACT=1, BLOCK=1024, PDL=False)),
    "rms_norm_f32_weight": ("minfer.kernels.rmsnorm", "_rms_norm_kernel",
                            dict(X="*bf16", R="*bf16", W="*fp32", OUT="*bf16", stride_x="i32", stride_xh="i32",
                                 stride_r="i32", heads="i32", hidden="i32", eps="fp32"),
                            dict(HAS_RESIDUAL=True, F32_WEIGHT=True, BLOCK=4096, PDL=False)),
    # attention's sinks (gpt-oss), with the split partials and a window as gpt-oss's sliding layers take them
    "decode_attention_sinks": ("minfer.kernels.attention.decode_attention", "_decode_split_kernel",
                               dict(Q="*bf16", K="*bf16", V="*bf16", KS="*bf16", VS="*bf16", BT="*i32", CL="*i32",
                                    O="*bf16", MID_O="*fp32", MID_LSE="*fp32", scale_log2e="fp32", stride_qb="i32",
                                    stride_qh="i32", stride_kb="i32", stride_kt="i32", stride_kh="i32",
                                    stride_btb="i32", stride_ob="i32", stride_oh="i32", num_splits="i32",
                                    SINKS="*bf16"),
                               dict(GROUP=8, GROUP_PAD=16, HEAD_DIM=64, PAGE=16, BLOCK_N=64, DIRECT=False,
                                    DOT_PREC="tf32", UPCAST=False, QUANT=False, F16=False, F16_KIND=-1, Q8=False,
                                    ASM=False, COLUMN_SUMS=False, PDL=False, WINDOW=128, SOFTCAP_LOG2=0.0,
                                    HAS_SINKS=True)),
    "prefill_attention_sinks": ("minfer.kernels.attention.prefill_attention", "_prefill_kernel",
                                dict(Q="*bf16", K="*bf16", V="*bf16", KS="*bf16", VS="*bf16", BT="*i32", QSL="*i32",
                                     CL="*i32", O="*bf16", scale_log2e="fp32", stride_qt="i32", stride_qh="i32",
                                     stride_kb="i32", stride_kt="i32", stride_kh="i32", stride_btb="i32",
                                     stride_ot="i32", stride_oh="i32", SINKS="*bf16"),
                                dict(GROUP=8, HEAD_DIM=64, PAGE=16, NUM_KV_HEADS=8, BLOCK_M=128, BLOCK_N=128,
                                     DOT_PREC="tf32", UPCAST=False, QUANT=False, F16=False, F16_KIND=-1, ASM=False,
                                     WINDOW=128, SOFTCAP_LOG2=0.0, HAS_SINKS=True)),
    # the MoE kernels' gpt-oss variants: top-k-then-softmax routing; MXFP4 codes expanded in registers (a decode
    # tile, mma.sync, with a K tail: 2880 = 22.5 * 128; a prefill tile, wgmma); biases and the clamped SwiGLU; the
    # decode kernels at their default tiles
    "moe_route_topk_softmax": ("minfer.kernels.moe.moe", "_moe_route_kernel",
                               dict(L="*bf16", IDS="*i32", WTS="*bf16", COUNTS="*i32", ROWS="*i32", E="i32", T="i32",
                                    stride_l="i32"),
                               dict(TOP_K=4, RENORM=False, E_PAD=32, TOPK_SOFTMAX=True)),
    "moe_gate_up_mxfp4_gpt_oss": ("minfer.kernels.moe.moe", "_moe_gate_up_kernel", dict(_MOE_SIG, X="*bf16"),
                                  dict(_MOE_CONSTS, TOP_K=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1,
                                       EVEN_K=False, LIMIT=7.0, ALPHA=1.702)),
    "moe_down_mxfp4_bias": ("minfer.kernels.moe.moe", "_moe_down_kernel", dict(_MOE_SIG, A="*bf16", WTS="*bf16"),
                            dict(_MOE_CONSTS, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EVEN_K=True)),
    "moe_decode_gate_up_mxfp4": ("minfer.kernels.moe.moe_decode", "_moe_decode_gate_up_kernel", _MXFP4_SIG,
                                 dict(_GPT_OSS_DECODE, BLOCK_N=8, BLOCK_K=512, LIMIT=7.0, ALPHA=1.702)),
    "moe_decode_down_mxfp4": ("minfer.kernels.moe.moe_decode", "_moe_decode_down_kernel", _MXFP4_SIG,
                              dict(_GPT_OSS_DECODE, TOP_K_PAD=4, BLOCK_N=4, BLOCK_K=512, W_DTYPE="bf16",
                                   C_DTYPE="bf16")),
    "moe_decode_down_bf16_top8": ("minfer.kernels.moe.moe_decode", "_moe_decode_down_kernel", _BF16_SIG,
                                  dict(_QWEN3_DECODE, TOP_K_PAD=8, BLOCK_N=4, BLOCK_K=256, W_DTYPE="bf16",
                                       C_DTYPE="bf16")),
    # Gated DeltaNet (Qwen3.5-9B's layer: 16 key / 32 value heads of 128, conv 4) with the launch options the
    # launchers use: the conv's one-token decode blocks; the recurrent decode; the chunked pair (float32 products
    # in tf32x3; the scan's single stage keeps it under sm_90's shared memory)
    "conv_decode": ("minfer.kernels.linear_attention.causal_conv", "_causal_conv_kernel",
                    dict(X="*bf16", W="*bf16", STATE="*bf16", Y="*bf16", QSL="*i32", SLOTS="*i32", HAS="*i1",
                         stride_xt="i32", stride_yt="i32", stride_ss="i32", C="i32"),
                    dict(K=4, KP=4, BLOCK_T=1, BLOCK_C=128)),
    "gated_delta_recurrent": ("minfer.kernels.linear_attention.gated_delta", "_recurrent_kernel",
                              dict(_GDN_SIG, Q="*bf16", V="*bf16", BETA="*bf16", STATE="*fp32", O="*bf16",
                                   SLOTS="*i32", HAS="*i1", stride_vt="i32", stride_vh="i32", stride_ot="i32",
                                   stride_oh="i32", stride_ss="i32", stride_sh="i32", scale="fp32"),
                              dict(GROUP=2, DK=128, BV=32, L2NORM=True)),
    "gated_delta_chunk_prepare": ("minfer.kernels.linear_attention.gated_delta", "_chunk_prepare_kernel",
                                  dict(_GDN_SIG, V="*bf16", BETA="*bf16", U="*fp32", W="*fp32", CUM="*fp32",
                                       num_tokens="i32", num_seqs="i32", search_steps="i32", stride_vt="i32",
                                       stride_vh="i32"),
                                  dict(GROUP=2, DK=128, DV=128, BT=64, LEVELS=6, L2NORM=True, PREC="tf32x3"),
                                  dict(num_warps=8)),
    "gated_delta_chunk_scan": ("minfer.kernels.linear_attention.gated_delta", "_chunk_scan_kernel",
                               dict(_GDN_SIG, Q="*bf16", U="*fp32", W="*fp32", CUM="*fp32", STATE="*fp32",
                                    O="*bf16", SLOTS="*i32", HAS="*i1", stride_qt="i32", stride_qh="i32",
                                    stride_ot="i32", stride_oh="i32", stride_ss="i32", stride_sh="i32",
                                    scale="fp32"),
                               dict(GROUP=2, DK=128, BV=64, BT=64, L2NORM=True, PREC="tf32x3"), dict(num_stages=1)),
    # multi-LoRA (llama-3.1-8b, rank 16, 8 slots) with the launchers' options: the shrink at decode (16-row
    # blocks, 128-wide K tiles) and at prefill (64-row blocks); the expand of qkv's three shards in one launch
    # (4096 / 1024 / 1024 columns: the shard geometry as constexpr tuples) after a split-K of 4, and of gate_up
    # at prefill; the expand's float32 product in tf32x3 (dot_mode(float32) on a GPU)
    "lora_shrink_decode": ("minfer.kernels.lora.lora", "_lora_shrink_kernel", _LORA_SHRINK_SIG,
                           dict(RANK=16, R_TILES=1, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, L_PAD=8, UPCAST=False,
                                PRECISION="tf32")),
    "lora_shrink_prefill": ("minfer.kernels.lora.lora", "_lora_shrink_kernel", _LORA_SHRINK_SIG,
                            dict(RANK=16, R_TILES=1, BLOCK_M=64, BLOCK_R=16, BLOCK_K=64, L_PAD=8, UPCAST=False,
                                 PRECISION="tf32")),
    "lora_expand_qkv_decode": ("minfer.kernels.lora.lora", "_lora_expand_kernel", _LORA_EXPAND_SIG,
                               dict(N_SHARDS=3, TILE_STARTS=(0, 64, 80, 96), B_ROWS=(0, 4096, 5120),
                                    OUT_COLS=(0, 4096, 5120), SIZES=(4096, 1024, 1024), RANK=16, SPLIT_K=4,
                                    BLOCK_M=16, BLOCK_N=64, BLOCK_R=16, L_PAD=8, PRECISION="tf32x3")),
    "lora_expand_gate_up_prefill": ("minfer.kernels.lora.lora", "_lora_expand_kernel", _LORA_EXPAND_SIG,
                                    dict(N_SHARDS=2, TILE_STARTS=(0, 224, 448), B_ROWS=(0, 14336),
                                         OUT_COLS=(0, 14336), SIZES=(14336, 14336), RANK=16, SPLIT_K=1,
                                         BLOCK_M=64, BLOCK_N=64, BLOCK_R=16, L_PAD=8, PRECISION="tf32x3")),
    # staged 8-bit prefill (kv_stage.py): int8 and e4m3 pages (as bytes) to bf16 through the inline-PTX conversion
    **{f"kv_stage_{fmt}": ("minfer.kernels.attention.kv_stage", "_stage_kernel",
                           dict(k_codes=codes, v_codes=codes, k_scales="*fp16", v_scales="*fp16", k_out="*bf16",
                                v_out="*bf16", block_tables="*i32", seq_of="*i32", col_of="*i32", bt_stride="i32"),
                           dict(PAGE=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK=4096, KIND=kind, ASM=True, EXACT=False,
                                MANT=7, EMIN=-126, SATURATE=False))
       for fmt, codes, kind in (("int8", "*i8", 0), ("e4m3", "*u8", 1))},
    # the weight streams pipelined (gemv_config.STREAM_STAGES): llama-3.1-8b's gate_up at batch 1 under the RMS
    # prologue, e4m3 (8 x 512) and bf16 (4 x 1024), three stages, and at the default depth (one); qwen3-30b-a3b's
    # decode gate/up kernel at three. Pointers aligned as a real launch specializes them (cp.async needs it).
    **{f"gemv_{w}_stages{stages}": ("minfer.kernels.gemm.gemv", "_gemv_kernel", dict(_GEMV_SIG, W=sig),
                                    dict(_GEMV_RMS, BLOCK_N=rows, BLOCK_K=cols, SCALE=scale, NSUB=cols // 128,
                                         SUB=128, STAGES=stages), dict(aligned=True))
       for w, sig, rows, cols, scale in (("e4m3", "*fp8e4nv", 8, 512, 1), ("bf16", "*bf16", 4, 1024, 0))
       for stages in (1, 3)},
    "moe_decode_gate_up_bf16_stages3": ("minfer.kernels.moe.moe_decode", "_moe_decode_gate_up_kernel", _BF16_SIG,
                                        dict(_QWEN3_DECODE, BLOCK_N=8, BLOCK_K=256, LIMIT=0.0, ALPHA=1.0, PDL=True,
                                             STAGES=3), dict(aligned=True)),
    # the split-K FP8 GEMM of decode batches (splitk_gemm.py): a split launch (partials, the ticket, the last
    # program's sum, the scales) at 64 x 64 promoting each k-step, and an unsplit one with bias and ragged K
    "fp8_splitk": ("minfer.kernels.gemm.splitk_gemm", "_splitk_kernel", _SPLITK_SIG,
                   dict(HAS_BIAS=False, SPLIT=3, EVEN_K=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, PROMOTE=True,
                        PDL=True)),
    "fp8_splitk_unsplit": ("minfer.kernels.gemm.splitk_gemm", "_splitk_kernel", _SPLITK_SIG,
                           dict(HAS_BIAS=True, SPLIT=1, EVEN_K=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128,
                                PROMOTE=True, PDL=False)),
}


def build(name: str) -> dict:
    """Compile one of BUILDS for sm_90 and return the size of its cubin, its shared memory and what its PTX holds
    (the child process's work)."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel, sig, consts, *options = BUILDS[name]  # options: the launcher's num_warps / num_stages
    options = dict(options[0]) if options else {}
    aligned = options.pop("aligned", False)  # pointers and integers divisible by 16, as a launch specializes them
    # a dtype constexpr (``*_DTYPE``) is named by Triton's short name ("bf16"): this module does not import triton
    consts = {k: tl.str_to_ty(v, None) if k.endswith("_DTYPE") else v for k, v in consts.items()}
    fn = getattr(importlib.import_module(module), kernel)
    signature = {n: sig.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if aligned and n in sig and not sig[n].startswith("fp")}
    compiled = triton.compile(ASTSource(fn, signature, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, **options})
    ptx = compiled.asm["ptx"]
    return {"cubin_bytes": len(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
            "wgmma": "wgmma.mma_async" in ptx, "local": ".local" in ptx, "pdl_wait": "griddepcontrol.wait" in ptx,
            "cp_async": "cp.async.cg" in ptx or "cp.async.ca" in ptx}


@functools.lru_cache(maxsize=None)  # a build the module's tests share compiles once
def _built(name: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(BUILDS))
def test_kernel_compiles_for_sm90(name: str) -> None:
    built = _built(name)
    assert built["cubin_bytes"] > 0
    assert built["shared"] <= SM90_SHARED, f"{built['shared']} bytes of shared memory: the launch would fail"


def test_the_split_k_gemm_runs_on_warpgroup_mma() -> None:
    """The decode-batch FP8 GEMM's 64-row tiles on warpgroup MMA, no spills to local memory, the PDL wait in it."""
    built = _built("fp8_splitk")
    assert built["wgmma"] and not built["local"] and built["pdl_wait"], built


@pytest.mark.parametrize("kind", ["e4m3", "bf16"])
def test_the_weight_streams_pipeline_when_asked(kind: str) -> None:
    """Triton pipelines a loop without a dot product only when the loop asks: at three stages the batch-1 gemv's K
    loop copies its chunks ahead into shared memory (cp.async), inside sm_90's shared memory, without spills; at
    the default depth of one it loads them as the step needs them (no cp.async: the kernel as it was built)."""
    deep, default = _built(f"gemv_{kind}_stages3"), _built(f"gemv_{kind}_stages1")
    assert deep["cp_async"] and not deep["local"] and deep["pdl_wait"], deep
    assert not default["cp_async"] and default["shared"] < deep["shared"], (default, deep)
    moe = _built("moe_decode_gate_up_bf16_stages3")
    assert moe["cp_async"] and not moe["local"], moe


if __name__ == "__main__":
    print(json.dumps(build(sys.argv[1])))
