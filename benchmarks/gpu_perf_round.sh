#!/usr/bin/env bash
# Issue 42's performance round on one H200: the missed targets' runs in parts that each fit one device call.
#
#   PARTS="base" bash benchmarks/gpu_perf_round.sh          # results under $OUT (default /tmp/minfer-out)
#
# base:     the targets' engine runs with weights drawn on the GPU (--load-format dummy), one process each:
#           workload A on qwen3-0.6b and llama-3.2-1b, batch 1 on llama-3.2-1b, workload A on llama-3.1-8b bf16 /
#           FP8 / FP8 + int8 KV, batch 1 on llama-3.1-8b FP8 and qwen3-30b-a3b, a batch of 16 on llama-3.1-8b FP8
#           (16 x 128 in, 512 out); decode attention B=1 x 32k
#           (benchmarks/sweep_decode_sm90.py, graph-timed)                          -> $OUT/base.md, $OUT/decode32k.md
# profile:  where the small models' steps go (dev/step_timeline.py on qwen3-0.6b and llama-3.2-1b, dev/profile_steps.py)
#           and a batch-1 profile of qwen3-30b-a3b                 -> $OUT/timeline_*.md, $OUT/profile_*.txt
# profile8b: where llama-3.1-8b's workload A goes in bf16, FP8 and FP8 + int8 KV (dev/step_timeline.py), the decode and
#           prompt steps' kernels (dev/profile_steps.py), and the decode split heuristic against its neighbours
#           -> $OUT/timelines_8b.md, $OUT/profile_8b_*.md, $OUT/decode_splits.md
# splitk:   the split-K FP8 GEMM of decode-sized batches: its gpu tests (SPLITK_ENGINE_TESTS=1: the FP8 engine's
#           too), benchmarks/bench_decode_gemm.py (cuBLAS against the rule's pick and a candidate grid; not with
#           SPLITK_NO_BENCH=1), llama-3.1-8b FP8 at a batch of 16 and workload A (KV formats: SPLITK_KV) with
#           MINFER_FP8_SPLITK 1 and 0                              -> $OUT/decode_gemm.md, $OUT/splitk.md
# stage:    staged 8-bit prefill (kv_stage.py): first the JIT misses after start-up of a staged run on a cold cache
#           (dev/compile_events.py: none should be left), its gpu tests and the 8-bit engine's, the 8k prefill kernels
#           over bf16 / int8 / fp8 caches with the staged rows (bench_kernels.py --only prefill), then workload A on
#           llama-3.1-8b FP8 + int8 KV and qwen3-0.6b int8 KV, 32 x 8k and 8 x 40k prompts on the 8B with
#           MINFER_STAGE_8BIT_PREFILL 0 and 1 in turn (STAGE_ORDER; STAGE_RUNS: which of "A8b Aqwen long8k long40k";
#           STAGE_NO_TESTS / STAGE_NO_KERNELS=1: without the tests / the kernel table). All of it passes one call's
#           ten minutes: e.g. STAGE_RUNS="A8b Aqwen" first, then STAGE_NO_TESTS=1 STAGE_NO_KERNELS=1
#           STAGE_RUNS="long8k long40k"     -> $OUT/stage_compiles.md, $OUT/stage_kernels.md, $OUT/stage.md
# overlap:  whether two half batches on two streams beat the whole batch on llama-3.1-8b's FP8 layers at 256
#           sequences (dev/overlap_probe.py; bf16 and int8 caches)                       -> $OUT/overlap.md
# moe:      the MoE decode kernels' gpu tests, and the kernels at the MoE shapes against candidate configs, each kernel
#           timed (dev/moe_decode_sweep.py; MOE_ARGS="--tokens 1,8" as measured)   -> moe_decode.md
# onetoken: the one-token MoE layout (router launch keeping the normed row, decode kernels under PDL): its gpu tests,
#           then benchmarks/ab_compare.sh against the old tree in $AB_OLD (default .ab_old): batch 1 on the MoE shapes
#           ($B1_SHAPES) and on llama-3.2-1b (RESULTS.md, "continued without a device"). The old tree travels inside the carried .whl: `mkdir -p .whl/ab_old && git archive a133d18 minfer
#           benchmarks pyproject.toml | tar -x -C .whl/ab_old`, then AB_OLD=.whl/ab_old     -> $OUT/ab.md
#           Before it, batch 1 on llama-3.2-1b with MINFER_FUSED_ROPE_STORE=0 / 1 (the default: rotary and the KV
#           store in the qkv launch, gemv_epilogue.py), twice                              -> $OUT/onetoken.md
#           (about 8 minutes: its own call; policyA in another)
# policyA:  workload A on qwen3-0.6b and llama-3.1-8b under fcfs and prefill-first (the default policy),
#           which the serving runs compared but the offline workload never did                 -> $OUT/policyA.md
# serve:    the scheduler policies (benchmarks/serve_policies.sh) at 64 and 256 clients (POLICIES="fcfs prefill-first"
#           as measured)                                                              -> $OUT/policies.md
# streams:  the batch-1 weight streams' K loops pipelined (gemv_config.STREAM_STAGES: cp.async copies ahead): the gemv,
#           FP8 and MoE decode gpu tests with MINFER_STREAM_STAGES=3 (the default configs pipelined), batch 1 on
#           llama-3.2-1b, llama-3.1-8b FP8 and qwen3-30b-a3b at each depth of STREAM_DEPTHS (default "1 3"), then the
#           gemv at llama-3.1-8b's projections at depth 1 and 3 (bench_fp8.py --only gemv: bf16 and e4m3)
#           (STREAMS_NO_TESTS=1: without the tests, e.g. after base in the same call)
#           -> $OUT/streams_gemv.md, $OUT/streams.md
# streamsweep: the same loops' configs swept over depths 1-4: bench_fp8.py --sweep --only gemv (bf16 and e4m3), the
#           llama-3.2-1b chain (gemv_chain.py, one projection at a time) and the MoE decode kernels at T=1
#           (dev/moe_decode_sweep.py)              -> $OUT/streams_sweep.md, $OUT/streams_chain.md, $OUT/moe_decode.md
# extras:   decode attention B=1 x 32k over split counts, and the FP8 / bf16 gemv at gate_up under ncu
#           (dev/ncu_gemv.py; NCU_DEPTHS="1 3": at each K-loop depth)      -> $OUT/decode32k.md, $OUT/ncu_gemv*.txt
# The figures and their commands go to benchmarks/RESULTS.md ("Performance round (issue 42)").
DEADLINE_DEFAULT=570
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-base}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null;
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/gpu.txt"
BENCH_CAP="${BENCH_CAP:-120}"

