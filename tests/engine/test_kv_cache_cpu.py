"""The CPU KV cache: sized for what the run can hold, with pages resident only as they fill."""
from __future__ import annotations

import torch

from minfer import LLM
from minfer.config import cdiv
from minfer.engine.kv_cache import KVCacheSpec, allocate_kv_cache, lazy_zeros


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _Layer:
    k_cache = v_cache = k_scale = v_scale = None


def test_lazy_zeros_commit_no_memory_until_written() -> None:
    before = _resident_bytes()
    t = lazy_zeros((256, 1024, 1024), torch.float32)  # 1 GiB
    assert _resident_bytes() - before < 64 << 20
    assert t.shape == (256, 1024, 1024) and t.dtype == torch.float32
    assert t[7].abs().sum().item() == 0 and t[-1, -1, -1].item() == 0
    t[3] = 1.5
    assert t[3].sum().item() == 1.5 * 1024 * 1024 and t[4].sum().item() == 0


def test_cpu_cache_is_zeroed_and_lazy_in_every_format() -> None:
    for fmt in ("auto", "int8", "fp8_e4m3"):
        spec = KVCacheSpec(4, 16, 2, 64, torch.float32) if fmt == "auto" else \
            KVCacheSpec(4, 16, 2, 64, torch.int8 if fmt == "int8" else torch.float8_e4m3fn, torch.float32, fmt)
        layers = [_Layer() for _ in range(4)]
        before = _resident_bytes()
        allocate_kv_cache(layers, spec, 8192, torch.device("cpu"))  # 4 layers x 2 x 64 MiB (float32)
        assert _resident_bytes() - before < 64 << 20
        for layer in layers:
            assert layer.k_cache.shape == (8192, 16, 2, 64)
            assert not layer.v_cache[100].view(torch.uint8).any()
            if spec.quantized:
                assert layer.k_scale.shape == (8192, 2, 16) and not layer.k_scale.any()


def test_cpu_default_cache_fits_the_run(checkpoints) -> None:
    """max_num_seqs sequences of max_model_len tokens, not a fixed size."""
    llm = LLM(str(checkpoints["llama3"]), max_num_seqs=3, max_model_len=100, block_size=16)
    assert llm.get_stats()["num_kv_blocks"] == 3 * cdiv(100, 16)
