"""GPU kernels (Triton)."""
