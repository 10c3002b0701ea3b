"""Kernel configurations: the mainloop/epilogue choices that are baked into a build, and the runtime
knobs (raster order, swizzle) that are not.

Measured on the H200 (docs/GPU.md): 128x256x64 cooperative with a 2x1 or 1x2 cluster lands within a
few percent of cuBLAS on Llama shapes in short runs; the untuned 128x128 1x1 is 1.17-1.40x with an
EVT. In long runs at the card's power limit the autotuner picks ping-pong 128x128 (cluster 1x2 or
2x1) for nearly every epilogue, which is therefore the default: ``DEFAULT`` below, the one default
configuration (lower/plan.py falls back to smaller tiles for programs that do not fit it).
"""

from __future__ import annotations

import operator
from math import gcd
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from .errors import ConfigError, check_options

WEIGHT_LAYOUTS = ("nk", "kn")   # W is [N, K] (nn.Linear) or [K, N]
SCHEDULES = ("cooperative", "pingpong")
RASTERS = ("heuristic", "m", "n")
SWIZZLES = (1, 2, 4, 8)
SCHEDULERS = ("persistent", "streamk")

# C++ names of the schedules
KERNEL_SCHEDULE = {
    "cooperative": "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
    "pingpong": "cutlass::gemm::KernelTmaWarpSpecializedPingpong",
}
EPILOGUE_SCHEDULE = {
    "cooperative": "cutlass::epilogue::TmaWarpSpecializedCooperative",
    "pingpong": "cutlass::epilogue::TmaWarpSpecialized",
}
TILE_SCHEDULER = {
    "persistent": "cutlass::gemm::PersistentScheduler",
    "streamk": "cutlass::gemm::StreamKScheduler",
}


@dataclass(frozen=True)
class KernelConfig:
    """Build-time configuration. ``raster`` and ``swizzle`` are runtime defaults (no rebuild).
    The field defaults (cooperative 128x256, cluster 2x1) are only a starting point for naming a
    configuration; without one, kernels use ``DEFAULT``."""

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    cluster_m: int = 2
    cluster_n: int = 1
    schedule: str = "cooperative"
    scheduler: str = "persistent"
    epilogue_tile: tuple[int, int] | None = None    # None: CUTLASS's EpilogueTileAuto
    raster: str = "heuristic"
    swizzle: int = 1

    def __new__(cls, *args: Any, **kwargs: Any) -> "KernelConfig":
        check_options(kwargs, _FIELDS, "cc.KernelConfig")     # a misspelt field: its close name, not a bare TypeError
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _normalise_types(self)
        check_config(self)

    @property
    def tile(self) -> tuple[int, int]:
        return (self.tile_m, self.tile_n)

    @property
    def build_key(self) -> dict[str, Any]:
        """The fields that change the generated code."""
        d = asdict(self)
        d.pop("raster")
        d.pop("swizzle")
        return d

    def name(self) -> str:
        epi = "" if self.epilogue_tile is None else f"_e{self.epilogue_tile[0]}x{self.epilogue_tile[1]}"
        sched = "" if self.scheduler == "persistent" else f"_{self.scheduler}"
        return (f"{self.tile_m}x{self.tile_n}x{self.tile_k}_c{self.cluster_m}x{self.cluster_n}_"
                f"{self.schedule}{sched}{epi}")

    @classmethod
    def from_name(cls, name: str) -> "KernelConfig":
        """The configuration ``name()`` spells: '128x128x64_c1x2_pingpong', with the scheduler
        ('_streamk') and the epilogue subtile ('_e64x128') when they are not the defaults."""
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            raise ConfigError(f"configuration name {name!r}: expected MxNxK_cMxN_SCHEDULE[_SCHEDULER][_eMxN], "
                              "e.g. 128x128x64_c1x2_pingpong or 128x256x64_c2x1_cooperative_streamk")
        tm, tn, tk, cm, cn, schedule, scheduler, em, en = m.groups()
        for digits in (tm, tn, tk, cm, cn, em or "", en or ""):
            if len(digits) > 9:     # (int() of thousands of digits is itself an error)
                raise ConfigError(f"configuration name {name[:40]!r}{'...' if len(name) > 40 else ''}: a size of "
                                  f"{len(digits)} digits is out of range")
        return cls(tile_m=int(tm), tile_n=int(tn), tile_k=int(tk), cluster_m=int(cm), cluster_n=int(cn),
                   schedule=schedule, scheduler=scheduler or "persistent",
                   epilogue_tile=None if em is None else (int(em), int(en)))

    def with_runtime(self, raster: str | None = None, swizzle: int | None = None) -> "KernelConfig":
        return replace(self, raster=raster or self.raster, swizzle=swizzle or self.swizzle)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KernelConfig":
        """The configuration ``build_key`` (or ``asdict``) wrote; ConfigError names a malformed field."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a KernelConfig is read from a dict of its fields, got {type(d).__name__} "
                              f"{str(d)[:80]!r}")
        unknown = [k for k in d if k not in _FIELDS]
        if unknown:
            raise ConfigError(f"KernelConfig has no field(s) {', '.join(repr(k)[:40] for k in unknown[:4])}; "
                              f"fields: {', '.join(_FIELDS)}")
        d = dict(d)
        if isinstance(d.get("epilogue_tile"), list):      # JSON has no tuples
            d["epilogue_tile"] = tuple(d["epilogue_tile"])
        return cls(**d)


_NAME = re.compile(r"([0-9]+)x([0-9]+)x([0-9]+)_c([0-9]+)x([0-9]+)_([a-z]+)(?:_([a-z]+))?(?:_e([0-9]+)x([0-9]+))?")
_FIELDS = tuple(f.name for f in fields(KernelConfig))
_INT_FIELDS = ("tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "swizzle")
_STR_FIELDS = ("schedule", "scheduler", "raster")


def _as_int(value: Any, what: str) -> int:
    """An int field: Python and numpy integers; not floats (128.0), bools or strings."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ConfigError(f"KernelConfig {what} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(f"KernelConfig {what} must be an int, got {type(value).__name__} {value!r}") from None
    if abs(v) >= 1 << 31:
        raise ConfigError(f"KernelConfig {what} is out of range ({len(str(abs(v)))} digits)")
    return v


