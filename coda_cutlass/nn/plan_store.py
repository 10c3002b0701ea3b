"""In-sequence tuning plans: a site's kernel choice (``Choice``), and where plans are stored and
found (the local tuning cache, then the plans shipped in nn/plans/*.json). Used by the runner (to
find a stored plan) and the tuner (to store one)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..config import KernelConfig
from ..tuning.store import TuningStore, m_bucket


@dataclass(frozen=True)
class Choice:
    """A site's kernel configuration and its runtime raster order / swizzle."""
    config: KernelConfig
    raster: str = "heuristic"
    swizzle: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.build_key, "raster": self.raster, "swizzle": self.swizzle}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Choice":
        return cls(KernelConfig.from_dict(d["config"]), d.get("raster", "heuristic"), int(d.get("swizzle", 1)))



def device_tag() -> str:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name}|sm{props.major}{props.minor}|cuda{torch.version.cuda}"


def plan_key(context: str, dtype: torch.dtype, M: int, device: str | None = None) -> str:
    """Where a plan is stored: GPU, CUDA, dtype, model widths and M bucket."""
    return f"inseq|{device or device_tag()}|{dtype}|{context}|M{m_bucket(M)}"


def load_plan(context: str, dtype: torch.dtype, M: int, cache_dir: Any = None,
              device: str | None = None) -> dict[str, Choice] | None:
    """The stored plan for this model context and M bucket, or None (a malformed record is ignored)."""
    key = plan_key(context, dtype, M, device)
    rec = TuningStore(cache_dir).get(key)
    if rec is None:
        rec = shipped_plans().get(key)
    if not isinstance(rec, dict) or not isinstance(rec.get("sites"), dict):
        return None
    try:
        return {site: Choice.from_json(c) for site, c in rec["sites"].items()}
    except (KeyError, TypeError, ValueError):
        return None


SHIPPED = Path(__file__).resolve().parent / "plans"


@lru_cache(maxsize=1)
def shipped_plans() -> dict[str, Any]:
    """Plans tuned on the project's own GPUs and shipped with the package (nn/plans/*.json, one
    record per plan key), used when the local tuning cache has none."""
    out: dict[str, Any] = {}
    for path in sorted(SHIPPED.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.update({k: v for k, v in data.items() if isinstance(v, dict)})
    return out


def store_plan(context: str, dtype: torch.dtype, M: int, record: dict[str, Any], cache_dir: Any = None,
               device: str | None = None) -> None:
    TuningStore(cache_dir).put(plan_key(context, dtype, M, device), json.loads(json.dumps(record)))