case " $PARTS " in *" base "*)
  bench A_qwen3-0.6b --shape qwen3-0.6b
  bench A_llama-3.2-1b --shape llama-3.2-1b
  bench b1_llama-3.2-1b --shape llama-3.2-1b --batch1
  bench A_8b_bf16 --shape llama-3.1-8b
  bench A_8b_fp8 --shape llama-3.1-8b --quantization fp8
  bench A_8b_fp8_int8kv --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype int8
  bench b1_8b_fp8 --shape llama-3.1-8b --quantization fp8 --batch1
  bench b16_8b_fp8 --shape llama-3.1-8b --quantization fp8 --num-prompts 16 --input-len 128 --output-len 512
  bench b1_qwen3-30b-a3b --shape qwen3-30b-a3b --batch1
  bench_table base.md
  echo "== decode attention B=1 x 32k ($(left) s left)"
  timeout "$(cap 90)" "$PY" benchmarks/sweep_decode_sm90.py --kv-dtype auto --batch 1 --ctx 32768 \
    > "$OUT/decode32k.md" 2>&1 || echo "   exit $?"
  grep "^|\|Error" "$OUT/decode32k.md" | head -12 ;;
esac
case " $PARTS " in *" profile "*)
  for s in qwen3-0.6b; do
    echo "== step timeline $s ($(left) s left)"
    timeout "$(cap 100)" "$PY" dev/step_timeline.py --shape "$s" --out "$OUT/timeline_$s.md" > "$OUT/timeline_$s.log" 2>&1 \
      || echo "   exit $?"
    cat "$OUT/timeline_$s.md" 2>/dev/null
  done
  [ -n "${TIMELINE_ONLY:-}" ] || {
  echo "== decode-step profile qwen3-0.6b ($(left) s left)"
  (cd dev && timeout "$(cap 100)" "$PY" profile_steps.py --shape qwen3-0.6b --load-format dummy --steps 20 \
    --out "$OUT/profile_qwen3-0.6b.txt" > "$OUT/profile_qwen3-0.6b.log" 2>&1) || echo "   exit $?"
  head -40 "$OUT/profile_qwen3-0.6b.txt" 2>/dev/null
  for s in qwen3-30b-a3b; do
    echo "== batch-1 profile $s ($(left) s left)"
    (cd dev && timeout "$(cap 100)" "$PY" profile_steps.py --shape "$s" --batch1 --load-format dummy --steps 20 \
      --out "$OUT/profile_b1_$s.txt" > "$OUT/profile_b1_$s.log" 2>&1) || echo "   exit $?"
    head -30 "$OUT/profile_b1_$s.txt" 2>/dev/null
  done; }
  echo "== step timeline llama-3.2-1b ($(left) s left)"
  timeout "$(cap 100)" "$PY" dev/step_timeline.py --shape llama-3.2-1b --out "$OUT/timeline_llama-3.2-1b.md" \
    > "$OUT/timeline_llama-3.2-1b.log" 2>&1 || echo "   exit $?"
  cat "$OUT/timeline_llama-3.2-1b.md" 2>/dev/null ;;
