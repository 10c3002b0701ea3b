"""Kernel configuration search: the candidate space, the persistent tuning cache and the autotuner."""

from ..lower.plan import default_config
from ..lower.smem import estimate_stages
from .space import candidate_configs
from .tuner import TunedEpilogue

__all__ = ["candidate_configs", "default_config", "estimate_stages", "TunedEpilogue"]
