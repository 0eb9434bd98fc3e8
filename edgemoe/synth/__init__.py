"""Checkpoint generation for tests and benchmarks: random-weight checkpoints in the exact Hugging Face
layout, with a self-contained Qwen-style tokenizer and chat template (``edgemoe make-model``).

- :mod:`~edgemoe.synth.archs`: what generation knows about each architecture (``transformers``
  classes, presets, parameter count): :data:`ARCHS`, :data:`PRESETS`.
- :mod:`~edgemoe.synth.writer`: the generic writer (:func:`make_model`, :func:`write_config_only`,
  :func:`config_for`): seeded random init, ``save_pretrained`` sharding, ``config.json`` and
  ``generation_config.json``.
- :mod:`~edgemoe.synth.tokenizer`: the built or copied tokenizer; its chat template and training text
  are package data (``data/``).

Not on the serving path: nothing in the engine imports this package.
"""

from edgemoe.synth.archs import ARCHS, PRESETS, SynthArch, param_count
from edgemoe.synth.tokenizer import ADDED_TOKENS, BUILT_VOCAB, CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer
from edgemoe.synth.writer import QUANT_LAYOUTS, config_for, make_model, quantize_checkpoint, write_config_only

__all__ = [
    "ADDED_TOKENS",
    "ARCHS",
    "BUILT_VOCAB",
    "CHAT_TEMPLATE",
    "PRESETS",
    "QUANT_LAYOUTS",
    "SPECIAL_TOKENS",
    "SynthArch",
    "build_tokenizer",
    "config_for",
    "make_model",
    "param_count",
    "quantize_checkpoint",
    "write_config_only",
]
