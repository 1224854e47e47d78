"""Speculative decoding's verification: which drafted tokens the target keeps, and the token after them.

A sequence with k drafts d_1..d_k has k + 1 rows of target logits, row j judging d_{j+1} (row k only draws the
bonus token). A random row accepts d_{j+1} with probability min(1, p_j(d) / q_j(d)) and, at the first rejection,
draws from the residual max(p_j - q_j, 0) (Leviathan et al. 2023, Chen et al. 2023): each emitted token is then
distributed exactly as the target's own draw would be, whatever the draft proposed. An n-gram draft is a point
mass (q(d) = 1): accepting with probability p(d), its residual is p with d removed.

Everything here is batched on the device over all drafts at once; the host only lays out which row and which
output slot each draft belongs to (``SpecLayout``), from the draft counts it already knows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minfer.ops.torch_sampling import mix32, noise_from_row_hash

# Salts of the counter-based noise (sampler.row_hash): the acceptance uniforms and the draft model's draws each
# get their own stream at a row's (seed, output index), independent of each other and of the target's draws,
# which keep the plain sampler's unsalted stream (so a row with no drafts draws exactly what a plain step would).
ACCEPT_SALT = 0x5BD1E995
DRAFT_SALT = 0x2545F491


def salted(hashes: np.ndarray, salt: int) -> np.ndarray:
    """Another stream's row hashes from the plain ones (uint64 arrays holding 32-bit values)."""
    return mix32(hashes ^ np.uint64(salt))


@dataclass(slots=True)
class SpecLayout:
    """Where a verification's rows and drafts lie. Sequence s owns rows ``first_row[s]`` .. ``first_row[s] + k_s``;
    its drafts are consecutive in the flat draft arrays, and so are the rows that judge them (every row but a
    sequence's last), so draft i is judged by row ``draft_rows[i]``. Output slot s * width + j of the padded
    ``[S, width]`` token tensor holds sequence s's j-th emitted token (row ``first_row[s] + j`` drew it)."""

    spec_lens: np.ndarray  # [S] int64
    first_row: np.ndarray  # [S]
    draft_rows: np.ndarray  # [D]
    draft_slots: np.ndarray  # [D]: s * width + j of draft j + 1
    row_slots: np.ndarray  # [N]: s * width + j of row j
    width: int  # 1 + the most drafts of a sequence

    @classmethod
    def build(cls, spec_lens: np.ndarray) -> "SpecLayout":
        k = np.asarray(spec_lens, dtype=np.int64)
        rows_per_seq = k + 1
        first_row = np.cumsum(rows_per_seq) - rows_per_seq
        seq_of_row = np.repeat(np.arange(len(k)), rows_per_seq)
        j = np.arange(int(rows_per_seq.sum())) - first_row[seq_of_row]
        width = int(k.max(initial=0)) + 1
        row_slots = seq_of_row * width + j
        judges = j < k[seq_of_row]
        return cls(k, first_row, np.flatnonzero(judges), row_slots[judges], row_slots, width)


def target_probs(logits: torch.Tensor, inv_temps: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """p of the judging rows: the distribution the plain sampler draws from (``logits`` already filtered)."""
    return (logits.index_select(0, rows) * inv_temps.index_select(0, rows)[:, None]).softmax(-1)


def accepts(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept d with probability min(1, p(d) / q(d)): ``u < p/q``, written without the division so that q(d) = 0
    (a draft the draft could not draw) accepts wherever p allows it. ``q`` None: a point mass, q(d) = 1."""
    p_d = p.gather(1, draft_ids[:, None])[:, 0]
    q_d = q.gather(1, draft_ids[:, None])[:, 0] if q is not None else 1.0
    return u * q_d < p_d


def residual(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0), unnormalised (the draw is a Gumbel argmax over its log). Where it is all zeros (p == q, so
    a rejection never happens in exact arithmetic but rounding may still reach it) it is p itself."""
    if q is None:
        res = p.scatter(1, draft_ids[:, None], 0.0)
    else:
        res = (p - q).clamp_min_(0.0)
    return torch.where(res.sum(-1, keepdim=True) > 0, res, p)


def judge_drafts(logits: torch.Tensor, inv_temps: torch.Tensor, draft_rows: torch.Tensor, draft_ids: torch.Tensor,
                 draft_probs: torch.Tensor | None, accept_hashes: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The random rows' rejection step. ``logits``, ``inv_temps``: every row's filtered logits and 1 / T, as the
    plain sampler's Gumbel draw takes them; ``accept_hashes``: the judging rows' acceptance stream.

    Returns (each draft accepted [D] bool, the logits every row's final token is drawn from, their 1 / T): a
    judging row draws from its residual (used only if its draft is the first rejected), a last row from p
    itself, the bonus token, with the plain sampler's arguments."""
    p = target_probs(logits, inv_temps, draft_rows)
    u = noise_from_row_hash(accept_hashes, 1)[:, 0]
    accepted = accepts(p, draft_probs, draft_ids, u)
    final = logits.index_copy(0, draft_rows, residual(p, draft_probs, draft_ids).log())
    return accepted, final, inv_temps.index_fill(0, draft_rows, 1.0)


def emit(layout: SpecLayout, first_row: torch.Tensor, draft_slots: torch.Tensor, draft_ids: torch.Tensor,
         accepted: torch.Tensor, final_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's accepted prefix of drafts and the token its first unaccepted row drew: ``[S, width]``
    int64, padded with -1, and how many tokens each sequence emits ([S], 1 .. k_s + 1)."""
    num_seqs, width = len(layout.spec_lens), layout.width
    dev = draft_ids.device
    judged = torch.zeros(num_seqs * width, dtype=torch.int32, device=dev)
    judged.index_copy_(0, draft_slots, accepted.int())  # slot k_s is never a draft: the cumprod stops there
    num_accepted = judged.view(num_seqs, width).cumprod(1).sum(1)
    drafts = torch.full((num_seqs * width,), -1, dtype=torch.int64, device=dev)
    drafts.index_copy_(0, draft_slots, draft_ids)
    last = final_tokens.index_select(0, first_row + num_accepted)
    col = torch.arange(width, device=dev)[None, :]
    n = num_accepted[:, None]
    tokens = torch.where(col < n, drafts.view(num_seqs, width), torch.where(col == n, last[:, None], -1))
    return tokens, num_accepted + 1
