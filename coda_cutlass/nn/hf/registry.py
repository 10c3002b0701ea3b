"""The family of a transformers config (by ``config.model_type``), or a clear refusal."""

from __future__ import annotations

from typing import Any

from . import gemma, gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from .family import Family
from .fields import UnsupportedConfig
from .unsupported import REFUSED

FAMILIES: dict[str, Family] = {t: m.FAMILY for m in (llama, mistral, phi3, qwen2, qwen3, gemma, gemma2, gemma3) for t in m.FAMILY.model_types}


def family_of(config: Any) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in REFUSED:
        raise UnsupportedConfig(f"model_type {model_type!r} is not supported by coda_cutlass.nn: {REFUSED[model_type]}")
    raise UnsupportedConfig(f"model_type {model_type!r} is not supported by coda_cutlass.nn; supported: "
                            f"{', '.join(sorted(FAMILIES))}")
