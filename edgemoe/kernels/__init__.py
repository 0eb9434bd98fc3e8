"""Triton kernels of the GPU decode fast path and of prefill's expert compute: pure functions over
tensors (imports only torch and triton), every one CUDA-graph capturable (no host synchronization, no
data-dependent shapes or allocations; outputs go to caller-provided buffers; ``grouped_gemm``
allocates scratch whose size follows the input shapes only).

- :mod:`.route_control`: one MoE layer's routing control (dedupe, hit/miss, q, LRU victims, table
  rewrite, CPU work layout) — the device twin of ``edgemoe.experts.hybrid.plan_step``.
- :mod:`.cpu_work`: the packed layout of a step's CPU work shared with the native executor (torch only).
- :mod:`.doorbell`: ring / wait, handing a decode step's CPU work to the native executor's server
  thread through pinned memory and waiting for it.
- :mod:`.gather`: the layer's fills, host expert pool → device cache slots, zero-copy over PCIe.
- :mod:`.expert_gemv`: grouped SwiGLU expert GEMVs over cache slots for decode batches.
- :mod:`.grouped_gemm`: grouped SwiGLU expert GEMMs over cache slots for prefill and large batches
  (routes aligned by expert on the device).
- :mod:`.decode_attention`: paged decode attention, split-KV (flash-decoding) with a merge pass.
- :mod:`.gated_delta`: the gated delta rule of ``qwen3_5_moe``'s linear attention (prefill and decode).

Importing a submodule imports triton; this package imports none of them eagerly.
"""
