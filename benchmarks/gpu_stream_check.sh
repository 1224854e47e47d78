# The stream-K decode kernel (decode_stream.py) against the split kernel on one H200: workload A's context
# mixes, equal contexts at B=64 x 4096 (bf16 and 8-bit caches) and batch 1. Tables under $OUT/stream.md.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
B=benchmarks/bench_decode_splits.py
{
echo "## qwen3 heads, workload A mixes"; timeout 150 python3 $B --heads 16/8/128 --splits 1 --stream 2,4,6
echo "## 8B heads, B=64 x 4096, bf16"; timeout 40 python3 $B --heads 32/8/128 --equal 64x4096 --splits 1 --stream 2,4
for kv in int8 fp8_e4m3; do echo "## 8B heads, B=64 x 4096, $kv"; timeout 40 python3 $B --heads 32/8/128 --equal 64x4096 --splits 2 --stream 2,4 --kv-dtype $kv; done
echo "## 8B heads, B=1 x 32768, bf16"; timeout 40 python3 $B --heads 32/8/128 --equal 1x32768 --splits 64 --stream 2,4
echo "## llama-1b heads, B=1 x 256 (split 16 = the engine's at max_model_len 4096)"; timeout 40 python3 $B --heads 32/8/64 --equal 1x256 --splits 4,16 --stream 2,4
} 2>&1 | grep -v Warn | tee $OUT/stream.md
