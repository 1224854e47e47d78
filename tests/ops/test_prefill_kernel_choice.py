"""The prefill attention kernel is chosen once, by TritonOps: the Hopper kernel only where it applies
(an sm_90 GPU, Gluon, head_dim 64/128, pages >= 16, not turned off); the Triton kernel elsewhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton loads: TritonOps on the CPU runs interpreted

import pytest  # noqa: E402
import torch  # noqa: E402

from minfer.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from minfer.kernels.prefill_attention_sm90 import paged_prefill_attention_sm90, sm90_prefill_available  # noqa: E402
from minfer.ops.triton_ops import TritonOps  # noqa: E402


def test_cpu_takes_the_triton_kernel() -> None:
    assert not sm90_prefill_available(torch.device("cpu"), 128, 16)
    assert TritonOps(torch.device("cpu"), 16, 128).prefill_attention is paged_prefill_attention


@pytest.mark.parametrize("head_dim,block_size", [(32, 16), (256, 16), (128, 8)])
def test_shapes_outside_the_kernel(head_dim: int, block_size: int) -> None:
    assert not sm90_prefill_available(torch.device("cpu"), head_dim, block_size)


def test_the_fallback_computes_the_same() -> None:
    """Called where it does not apply (the CPU), the Hopper entry point hands the call to the Triton kernel."""
    k_cache, v_cache = torch.randn(2, 6, 16, 2, 32).unbind(0)
    table = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32)
    lens = torch.tensor([40, 7], dtype=torch.int32)
    qsl = torch.tensor([0, 20, 27], dtype=torch.int32)
    q = torch.randn(27, 4, 32)
    args = (q, k_cache, v_cache, table, qsl, lens, 20, 32 ** -0.5)
    assert torch.equal(paged_prefill_attention_sm90(*args), paged_prefill_attention(*args))


def test_a_kernel_that_fails_to_build_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Gluon is experimental: if the Hopper kernel does not build on the installed Triton, prefill keeps
    working on the Triton kernel, says so once, and does not try again."""
    from minfer.kernels import prefill_attention_sm90 as sm90

    class Unbuildable:
        calls = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Unbuildable.calls += 1
                raise TypeError("an API this Triton does not have")
            return launch

    monkeypatch.setattr(sm90, "sm90_prefill_available", lambda *a: True)
    monkeypatch.setattr(sm90, "_prefill_sm90_kernel", Unbuildable())
    monkeypatch.setattr(sm90, "_failed", set())
    monkeypatch.setattr(sm90, "_launched", set())
    k_cache, v_cache = torch.randn(2, 6, 16, 2, 64).to(torch.bfloat16).unbind(0)
    table = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32)
    lens = torch.tensor([40, 7], dtype=torch.int32)
    qsl = torch.tensor([0, 20, 27], dtype=torch.int32)
    q = torch.randn(27, 4, 64).to(torch.bfloat16)
    args = (q, k_cache, v_cache, table, qsl, lens, 20, 64 ** -0.5)
    with caplog.at_level("WARNING", logger="minfer"):
        first = sm90.paged_prefill_attention_sm90(*args)
        second = sm90.paged_prefill_attention_sm90(*args)
    want = paged_prefill_attention(*args)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert Unbuildable.calls == 1 and sm90._failed == {False}
    assert sum("failed to build" in r.getMessage() for r in caplog.records) == 1
