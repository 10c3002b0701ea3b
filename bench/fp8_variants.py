"""The FP8 variants of the block benchmark (``bench/block.py --fp8``), on the same weights, tokens
and gradient as the bf16 variants:

- coda-fp8-RECIPE: ``LlamaBlock(fp8=RECIPE)`` as a middle block of a stack (its input's FP8 copy
  comes from the previous block, computed once outside the timing as the bf16 block's h is; its
  output's FP8 copy goes to the next block; its output's gradient arrives in FP8 with its
  transposed copy, as the next block's QKV dX epilogue writes it, also made once outside). The weights' FP8 copies are made once per optimizer
  step, so they are cached across the timed steps; ``weight_quant_ms`` says what one remake costs.
- torchao-tensorwise / torchao-rowwise: the standard block with nn.Linear layers converted by
  ``torchao.float8.convert_to_float8_training`` with that recipe, then torch.compile (torchao's
  documented use; it quantises the weights inside every step).
- torchao-blockwise: the same block with torchao's DeepSeek-V3 recipe
  (``torchao.prototype.blockwise_fp8_training``: 1 x 128 activations and gradients, 128 x 128
  weights, Triton quantisation kernels, cuBLAS blockwise GEMMs through ``torch._scaled_mm``), then
  torch.compile: the peer of coda's "blockwise" recipe. Opt-in (``bench/block.py
  --torchao-blockwise``): on the H200 (torchao 0.18, torch 2.11) its first compiled step had not
  finished after 200 s (dynamo cannot trace ``_scaled_mm_v2`` and breaks the graph there).
- cublas-fp8: the block's 12 GEMMs as ``torch._scaled_mm`` with per-tensor scales on operands
  quantised beforehand (fast accumulation, as torchao's tensorwise forward), and the same attention,
  nothing else: the FP8 floor.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.nn as nn

from coda_cutlass.nn import KernelRunner, LlamaBlock
from coda_cutlass.nn.fp8.autograd import stash_put
from coda_cutlass.nn.fp8.functional import quantize_operand
from coda_cutlass.nn.fp8.support import first_norm_fp8
from coda_cutlass.nn.fp8.tensorwise import TensorOperand
from coda_cutlass.nn.reference import PROJECTIONS, LinearBlock
from coda_cutlass.nn.runner import Runner
from coda_cutlass.quantization import quantize_tensor

E4M3 = torch.float8_e4m3fn


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:      # not installed, or built for another torch
        return False
    return True


def torchao_layer(w: dict[str, torch.Tensor], dims: Any, inv_freq: torch.Tensor, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    layer = LinearBlock(w, dims, inv_freq)
    convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    return torch.compile(layer)


def torchao_blockwise_layer(w: dict[str, torch.Tensor], dims: Any, inv_freq: torch.Tensor,
                            probe: torch.Tensor) -> nn.Module | None:
    """The standard block with torchao's blockwise FP8 linears, compiled (eager where torch.compile
    fails on it; one step on ``probe`` decides); None where that prototype does not import or run
    (it is a prototype: its module path and its needs may change between torchao releases)."""
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"torchao blockwise FP8 training not importable ({type(e).__name__}: {e}): skipped", flush=True)
        return None
    layer = LinearBlock(w, dims, inv_freq)
    for name in PROJECTIONS:
        setattr(layer, name, Float8BlockwiseLinear.from_float(getattr(layer, name)))
    for how, candidate in (("compiled", torch.compile(layer)), ("eager", layer)):
        try:
            x = probe.detach().clone().requires_grad_()
            candidate(x).float().sum().backward()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"torchao blockwise ({how}) failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        layer.zero_grad(set_to_none=True)
        if how == "eager":
            print("torchao-blockwise runs eagerly (torch.compile failed on it)", flush=True)
        return candidate
    return None


def _q(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t in e4m3 with a per-tensor scale (amax / 448), as torchao's tensorwise recipe makes it."""
    s = t.float().abs().amax().clamp(min=1e-12) / 448.0
    return quantize_tensor(t, E4M3, s), s


