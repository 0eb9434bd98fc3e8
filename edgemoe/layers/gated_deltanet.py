"""Gated DeltaNet: the linear-attention layer of ``qwen3_5_moe`` (Yang et al. 2024, arXiv 2412.06464).

Per token, in-projections give a mixed ``q | k | v`` vector (through a depthwise causal conv1d of
``kernel`` taps and SiLU), an output gate ``z``, a write strength ``beta = sigmoid(b)`` and a log
decay ``g = -exp(A_log) * softplus(a + dt_bias)``. Each value head keeps a memory ``S [Dk, Dv]``
updated by the gated delta rule (q, k L2-normalized, q scaled by ``Dk ** -0.5``)::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t ⊗ (beta_t * (v_t - S_tᵀ k_t))
    o_t = S_tᵀ q_t

and the output is ``out_proj(gated_rmsnorm(o, z))``. Decode uses that recurrence directly; prefill
uses the chunked form (below). A sequence's conv inputs and memory persist between steps in the
runner's :class:`~edgemoe.kvcache.state.RecurrentStatePool`, so a prefill may start from an existing
state (chunked prefill, restored checkpoints). Reference: ``Qwen3_5MoeGatedDeltaNet`` in
``transformers`` (``modeling_qwen3_5_moe.py``).

On CUDA, the rule runs as the Triton kernels of ``edgemoe.kernels.gated_delta`` when that module is
importable (:func:`gated_delta_rule`); elsewhere as the torch functions here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.core import ForwardBatch, Phase
from edgemoe.kernels import kernel_module
from edgemoe.kvcache.state import RecurrentStatePool
from edgemoe.kvcache.state_checkpoints import StateCheckpointStore
from edgemoe.layers.linear import Linear
from edgemoe.layers.norm import GatedRMSNorm

CHUNK_SIZE = 64


def _prepare(query, key, value, g, beta, use_qk_l2norm: bool):
    """Float32 ``[B, H, T, D]`` / ``[B, H, T]`` views; q/k heads repeated to the value heads, optionally
    L2-normalized (eps 1e-6 inside the root, as FLA and the reference), q scaled by ``Dk ** -0.5``."""
    rep = value.shape[2] // key.shape[2]
    if rep > 1:  # q/k head i serves value heads [i * rep, (i + 1) * rep)
        query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (query, key, value))  # [B, H, T, D]
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()  # [B, H, T]
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                                 output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                 chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a sequence, chunk by chunk (prefill), in float32 torch ops.

    Within a chunk of ``C`` tokens, with ``G_i`` the cumulative log decay from the chunk start through
    token ``i`` and ``S_0`` the state entering the chunk, the delta rule's corrections
    ``u_i = beta_i (v_i - exp(G_i) S_0ᵀ k_i - Σ_{j<i} exp(G_i - G_j) (k_i·k_j) u_j)`` solve one
    unit-lower-triangular system ``(I + A) U = beta V - beta exp(G) K S_0`` with
    ``A_ij = beta_i exp(G_i - G_j) k_i·k_j`` (j < i) — the WY/UT form of chunked DeltaNet (Yang et
    al. 2024, arXiv 2406.06484; with gating, arXiv 2412.06464). Then
    ``O = (exp(G) Q) S_0 + ((Q Kᵀ) ∘ exp(G_i - G_j))_{j≤i} U`` and
    ``S_C = exp(G_C) S_0 + (exp(G_C - G) K)ᵀ U``. Chunks run in sequence, each starting from the
    previous one's state; the sequence is zero-padded to a multiple of ``C`` (padding has ``k = v = 0``
    and ``g = 0``, so it changes neither outputs nor the state).

    Args:
        query, key: ``[B, T, Hk, Dk]``; value: ``[B, T, Hv, Dv]`` with ``Hv`` a multiple of ``Hk`` (q/k
            head ``i`` serves value heads ``[i * Hv/Hk, (i + 1) * Hv/Hk)``).
        g: ``[B, T, Hv]`` log decay (``<= 0``); beta: ``[B, T, Hv]`` write strength.
        initial_state: ``[B, Hv, Dk, Dv]`` (any float dtype; used as float32) or ``None`` (zeros).
        output_final_state: return the state after token ``T - 1``.
        use_qk_l2norm_in_kernel: L2-normalize q and k per head first.
        chunk_size: ``C``.

    Returns:
        ``(out [B, T, Hv, Dv] in value.dtype, final_state [B, Hv, Dk, Dv] float32 or None)``; same
        contract as transformers' ``torch_chunk_gated_delta_rule``.
    """
    B, T, Hv, Dv = value.shape
    q, k, v, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    Dk, C = k.shape[-1], chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v = (x.reshape(B, Hv, N, C, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, D]
    G = g.reshape(B, Hv, N, C).cumsum(-1)  # [B, H, N, C]
    beta = beta.reshape(B, Hv, N, C)
    seen = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [C, C]: j <= i
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~seen, float("-inf")).exp()  # [B, H, N, C, C]
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # [B, H, N, C, C]: A
    system = lower + torch.eye(C, dtype=lower.dtype, device=lower.device)
    u_free = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False,
                                           unitriangular=True)  # [B, H, N, C, Dv]
    u_state = torch.linalg.solve_triangular(system, (beta * G.exp())[..., None] * k, upper=False,
                                            unitriangular=True)  # [B, H, N, C, Dk]
    scores = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    q_in = q * G.exp()[..., None]  # [B, H, N, C, Dk]: reads of the entering state
    k_out = k * (G[..., -1:] - G).exp()[..., None]  # [B, H, N, C, Dk]: writes decayed to the chunk end
    chunk_decay = G[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    S = (torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32, device=q.device) if initial_state is None
         else initial_state.float())  # [B, H, Dk, Dv]
    out = torch.empty_like(v)  # [B, H, N, C, Dv]
    for n in range(N):
        u = u_free[:, :, n] - u_state[:, :, n] @ S  # [B, H, C, Dv]
        out[:, :, n] = q_in[:, :, n] @ S + scores[:, :, n] @ u
        S = S * chunk_decay[:, :, n] + k_out[:, :, n].transpose(-1, -2) @ u
    out = out.reshape(B, Hv, N * C, Dv)[:, :, :T].transpose(1, 2).to(value.dtype)  # [B, T, H, Dv]
    return out.contiguous(), (S if output_final_state else None)