def _normalise_types(c: KernelConfig) -> None:
    """Check each field's type, storing integers as Python ints (numpy integers are accepted)."""
    for name in _INT_FIELDS:
        object.__setattr__(c, name, _as_int(getattr(c, name), name))
    for name in _STR_FIELDS:
        if not isinstance(getattr(c, name), str):
            raise ConfigError(f"KernelConfig {name} must be a string, got {getattr(c, name)!r}")
    et = c.epilogue_tile
    if et is not None:
        if isinstance(et, (str, bytes)) or not hasattr(et, "__len__") or len(et) != 2:
            raise ConfigError(f"KernelConfig epilogue_tile must be None or a pair (M, N) of ints, got {et!r}")
        em, en = (_as_int(v, "epilogue_tile") for v in et)
        if em <= 0 or en <= 0:
            raise ConfigError(f"KernelConfig epilogue_tile must be positive, got {et!r}")
        object.__setattr__(c, "epilogue_tile", (em, en))


def check_config(c: KernelConfig) -> None:
    """Reject configurations CUTLASS's sm90 builders cannot instantiate, before compiling anything."""
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"kernel config {c.tile_m}x{c.tile_n}x{c.tile_k} c{c.cluster_m}x{c.cluster_n} "
                           f"{c.schedule}: {msg}")
    if c.schedule not in SCHEDULES:
        raise bad(f"schedule must be one of {SCHEDULES}")
    if c.scheduler not in SCHEDULERS:
        raise bad(f"scheduler must be one of {SCHEDULERS}")
    if c.raster not in RASTERS:
        raise bad(f"raster must be one of {RASTERS}")
    if c.swizzle not in SWIZZLES:
        raise bad(f"swizzle must be one of {SWIZZLES}")
    min_m = 128 if c.schedule == "cooperative" else 64
    if c.tile_m not in (64, 128, 256) or c.tile_m < min_m:
        raise bad(f"tile_m must be in (64, 128, 256) and >= {min_m} for the {c.schedule} schedule")
    if c.tile_n not in (64, 128, 192, 256):
        raise bad("tile_n must be one of 64, 128, 192, 256")
    if c.tile_k not in (32, 64, 128):
        raise bad("tile_k must be one of 32, 64, 128")
    if c.cluster_m * c.cluster_n > 4 or c.cluster_m not in (1, 2, 4) or c.cluster_n not in (1, 2, 4):
        raise bad("cluster must be 1x1, 1x2, 2x1, 2x2, 1x4 or 4x1")
    if c.scheduler == "streamk" and c.schedule != "cooperative":
        raise bad("the stream-K scheduler needs the cooperative schedule")
    if c.epilogue_tile is not None:
        em, en = c.epilogue_tile
        if c.tile_m % em or c.tile_n % en or em % 64 or en % 16:
            raise bad("epilogue_tile must divide the CTA tile (M a multiple of 64, N of 16)")
        want = 64 if c.schedule == "pingpong" else 128      # CUTLASS's sm90 epilogue builder asserts it
        if em != want:
            raise bad(f"epilogue_tile's M must be {want} for the {c.schedule} schedule")
    # Shared memory: the mainloop needs at least 2 stages of A and B tiles next to the epilogue.
    stage_bytes = (c.tile_m + c.tile_n) * c.tile_k * 2
    if 2 * stage_bytes > 200 * 1024:
        raise bad(f"two mainloop stages need {2 * stage_bytes // 1024} KiB of shared memory (max ~227 KiB "
                  "with the epilogue)")


# The heuristic default: ping-pong 128x128x64, cluster 1x2. In the third session's benchmark runs
# (H200 at its 700 W limit, Llama-3-8B shapes, 47 workloads run 2-4 times) the tuner picked
# ping-pong 128x128 for 110 of 114 tuned kernels (74 with cluster 1x2), while cooperative 128x256
# (the earlier default, best in short runs at full clock) cost 1.02-1.76 x the tuned kernel on the
# pairwise / log-sum-exp workloads (docs/RESULTS.md).
DEFAULT = KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2, schedule="pingpong")


def epilogue_tile(c: KernelConfig) -> tuple[int, int]:
    """The epilogue subtile of a configuration (CUTLASS's EpilogueTileAuto unless the config names one)."""
    if c.epilogue_tile is not None:
        return c.epilogue_tile
    if c.schedule == "cooperative":
        return min(128, c.tile_m), gcd(min(32, c.tile_n), c.tile_n)
    return min(64, c.tile_m), gcd(min(32, c.tile_n), c.tile_n)
