"""Kernel configuration search: the candidate space, the persistent tuning cache and the autotuner."""

from .space import candidate_configs, default_config, estimate_stages
from .tuner import TunedEpilogue

__all__ = ["candidate_configs", "default_config", "estimate_stages", "TunedEpilogue"]
