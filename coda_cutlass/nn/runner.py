"""How the block's kernels run: compiled GEMM + epilogue kernels on a Hopper GPU, or the torch
reference interpreter anywhere else (the same programs, so CPU tests check the GPU code path's math).

Every launch names its *site* ("qkv", "down.dgrad", ...): the kernel configuration is chosen per
site (a ``KernelPlan``, e.g. from the in-sequence tuner), and an optional ``Recorder`` brackets each
launch with CUDA events to time it inside the block's own sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..api import compile_epilogue
from ..build.cache import absolute
from ..build.progress import say
from ..config import DEFAULT, KernelConfig
from ..interpret import interpret
from ..lower.plan import default_config
from ..maps import compile_map, interpret_map
from ..pipeline import Options, lower_program, typed_ir
from ..timing import elapsed_us, medians_us, timed_call
from ..tuning.store import m_bucket
from .kernels import PLAN_FALLBACK
from .plan_store import Choice, find_plan, plan_key, tuned_at, tuned_on

# An FP8 GEMM's (operand dtype or (A, W) dtypes, scaling[, fast accumulation]); None: a 16-bit GEMM
# in the runner's dtype.
Fp8Options = tuple[Any, str] | tuple[Any, str, bool] | None

_BORROWED: set[tuple[str, str]] = set()    # (this GPU's and M's plan key, the one used instead) announced


def fp8_parts(fp8: tuple) -> tuple[Any, str, bool]:
    """(operand dtype(s), scaling, fast accumulation) of an FP8 GEMM's options."""
    return fp8[0], fp8[1], bool(fp8[2]) if len(fp8) > 2 else False


def gemm_options(dtype: torch.dtype, layout: str, fp8: Fp8Options) -> Options:
    """The compile options of a runner's GEMM: its own dtype, or an FP8 GEMM's operands and scaling."""
    if fp8 is None:
        return Options.make(dtype, layout)
    d, scaling, fast = fp8_parts(fp8)
    return Options.make(d, layout, scaling=scaling, fast_accum=fast)


REFERENCE_TILE = DEFAULT.tile   # partial-reduction layout the reference runner reproduces


@dataclass
class Recorder:
    """CUDA events around every launch: site -> list of (start, end) pairs."""
    events: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)

    def around(self, site: str, fn: Callable[[], Any]) -> Any:
        result: list[Any] = []
        self.events.setdefault(site, []).append(timed_call(lambda: result.append(fn())))
        return result[0]

    def times_us(self) -> dict[str, list[float]]:
        torch.cuda.synchronize()
        return {k: [elapsed_us(p) for p in v] for k, v in self.events.items()}

    def medians_us(self) -> dict[str, float]:
        return medians_us(self.events)


