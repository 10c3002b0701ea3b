"""In-sequence tuning plans: a site's kernel choice (``Choice``), and where plans are stored and
found (the local tuning cache, then the plans shipped in nn/plans/*.json). Used by the runner (to
find a stored plan) and the tuner (to store one).

A plan record is data from a file: a malformed one (a site whose configuration, raster order or
swizzle is not valid, a record that is not an object, a key whose M bucket is not a number) is
ignored with a warning naming its key, and the forward runs on without it."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..config import RASTERS, SWIZZLES, KernelConfig
from ..errors import ConfigError
from ..tuning.store import TuningStore, device_tag, m_bucket


@dataclass(frozen=True)
class Choice:
    """A site's kernel configuration and its runtime raster order / swizzle."""
    config: KernelConfig
    raster: str = "heuristic"
    swizzle: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.config, KernelConfig):
            raise ConfigError(f"Choice config must be a KernelConfig, got {self.config!r}")
        if not isinstance(self.raster, str) or self.raster not in RASTERS:
            raise ConfigError(f"Choice raster must be one of {RASTERS}, got {self.raster!r}")
        if isinstance(self.swizzle, bool) or not isinstance(self.swizzle, int) or self.swizzle not in SWIZZLES:
            raise ConfigError(f"Choice swizzle must be one of {SWIZZLES}, got {self.swizzle!r}")

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.build_key, "raster": self.raster, "swizzle": self.swizzle}

    @classmethod
    def from_json(cls, d: Any) -> "Choice":
        """The choice a plan record stores; ConfigError names what is malformed."""
        if not isinstance(d, dict) or "config" not in d:
            raise ConfigError(f"a site's choice must be an object with a 'config', got {_short(d)}")
        return cls(KernelConfig.from_dict(d["config"]), d.get("raster", "heuristic"), d.get("swizzle", 1))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def plan_key(context: str, dtype: torch.dtype, M: int, device: str | None = None) -> str:
    """Where a plan is stored: GPU, CUDA, dtype, model widths and M bucket."""
    return f"inseq|{device or device_tag()}|{dtype}|{context}|M{m_bucket(M)}"


def _parse(key: str, rec: Any) -> dict[str, Choice] | None:
    """The plan stored under ``key``, or None (with a warning) when the record is malformed."""
    if rec is None:
        return None
    try:
        if not isinstance(rec, dict) or not isinstance(rec.get("sites"), dict):
            raise ConfigError("not an object with a 'sites' object")
        plan = {}
        for site, c in rec["sites"].items():
            try:
                plan[site] = Choice.from_json(c)
            except ConfigError as e:
                raise ConfigError(f"site {site!r}: {e}") from None
        return plan
    except ConfigError as e:
        warnings.warn(f"coda-cutlass: ignoring the malformed in-sequence plan {_short(key)}: {e}", RuntimeWarning,
                      stacklevel=4)
        return None


_BUCKET = re.compile(r"[0-9]{1,9}")     # an M bucket as plan_key writes it (at most 65536)


def find_plan(context: str, dtype: torch.dtype, M: int, cache_dir: Any = None, device: str | None = None,
              nearest: bool = True) -> tuple[str, dict[str, Choice]] | None:
    """(plan key, plan) for this model context and M bucket: the local tuning cache first, then the
    shipped plans. With ``nearest``, when neither has this M bucket, the plan of the nearest bucket
    (in powers of two; the larger on a tie) tuned for the same GPU, dtype and model widths: the
    configurations that win in a block's sequence change little between neighbouring M, while the
    default configuration can be 1.1-1.4x cuBLAS in the sequence at 70B widths. When this GPU has
    no plan for the widths at all, the plan tuned on another GPU of the same architecture (its
    exact M bucket, else the nearest; this CUDA version first): e.g. an H100 takes the shipped H200
    plans (the same sm90 tiles and SM count; on the H100 the H200 plan's down dX choice ran 1311 us
    against the default's 1466, docs/RESULTS.md, twenty-seventh session). The returned key names
    the GPU it was tuned on (``KernelRunner.plan_source``)."""
    key = plan_key(context, dtype, M, device)
    local = TuningStore(cache_dir).load()
    records = {**shipped_plans(), **local}
    plan = _parse(key, records.get(key))
    if plan is not None or not nearest:
        return (key, plan) if plan is not None else None
    gpu, arch, cuda, rest = _split(key)
    want_stem = rest.rpartition("|M")[0]          # dtype and model context
    want = m_bucket(M).bit_length()
    found = []
    for k, rec in records.items():
        if not isinstance(k, str) or k == key or not k.startswith("inseq|"):
            continue
        other_gpu, other_arch, other_cuda, other_rest = _split(k)
        same_gpu = (other_gpu, other_arch, other_cuda) == (gpu, arch, cuda)
        if not (same_gpu or (arch and other_arch == arch)):     # an unknown architecture matches only itself
            continue
        stem, _, bucket_text = other_rest.rpartition("|M")
        if stem != want_stem:
            continue
        if not _BUCKET.fullmatch(bucket_text):
            warnings.warn(f"coda-cutlass: ignoring the in-sequence plan {_short(k)}: its M bucket is not a "
                          "number of tokens", RuntimeWarning, stacklevel=3)
            continue
        if (other := _parse(k, rec)) is not None:
            bucket = int(bucket_text)
            found.append((not same_gpu, other_cuda != cuda, abs(bucket.bit_length() - want), -bucket, k, other))
    if not found:
        return None
    *_, k, other = min(found, key=lambda t: t[:5])
    return k, other


def _split(key: str) -> tuple[str, str, str, str]:
    """A plan key's GPU name, architecture ("sm90") and CUDA parts, and the rest (dtype, context, M
    bucket). A device tag not of ``device_tag``'s form (name|smXY|cudaV) is all name: its
    architecture is unknown ("")."""
    body = key.removeprefix("inseq|")
    parts = body.split("|")
    if len(parts) >= 6 and parts[1].startswith("sm") and parts[2].startswith("cuda"):
        return parts[0], parts[1], parts[2], "|".join(parts[3:])
    device, _, rest = body.partition("|")
    return device, "", "", rest


def tuned_on(key: str) -> str:
    """The GPU part of a plan key ("NVIDIA H200|sm90|cuda13.0")."""
    gpu, arch, cuda, _ = _split(key)
    return "|".join(p for p in (gpu, arch, cuda) if p)


def tuned_at(key: str) -> int | None:
    """The M bucket of a plan key (tokens), None if it has none of ``plan_key``'s form."""
    bucket = key.rpartition("|M")[2]
    return int(bucket) if _BUCKET.fullmatch(bucket) else None


def load_plan(context: str, dtype: torch.dtype, M: int, cache_dir: Any = None,
              device: str | None = None, nearest: bool = True) -> dict[str, Choice] | None:
    """The stored plan for this model context and M bucket (or the nearest bucket's, see
    ``find_plan``), or None. A malformed record is ignored with a warning."""
    found = find_plan(context, dtype, M, cache_dir, device, nearest)
    return None if found is None else found[1]


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
