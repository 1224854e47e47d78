#!/usr/bin/env bash
# Structured outputs on one H200, in one device call that ends within ~9.5 minutes (DEADLINE seconds):
#
#   bash benchmarks/fetch_server_wheels.sh      # here, once: xgrammar, apache-tvm-ffi, jsonschema, ... into .whl/
#   PARTS="mask throughput tests" bash benchmarks/gpu_structured.sh     # on the device, carrying .whl
#
# mask:       benchmarks/bench_structured.py --mask-cost (bitmask fill on the host at batch 1/64/256 over a
#             128k vocabulary; unpack + masked_fill on the GPU)            -> $OUT/structured_mask.md
# throughput: benchmarks/bench_structured.py --throughput --shape llama-3.1-8b (random weights drawn on the
#             device; 64 x 256 tokens under a JSON schema, default and compact whitespace, vs unconstrained;
#             TTFT cold / cached schema)                                   -> $OUT/structured_throughput.{md,json}
# tests:      tests/engine/test_structured_outputs.py on CUDA (the built-in model in bf16; informative: its
#             seeds were chosen on the CPU's float32 outputs)              -> $OUT/structured_tests.log
# The GPU machine's python3 has torch, triton, transformers, numpy but not xgrammar / apache-tvm-ffi / jsonschema:
# they come from the carried wheels.
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-mask throughput tests}"
[ "$WHEELS" = 1 ] || echo "no .whl/ carried: run benchmarks/fetch_server_wheels.sh and carry .whl"
{ nvidia-smi --query-gpu=name --format=csv,noheader; nproc; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"
python3 -c "import xgrammar, jsonschema, tvm_ffi; print('xgrammar', xgrammar.__file__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

case " $PARTS " in *" mask "*)
  echo "== mask cost ($(left) s left)"
  timeout "$(cap 150)" python3 benchmarks/bench_structured.py --mask-cost > "$OUT/structured_mask.log" 2>&1 \
    || echo "   exit $? (124: cut by the time limit)"
  grep -v "Warning:" "$OUT/structured_mask.log" | tail -20 ;;
esac
case " $PARTS " in *" throughput "*)
  echo "== throughput, llama-3.1-8b ($(left) s left)"
  timeout "$(cap 330)" python3 benchmarks/bench_structured.py --throughput --shape llama-3.1-8b \
    > "$OUT/structured_throughput.log" 2>&1 || echo "   exit $? (124: cut by the time limit)"
  grep -v "Warning:" "$OUT/structured_throughput.log" | tail -22 ;;
esac
case " $PARTS " in *" tests "*)
  echo "== tests on CUDA ($(left) s left)"
  timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider tests/engine/test_structured_outputs.py -rf \
    > "$OUT/structured_tests.log" 2>&1; echo "   exit $?; $(tail -1 "$OUT/structured_tests.log")"
  grep -E "^FAILED" "$OUT/structured_tests.log" | cut -c1-200 | head -20 ;;
esac
echo "done after $(( SECONDS - START )) s"