class Runner:
    """The interface the block's forward and backward call. Runners hold caches (typed IR, compiled
    kernels with their ctypes handles, CUDA events): pickling or copying one drops them, and they
    are made again on first use."""
    recorder: Recorder | None = None
    _caches: tuple[str, ...] = ()
    # map calls with out = X run in one pass without temporaries (kernels; the interpreter makes fp32
    # copies of the whole tensor)
    in_place_maps: bool = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("recorder", None)
        for name in self._caches:
            state[name] = {}
        return state

    def gemm(self, site: str, program: Any, A: torch.Tensor, W: torch.Tensor, *, layout: str = "nk",
             partial: bool = False, out: dict[str, torch.Tensor] | None = None, fp8: Fp8Options = None,
             **operands: Any) -> dict[str, torch.Tensor]:
        """One fused GEMM: ``program``'s outputs for acc = A @ W.T ("nk") or A @ W ("kn"); tile outputs
        go into ``out`` when given; ``partial``: reductions as per-tile partials. ``fp8``: (operand
        dtype or (A, W) dtypes, scaling) of an FP8 GEMM, whose scales come as ``scale_a`` / ``scale_b``."""
        raise NotImplementedError

    def map(self, site: str, program: Any, X: torch.Tensor, *, partial: bool = False,
            out: dict[str, torch.Tensor] | None = None, **operands: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def timed(self, site: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, between CUDA events when a recorder is set (every launch of a step goes through
        here: the kernels and the plain torch work, cuBLAS weight gradients and attention)."""
        return fn() if self.recorder is None else self.recorder.around(site, fn)


class ReferenceRunner(Runner):
    """The torch interpreter, on whatever device the tensors are (fp32 tensors: exact math)."""
    _caches = ("_ir",)

    def __init__(self, dtype: torch.dtype = torch.bfloat16, precision: str | None = None):
        self.dtype = dtype
        self.precision = precision
        self._ir: dict[tuple[Any, str], Any] = {}

    def _typed(self, program: Any, fp8: Fp8Options = None) -> Any:
        key = (program, str(self.dtype), fp8)     # the program itself: two programs may share a name
        ir = self._ir.get(key)
        if ir is None:
            ir = self._ir[key] = typed_ir(program, gemm_options(self.dtype, "nk", fp8))
        return ir

    def _precision(self, t: torch.Tensor) -> str:
        return self.precision or ("fp32" if t.dtype == torch.float32 else "kernel")

    def gemm(self, site, program, A, W, *, layout="nk", partial=False, out=None, fp8=None, **operands):
        res = interpret(self._typed(program, fp8), A, W, operands, weight_layout=layout,
                        precision=self._precision(A), partial_tile=REFERENCE_TILE if partial else None)
        return _into(res, out)

    def map(self, site, program, X, *, partial=False, out=None, **operands):
        res = interpret_map(program, X, self.dtype, self._precision(X), partial, operands)
        return _into(res, out)


def _into(res: dict[str, torch.Tensor], out: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Copy tile outputs into the caller's ``out`` tensors, as a kernel writes them there."""
    for name, t in (out or {}).items():
        t.copy_(res[name].reshape(t.shape))
        res[name] = t
    return res


class KernelRunner(Runner):
    """Compiled kernels on a Hopper GPU. ``plan`` maps a site to its Choice (default: the heuristic
    default configuration); kernels are compiled (or fetched from the cache) on first use."""
    _caches = ("_gemms", "_maps", "_defaults")
    in_place_maps = True

    def __init__(self, dtype: torch.dtype = torch.bfloat16, plan: dict[str, Choice] | None = None,
                 cache_dir: Any = None, verbose: bool | None = None):
        self.dtype = dtype
        self._explicit: dict[str, Choice] = dict(plan or {})
        self.plan: dict[str, Choice] = dict(self._explicit)
        self.cache_dir = absolute(cache_dir) if cache_dir is not None else None   # survives a chdir
        self.verbose = verbose
        self._gemms: dict[tuple[Any, ...], Any] = {}
        self._maps: dict[tuple[Any, ...], Any] = {}
        self._defaults: dict[tuple[Any, str], KernelConfig] = {}
        self._stored: dict[tuple[str, int], tuple[str, dict[str, Choice]] | None] = {}
        self._prepared: tuple[str, int] | None = None
        self.plan_source: str | None = None

    def prepare(self, context: str, M: int, device: str | None = None) -> None:
        """Use the in-sequence tuned plan stored for this model context and M bucket, or the nearest
        M bucket's, or one tuned on another GPU of the same architecture (``plan_store.find_plan``;
        said once), if there is one (a plan passed to the constructor or tuned in this process takes
        precedence). ``plan_source`` names the stored plan in use (its key names the GPU)."""
        key = (context, m_bucket(M))
        if key == self._prepared:
            return
        if key not in self._stored:
            self._stored[key] = found = find_plan(context, self.dtype, M, self.cache_dir, device)
            if found is not None:
                self._say_if_borrowed(context, M, device, found[0])
        found = self._stored[key]
        self.plan_source = None if found is None else found[0]
        self.plan = {**(found[1] if found else {}), **self._explicit}
        self._prepared = key

    def _say_if_borrowed(self, context: str, M: int, device: str | None, key: str) -> None:
        """Say once per plan when it was tuned on another GPU than this one, or at another M bucket
        (find_plan's fallbacks): the sites whose K is the token count (the weight gradients) can run
        1.4-1.7x cuBLAS on the M = 8192 plan at M = 16384 (docs/RESULTS.md, thirty-fifth session)."""
        if device is None and not torch.cuda.is_available():
            return                                  # no GPU to name (a test's stand-in plan)
        own = plan_key(context, self.dtype, M, device)
        other_gpu, other_m = tuned_on(key) != tuned_on(own), tuned_at(key) != tuned_at(own)
        if (other_gpu or other_m) and (own, key) not in _BORROWED:
            _BORROWED.add((own, key))
            mine = [f"on this GPU ({tuned_on(own)})"] * other_gpu + [f"at M = {tuned_at(own)} tokens"] * other_m
            used = [f"on {tuned_on(key)}"] * other_gpu + [f"at M = {tuned_at(key)}"] * other_m
            say(f"no in-sequence plan tuned {' '.join(mine)} for {context}: using the one tuned {' '.join(used)} "
                "(model.tune() / block.tune() tunes one for this GPU and M)", self.verbose)

    def bound(self, context: str, M: int) -> "KernelRunner":
        """This runner with the plan of another model context and M (a block of another FP8 recipe
        in a model that mixes them: its sites have their own stored plans): itself when already
        prepared for it, else a view (``PlanView``) that reads everything but its plan from this one."""
        if self._prepared == (context, m_bucket(M)):
            return self
        return PlanView(self, context, M)

    def adopt(self, context: str, M: int, key: str, plan: dict[str, Choice]) -> None:
        """Use ``plan`` (just tuned and stored under ``key``) for this model context and M bucket from
        now on, also after ``prepare`` has switched to another M and back."""
        self._stored[(context, m_bucket(M))] = (key, dict(plan))
        self._prepared = None
        self.prepare(context, M)

    def choice(self, site: str, program: Any, layout: str, fp8: Fp8Options = None) -> Choice:
        c = self.plan.get(site)
        if c is None and site in PLAN_FALLBACK:
            c = self.plan.get(PLAN_FALLBACK[site])
        if c is not None:
            return c
        key = (program, layout, fp8)
        cfg = self._defaults.get(key)
        if cfg is None:
            cfg = self._defaults[key] = default_config(lower_program(program, gemm_options(self.dtype, layout, fp8)).graph)
        return Choice(cfg)

    @staticmethod
    def _kernel_key(program: Any, layout: str, partial: bool, config: KernelConfig, fp8: Fp8Options = None) -> tuple:
        # The program object itself (hashed by identity), not id(program): the key keeps it alive,
        # so a new program can never take a freed one's address and be given its kernel.
        return (program, layout, partial, config.name(), fp8)

    def add_kernel(self, program: Any, layout: str, partial: bool, config: KernelConfig, kernel: Any,
                   fp8: Fp8Options = None) -> None:
        """Use ``kernel`` (already built, e.g. by the tuner) for this program, layout and config."""
        self._gemms[self._kernel_key(program, layout, partial, config, fp8)] = kernel

    def kernel(self, program: Any, layout: str, partial: bool, config: KernelConfig, fp8: Fp8Options = None) -> Any:
        key = self._kernel_key(program, layout, partial, config, fp8)
        k = self._gemms.get(key)
        if k is None:
            dtype, scaling, fast = fp8_parts(fp8) if fp8 is not None else (self.dtype, None, False)
            k = self._gemms[key] = compile_epilogue(program, dtype, weight_layout=layout, config=config,
                                                    scaling=scaling, fast_accum=fast, partial_reductions=partial,
                                                    cache_dir=self.cache_dir, verbose=self.verbose)
        return k

    def gemm(self, site, program, A, W, *, layout="nk", partial=False, out=None, fp8=None, **operands):
        c = self.choice(site, program, layout, fp8)
        k = self.kernel(program, layout, partial, c.config, fp8)
        return self.timed(site, lambda: k(A, W, raster=c.raster, swizzle=c.swizzle, out=out, **operands))

    def map(self, site, program, X, *, partial=False, out=None, **operands):
        key = (program, partial)         # the program itself, as _kernel_key
        k = self._maps.get(key)
        if k is None:
            k = self._maps[key] = compile_map(program, self.dtype, partial_reductions=partial,
                                              cache_dir=self.cache_dir, verbose=self.verbose)
        return self.timed(site, lambda: k(X, out=out, **operands))


class PlanView(KernelRunner):
    """A KernelRunner seen with another context's plan: its own ``plan`` (and ``plan_source``); every
    other attribute (kernels, caches, stored plans, the recorder, the dtype) is the base runner's,
    read when used, so a recorder set on the base later, or kernels it builds, are the view's too."""

    def __init__(self, base: KernelRunner, context: str, M: int):     # no KernelRunner.__init__: the base's state
        self.__dict__["_base"] = base
        self.plan, self.plan_source, self._prepared = {}, None, None
        self.prepare(context, M)

    def __getattr__(self, name: str) -> Any:           # what the view does not hold itself
        base = self.__dict__.get("_base")
        if base is None:                                # mid-unpickling: nothing to read yet
            raise AttributeError(name)
        return getattr(base, name)

    @property
    def recorder(self) -> Recorder | None:            # type: ignore[override]
        return self._base.recorder

    def bound(self, context: str, M: int) -> KernelRunner:
        return self if self._prepared == (context, m_bucket(M)) else self._base.bound(context, M)


def default_runner(device: torch.device, dtype: torch.dtype) -> Runner:
    """Kernels on a Hopper GPU, the reference interpreter elsewhere (CPU, fp32, other GPUs)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) \
            and torch.cuda.get_device_capability(device) == (9, 0):
        return KernelRunner(dtype)
    return ReferenceRunner(dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