class Fp8Skeleton(Runner):
    """The block's 12 GEMMs as torch._scaled_mm (per-tensor scales, operands quantised beforehand)
    and its attention, in the coda block's order: the FP8 floor."""

    def __init__(self, wl: Any, device: torch.device):
        b, d, M = wl.block, wl.block.dims, wl.M
        rnd = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
        self.wl = wl
        self.recorder = None
        acts = {"h": wl.h, "o": rnd(M, d.q_width), "h1": rnd(M, d.dim), "y": rnd(M, d.ffn_dim),
                "dx2": rnd(M, d.dim), "dz": rnd(M, 2 * d.ffn_dim), "dx1": rnd(M, d.dim), "dqkv": rnd(M, d.qkv_width)}
        self.a = {k: _q(v) for k, v in acts.items()}                           # A operands (row-major)
        self.at = {k: _q(v.t().contiguous()) for k, v in acts.items()}         # transposed (wgrad A and B)
        W = {"qkv": b.qkv, "o": b.o, "gu": b.gate_up, "down": b.down}
        self.w = {k: _q(v.detach()) for k, v in W.items()}                     # (N, K): B = w.t() column-major
        self.wt = {k: _q(v.detach().t().contiguous()) for k, v in W.items()}   # (K, N): dgrad's B

    def _mm(self, site: str, a: tuple, b: tuple) -> torch.Tensor:
        """a (M, K) row-major @ b (N, K)^T -> (M, N) bf16."""
        return self.timed(site, lambda: torch._scaled_mm(a[0], b[0].t(), scale_a=a[1], scale_b=b[1],
                                                         out_dtype=torch.bfloat16, use_fast_accum=True))

    def run(self, backward: bool) -> None:
        a, at, w, wt, step = self.a, self.at, self.w, self.wt, self.wl.step
        with torch.no_grad():
            qkv = self._mm("qkv", a["h"], w["qkv"])
            o, ctx = self.timed("attention.fwd", lambda: step.attention.forward(qkv, step.batch, step.seq, step.dims))
            self._mm("o", a["o"], w["o"])
            self._mm("gate_up", a["h1"], w["gu"])
            self._mm("down", a["y"], w["down"])
            if not backward:
                return
            self._mm("down.dgrad", a["dx2"], wt["down"])
            self._mm("down.wgrad", at["dx2"], at["y"])
            self._mm("gate_up.dgrad", a["dz"], wt["gu"])
            self._mm("gate_up.wgrad", at["dz"], at["h1"])
            da = self._mm("o.dgrad", a["dx1"], wt["o"])
            self._mm("o.wgrad", at["dx1"], at["o"])
            self.timed("attention.bwd", lambda: step.attention.backward(ctx, da))
            self._mm("qkv.dgrad", a["dqkv"], wt["qkv"])
            self._mm("qkv.wgrad", at["dqkv"], at["h"])


def incoming_gradient(step: Any, dy: torch.Tensor, recipe: Any) -> Any:
    """dy in FP8 as the next block's QKV dX epilogue hands it over (nn/fp8/autograd.py's stash):
    per-tensor codes with their transposed copy, or 1 x 128 runs with the transposed 128 x 1 copy."""
    if recipe.scaling == "tensor":
        q, s = _q(dy)
        return TensorOperand(q, s, q.t().contiguous())
    return quantize_operand(step, "dx2.quant", dy)    # as a block quantises a gradient from outside


