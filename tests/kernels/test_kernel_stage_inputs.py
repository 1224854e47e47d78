"""The CUDA-graph input staging kernel (interpreter on CPU) against its torch reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minfer.kernels.stage_inputs import pack_decode_inputs, packed_words, stage_decode_inputs, stage_decode_inputs_ref


def _buffers(rows: int, max_width: int, groups: int = 1) -> list[torch.Tensor]:
    """Static buffers full of stale values (a previous, larger step's), as a graph's are between replays."""
    g = torch.Generator().manual_seed(rows)
    return [torch.randint(0, 1000, (rows,), generator=g), torch.randint(0, 1000, (rows,), generator=g),
            torch.randint(0, 1000, (groups, rows), generator=g), torch.randint(1, 1000, (rows,), generator=g).int(),
            torch.randint(0, 1000, (groups, rows, max_width), generator=g).int()]


@pytest.mark.parametrize("n,rows,width,pending,groups", [(1, 1, 3, True, 1), (3, 8, 300, True, 1),
                                                         (5, 8, 1, False, 1), (8, 8, 129, True, 1),
                                                         (3, 8, 130, True, 3)])
def test_staging_kernel_matches_reference(n, rows, width, pending, groups):
    rng = np.random.default_rng(n * width)
    ids = rng.integers(0, 50_000, n)
    src_rows = np.where(rng.random(n) < 0.5, rng.integers(0, 4, n), -1) if pending else np.full(n, -1)
    arrays = (ids, rng.integers(0, 4096, n), rng.integers(0, 10**6, (groups, n)), src_rows,
              rng.integers(1, 4096, n).astype(np.int32),
              rng.integers(0, 10**5, (groups, n, width)).astype(np.int32))
    packed = np.zeros(packed_words(n, width, groups), dtype=np.int64)
    pack_decode_inputs(packed, *arrays)
    prev = torch.tensor([70_001, 70_002, 70_003, 70_004])
    got, want = _buffers(rows, 320, groups), _buffers(rows, 320, groups)
    stage_decode_inputs(torch.from_numpy(packed), n, width, prev if pending else None, *got)
    stage_decode_inputs_ref(torch.from_numpy(packed), n, width, prev if pending else None, *want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    ids_out, _, slots_out, ctx_out, tables_out = got
    assert torch.equal(ids_out[:n], torch.where(torch.from_numpy(src_rows) >= 0,
                                                prev[torch.from_numpy(src_rows).clamp(min=0)], torch.from_numpy(ids)))
    assert torch.equal(tables_out[:, :n, :width], torch.from_numpy(arrays[-1]))
    assert torch.equal(slots_out[:, :n], torch.from_numpy(arrays[2]))
    assert bool((slots_out[:, n:] == -1).all()) and bool((ctx_out[n:] == 1).all())  # padding rows


def test_staging_rejects_a_step_larger_than_the_buffers():
    bufs = _buffers(4, 8)
    with pytest.raises(ValueError, match="do not fit"):
        stage_decode_inputs(torch.zeros(packed_words(5, 8), dtype=torch.int64), 5, 8, None, *bufs)
    with pytest.raises(ValueError, match="do not fit"):
        stage_decode_inputs(torch.zeros(packed_words(2, 9), dtype=torch.int64), 2, 9, None, *bufs)
