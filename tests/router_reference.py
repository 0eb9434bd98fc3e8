"""The softmax router's torch ops (``TopKRouter`` then ``pad_routes``), the reference of the fused router
top-k kernel's tests (interpreter and CUDA)."""

from __future__ import annotations

import torch


def torch_route(logits: torch.Tensor, k: int, renorm: bool, valid: torch.Tensor | None = None):
    """``logits [T, E] -> (ids [T, k] int64, weights [T, k] in logits.dtype)``: softmax in float32, top-k,
    optional renormalization, cast; rows where ``valid [T]`` is false route like row 0 with weight 0."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w.to(logits.dtype)
    if valid is not None:
        keep = valid[:, None]
        ids, w = torch.where(keep, ids, ids[:1]), w * keep.to(w.dtype)
    return ids, w