def recurrent_gated_delta_rule_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = True, use_qk_l2norm_in_kernel: bool = False,
                                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token (decode), in float32 torch ops.

    Same arguments and returns as :func:`chunk_gated_delta_rule_torch` (without ``chunk_size``);
    the recurrence of the module docstring (transformers' ``torch_recurrent_gated_delta_rule``).
    """
    B, T, Hv, Dv = value.shape
    q, k, v, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    S = (torch.zeros(B, Hv, k.shape[-1], Dv, dtype=torch.float32, device=q.device) if initial_state is None
         else initial_state.float())  # [B, H, Dk, Dv]
    out = torch.empty_like(v)  # [B, H, T, Dv]
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]  # [B, H, Dk]
        delta = (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)) * beta[:, :, t, None]  # [B, H, Dv]
        S = S + k_t[..., :, None] * delta[..., None, :]
        out[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], S)
    return out.transpose(1, 2).to(value.dtype).contiguous(), (S if output_final_state else None)


# On the H200 the Triton kernels gave wrong results at Dk = Dv = 16 (tests/gpu/test_gated_delta_gpu.py,
# 2026-11-30) while 24x40, 16x48, 32, 64 and 128 matched; below this the torch path runs.
MIN_KERNEL_HEAD_DIM = 16


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the gated delta rule from ``state``: the recurrent form for decode, the chunked one otherwise.

    Args:
        q, k: ``[B, T, Hv, Dk]`` (already repeated to the value heads); v: ``[B, T, Hv, Dv]``.
        g, beta: ``[B, T, Hv]``.
        state: ``[B, Hv, Dk, Dv]`` float32, the memory before token 0. The kernels' decode updates it in
            place (and returns it): pass a tensor the caller owns.
        decode: use the recurrent form (``T`` is 1 per sequence).

    Returns:
        ``(out [B, T, Hv, Dv] in v.dtype, new_state [B, Hv, Dk, Dv] float32)``. q/k are L2-normalized
        inside. CUDA tensors go to ``edgemoe.kernels.gated_delta`` when it imports and ``Dk, Dv <=
        MAX_HEAD_DIM`` (256, the kernels' limit) and both head dims exceed ``MIN_KERNEL_HEAD_DIM``, else the
        torch functions of this module.
    """
    kernels = kernel_module("gated_delta", q.device)
    dims = (k.shape[-1], v.shape[-1])
    if kernels is not None and min(dims) > MIN_KERNEL_HEAD_DIM and max(dims) <= kernels.MAX_HEAD_DIM:
        fn = kernels.fused_recurrent_gated_delta_rule if decode else kernels.chunk_gated_delta_rule
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    else:
        fn = recurrent_gated_delta_rule_torch if decode else chunk_gated_delta_rule_torch
    return fn(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


class GatedDeltaNet(nn.Module):
    """One gated DeltaNet layer over the batch; ``forward(x [T, H], batch) -> [T, H]``.

    Weight names match the checkpoint (``in_proj_qkv [2·Hk·Dk + Hv·Dv, H]``, ``in_proj_z [Hv·Dv, H]``,
    ``in_proj_b``/``in_proj_a [Hv, H]``, ``conv1d.weight [conv_dim, 1, kernel]``, ``dt_bias``/``A_log
    [Hv]``, ``norm.weight [Dv]``, ``out_proj [H, Hv·Dv]``). The layer reads and updates its state in
    ``self.state`` (a :class:`RecurrentStatePool` bound by the runner) at each sequence's
    ``SeqSlice.state_slot``; ``state_index`` is its ordinal among the linear-attention layers. A
    prefill sequence with ``SeqSlice.checkpoints`` runs the delta rule in pieces split at those offsets
    and saves its conv window and memory at each into ``self.checkpoints`` (a
    :class:`StateCheckpointStore` bound by the runner).
    """

    def __init__(self, cfg: ModelConfig, state_index: int):
        super().__init__()
        la = cfg.linear_attention
        self.num_k_heads, self.num_v_heads = la.num_key_heads, la.num_value_heads
        self.head_k_dim, self.head_v_dim = la.key_head_dim, la.value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads {self.num_k_heads}")
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = la.conv_kernel
        H = cfg.hidden_size
        self.in_proj_qkv = Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = Linear(H, self.value_dim, bias=False)
        self.in_proj_b = Linear(H, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(H, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, H, bias=False)
        self.state_index = state_index
        self.state: RecurrentStatePool | None = None  # bound by the model runner
        self.checkpoints: StateCheckpointStore | None = None  # bound by the runner when checkpoints are on

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU: ``window [B, C, W + t]`` (W = kernel - 1 past inputs) -> ``[B, C, t]``."""
        return F.silu(F.conv1d(window, self.conv1d.weight, groups=self.conv_dim))

    def _heads(self, mixed: torch.Tensor):
        """``mixed [B, t, C]`` -> q, k ``[B, t, Hv, Dk]`` (q/k heads repeated to value heads), v ``[B, t, Hv, Dv]``."""
        B, t = mixed.shape[:2]
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = q.reshape(B, t, self.num_k_heads, self.head_k_dim).repeat_interleave(rep, dim=2)
        k = k.reshape(B, t, self.num_k_heads, self.head_k_dim).repeat_interleave(rep, dim=2)
        return q, k, v.reshape(B, t, self.num_v_heads, self.head_v_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.in_proj_qkv(x)  # [T, C]
        z = self.in_proj_z(x).view(T, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        beta = torch.sigmoid(self.in_proj_b(x))  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv] float32
        conv_state = self.state.conv[self.state_index]  # [S, C, W]
        memory = self.state.recurrent[self.state_index]  # [S, Hv, Dk, Dv]
        # decode, one token per row: all rows at once. On the device path (batch.decode) a captured batch size
        # may add padding rows past batch.seqs; batch.state_slots gives them a scratch slot (and the
        # per-sequence branch below would bake Python slot numbers into a captured CUDA graph).
        if batch.phase is Phase.DECODE and (batch.decode is not None or T == len(batch.seqs)):
            slots = batch.state_slots  # [B]
            window = torch.cat((conv_state.index_select(0, slots), qkv[:, :, None]), dim=-1)  # [B, C, W + 1]
            conv_state.index_copy_(0, slots, window[..., 1:])
            q, k, v = self._heads(self._conv(window).transpose(1, 2))  # [B, 1, Hv, D]
            o, new = gated_delta_rule(q, k, v, g[:, None], beta[:, None], memory.index_select(0, slots), decode=True)
            memory.index_copy_(0, slots, new)
            o = o[:, 0]  # [B, Hv, Dv]
        else:  # prefill: each sequence's chunk continues its own conv inputs and memory (chunked form)
            o = torch.empty((T, self.num_v_heads, self.head_v_dim), dtype=x.dtype, device=x.device)
            W = self.kernel - 1
            for s in batch.seqs:
                rows, slot = slice(s.q_start, s.q_start + s.q_len), s.state_slot
                window = torch.cat((conv_state[slot], qkv[rows].t()), dim=-1)  # [C, W + t]
                conv_state[slot] = window[:, window.shape[1] - W:]
                q, k, v = self._heads(self._conv(window[None]).transpose(1, 2))  # [1, t, Hv, D]
                gs, bs = g[None, rows], beta[None, rows]  # [1, t, Hv]
                state, start = memory[slot:slot + 1], 0  # [1, Hv, Dk, Dv]
                # split the rule where checkpoints are due (state saved after each piece), then the rest
                for end, ckpt in [*s.checkpoints, (s.q_len, None)]:
                    if end > start:
                        out, state = gated_delta_rule(q[:, start:end], k[:, start:end], v[:, start:end],
                                                      gs[:, start:end], bs[:, start:end], state, decode=False)
                        o[s.q_start + start:s.q_start + end] = out[0]
                        start = end
                    if ckpt is not None:
                        self.checkpoints.save_layer(ckpt, self.state_index, window[:, end:end + W], state[0])
                memory[slot] = state[0]
        o = self.norm(o, z)  # [T, Hv, Dv]
        return self.out_proj(o.reshape(T, self.value_dim))
