"""Weights: reading checkpoints into a meta-built model and the host expert pool.

- :mod:`~edgemoe.weights.dtypes`: the dtype table (names, safetensors codes, sizes; ``parse_dtype``).
- :mod:`~edgemoe.weights.index`: the checkpoint index of a Hugging Face directory (safetensors files,
  tensor -> file, dtypes and shapes from the headers) and the strict checks against a model;
  ``CheckpointError``.
- :mod:`~edgemoe.weights.loader`: ``load_checkpoint`` (HF safetensors) and ``init_dummy``.
- :mod:`~edgemoe.weights.ftw`: the FTW format (spec, direct-I/O reader, writer, ``convert``).
- :mod:`~edgemoe.weights.bootstrap`: ``pin_or_fallback``, pinning the pool after any load.

This package imports nothing at import time, so its low modules (``dtypes``) can be used anywhere.
"""
