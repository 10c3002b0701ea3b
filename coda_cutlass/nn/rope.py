"""RoPE settings of a block: which frequencies rotate q and k, for which sequence length, and the
factor the rotation scales q and k by (``Rope``).

The types are those of transformers' ``rope_parameters["rope_type"]`` (``rope_scaling`` before
transformers 5): default, linear, dynamic (NTK), llama3, yarn, longrope and proportional, and
``explicit`` (a given frequency table). The frequencies are computed the way transformers and the
reference implementations compute them, in fp32 (the fp64 values of the same powers differ by up to
~1e-6 relative, a few mrad of angle at position 8000), so a converted checkpoint rotates exactly as
it was trained.

Two types depend on the length of the sequence a call sees (its largest position + 1):
``dynamic`` rescales the base past ``max_position_embeddings``, ``longrope`` switches to its long
factors past ``original_max_position_embeddings``. transformers keeps the grown dynamic table in the
rotary module between calls (shorter calls after a long one reuse it until they fall below the
original length); a ``Rope`` is stateless: each call uses its own length, which is what transformers
computes for a call that is the longest so far (a fixed training length, or a fresh model).

yarn and longrope also multiply cos and sin by an ``attention_scaling`` factor: q and k grow by it,
the attention logits by its square, which the block folds into the softmax scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional", "explicit")

# the keys each type reads (besides rope_type and rope_theta); any other key is refused by name:
# an unknown key may change the frequencies
_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor", "max_position_embeddings"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"short_factor", "long_factor", "factor", "original_max_position_embeddings",
                           "max_position_embeddings", "attention_factor"}),
    "proportional": frozenset({"factor", "partial_rotary_factor"}),
    "explicit": frozenset({"inv_freq"}),
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "explicit": ("inv_freq",),
}


def _powers(theta: float, dim: int, count: int | None = None) -> torch.Tensor:
    """theta ** (2i / dim) for i < count (default dim / 2), in fp32 as the reference code computes it."""
    stop = dim if count is None else 2 * count
    return theta ** (torch.arange(0, stop, 2, dtype=torch.int64).to(torch.float32) / dim)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class Rope:
    """RoPE frequencies for one head size. ``params`` are the transformers-style parameters of the
    type (``rope_theta``, ``factor``, ...); build one with ``Rope.default``, ``Rope.explicit`` or
    ``Rope.from_params``."""
    head_dim: int
    rope_type: str = "default"
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported types: {', '.join(ROPE_TYPES)}")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        extra = set(self.params) - _KEYS[self.rope_type] - {"rope_theta"}
        if extra:
            raise ValueError(f"rope_type {self.rope_type!r}: unknown RoPE parameter(s) {sorted(extra)} (they may change "
                             f"the frequencies); known: {sorted(_KEYS[self.rope_type] | {'rope_theta'})}")
        missing = [k for k in _REQUIRED.get(self.rope_type, ()) if self.params.get(k) is None]
        if self.rope_type not in ("explicit",) and self.params.get("rope_theta") is None:
            missing.insert(0, "rope_theta")
        if missing:
            raise ValueError(f"rope_type {self.rope_type!r} needs the RoPE parameter(s) {missing}")
        if self.rope_type == "explicit" and len(self.params["inv_freq"]) != self.head_dim // 2:
            raise ValueError(f"an explicit RoPE table needs head_dim / 2 = {self.head_dim // 2} frequencies, "
                             f"got {len(self.params['inv_freq'])}")
        if self.rope_type == "longrope":
            for k in ("short_factor", "long_factor"):
                if len(self.params[k]) != self.head_dim // 2:
                    raise ValueError(f"rope_type 'longrope': {k} needs head_dim / 2 = {self.head_dim // 2} values, "
                                     f"got {len(self.params[k])}")
        # a frozen dataclass still holds the caller's dict: keep a private copy
        object.__setattr__(self, "params", dict(self.params))

    # ------------------------------------------------------------------ construction
    @classmethod
    def default(cls, head_dim: int, theta: float) -> "Rope":
        return cls(head_dim, "default", {"rope_theta": float(theta)})

    @classmethod
    def explicit(cls, inv_freq: torch.Tensor) -> "Rope":
        """A fixed table of head_dim / 2 frequencies (any length of sequence)."""
        values = [float(v) for v in inv_freq.detach().double().cpu().reshape(-1)]
        return cls(2 * len(values), "explicit", {"inv_freq": values})

    @classmethod
    def from_params(cls, head_dim: int, params: Mapping[str, Any]) -> "Rope":
        """From transformers-style parameters: ``{"rope_type": ..., "rope_theta": ..., ...}``."""
        p = dict(params)
        rope_type = p.pop("rope_type", None) or p.pop("type", None) or "default"
        p.pop("type", None)
        return cls(head_dim, str(rope_type), p)

    def to_dict(self) -> dict[str, Any]:
        return {"head_dim": self.head_dim, "rope_type": self.rope_type, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Rope":
        return cls(int(d["head_dim"]), str(d["rope_type"]), dict(d["params"]))

    # ------------------------------------------------------------------ frequencies
    @property
    def depends_on_length(self) -> bool:
        """Do the frequencies change with the length of the sequence (dynamic, longrope)?"""
        return self.rope_type in ("dynamic", "longrope")

    def length_key(self, seq_len: int) -> int:
        """A key that is equal for every sequence length with the same frequencies."""
        p = self.params
        if self.rope_type == "dynamic":
            return max(seq_len, int(p["max_position_embeddings"]))
        if self.rope_type == "longrope":
            return int(seq_len > int(p["original_max_position_embeddings"]))
        return 0

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (q and k grow by it)."""
        p = self.params
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        if self.rope_type == "yarn":
            factor = self._yarn_factor()
            if p.get("mscale") and p.get("mscale_all_dim"):
                return float(_mscale(factor, p["mscale"]) / _mscale(factor, p["mscale_all_dim"]))
            return _mscale(factor)
        if self.rope_type == "longrope":
            factor = self._longrope_factor()
            if factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(factor) / math.log(int(p["original_max_position_embeddings"])))
        return 1.0

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """The head_dim / 2 frequencies (fp64 of the fp32 values) for a call whose largest position
        is seq_len - 1 (None: the table at or below the model's trained length)."""
        p, d, t = self.params, self.head_dim, self.rope_type
        if t == "explicit":
            return torch.tensor(p["inv_freq"], dtype=torch.float64)
        theta = float(p["rope_theta"])
        if t == "default":
            inv = 1.0 / _powers(theta, d)
        elif t == "linear":
            inv = 1.0 / _powers(theta, d) / float(p["factor"])
        elif t == "dynamic":
            inv = self._dynamic(theta, seq_len)
        elif t == "llama3":
            inv = self._llama3(theta)
        elif t == "yarn":
            inv = self._yarn(theta)
        elif t == "longrope":
            orig = int(p["original_max_position_embeddings"])
            factors = p["long_factor"] if seq_len is not None and seq_len > orig else p["short_factor"]
            inv = 1.0 / (torch.tensor(factors, dtype=torch.float32) * _powers(theta, d))
        else:   # proportional: the first partial_rotary_factor of the pairs rotate, the others not
            angles = int(float(p.get("partial_rotary_factor", 1.0)) * d // 2)
            inv = torch.zeros(d // 2, dtype=torch.float32)
            inv[:angles] = 1.0 / _powers(theta, d, angles)
            inv = inv / float(p.get("factor", 1.0))
        return inv.to(torch.float64)

    def _dynamic(self, theta: float, seq_len: int | None) -> torch.Tensor:
        p, d = self.params, self.head_dim
        factor, trained = float(p["factor"]), int(p["max_position_embeddings"])
        length = trained if seq_len is None else max(seq_len, trained)
        base = theta * ((factor * length / trained) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / _powers(base, d)

    def _llama3(self, theta: float) -> torch.Tensor:
        p = self.params
        inv = 1.0 / _powers(theta, self.head_dim)
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        context = int(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        long_waves = wavelen > context / low                 # low frequencies: interpolated by factor
        short_waves = wavelen < context / high               # high frequencies: kept
        scaled = torch.where(long_waves, inv / factor, inv)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        return torch.where(~short_waves & ~long_waves, blended, scaled)

    def _yarn_factor(self) -> float:
        p = self.params
        if p.get("factor") is not None:
            return float(p["factor"])
        if p.get("max_position_embeddings") is None:
            raise ValueError("rope_type 'yarn' without a factor needs max_position_embeddings")
        return int(p["max_position_embeddings"]) / int(p["original_max_position_embeddings"])

    def _longrope_factor(self) -> float:
        p = self.params
        if p.get("factor") is not None:
            return float(p["factor"])
        if p.get("max_position_embeddings") is None:
            return 1.0
        return int(p["max_position_embeddings"]) / int(p["original_max_position_embeddings"])

    def _yarn(self, theta: float) -> torch.Tensor:
        p, d = self.params, self.head_dim
        factor = self._yarn_factor()
        fast, slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)
        context = int(p["original_max_position_embeddings"])

        def dim_of(rotations: float) -> float:   # the pair index that turns `rotations` times over the context
            return d * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(fast), dim_of(slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        powers = _powers(theta, d)
        keep = 1 - ramp                                   # 1: extrapolate (high frequencies), 0: interpolate
        return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep


def column_frequencies(inv_freq: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """RoPE frequency of every column of the fused (pair-adjacent) QKV output: each pair's frequency
    on both of its columns, for the q and k heads; 0 on v (not rotated)."""
    head = inv_freq.to(torch.float32).repeat_interleave(2)
    return torch.cat((head.repeat(n_heads + n_kv_heads), torch.zeros(n_kv_heads * head.numel())))