esac
case " $PARTS " in *" profile8b "*)
  echo "== decode attention splits: the heuristic (auto) against its neighbours ($(left) s left)"
  for shape in "1 32768 auto,16,17" "4 4096 auto,4,5" "16 1024 auto,1,2"; do
    set -- $shape
    timeout "$(cap 60)" "$PY" benchmarks/sweep_decode_sm90.py --batch "$1" --ctx "$2" --splits "$3" 2>&1 \
      | grep "^|\|^B=\|Error" | grep -v "^|---\|^| impl"
  done | tee "$OUT/decode_splits.md"
  for v in "fp8:--quantization fp8" "fp8_int8kv:--quantization fp8 --kv-cache-dtype int8" "bf16:"; do
    name=${v%%:*}; args=${v#*:}
    echo "== step timeline llama-3.1-8b $name ($(left) s left)"
    timeout "$(cap 120)" "$PY" dev/step_timeline.py --shape llama-3.1-8b --load-format dummy $args \
      --out "$OUT/timeline_$name.md" > "$OUT/timeline_8b_$name.log" 2>&1 || echo "   exit $?"
    { echo "### $name"; cat "$OUT/timeline_$name.md" 2>/dev/null; } | tee -a "$OUT/timelines_8b.md"
    rm -f "$OUT/timeline_$name.md"
  done
  for v in "decode_fp8:--quantization fp8" "decode_fp8_int8kv:--quantization fp8 --kv-cache-dtype int8" \
           "prompt_fp8:--quantization fp8 --prompt-steps --steps 4"; do
    name=${v%%:*}; args=${v#*:}
    echo "== step profile llama-3.1-8b $name ($(left) s left)"
    (cd dev && timeout "$(cap 110)" "$PY" profile_steps.py --shape llama-3.1-8b --load-format dummy --steps 20 $args \
      --out "$OUT/profile_8b_$name.md" > "$OUT/profile_8b_$name.log" 2>&1) || echo "   exit $?"
    head -4 "$OUT/profile_8b_$name.md" 2>/dev/null
  done ;;
esac
case " $PARTS " in *" splitk "*)
  echo "== split-K GEMM gpu tests ($(left) s left)"
  timeout "$(cap 120)" "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/kernels/test_kernel_splitk_gemm.py \
    > "$OUT/splitk_tests.log" 2>&1; echo "   exit $?; $(tail -1 "$OUT/splitk_tests.log")"
  grep -E "^(FAILED|ERROR)|Error|rel err" "$OUT/splitk_tests.log" | head -20
  [ -z "${SPLITK_ENGINE_TESTS:-}" ] || { echo "== FP8 engine gpu tests ($(left) s left)"
    timeout "$(cap 150)" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_fp8_gpu.py \
      > "$OUT/fp8_engine_tests.log" 2>&1; echo "   exit $?; $(tail -1 "$OUT/fp8_engine_tests.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/fp8_engine_tests.log" | head -5; }
  [ -n "${SPLITK_NO_BENCH:-}" ] || {
  echo "== the decode-sized FP8 GEMMs: cuBLAS against split-K ($(left) s left)"
  timeout "$(cap 240)" "$PY" benchmarks/bench_decode_gemm.py --ms "${SPLITK_MS:-4,16,32,64,96,128,256}" \
    --out "$OUT/decode_gemm.md" > "$OUT/decode_gemm.log" 2>&1 || echo "   exit $?"
  grep -A10 "^| M | layer" "$OUT/decode_gemm.md" 2>/dev/null; grep -E "Error|error" "$OUT/decode_gemm.log" | head -5
  grep -E "M=[0-9]+: cuBLAS" "$OUT/decode_gemm.md" | cut -c1-260; }
  [ -n "${SPLITK_BENCH_ONLY:-}" ] || for f in 1 0; do  # a batch of 16 (decode at M = 16), then workload A
    export MINFER_FP8_SPLITK=$f
    bench "b16_8b_fp8_splitk$f" --shape llama-3.1-8b --quantization fp8 --num-prompts 16 --input-len 128 --output-len 512
  done
  [ -n "${SPLITK_BENCH_ONLY:-}" ] || for kv in ${SPLITK_KV:-auto int8}; do
    for f in 1 0; do
      export MINFER_FP8_SPLITK=$f
      bench "A_8b_fp8_kv${kv}_splitk$f" --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype "$kv"
    done
  done
  unset MINFER_FP8_SPLITK
  bench_table splitk.md ;;
esac
case " $PARTS " in *" stage "*)
  # first, on a cold Triton cache: no kernel may build after start-up (dev/compile_events.py lists each JIT miss)
  echo "== JIT misses after start-up, qwen3-0.6b int8 KV, staging on ($(left) s left)"
  MINFER_STAGE_8BIT_PREFILL=1 timeout "$(cap 120)" "$PY" dev/compile_events.py --shape qwen3-0.6b \
    --kv-cache-dtype int8 --load-format dummy --quiet > "$OUT/stage_compiles.log" 2>&1 || echo "   exit $?"
  sed -n '/kernel warm-up took/,$p' "$OUT/stage_compiles.log" | grep "JIT miss" | cut -c1-80 | sort | uniq -c \
    | tee "$OUT/stage_compiles.md"; grep -c "JIT miss" "$OUT/stage_compiles.log" | sed 's/^/   misses in all: /'
  [ -n "${STAGE_NO_TESTS:-}" ] || { echo "== staged 8-bit prefill gpu tests ($(left) s left)"
  timeout "$(cap 150)" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernel_kv_stage.py tests/engine/test_kv_quant.py \
    > "$OUT/stage_tests.log" 2>&1
  echo "   exit $?; $(tail -1 "$OUT/stage_tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/stage_tests.log" | head -8; }
  [ -n "${STAGE_NO_KERNELS:-}" ] || { echo "== 8k prefill kernels ($(left) s left)"
  timeout "$(cap 150)" "$PY" benchmarks/bench_kernels.py --only prefill --kv-dtypes auto,int8,fp8_e4m3 \
    > "$OUT/stage_kernels.log" 2>&1 || echo "   exit $?"
  grep -E "^\| (prefill|stage)|Error" "$OUT/stage_kernels.log" | tee "$OUT/stage_kernels.md"; }
  r=0
  runs=" ${STAGE_RUNS:-A8b Aqwen long8k long40k} "
  for f in ${STAGE_ORDER:-0 1}; do
    export MINFER_STAGE_8BIT_PREFILL=$f; r=$((r + 1))
    case $runs in *" A8b "*)
      bench "A_8b_fp8_int8kv_stage${f}_$r" --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype int8 ;; esac
    case $runs in *" Aqwen "*) bench "A_qwen3-0.6b_int8kv_stage${f}_$r" --shape qwen3-0.6b --kv-cache-dtype int8 ;; esac
    case $runs in *" long8k "*)  # long prompts, which stage: 32 x 8k in, 64 out
      bench "long_8b_fp8_int8kv_stage${f}_$r" --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype int8 \
        --num-prompts 32 --input-len 8192 --output-len 64 ;; esac
    case $runs in *" long40k "*)  # past the 16k token budget: later chunks stage their whole context
      bench "long40k_8b_fp8_int8kv_stage${f}_$r" --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype int8 \
        --num-prompts 8 --input-len 40000 --output-len 16 --max-model-len 40960 ;; esac
  done
  unset MINFER_STAGE_8BIT_PREFILL
  bench_table stage.md ;;
