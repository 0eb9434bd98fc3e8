"""The CPU expert executor: computes routed experts in place from the host pool (DESIGN.md §2).

This is the torch-ops executor (one GEMM pair per expert, intra-op threads set by
``--cpu-threads``). A native bandwidth-bound kernel plugs in behind the same ``run`` interface.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgemoe.experts.pool import HostExpertPool


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One routed expert: ``down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[n, H]`` tokens routed to the expert, in the weights' dtype.
        w13: ``[2I, H]`` gate rows then up rows. w2: ``[H, I]``.

    Returns:
        ``[n, H]`` in the weights' dtype (reference: ``Qwen3MoeExperts.forward``).
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w2)  # [n, H]


class TorchCpuExecutor:
    """Runs a set of experts on the CPU with torch ops, weights read from the host pool.

    Args:
        pool: the host expert pool (source of ``w13``/``w2`` rows).
        threads: intra-op threads for the CPU branch (``None`` keeps torch's setting).
    """

    name = "torch"

    def __init__(self, pool: HostExpertPool, threads: int | None = None):
        self.pool = pool
        if threads:
            torch.set_num_threads(int(threads))
        self.threads = torch.get_num_threads()

    def run(self, x: torch.Tensor, work: list[tuple[int, torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
        """Accumulate ``Σ weight · expert(x[token])`` into ``out``.

        Args:
            x: ``[T, H]`` hidden states on the CPU (any float dtype).
            work: per expert ``(flat_id, token_idx [n] int64, weight [n] float)``.
            out: ``[T, H]`` float32 CPU accumulator (added to, not overwritten).
        """
        w13, w2 = self.pool.w13, self.pool.w2
        xd = x.to(w13.dtype)
        for fid, tok, wt in work:
            y = swiglu_expert(xd.index_select(0, tok), w13[fid], w2[fid])  # [n, H]
            out.index_add_(0, tok, (y * wt.to(y.dtype)[:, None]).float())
