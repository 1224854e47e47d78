"""Fused Gumbel-argmax sampling kernel (interpreter on CPU) against the sampler's torch reference."""
from __future__ import annotations

import pytest
import torch

from minfer.engine.sampler import row_hash, uniform_noise
from minfer.kernels.sampling import greedy_argmax, gumbel_argmax


@pytest.mark.parametrize("rows,vocab", [(3, 1000), (5, 5003)])
def test_gumbel_argmax_matches_reference(rows, vocab):
    torch.manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab) * 3
    logits[0, 7] = float("-inf")  # masked tokens are never drawn
    seeds = torch.randint(0, 2**62, (rows,), dtype=torch.int64)
    counters = torch.randint(0, 1000, (rows,), dtype=torch.int64)
    temps = torch.rand(rows) + 0.3
    got = gumbel_argmax(logits, row_hash(seeds, counters), 1 / temps, block=512)
    score = logits / temps[:, None] - torch.log(-torch.log(uniform_noise(seeds, counters, vocab)))
    ref = score.argmax(-1)
    picked = score.gather(-1, got[:, None]).squeeze(-1)
    assert torch.all(score.max(-1).values - picked <= 1e-5)  # the kernel's pick is the reference's max
    assert int((got == ref).sum()) == rows


@pytest.mark.parametrize("rows,vocab,block", [(1, 5003, 256), (3, 1000, 128), (2, 70, 64)])
def test_greedy_argmax_matches_torch(rows, vocab, block):
    """Chunked over the vocabulary (one row: many chunks); ties resolve to the lowest id, like torch."""
    torch.manual_seed(vocab)
    logits = torch.randn(rows, vocab)
    logits[0, vocab - 1] = logits[0, 3] = 50.0  # a tie across chunks: the first one wins
    if rows > 1:
        logits[1, :] = float("-inf")
        logits[1, vocab // 2] = 0.0
    got = greedy_argmax(logits, block=block)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(-1))
    assert int(got[0]) == 3


def test_argmax_kernels_return_a_real_token_for_rows_without_a_finite_score():
    """A row of NaN (a broken model) or of -inf (everything masked) still yields an id inside the vocabulary:
    one past it (the kernels' old "no winner" value) would fault the embedding lookup of the next step and take
    the engine down. A NaN among finite scores is passed over."""
    vocab = 1000
    logits = torch.randn(4, vocab)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[2, ::3] = float("nan")
    for got in (greedy_argmax(logits, block=128),
                gumbel_argmax(logits, row_hash(torch.arange(4), torch.zeros(4, dtype=torch.int64)),
                              torch.ones(4), block=128)):
        assert torch.all((got >= 0) & (got < vocab)), got
    greedy = greedy_argmax(logits, block=128)
    assert greedy[0] == 0 and greedy[1] == 0
    finite = logits[2].nan_to_num(float("-inf"))
    assert greedy[2] == finite.argmax() and greedy[3] == logits[3].argmax()


@pytest.mark.gpu
def test_greedy_argmax_on_gpu_matches_torch():
    for rows in (1, 7, 256):
        logits = torch.randn(rows, 128256, device="cuda") * 3
        assert torch.equal(greedy_argmax(logits), logits.argmax(-1))


@pytest.mark.gpu
def test_gumbel_argmax_on_gpu_matches_reference():
    rows, vocab = 64, 151936
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab) * 3).cuda()
    seeds = torch.randint(0, 2**62, (rows,), dtype=torch.int64).cuda()
    counters = torch.randint(0, 1000, (rows,), dtype=torch.int64).cuda()
    temps = (torch.rand(rows) + 0.3).cuda()
    got = gumbel_argmax(logits, row_hash(seeds, counters), 1 / temps)
    score = logits / temps[:, None] - torch.log(-torch.log(uniform_noise(seeds, counters, vocab)))
    picked = score.gather(-1, got[:, None]).squeeze(-1)
    assert torch.all(score.max(-1).values - picked <= 1e-4)


def test_argmax_kernels_read_bfloat16_logits_exactly():
    """The engine hands the model-dtype logits straight to the kernels (no float32 copy): each value
    converts exactly, so the draws equal those on the float32 logits."""
    torch.manual_seed(1)
    logits = (torch.randn(3, 3000) * 4).bfloat16()
    seeds = torch.randint(0, 2**62, (3,), dtype=torch.int64)
    hashes = row_hash(seeds, torch.tensor([0, 5, 9]))
    inv_temps = 1 / torch.tensor([0.5, 1.0, 1.7])
    assert torch.equal(gumbel_argmax(logits, hashes, inv_temps, block=512),
                       gumbel_argmax(logits.float(), hashes, inv_temps, block=512))
    assert torch.equal(greedy_argmax(logits, block=256), logits.float().argmax(-1))