esac
case " $PARTS " in *" overlap "*)
  for kv in auto int8; do  # dev/overlap_probe.py: two half batches on two streams against the whole batch
    echo "== nano-batch overlap probe, KV $kv ($(left) s left)"
    timeout "$(cap 120)" "$PY" dev/overlap_probe.py --batch 256 --ctx 1024 --kv-dtype "$kv" \
      > "$OUT/overlap_$kv.log" 2>&1 || echo "   exit $?"
    grep "^|\|Error" "$OUT/overlap_$kv.log" | tee -a "$OUT/overlap.md"
  done ;;
esac
case " $PARTS " in *" moe "*)
  echo "== MoE decode gpu tests ($(left) s left)"
  timeout "$(cap 120)" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_kernel_moe_decode_gpu.py \
    > "$OUT/moe_tests.log" 2>&1; echo "   exit $?; $(tail -1 "$OUT/moe_tests.log")"
  echo "== MoE decode kernels ($(left) s left)"
  PYTHONPATH="$PYTHONPATH:$PWD" timeout "$(cap 200)" "$PY" dev/moe_decode_sweep.py ${MOE_ARGS:-} > "$OUT/moe_decode.md" 2>&1 \
    || echo "   exit $?"
  cat "$OUT/moe_decode.md" | head -80 ;;
