"""CUDA checks of the fused router top-k (``edgemoe.kernels.router_topk.topk_softmax``) against the
torch ops of ``TopKRouter`` on CUDA: ids identical, weights bitwise (the kernel sums and divides in the
order of PyTorch's warp softmax and reduction kernels, with libdevice's ``expf``), the padding rows of a
captured batch, the router module taking the kernel, CUDA-graph capture, and the launch time against
the torch ops.

Measured numbers are printed (run with ``-s``) and, when ``$OUT`` is set, appended as JSON lines to
``$OUT/router_topk_gpu.jsonl``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("triton")

from perf import capture, replay_us, report  # noqa: E402
from router_reference import torch_route  # noqa: E402

from edgemoe.kernels.router_topk import topk_softmax  # noqa: E402


def _report(name: str, **values) -> None:
    report("router_topk_gpu.jsonl", name, **values)


CUDA = torch.device("cuda")


def distinct_logits(T, E, dtype, g):
    """``[T, E]`` logits without ties (exact in bfloat16), shuffled per row, spread like router logits."""
    rows = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float()
    return ((rows - E // 2) / 16).to(dtype).to(CUDA)


def ulps(a, b):
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return (a.view(view).long() - b.view(view).long()).abs()


# float32 logits: the weights are not rounded back to 16 bits, so the order of torch's float32 softmax
# kernel (not the one emulated) shows, by up to 2 ulps on the GPU host; the router keeps the torch ops there
@pytest.mark.parametrize("dtype,max_ulps", [(torch.bfloat16, 0), (torch.float16, 0), (torch.float32, 4)])
def test_topk_softmax_equals_the_torch_ops_on_cuda(dtype, max_ulps):
    g = torch.Generator().manual_seed(0)
    worst, differ, total = 0, 0, 0
    for E in (8, 128, 160, 256, 512):
        for k in (1, 2, 6, 8, 32):
            if k > E:
                continue
            for T in (1, 5, 64):
                for renorm in (False, True):
                    for padded in (False, True):
                        logits = distinct_logits(T, E, dtype, g)
                        valid = (torch.arange(T, device=CUDA) < max(1, T - 2)) if padded else None
                        ids, w = topk_softmax(logits, k, renorm, valid)
                        ref_ids, ref_w = torch_route(logits, k, renorm, valid)
                        assert torch.equal(ids, ref_ids), (E, k, T, renorm, padded)
                        u = ulps(w, ref_w)
                        worst, differ, total = max(worst, int(u.max())), differ + int((u > 0).sum()), total + u.numel()
    _report("topk_softmax_vs_torch", dtype=str(dtype), max_ulps=worst, weights_differing=differ, weights=total)
    assert worst <= max_ulps, f"{differ} of {total} weights differ, by up to {worst} ulps"


def test_topk_softmax_on_router_like_logits():
    """Gaussian logits from a real-sized router GEMV (bfloat16, ties possible): ids equal where the k-th
    and (k+1)-th logits differ, weights bitwise."""
    g = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(64, 2048, device=CUDA, generator=g).to(torch.bfloat16)
    w_router = (torch.randn(128, 2048, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    logits = x @ w_router.T
    for renorm in (False, True):
        ids, w = topk_softmax(logits, 8, renorm)
        ref_ids, ref_w = torch_route(logits, 8, renorm)
        top9 = logits.float().sort(dim=-1, descending=True).values[:, :9]
        clean = (top9[:, 1:] != top9[:, :-1]).all(dim=-1)  # no tie inside the top 9
        assert clean.sum() > 32
        assert torch.equal(ids[clean], ref_ids[clean]) and torch.equal(w[clean], ref_w[clean])


def test_router_module_takes_the_kernel_and_pads():
    from edgemoe.layers.moe import TopKRouter

    class Cfg:  # the fields TopKRouter reads
        num_experts, hidden_size, top_k, norm_topk_prob = 128, 256, 8, True

    router = TopKRouter(Cfg()).to(CUDA, torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_(0, 0.05)
    x = torch.randn(64, 256, device=CUDA).to(torch.bfloat16)
    valid = torch.arange(64, device=CUDA) < 24
    logits = torch.nn.functional.linear(x, router.weight)
    top9 = logits.float().sort(dim=-1, descending=True).values[:, :9]
    clean = (top9[:, 1:] != top9[:, :-1]).all(dim=-1)  # bfloat16 logits tie often: a tie's order is free
    for v in (None, valid):
        ids, w = router(x, v)
        ref_ids, ref_w = torch_route(logits, 8, True, v)
        rows = clean if v is None else torch.where(v, clean, clean[0])  # padding rows route like row 0
        assert rows.sum() > 8
        assert torch.equal(ids[rows], ref_ids[rows]) and torch.equal(w[rows], ref_w[rows])


def test_topk_softmax_in_a_cuda_graph_and_its_time():
    g = torch.Generator().manual_seed(2)
    logits = distinct_logits(1, 128, torch.bfloat16, g)
    valid = torch.ones(1, dtype=torch.bool, device=CUDA)
    (fused, ref), (out, ref_out) = capture(lambda: topk_softmax(logits, 8, True, valid),
                                           lambda: torch_route(logits, 8, True, valid))
    logits.copy_(distinct_logits(1, 128, torch.bfloat16, g))
    fused.replay()
    ref.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], ref_out[0]) and torch.equal(out[1], ref_out[1])
    _report("topk_softmax_graph_us", fused_us=replay_us(fused), torch_ops_us=replay_us(ref))