class CodaFp8:
    """An FP8 coda block with the bf16 block's weights, as a middle block of a stack."""

    def __init__(self, wl: Any, recipe: str, dims: dict[str, int], device: torch.device,
                 inputs: str = "views", follows: "CodaFp8 | None" = None):
        self.block = LlamaBlock(**dims, eps=1e-5, fp8=recipe, device=device, dtype=torch.bfloat16)
        self.block.load_state_dict(wl.block.state_dict())
        self.block.attention.inputs = inputs          # nn/attention.py ATTENTION_INPUTS
        # a variant of another block (its attention inputs only) runs that block's runner: the same
        # kernels and plan, tuned or not (--tune tunes the block it follows)
        self.follows = follows
        self.runner = follows.runner if follows is not None else KernelRunner(torch.bfloat16)
        self.block.runner = self.runner
        self.wl = wl
        self.step = self.block.step(wl.batch, wl.seq)
        with torch.no_grad():
            self.h, self.r = first_norm_fp8(self.step, wl.x.detach(), self.block.attn_norm)
            # a middle block's h arrives quantised by the previous block's down-proj epilogue
            self.h = self.block.fp8_path().quantize_input(self.step, self.h)
            # and its output's gradient quantised, with the transposed copy, by the next block's QKV dX
            # epilogue: made once here, outside the timing, as h is (the block's own QKV dX epilogue
            # makes the same for the block before it, inside the timing)
            self.dy_q = incoming_gradient(self.step, wl.dy, self.block.fp8)

    def __call__(self, backward: bool) -> None:
        wl = self.wl
        if backward:
            x2, _, _ = self.block.run(self.step, wl.x, self.h, self.r, wl.g_next, next_fp8=True)
            stash_put(self.step, wl.dy, self.dy_q)
            x2.backward(wl.dy)
        else:
            with torch.no_grad():
                self.block.run(self.step, wl.x, self.h, self.r, wl.g_next, next_fp8=True)

    def weight_quant_ms(self, reps: int = 5, map_kernel: bool = False) -> float:
        """One remake of the block's four FP8 weight copies (what each optimizer step adds), as the
        block makes them (compiled torch, the four in one call), or with ``map_kernel`` (per tensor
        only) by the runner's ``quantize_tensor`` map kernel, the alternative docs/RESULTS.md measures
        against it."""
        cache = self.block.fp8_weights()
        b = self.block
        times = []
        for _ in range(reps + 1):
            cache.clear()
            torch.cuda.synchronize()
            t = time.perf_counter()
            pairs = [(b.qkv, False), (b.o, False), (b.down, False), (b.gate_up, b.fp8.scaling == "tensor")]
            if map_kernel:
                for w, halves in pairs:
                    cache.get(w, halves=halves, runner=self.runner)
            else:                               # as the blocks make them: together (Fp8Weights.get_all)
                cache.get_all(pairs)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times[1:])[reps // 2]


class PlanBefore:
    """An FP8 coda block run with the plan its runner had before in-sequence tuning (``--tune``),
    timed in the same rounds as the tuned plan (the plan swapped in for one call)."""

    def __init__(self, part: CodaFp8, plan: dict[str, Any]):
        self.part, self.plan, self.runner = part, plan, part.runner

    def __call__(self, backward: bool) -> None:
        tuned, self.runner.plan = self.runner.plan, self.plan
        try:
            self.part(backward)
        finally:
            self.runner.plan = tuned


def fp8_variants(wl: Any, recipes: list[str], dims: dict[str, int], device: torch.device,
                 torchao_blockwise: bool = False, attention_inputs: tuple[str, ...] = ()
                 ) -> tuple[dict[str, Callable[[bool], None]], list[torch.Tensor], dict[str, Any]]:
    """(variants by name, their parameters for zero_grad, the coda FP8 blocks by variant name).
    ``attention_inputs``: also each recipe's block with SDPA handed those inputs ("heads",
    "heads_repeated"), as variants ``coda-fp8-RECIPE@INPUTS`` on the recipe block's runner."""
    v: dict[str, Callable[[bool], None]] = {}
    params: list[torch.Tensor] = []
    coda: dict[str, CodaFp8] = {}
    for r in recipes:
        base = c = coda[f"coda-fp8-{r}"] = CodaFp8(wl, r, dims, device)
        v[f"coda-fp8-{r}"] = c
        params += list(c.block.parameters())
        for inputs in attention_inputs:
            c = coda[f"coda-fp8-{r}@{inputs}"] = CodaFp8(wl, r, dims, device, inputs=inputs, follows=base)
            v[f"coda-fp8-{r}@{inputs}"] = c
            params += list(c.block.parameters())
    skel = Fp8Skeleton(wl, device)
    v["cublas-fp8"] = skel.run
    coda["cublas-fp8"] = skel          # type: ignore[assignment]   (timed per site like the others)
    if torchao_available():
        layers = {r: torchao_layer(wl.w, wl.block.dims, wl.inv, r) for r in ("tensorwise", "rowwise")}
        if torchao_blockwise:   # opt-in: see torchao_blockwise_layer
            layers["blockwise"] = torchao_blockwise_layer(wl.w, wl.block.dims, wl.inv, wl.x3)
        for r, layer in layers.items():
            if layer is None:
                continue
            params += list(layer.parameters())

            def run(backward: bool, layer: nn.Module = layer) -> None:
                if backward:
                    layer(wl.x3).backward(wl.dy3)
                else:
                    with torch.no_grad():
                        layer(wl.x3)
            v[f"torchao-{r}"] = run
    else:
        print("torchao not importable: its float8 variants are skipped", flush=True)
    return v, params, coda