esac
case " $PARTS " in *" onetoken "*)
  echo "== one-token and MoE decode gpu tests ($(left) s left)"
  timeout "$(cap 150)" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_one_token_forward.py \
    tests/kernels/test_kernel_moe_decode_gpu.py tests/kernels/test_kernel_pdl.py tests/kernels/test_kernel_gemv.py \
    > "$OUT/onetoken_tests.log" 2>&1
  echo "   exit $?; $(tail -1 "$OUT/onetoken_tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/onetoken_tests.log" | head -5
  for r in 1 2; do  # the rope-and-store epilogue in the qkv launch (gemv_epilogue.py), off then on, twice
    for f in 0 1; do MINFER_FUSED_ROPE_STORE=$f bench "b1_llama-3.2-1b_rope${f}_$r" --shape llama-3.2-1b --batch1; done
  done
  bench_table onetoken.md
  echo "== A/B against ${AB_OLD:-.ab_old} ($(left) s left)"
  OUT="$OUT/ab" ROUNDS="${ROUNDS:-1}" A_ROUNDS=0 B1_SHAPES="${B1_SHAPES:-qwen3-30b-a3b gpt-oss-20b qwen3.5-35b-a3b}" \
    timeout "$(cap 420)" bash benchmarks/ab_compare.sh "${AB_OLD:-.ab_old}"; cp "$OUT/ab/summary.md" "$OUT/ab.md" ;;
esac
case " $PARTS " in *" policyA "*)
  for shape in ${POLICY_SHAPES:-qwen3-0.6b llama-3.1-8b}; do
    for policy in fcfs prefill-first; do bench "A_${shape}_$policy" --shape "$shape" --scheduling-policy "$policy"; done
  done
  bench_table policyA.md ;;
