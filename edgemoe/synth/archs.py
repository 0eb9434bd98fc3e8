"""What checkpoint generation knows about each architecture: its ``transformers`` classes and presets,
read from the architecture's own file in ``edgemoe.models`` (``hf_classes``, ``presets``,
``synth_tokenizer``).

One :class:`SynthArch` per served architecture. The ``transformers`` model class defines the
checkpoint's tensor names and shapes (its own init and ``save_pretrained`` write them, as for a real
release); the presets are the geometries edgemoe tests and benchmarks with; ``param_count`` comes
from edgemoe's model of the config, so sizes are known without building a ``transformers`` model.
Everything generic (random init, sharding, tokenizer, ``generation_config.json``) is in
:mod:`edgemoe.synth.writer` and :mod:`edgemoe.synth.tokenizer`, which read an architecture only
through :data:`ARCHS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers takes ~2 s to import; import it only where it is used
    import transformers

__all__ = ["ARCHS", "PRESETS", "SynthArch", "param_count"]


@dataclass(frozen=True)
class SynthArch:
    """Checkpoint generation's knowledge of one architecture.

    Attributes:
        model_type: the key of :data:`ARCHS` (``make-model --arch``), e.g. ``"qwen3_moe"``.
        config_class, model_class: names of the ``transformers`` classes whose init and
            ``save_pretrained`` write the checkpoint.
        presets: preset name -> ``config_class`` kwargs. ``vocab_size`` is nominal unless the preset is
            in ``fixed_vocab``: the writer sets it from the tokenizer.
        fixed_vocab: presets whose ``vocab_size`` is a floor set by a real tokenizer (kept even if the
            tokenizer is smaller).
        param_count: parameters of a ``config_class`` instance (embeddings, lm_head and every layer,
            routed experts included).
        tokenizer: the :data:`~edgemoe.synth.tokenizer.TOKENIZERS` flavour built when no tokenizer is given.
    """

    model_type: str
    config_class: str
    model_class: str
    presets: dict[str, dict]
    param_count: Callable[[transformers.PretrainedConfig], int]
    fixed_vocab: frozenset[str] = field(default_factory=frozenset)
    tokenizer: str = "qwen3"

    def classes(self) -> tuple[type, type]:
        """The ``transformers`` (config class, model class)."""
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)


def _param_count(config: transformers.PretrainedConfig) -> int:
    """Parameters of an HF config's checkpoint, counted from edgemoe's own model of it."""
    from edgemoe.models import load_config, model_class

    cfg = load_config(config.to_dict())
    return model_class(cfg.architecture).param_count(cfg)


def _synth_arch(cls) -> SynthArch:
    config_class, model_class = cls.hf_classes
    return SynthArch(model_type=cls.model_types[0], config_class=config_class, model_class=model_class,
                     presets=cls.presets, param_count=_param_count, fixed_vocab=cls.fixed_vocab_presets,
                     tokenizer=cls.synth_tokenizer)


def _archs() -> dict[str, SynthArch]:
    from edgemoe.models import FAMILIES

    return {a.model_type: a for a in map(_synth_arch, FAMILIES)}


ARCHS: dict[str, SynthArch] = _archs()

# arch -> preset -> config kwargs (a view of ARCHS)
PRESETS: dict[str, dict[str, dict]] = {a.model_type: a.presets for a in ARCHS.values()}


def param_count(config: transformers.PretrainedConfig) -> int:
    """Parameters of the checkpoint of an HF config (embeddings, LM head and every layer, routed
    experts included), from edgemoe's model of its architecture.

    Raises:
        ValueError: a config of an architecture edgemoe does not serve.
    """
    return _param_count(config)
