"""FP8 training recipes: one object says how a block's GEMMs run in FP8 (formats per operand, scale
granularity and format), so the block code takes a recipe, never flags.

- ``"blockwise"`` (DeepSeek-V3's): activations and gradients in 1 x 128 runs along each GEMM's K,
  weights in 128 x 128 tiles, fp32 dequantisation scales rounded up to powers of two; every scale
  is computed from the tensor it scales (nothing delayed), inside the epilogue that produces it
  where the run lies inside the tile (``cc.quantize(..., block=128)``).
- ``"blockwise_g16"``: ``"blockwise"`` with one change: the weight-gradient GEMMs' activation
  operand (the transposed copies of h, o and y) shares one scale per 16 channels and 128 tokens
  (``cc.quantize(..., transpose=True, group=16)``), so those GEMMs read 16 x 128 W scales
  (``scaling="block_16x128"``) instead of 1 x 128 on both operands. Gradients keep 1 x 128 runs
  along their GEMMs' K everywhere (DeepSeek-V3 reports that 128 x 128 blocks for activation
  gradients made a ~16B MoE model diverge).
- ``"tensorwise"``: one scale per tensor, delayed (Transformer Engine's DelayedScaling): each
  quantised tensor's scale comes from the largest finite amax of its last ``history`` steps, which the
  epilogue that quantises it reports beside the codes; a tensor's first step runs its producing
  kernel twice, the first time only for the amax (nn/fp8/delayed.py), so no step quantises with
  a guessed scale. The transposed copies keep the scale. Every GEMM is a per-tensor FP8 GEMM. With
  several data-parallel ranks the amaxes are reduced over them (``reduce_amax``, as Transformer
  Engine's ``reduce_amax=True``), so every rank keeps the same scales.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALINGS = ("block", "tensor")
WGRAD_GROUPS = (1, 16)
DEFAULT_HISTORY = 16
MAX_HISTORY = 1024       # the history is a (tensors, history) table, its one-hot slots (history, history)


@dataclass(frozen=True)
class Fp8Recipe:
    """How the linears of a block run in FP8.

    ``scaling``: "block" (1 x 128 activations and gradients, 128 x 128 weights; the weight-gradient
    GEMMs, whose K is the token dimension, read 1 x 128 runs of both transposed operands) or
    "tensor" (one scale per tensor; activations and gradients delayed, weights current).
    ``activation`` / ``gradient`` / ``weight``: the FP8 format of each kind of operand.
    ``pow2``: scales rounded up to powers of two (exact to apply; see docs/FP8.md for the measured
    effect) or amax / fp8_max.
    ``history`` / ``margin`` ("tensor" only: refused for blockwise scaling, which would ignore them;
    default 16 and 0): a delayed scale is the largest finite, positive amax of the last ``history``
    steps times 2^margin, over fp8_max; ``history`` at most 1024 (Transformer Engine's default
    length: the history is kept as a (tensors, history) table on the device).
    ``wgrad_group`` ("block"): 1, or 16: the activation operand of the weight-gradient GEMMs (h^T,
    o^T, y^T, whose K is the token dimension) in 16 x 128 blocks (16 channels x 128 tokens) instead
    of 1 x 128 runs; the weight-gradient GEMMs then run ``scaling="block_16x128"``.
    ``fast_accum`` ("tensor"): the FP8 GEMMs accumulate in the tensor cores' own precision instead
    of adding into fp32 every 128 of K (measured on the H200: 1.2x faster, and a GEMM error of
    ~3e-3 at K = 14336 against FP8's own ~5e-2; docs/RESULTS.md). Blockwise GEMMs always promote.
    ``reduce_amax`` ("tensor"; blockwise scales have nothing delayed to reduce and ignore it): in a
    torch.distributed world of several processes, each step's amaxes are reduced (MAX) over the
    default process group before they are folded, so every rank keeps the same histories and scales
    (Transformer Engine's DelayedScaling does so by default); False: each rank folds its own
    (nn/fp8/delayed.py). It picks no kernel."""
    name: str
    scaling: str = "block"
    activation: torch.dtype = E4M3
    gradient: torch.dtype = E4M3
    weight: torch.dtype = E4M3
    pow2: bool = True
    history: int | None = None          # "tensor": 16 when not given
    margin: int | None = None           # "tensor": 0 when not given
    fast_accum: bool = False
    wgrad_group: int = 1
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in ":|"):
            # the name is part of the tuning plans' key (LlamaBlock.context: "...:fp8-NAME|M...")
            raise ConfigError(f"FP8 recipe name must be a non-empty str without ':' or '|', got {self.name!r}")
        if self.scaling not in SCALINGS:
            raise ConfigError(f"FP8 recipe {self.name!r}: scaling {self.scaling!r} is not supported; one of "
                              f"{', '.join(map(repr, SCALINGS))}")
        for what, value in (("pow2", self.pow2), ("fast_accum", self.fast_accum),
                            ("reduce_amax", self.reduce_amax)):
            if not isinstance(value, bool):
                raise ConfigError(f"FP8 recipe {self.name!r}: {what} must be True or False, got {value!r}")
        if self.scaling == "block":
            given = [what for what in ("history", "margin") if getattr(self, what) is not None]
            if given:
                raise ConfigError(f"FP8 recipe {self.name!r}: {' and '.join(given)} "
                                  f"{'apply' if len(given) > 1 else 'applies'} to delayed per-tensor "
                                  "scaling (scaling='tensor'); blockwise scales come from each block's own amax, "
                                  "so they would be ignored: leave them out (a recipe made by dataclasses.replace "
                                  "from a per-tensor one carries its history and margin: pass history=None, "
                                  "margin=None)")
        else:       # defaults of the delayed scales (a frozen dataclass: set once, here)
            object.__setattr__(self, "history", DEFAULT_HISTORY if self.history is None else self.history)
            object.__setattr__(self, "margin", 0 if self.margin is None else self.margin)
            if isinstance(self.history, bool) or not isinstance(self.history, int) \
                    or not 1 <= self.history <= MAX_HISTORY:
                raise ConfigError(f"FP8 recipe {self.name!r}: history must be an int in 1..{MAX_HISTORY} (steps of "
                                  "amaxes kept per tensor; Transformer Engine's default length is 1024), got "
                                  f"{self.history!r}")
            if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not 0 <= self.margin <= 8:
                raise ConfigError(f"FP8 recipe {self.name!r}: margin must be an int in 0..8, got {self.margin!r}")
        if self.fast_accum and self.scaling == "block":
            raise ConfigError(f"FP8 recipe {self.name!r}: fast_accum needs per-tensor scaling (the blockwise "
                              "mainloop applies its scales while it adds into fp32)")
        # an int, as history and margin (16.0 compares equal to 16 and would go on into the kernels' options)
        if type(self.wgrad_group) is not int or self.wgrad_group not in WGRAD_GROUPS:
            raise ConfigError(f"FP8 recipe {self.name!r}: wgrad_group must be one of {WGRAD_GROUPS}, got "
                              f"{self.wgrad_group!r}")
        if self.wgrad_group != 1 and self.scaling != "block":
            raise ConfigError(f"FP8 recipe {self.name!r}: wgrad_group applies to blockwise scaling (per-tensor "
                              "scales need no blocks)")
        for what in ("activation", "gradient", "weight"):
            if getattr(self, what) not in (E4M3, E5M2):
                raise ConfigError(f"FP8 recipe {self.name!r}: {what} format must be torch.float8_e4m3fn or "
                                  f"torch.float8_e5m2, got {getattr(self, what)}")
        if self.scaling == "block" and (self.activation != E4M3 or self.gradient != E4M3 or not self.pow2):
            # the blockwise epilogue programs (epilogues/fp8_block.py) store e4m3 codes with power-of-two scales
            raise ConfigError(f"FP8 recipe {self.name!r}: blockwise scaling quantises activations and gradients to "
                              "torch.float8_e4m3fn with power-of-two scales (pow2=True); other formats need "
                              "scaling='tensor'")

    @property
    def plan_name(self) -> str:
        """What the tuned plans of this recipe's FP8 sites are stored under (LlamaBlock.context): the
        name when the recipe's kernels are those of the built-in recipe of that name, else the name
        with a digest of the settings that pick the kernels, so a recipe of one's own named like
        another (a built-in with another scaling, say) never takes plans tuned, or shipped, for other
        kernels. The delayed scales' history, margin and reduce_amax pick no kernel."""
        built_in = RECIPES.get(self.name)
        if built_in is not None and built_in._kernel_settings() == self._kernel_settings():
            return self.name
        return f"{self.name}-{hashlib.sha256(repr(self._kernel_settings()).encode()).hexdigest()[:8]}"

    def _kernel_settings(self) -> tuple:
        return (self.scaling, self.activation, self.gradient, self.weight, self.pow2, self.fast_accum,
                self.wgrad_group)

    def gemm_dtype(self, a: str, w: str) -> Any:
        """The dtype option of a GEMM whose A and W are operands of these kinds."""
        da, dw = getattr(self, a), getattr(self, w)
        return da if da == dw else (da, dw)

    def gemm(self, kinds: tuple[str, str], scaling: str) -> tuple:
        """The runner's FP8 options of a GEMM whose A and W are operands of these kinds."""
        if self.fast_accum:
            return (self.gemm_dtype(*kinds), scaling, True)
        return (self.gemm_dtype(*kinds), scaling)


RECIPES: dict[str, Fp8Recipe] = {
    "blockwise": Fp8Recipe("blockwise"),
    "blockwise_g16": Fp8Recipe("blockwise_g16", wgrad_group=16),
    "tensorwise": Fp8Recipe("tensorwise", scaling="tensor", fast_accum=True),
}


def as_recipe(fp8: Any) -> Fp8Recipe | None:
    """None (bf16), a recipe name or an Fp8Recipe -> the recipe; anything else is a clear error."""
    if fp8 is None or isinstance(fp8, Fp8Recipe):
        return fp8
    if isinstance(fp8, str) and fp8 in RECIPES:
        return RECIPES[fp8]
    # a misspelt name ("tensorwize", "Blockwise") gets the name it was probably meant to be
    close = difflib.get_close_matches(fp8.lower(), RECIPES, n=1) if isinstance(fp8, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"fp8 must be None (bf16), an Fp8Recipe or one of {sorted(RECIPES)}, got {fp8!r}{hint}")