esac
case " $PARTS " in *" streams "*)
  [ -n "${STREAMS_NO_TESTS:-}" ] || { echo "== gemv / FP8 / MoE decode gpu tests, K loops 3 deep ($(left) s left)"
  MINFER_STREAM_STAGES=3 timeout "$(cap 200)" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_kernel_gemv.py tests/kernels/test_kernel_fp8.py tests/kernels/test_kernel_moe_decode_gpu.py \
    > "$OUT/streams_tests.log" 2>&1
  echo "   exit $?; $(tail -1 "$OUT/streams_tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/streams_tests.log" | head -8; }
  r=0
  for d in ${STREAM_DEPTHS:-1 3}; do
    export MINFER_STREAM_STAGES=$d; r=$((r + 1))
    bench "b1_llama-3.2-1b_depth${d}_$r" --shape llama-3.2-1b --batch1
    bench "b1_8b_fp8_depth${d}_$r" --shape llama-3.1-8b --quantization fp8 --batch1
    bench "b1_qwen3-30b-a3b_depth${d}_$r" --shape qwen3-30b-a3b --batch1
  done
  unset MINFER_STREAM_STAGES
  bench_table streams.md
  for d in 1 3; do
    echo "== gemv at llama-3.1-8b's projections, depth $d ($(left) s left)"
    MINFER_STREAM_STAGES=$d timeout "$(cap 90)" "$PY" benchmarks/bench_fp8.py --only gemv > "$OUT/streams_gemv$d.log" 2>&1 \
      || echo "   exit $?"
    grep "^| \(qkv\|o\|gate_up\|down\)" "$OUT/streams_gemv$d.log" | sed "s/^/| $d /" | tee -a "$OUT/streams_gemv.md"
  done ;;
esac
case " $PARTS " in *" streamsweep "*)
  echo "== gemv configs over pipelining depths ($(left) s left)"
  timeout "$(cap 240)" "$PY" benchmarks/bench_fp8.py --sweep --only gemv > "$OUT/streams_sweep.log" 2>&1 || echo "   exit $?"
  grep -E "^\||BEST" "$OUT/streams_sweep.log" | tee "$OUT/streams_sweep.md"
  echo "== llama-3.2-1b gemv chain ($(left) s left)"
  timeout "$(cap 200)" "$PY" benchmarks/gemv_chain.py --shape llama-3.2-1b > "$OUT/streams_chain.log" 2>&1 || echo "   exit $?"
  grep -E "BEST|all best|defaults" "$OUT/streams_chain.log" | tee "$OUT/streams_chain.md"
  echo "== MoE decode kernels at T=1 ($(left) s left)"
  PYTHONPATH="$PYTHONPATH:$PWD" timeout "$(cap 120)" "$PY" dev/moe_decode_sweep.py --tokens 1 > "$OUT/moe_decode.md" 2>&1 \
    || echo "   exit $?"
  head -40 "$OUT/moe_decode.md" ;;
esac
case " $PARTS " in *" extras "*)
  echo "== decode attention B=1 x 32k, split counts ($(left) s left)"
  timeout "$(cap 90)" "$PY" benchmarks/sweep_decode_sm90.py --batch 1 --ctx 32768 --splits "${SPLITS:-16,24,33,48,64,96,132}" \
    > "$OUT/decode32k.md" 2>&1 || echo "   exit $?"
  grep "^|\|^B=\|Error" "$OUT/decode32k.md" | head -24
  for d in ${NCU_DEPTHS:-1}; do  # the K loop's pipelining depth (MINFER_STREAM_STAGES; NCU_DEPTHS="1 3" compares)
    echo "== ncu: the FP8 and bf16 gemv at gate_up, depth $d ($(left) s left)"
    MINFER_STREAM_STAGES=$d timeout "$(cap 150)" ncu --clock-control none --kernel-name regex:_gemv_kernel \
      --launch-skip 2 --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats "$PY" dev/ncu_gemv.py > "$OUT/ncu_gemv$d.txt" 2>&1 \
      || echo "   exit $?"
    grep -E "_gemv_kernel|Duration|Memory Throughput|DRAM Throughput|Stall|Issued Warp|Eligible|Active Warps|L2 Hit|L1/TEX Hit|Warp Cycles" \
      "$OUT/ncu_gemv$d.txt" | head -60
  done ;;
esac
case " $PARTS " in *" serve "*)
  bash benchmarks/serve_policies.sh ;;
esac
# Only a few files come back from the device: the tables stay, the logs and JSON go into one archive.
(cd "$OUT" && tar czf logs.tgz --remove-files $(ls -d *.log *.json *.txt ab 2>/dev/null | grep -v '^gpu.txt$') 2>/dev/null)
echo "done in $(( SECONDS - START )) s"
