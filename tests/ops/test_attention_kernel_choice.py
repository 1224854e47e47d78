"""The attention kernels are chosen once, by TritonOps: the Hopper kernels only where they apply (an sm_90 GPU,
Gluon, head_dim 64/128, pages >= 16, a measured Triton or the switch on); the Triton kernels elsewhere, and
whenever a Hopper kernel does not build."""

import pytest
import torch

from minfer.kernels.attention import decode_attention_sm90 as sm90_decode
from minfer.kernels.attention import gluon_sm90
from minfer.kernels.attention import prefill_attention_sm90 as sm90
from minfer.kernels.attention.decode_attention import paged_decode_attention
from minfer.kernels.attention.gluon_sm90 import BuildGuard
from minfer.kernels.attention.prefill_attention import paged_prefill_attention
from minfer.ops.triton_ops import TritonOps

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def small_batch(head_dim: int, dtype: torch.dtype) -> tuple:
    """A two-sequence prefill batch (a 20-row chunk over 40 tokens, a 7-token prompt) on pages of 16."""
    k_cache, v_cache = torch.randn(2, 6, 16, 2, head_dim, device=DEV).to(dtype).unbind(0)
    table = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([40, 7], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 20, 27], dtype=torch.int32, device=DEV)
    q = torch.randn(27, 4, head_dim, device=DEV).to(dtype)
    return q, k_cache, v_cache, table, qsl, lens, 20, head_dim ** -0.5


def decode_batch(head_dim: int, dtype: torch.dtype) -> tuple:
    """Three decodes (contexts 40, 7 and 1) on pages of 16."""
    k_cache, v_cache = torch.randn(2, 6, 16, 2, head_dim, device=DEV).to(dtype).unbind(0)
    table = torch.tensor([[4, 1, 5], [2, 0, 3], [3, 3, 3]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([40, 7, 1], dtype=torch.int32, device=DEV)
    q = torch.randn(3, 4, head_dim, device=DEV).to(dtype)
    return q, k_cache, v_cache, table, lens, head_dim ** -0.5


def test_the_cpu_takes_the_triton_kernels() -> None:
    assert not gluon_sm90.sm90_available(torch.device("cpu"), 128, 16)
    ops = TritonOps(torch.device("cpu"), 16, 128)
    assert ops.prefill_attention is paged_prefill_attention and ops.decode_attention is paged_decode_attention


@pytest.mark.parametrize("head_dim,block_size,mode,want", [
    (128, 16, "1", True), (64, 256, "1", True),  # the shapes it serves
    (32, 16, "1", False), (256, 16, "1", False), (128, 8, "1", False),  # the shapes it does not
    (128, 16, "0", False),  # switched off
])
def test_where_the_hopper_kernel_applies(monkeypatch: pytest.MonkeyPatch, head_dim: int, block_size: int,
                                         mode: str, want: bool) -> None:
    """On a (stood-in) sm_90 device: the shape rules and the switch."""
    monkeypatch.setattr(gluon_sm90, "_capable", lambda index: True)
    monkeypatch.setenv("MINFER_SM90_ATTENTION", mode)
    assert gluon_sm90.sm90_available(torch.device("cuda", 0), head_dim, block_size) is want


def test_by_default_only_on_the_measured_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gluon_sm90, "_capable", lambda index: True)
    monkeypatch.delenv("MINFER_SM90_ATTENTION", raising=False)
    monkeypatch.setattr(gluon_sm90.triton, "__version__", "3.6.0")
    assert gluon_sm90.sm90_available(torch.device("cuda", 0), 128, 16)
    monkeypatch.setattr(gluon_sm90.triton, "__version__", "3.9.0")
    assert not gluon_sm90.sm90_available(torch.device("cuda", 0), 128, 16)


def test_the_fallback_computes_the_same() -> None:
    """Called where they do not apply (head_dim 32), the Hopper entry points hand the call to the Triton kernels."""
    args = small_batch(32, torch.float32)
    assert torch.equal(sm90.paged_prefill_attention_sm90(*args), paged_prefill_attention(*args))
    args = decode_batch(32, torch.float32)
    assert torch.equal(sm90_decode.paged_decode_attention_sm90(*args), paged_decode_attention(*args))


def test_the_fallback_keeps_the_sinks() -> None:
    """Attention sinks (gpt-oss) reach the Triton kernel through the fallback too: a bug there would drop them."""
    sinks = 2 * torch.randn(4, device=DEV)
    for hopper, triton_kernel, args in ((sm90.paged_prefill_attention_sm90, paged_prefill_attention, small_batch),
                                        (sm90_decode.paged_decode_attention_sm90, paged_decode_attention, decode_batch)):
        args = args(32, torch.float32)
        got = hopper(*args, sinks=sinks)
        assert torch.equal(got, triton_kernel(*args, sinks=sinks)) and not torch.equal(got, triton_kernel(*args))


class Unbuildable:
    """A kernel whose launch fails as a Gluon API missing from the installed Triton would."""

    def __init__(self) -> None:
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1
            raise TypeError("an API this Triton does not have")
        return launch


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_kernel_that_fails_to_build_falls_back(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                  kind: str) -> None:
    """Gluon is experimental: if a Hopper kernel does not build on the installed Triton, attention keeps
    working on the Triton kernel, says so once, and does not try again."""
    kernel = Unbuildable()
    if kind == "prefill":
        module, name, args, triton_kernel = sm90, "_prefill_sm90_kernel", small_batch(64, torch.bfloat16), \
            paged_prefill_attention
        monkeypatch.setattr(sm90, "sm90_available", lambda *a: True)
    else:
        module, name, args, triton_kernel = sm90_decode, "_decode_sm90_kernel", decode_batch(64, torch.bfloat16), \
            paged_decode_attention
        monkeypatch.setattr(sm90_decode, "sm90_decode_applies", lambda *a: True)
    monkeypatch.setattr(module, name, kernel)
    monkeypatch.setattr(module, "_guard", BuildGuard(kind))
    with caplog.at_level("WARNING", logger="minfer"):
        first = getattr(module, f"paged_{kind}_attention_sm90")(*args)
        second = getattr(module, f"paged_{kind}_attention_sm90")(*args)
    want = triton_kernel(*args)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert kernel.calls == 1 and module._guard.failed == {False}
    assert sum("failed to build" in r.getMessage() for r in caplog.records) == 1
