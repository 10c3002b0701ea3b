"""The Llama block benchmark (issue 11): one decoder block, forward and forward+backward, as the
training step runs it, against eager PyTorch, torch.compile (default and max-autotune) and the
bare cuBLAS GEMMs of the same block, all in one process.

    python bench/block.py --out bench/results_block                      # 8B and 70B widths, M 8192/16384
    python bench/block.py --widths 8b --tokens 8192 --tune --no-max-autotune
    python bench/block.py --widths 8b 70b --tokens 8192 --fp8 --skip coda coda-identity  # FP8 rows only

Variants (each a full block on (M, D) tokens, bf16, causal GQA attention through SDPA):
- eager / compile / max-autotune: a standard Llama block (separate q/k/v and gate/up weights,
  half-split RoPE, F.rms_norm), plain autograd; torch.compile and mode="max-autotune-no-cudagraphs".
- coda: coda_cutlass.nn in a stack (the norm statistics come in from the previous block and the
  next block's go out of the down-proj epilogue), every non-attention op in an epilogue.
- cublas: the same 12 GEMMs (plain torch.mm, cuBLAS) and the same attention, in the block's
  order, and nothing else: the floor the fused kernels are held to, per GEMM and in total.
- coda-before (with --tune): the coda block with the plan it had before tuning (the stored or
  shipped plan, else the default configurations), timed in the same rounds as the tuned one: a new
  plan is judged against the old in one run, not across runs.
- with --fp8 (bench/fp8_variants.py): coda-fp8-RECIPE (LlamaBlock(fp8=RECIPE) as a middle block of
  a stack), torchao-tensorwise / torchao-rowwise (torchao float8 training + torch.compile, when
  importable), torchao-blockwise (only with --torchao-blockwise: torchao's DeepSeek-V3 prototype)
  and cublas-fp8 (the 12 GEMMs as torch._scaled_mm on operands quantised beforehand, and the same
  attention: the FP8 floor); an FP8 table gives each against bf16 torch.compile and
  torchao, the non-GEMM non-attention share, and the per-site times. With --tune each FP8 block
  is tuned in its own sequence too (its plan context is the bf16 one plus ":fp8-RECIPE"), and
  coda-fp8-RECIPE-before runs it with the plan it had before, in the same rounds. --attention-inputs
  heads heads_repeated adds coda-fp8-RECIPE@INPUTS: the same block (and runner) with SDPA handed
  head-major copies of q, k, v (k and v repeated to every head), nn/attention.py.
The forward-only figures run under torch.no_grad(), as inference or evaluation does: torch.compile
then compiles an inference graph, and the coda block runs its forward alone (nothing saved, the
gate/up GEMM writes only the SwiGLU output).
Timing: >= 50 back-to-back iterations per variant after warm-up, CUDA events around each
iteration, variants visited in a fresh shuffled order every round (same clock and power state).
Per-site times (CUDA events around each launch inside the sequence) and a profiler pass give the
per-kernel table and the non-attention device time. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.config import KernelConfig  # noqa: E402
from coda_cutlass.nn import KernelRunner, LlamaBlock, Recorder  # noqa: E402
from coda_cutlass.nn.runner import Runner  # noqa: E402
from coda_cutlass.nn.functional import first_norm  # noqa: E402
from coda_cutlass.nn.kernels import forward_only_site  # noqa: E402
from coda_cutlass.nn.plan_store import plan_key  # noqa: E402
from coda_cutlass.nn.tuning import named_candidates, tune_in_sequence  # noqa: E402
from coda_cutlass.timing import in_bursts, timed_call  # noqa: E402
from coda_cutlass.nn.reference import standard_block, standard_weights  # noqa: E402
from fp8_variants import PlanBefore, fp8_variants  # noqa: E402
from report import GpuSampler, Nvml, config_label, environment, machine_line, require_hopper  # noqa: E402

WIDTHS = {
    "1b": dict(dim=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192),      # Llama-3.2-1B
    "3b": dict(dim=3072, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192),     # Llama-3.2-3B
    "8b": dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336),
    "70b": dict(dim=8192, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=28672),
}
SEQ = 4096
MIN_ENERGY_SECONDS = 1.5   # H200: 0.5-1 s windows read 566-735 W across variants, 1.5 s ones 656-706 W
ATTENTION_NAMES = ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")


def is_attention(kernel: str) -> bool:
    k = kernel.lower()
    return any(n in k for n in ATTENTION_NAMES)


def liger_available() -> bool:
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
    except Exception:   # noqa: BLE001 - not installed, or no Triton here
        return False
    return True


def liger_block(x: torch.Tensor, w: dict[str, torch.Tensor], dims: Any, inv_freq: torch.Tensor) -> torch.Tensor:
    """The standard block with Liger-Kernel's Triton RMSNorm, RoPE and SiLU*mul (what
    liger_kernel.transformers.apply_liger_kernel_to_llama swaps into a Llama layer)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    B, S, D = x.shape
    hd, H, KV = dims.head_dim, dims.n_heads, dims.n_kv_heads
    h = LigerRMSNormFunction.apply(x, w["attn_norm"], dims.eps, 0.0, "llama", False)
    q = (h @ w["q"].t()).view(B, S, H, hd).transpose(1, 2)
    k = (h @ w["k"].t()).view(B, S, KV, hd).transpose(1, 2)
    v = (h @ w["v"].t()).view(B, S, KV, hd).transpose(1, 2)
    theta = torch.arange(S, dtype=torch.float32, device=x.device)[:, None] * inv_freq.to(x.device, torch.float32)[None]
    emb = torch.cat((theta, theta), dim=-1)[None]
    q, k = LigerRopeFunction.apply(q, k, emb.cos().to(x.dtype), emb.sin().to(x.dtype))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KV)
    x1 = x + o.transpose(1, 2).reshape(B, S, H * hd) @ w["o"].t()
    h1 = LigerRMSNormFunction.apply(x1, w["mlp_norm"], dims.eps, 0.0, "llama", False)
    return x1 + LigerSiLUMulFunction.apply(h1 @ w["gate"].t(), h1 @ w["up"].t()) @ w["down"].t()


class Workload:
    """One block at one width and token count, with every variant's inputs."""

    def __init__(self, width: str, M: int, device: torch.device, max_autotune: bool, fp8: list[str] | None = None,
                 torchao_blockwise: bool = False, attention_inputs: tuple[str, ...] = ()):
        torch.manual_seed(0)
        self.width, self.M = width, M
        self.batch, self.seq = M // SEQ, SEQ
        dims = WIDTHS[width]
        block = LlamaBlock(**dims, eps=1e-5, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            for w in (block.qkv, block.o, block.gate_up, block.down):
                w.normal_(0.0, 0.02)
            block.attn_norm.normal_(1.0, 0.1)
            block.mlp_norm.normal_(1.0, 0.1)
        self.block = block
        self.runner = KernelRunner(torch.bfloat16)
        block.runner = self.runner
        D = dims["dim"]
        self.g_next = (torch.randn(D, device=device) * 0.1 + 1).to(torch.bfloat16)
        x = torch.randn(M, D, device=device, dtype=torch.bfloat16)
        self.step = block.step(self.batch, self.seq)
        with torch.no_grad():
            self.h, self.r = first_norm(self.step, x, block.attn_norm)
        self.x = x.requires_grad_()
        self.dy = torch.randn(M, D, device=device, dtype=torch.bfloat16)
        # the standard block
        self.w = standard_weights(block)
        self.x3 = x.detach().view(self.batch, self.seq, D).clone().requires_grad_()
        self.dy3 = self.dy.view(self.batch, self.seq, D)
        self.inv = block.inv_freq
        fn = lambda x3, *ws: standard_block(x3, dict(zip(self.w, ws)), block.dims, self.inv)  # noqa: E731
        self.eager_fn = fn
        self.compiled = torch.compile(fn)
        self.compiled_max = torch.compile(fn, mode="max-autotune-no-cudagraphs") if max_autotune else None
        self.liger_fn = (lambda x3, *ws: liger_block(x3, dict(zip(self.w, ws)), block.dims, self.inv)) \
            if liger_available() else None
        self.skeleton = Skeleton(self, device)
        self.identity = Skeleton(self, device, identity=True)
        self.plan_before: dict[str, Any] | None = None     # set by --tune: the plan tuning replaced
        # --fp8: the FP8 variants (bench/fp8_variants.py), same weights, tokens and gradient
        self.fp8_v, self.fp8_params, self.fp8_parts = (fp8_variants(self, fp8, dims, device, torchao_blockwise,
                                                                    attention_inputs)
                                                       if fp8 is not None else ({}, [], {}))

    def params(self) -> list[torch.Tensor]:
        return list(self.block.parameters()) + list(self.w.values()) + [self.x, self.x3] + self.fp8_params

    def zero_grad(self) -> None:
        for p in self.params():
            p.grad = None

    # ---- variants: fwd(), fwd_bwd()
    def coda(self, backward: bool) -> None:
        if backward:
            x2, _, _ = self.block.run(self.step, self.x, self.h, self.r, self.g_next)
            x2.backward(self.dy)
        else:
            with torch.no_grad():
                self.block.run(self.step, self.x, self.h, self.r, self.g_next)

    def add_fp8_before(self, name: str, plan: dict[str, Any]) -> None:
        """Time the FP8 block ``name`` with the plan it had before tuning beside the tuned one."""
        before = PlanBefore(self.fp8_parts[name], plan)
        self.fp8_v[f"{name}-before"] = before
        self.fp8_parts[f"{name}-before"] = before

    def coda_before(self, backward: bool) -> None:
        """The coda block with the plan it had before tuning (the runner's plan swapped for one call)."""
        assert self.plan_before is not None
        tuned, self.runner.plan = self.runner.plan, self.plan_before
        try:
            self.coda(backward)
        finally:
            self.runner.plan = tuned

    def standard(self, fn: Callable[..., torch.Tensor], backward: bool) -> None:
        if backward:
            fn(self.x3, *self.w.values()).backward(self.dy3)
        else:
            with torch.no_grad():
                fn(self.x3, *self.w.values())

    def variants(self) -> dict[str, Callable[[bool], None]]:
        v: dict[str, Callable[[bool], None]] = {
            "eager": lambda b: self.standard(self.eager_fn, b),
            "compile": lambda b: self.standard(self.compiled, b),
            "coda": self.coda,
            "cublas": self.skeleton.run,
            "coda-identity": self.identity.run,
        }
        if self.plan_before is not None:
            v["coda-before"] = self.coda_before
        if self.compiled_max is not None:
            v["max-autotune"] = lambda b: self.standard(self.compiled_max, b)
        if self.liger_fn is not None:
            v["liger"] = lambda b: self.standard(self.liger_fn, b)
        v.update(self.fp8_v)
        return v


class Skeleton(Runner):
    """The block's 12 GEMMs (cuBLAS through torch.mm) and its attention, in the coda block's order,
    with every site timed like the coda runner's. With ``identity=True`` the forward and dX GEMMs
    run as coda kernels with an identity epilogue (heuristic default configuration): the mainloop's
    own gap to cuBLAS in the same sequence, without any epilogue work."""

    def __init__(self, wl: Workload, device: torch.device, identity: bool = False):
        self.identity = KernelRunner(torch.bfloat16) if identity else None
        b, d = wl.block, wl.block.dims
        M = wl.M
        rnd = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
        self.wl = wl
        self.h, self.x = wl.h, wl.x.detach()
        self.y, self.dz, self.dqkv = rnd(M, d.ffn_dim), rnd(M, 2 * d.ffn_dim), rnd(M, d.qkv_width)
        self.W = {"qkv": b.qkv.detach(), "o": b.o.detach(), "gu": b.gate_up.detach(), "down": b.down.detach()}
        self.recorder: Recorder | None = None

    def _mm(self, site: str, A: torch.Tensor, W: torch.Tensor, layout: str) -> torch.Tensor:
        """A @ W.T ("nk") or A @ W ("kn"): cuBLAS, or the coda identity kernel."""
        if self.identity is not None:
            self.identity.recorder = self.recorder
            try:
                return self.identity.gemm(site, E.identity, A, W, layout=layout)["D"]
            finally:
                self.identity.recorder = None
        return self.timed(site, lambda: A @ (W.t() if layout == "nk" else W))

    def run(self, backward: bool) -> None:
        W, h, x, step = self.W, self.h, self.x, self.wl.step
        with torch.no_grad():
            qkv = self._mm("qkv", h, W["qkv"], "nk")
            o, ctx = self.timed("attention.fwd", lambda: step.attention.forward(qkv, step.batch, step.seq, step.dims))
            x1 = self._mm("o", o, W["o"], "nk")
            self._mm("gate_up", x1, W["gu"], "nk")
            x2 = self._mm("down", self.y, W["down"], "nk")
            if not backward:
                return
            self._mm("down.dgrad", x2, W["down"], "kn")
            self.timed("down.wgrad", lambda: x2.t() @ self.y)
            dx1 = self._mm("gate_up.dgrad", self.dz, W["gu"], "kn")
            self.timed("gate_up.wgrad", lambda: self.dz.t() @ x1)
            da = self._mm("o.dgrad", dx1, W["o"], "kn")
            self.timed("o.wgrad", lambda: dx1.t() @ o)
            self.timed("attention.bwd", lambda: step.attention.backward(ctx, da))
            self._mm("qkv.dgrad", self.dqkv, W["qkv"], "kn")
            self.timed("qkv.wgrad", lambda: self.dqkv.t() @ h)


def time_rounds(wl: Workload, names: list[str], backward: bool, rounds: int, iters: int, seed: int) -> dict[str, list[float]]:
    """Per-iteration times (ms) of each variant; variants visited in a shuffled order each round."""
    fns = wl.variants()

    def call(name: str, i: int) -> Any:
        wl.zero_grad()
        return timed_call(fns[name], backward)

    events = in_bursts(names, call, rounds=rounds, burst=iters, seed=seed)
    torch.cuda.synchronize()
    return {n: [s.elapsed_time(e) for s, e in v] for n, v in events.items()}


def energy_per_step(wl: Workload, names: list[str], times_ms: dict[str, float], seconds: float, seed: int
                    ) -> dict[str, dict[str, float]]:
    """Board energy (J) per fwd+bwd step and mean power of each variant, sustained: each runs back to
    back for about ``seconds`` between two readings of NVML's energy counter, in a shuffled order.
    At the power limit a step's time is about its energy over the limit, so a variant gains time
    only by saving energy (docs/RESULTS.md)."""
    try:
        nvml = Nvml()
    except (OSError, RuntimeError) as e:
        print(f"energy pass skipped: NVML not usable ({e})", flush=True)
        return {}
    fns = wl.variants()
    order = list(names)
    random.Random(seed).shuffle(order)
    out = {}
    for n in order:
        steps = max(3, int(seconds * 1000 / times_ms[n]))
        for _ in range(2):
            wl.zero_grad()
            fns[n](True)
        with nvml.window() as w:
            for _ in range(steps):
                wl.zero_grad()
                fns[n](True)
        out[n] = {"joules": w["joules"] / steps, "watts": w["joules"] / w["seconds"], "steps": steps}
    return out


def site_times(wl: Workload, rounds: int, iters: int, backward: bool = True, skip: tuple[str, ...] = ()
               ) -> dict[str, dict[str, float]]:
    """Median time per site (us) of the coda block (and its plan before tuning) and the cuBLAS
    skeletons, fwd+bwd (or the forward alone: the coda sites are then "qkv.infer", ...), alternating."""
    rec = {"coda": Recorder(), "cublas": Recorder(), "coda-identity": Recorder()}
    if wl.plan_before is not None:
        rec["coda-before"] = Recorder()
    skeletons = {"cublas": wl.skeleton, "coda-identity": wl.identity}
    for name, part in wl.fp8_parts.items():     # --fp8: the FP8 coda blocks (their runners) and FP8 floor
        rec[name] = Recorder()
        skeletons[name] = part
    for name in skip:
        rec.pop(name, None)
    for _ in range(rounds):
        for name in rec:
            for _ in range(iters):
                wl.zero_grad()
                if name in ("coda", "coda-before"):
                    wl.runner.recorder = rec[name]
                    (wl.coda if name == "coda" else wl.coda_before)(backward)
                    wl.runner.recorder = None
                elif name in wl.fp8_parts and hasattr(wl.fp8_parts[name], "runner"):
                    part = wl.fp8_parts[name]
                    part.runner.recorder = rec[name]
                    part(backward)
                    part.runner.recorder = None
                else:
                    skeletons[name].recorder = rec[name]
                    skeletons[name].run(backward)
                    skeletons[name].recorder = None
    # a site launched more than once a step (the tensorwise gate/up weight gradient: gate and up rows)
    # counts once per launch: its median launch times its launches per step
    return {n: {site: statistics.median(t) * len(t) / (rounds * iters) for site, t in r.times_us().items()}
            for n, r in rec.items()}


def device_breakdown(wl: Workload, names: list[str], iters: int, backward: bool = True) -> dict[str, dict[str, float]]:
    """Profiler pass: device time per fwd+bwd (or forward-only) iteration (us), split into attention
    and the rest, and for the rest into GEMM-like kernels and others."""
    from torch.profiler import ProfilerActivity, profile
    fns = wl.variants()
    out: dict[str, dict[str, float]] = {}
    for n in names:
        for _ in range(8):      # the sustained state the timing rounds see, not a cold start
            wl.zero_grad()
            fns[n](backward)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                wl.zero_grad()
                fns[n](backward)
            torch.cuda.synchronize()
        tot = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
        kernels: dict[str, float] = {}
        for ev in prof.events():
            if ev.device_type != torch.autograd.DeviceType.CUDA or getattr(ev, "is_user_annotation", False):
                continue    # kernels only: a record_function range's GPU span is not one
            us = ev.time_range.elapsed_us() / iters
            name = ev.name
            kernels[name] = kernels.get(name, 0.0) + us
            low = name.lower()
            if is_attention(name):
                tot["attention"] += us
            elif any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "device_kernel")):
                tot["gemm"] += us
            else:
                tot["other"] += us
        tot["non_attention"] = tot["gemm"] + tot["other"]
        tot["top"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])  # type: ignore[assignment]
        out[n] = tot
    return out


def run_workload(width: str, M: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    t0 = time.monotonic()
    wl = Workload(width, M, device, args.max_autotune, args.fp8, args.torchao_blockwise, tuple(args.attention_inputs))
    names = [n for n in wl.variants() if n not in args.skip]
    print(f"[{width} M={M}] warm-up / compile ...", flush=True)
    for n in names:
        for backward in (False, True):
            for _ in range(2):
                wl.zero_grad()
                wl.variants()[n](backward)
    torch.cuda.synchronize()
    print(f"[{width} M={M}] ready in {time.monotonic() - t0:.0f} s", flush=True)
    tuned = tuned_fwd = None
    tuned_fp8: dict[str, dict[str, Any]] = {}
    before = dict(wl.runner.plan)       # the stored or shipped plan (prepared in the warm-up)
    tuning = dict(context=wl.block.context(), M=M, iters=args.tune_iters, rounds=args.tune_rounds, warmup=1,
                  confirm_rounds=args.confirm_rounds, margin=args.margin,
                  extra=[KernelConfig.from_name(c) for c in args.extra_configs], verbose=True,
                  candidates=named_candidates(args.tune_configs, torch.bfloat16) if args.tune_configs else None)
    if args.tune and "coda" not in args.skip:
        print(f"[{width} M={M}] in-sequence tuning ...", flush=True)
        tuned = tune_in_sequence(wl.runner, lambda: (wl.zero_grad(), wl.coda(True)), **tuning)
    if args.tune:       # the FP8 blocks (--fp8), each in its own sequence
        for name, part in list(wl.fp8_parts.items()):
            if not hasattr(part, "runner") or getattr(part, "follows", None) is not None:
                continue       # the cuBLAS floor; an attention-inputs variant (on its block's runner)
            print(f"[{width} M={M}] in-sequence tuning of {name} ...", flush=True)
            before_fp8 = dict(part.runner.plan)
            tuned_fp8[name] = tune_in_sequence(part.runner, lambda part=part: (wl.zero_grad(), part(True)),
                                               **{**tuning, "context": part.block.context()})
            wl.add_fp8_before(name, before_fp8)
    if args.tune_forward:
        print(f"[{width} M={M}] in-sequence tuning of the forward alone (no autograd) ...", flush=True)
        tuned_fwd = tune_in_sequence(wl.runner, lambda: wl.coda(False), only=forward_only_site, **tuning)
    if tuned or tuned_fwd:
        wl.plan_before = before     # timed beside the new plan (when equal: a control of the noise)
    if tuned or tuned_fwd or tuned_fp8:
        names = [n for n in wl.variants() if n not in args.skip]
    res: dict[str, Any] = {"width": width, "M": M, "batch": wl.batch, "seq": wl.seq}
    for backward in (False, True):
        times = time_rounds(wl, names, backward, args.rounds, args.iters, seed=M + backward)
        res["fwd_bwd" if backward else "fwd"] = {n: {"median_ms": statistics.median(v), "mean_ms": statistics.fmean(v),
                                                     "n": len(v)} for n, v in times.items()}
    res["energy"] = energy_per_step(wl, names, {n: v["median_ms"] for n, v in res["fwd_bwd"].items()},
                                    seconds=args.energy_seconds, seed=M) if args.energy_seconds > 0 else {}
    res["sites"] = site_times(wl, rounds=2, iters=max(3, args.iters // 4), skip=tuple(args.skip))
    res["sites_fwd"] = site_times(wl, rounds=2, iters=max(3, args.iters // 4), backward=False, skip=tuple(args.skip))
    res["device"] = device_breakdown(wl, names, iters=3)
    res["device_fwd"] = device_breakdown(wl, names, iters=3, backward=False)
    res["fp8_weight_quant_ms"] = {n: p.weight_quant_ms() for n, p in wl.fp8_parts.items() if hasattr(p, "weight_quant_ms")}
    res["fp8_weight_quant_map_ms"] = {n: p.weight_quant_ms(map_kernel=True) for n, p in wl.fp8_parts.items()
                                      if hasattr(p, "weight_quant_ms") and p.block.fp8.scaling == "tensor"}
    res["plan"] = {s: c.to_json() for s, c in wl.runner.plan.items()}
    res["plan_source"] = wl.runner.plan_source    # the plan key in use (None: default configurations)
    res["fp8_plans"] = {n: {"source": p.runner.plan_source, "plan": {s: c.to_json() for s, c in p.runner.plan.items()}}
                        for n, p in wl.fp8_parts.items() if hasattr(p, "runner") and not n.endswith("-before")}
    for n, rec in tuned_fp8.items():
        res.setdefault("fp8_tuning", {})[n] = {k: rec[k] for k in ("before_us", "after_us", "seconds", "timings",
                                                                   "confirm")}
    if wl.plan_before is not None:
        res["plan_before"] = {s: c.to_json() for s, c in wl.plan_before.items()}
    for key, rec in (("tuning", tuned), ("tuning_forward", tuned_fwd)):
        if rec:
            res[key] = {k: rec[k] for k in ("before_us", "after_us", "seconds", "timings", "confirm")}
            res["plan_key"] = plan_key(wl.block.context(), torch.bfloat16, M)
    res["seconds"] = round(time.monotonic() - t0, 1)
    del wl
    torch.cuda.empty_cache()
    return res


SITE_ORDER = ["qkv", "o", "gate_up", "down", "down.dgrad", "gate_up.dgrad", "qkv.dgrad"]


def markdown(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [f"# Llama block benchmark\n\n{machine_line(env)}{env.get('sampler', '')}\n"]
    lines.append("| width | M | variant | fwd ms | fwd+bwd ms | fwd+bwd vs compile | non-attention device us | "
                 "vs cuBLAS GEMMs | fwd: non-attention us | fwd: vs cuBLAS | J per fwd+bwd | W |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        comp = r["fwd_bwd"].get("compile", {}).get("median_ms", float("nan"))   # nan: --skip compile
        floor = r["device"].get("cublas", {}).get("non_attention", float("nan"))
        fwd = r.get("device_fwd", {})
        floor_fwd = fwd.get("cublas", {}).get("non_attention", float("nan"))
        for n in r["fwd_bwd"]:
            fb = r["fwd_bwd"][n]["median_ms"]
            na = r["device"].get(n, {}).get("non_attention", float("nan"))
            naf = fwd.get(n, {}).get("non_attention", float("nan"))
            en = r.get("energy", {}).get(n, {})
            lines.append(f"| {r['width']} | {r['M']} | {n} | {r['fwd'][n]['median_ms']:.2f} | {fb:.2f} | "
                         f"{comp / fb - 1:+.1%} | {na:.0f} | {na / floor:.3f} | {naf:.0f} | {naf / floor_fwd:.3f} | "
                         f"{en.get('joules', float('nan')):.2f} | {en.get('watts', float('nan')):.0f} |")
    lines.append("\nPer fused kernel inside the block's sequence (fwd+bwd, median us), against the same GEMM on cuBLAS "
                 "in the same sequence:\n")
    lines.append("| width | M | site | coda us | cuBLAS us | ratio | coda identity epilogue (default config) / cuBLAS | "
                 "config | plan before tuning / cuBLAS | its config |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for s in SITE_ORDER:
            c, b = r["sites"].get("coda", {}).get(s), r["sites"].get("cublas", {}).get(s)
            if c is None or b is None:
                continue
            plan = r["plan"].get(s)
            cfg = "default" if plan is None else config_label(plan)
            ident = r["sites"].get("coda-identity", {}).get(s)
            ident_ratio = f"{ident / b:.3f}" if ident else "-"
            before, before_cfg = r["sites"].get("coda-before", {}).get(s), "-"
            if "plan_before" in r:
                p = r["plan_before"].get(s)
                before_cfg = "default" if p is None else ("same" if p == plan else config_label(p))
            before_ratio = f"{before / b:.3f}" if before else "-"
            lines.append(f"| {r['width']} | {r['M']} | {s} | {c:.0f} | {b:.0f} | {c / b:.3f} | {ident_ratio} | {cfg} | "
                         f"{before_ratio} | {before_cfg} |")
    if any("sites_fwd" in r for r in results):
        lines.append("\nThe forward alone (no autograd: the coda block's forward-only sites, \"qkv.infer\", ...), per "
                     "fused kernel, median us, against the same GEMM on cuBLAS in the forward-only sequence:\n")
        lines.append("| width | M | site | coda us | cuBLAS us | ratio | config | plan before tuning / cuBLAS |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in results:
            fwd = r.get("sites_fwd", {})
            for s in ("qkv", "o", "gate_up", "down"):
                c, b = fwd.get("coda", {}).get(s + ".infer"), fwd.get("cublas", {}).get(s)
                if c is None or b is None:
                    continue
                plan = r["plan"].get(s + ".infer") or r["plan"].get(s)
                cfg = "default" if plan is None else config_label(plan)
                before = fwd.get("coda-before", {}).get(s + ".infer")
                lines.append(f"| {r['width']} | {r['M']} | {s}.infer | {c:.0f} | {b:.0f} | {c / b:.3f} | {cfg} | "
                             f"{f'{before / b:.3f}' if before else '-'} |")
    lines += fp8_markdown(results)
    return "\n".join(lines) + "\n"


def fp8_markdown(results: list[dict[str, Any]]) -> list[str]:
    """The FP8 rows (--fp8): each variant's fwd+bwd against bf16 torch.compile and torchao float8,
    and the share of its device time outside GEMMs and attention."""
    rows = [r for r in results if any(n.startswith(("coda-fp8", "torchao")) for n in r["fwd_bwd"])]
    if not rows:
        return []
    out = ["\nFP8 (fwd+bwd, same rounds as above): speed-up over each peer (>1: faster), and the share of device "
           "time in kernels that are neither GEMMs nor attention:\n",
           "| width | M | variant | fwd+bwd ms | x bf16 compile | x torchao tensorwise | x torchao rowwise | "
           "x torchao blockwise | GEMM / attention / other us | other share | weight copies ms per optimizer step "
           "(by the map kernel) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fb = {n: v["median_ms"] for n, v in r["fwd_bwd"].items()}
        for n in [n for n in fb if n.startswith(("coda", "torchao", "cublas")) or n == "compile"]:
            dev = r["device"].get(n, {})
            tot = sum(dev.get(k, 0.0) for k in ("gemm", "attention", "other"))
            x = lambda peer: f"{fb[peer] / fb[n]:.2f}" if peer in fb else "-"  # noqa: E731
            wq, wt = r.get("fp8_weight_quant_ms", {}).get(n), r.get("fp8_weight_quant_map_ms", {}).get(n)
            out.append(f"| {r['width']} | {r['M']} | {n} | {fb[n]:.2f} | {x('compile')} | {x('torchao-tensorwise')} | "
                       f"{x('torchao-rowwise')} | {x('torchao-blockwise')} | {dev.get('gemm', 0):.0f} / {dev.get('attention', 0):.0f} / "
                       f"{dev.get('other', 0):.0f} | {dev.get('other', 0) / tot if tot else float('nan'):.1%} | "
                       f"{'-' if wq is None else f'{wq:.2f}'}{'' if wt is None else f' ({wt:.2f})'} |")
    out += ["\nFP8 per site inside the block's sequence (fwd+bwd, median us; quantisation launches are their own "
            "sites), against torch._scaled_mm tensorwise on operands quantised beforehand:\n",
            "| width | M | variant | site | us | cublas-fp8 us | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = r["sites"].get("cublas-fp8", {})
        for n, sites in r["sites"].items():
            if not n.startswith("coda-fp8"):
                continue
            for site, us in sites.items():
                b = floor.get(site)
                out.append(f"| {r['width']} | {r['M']} | {n} | {site} | {us:.0f} | {'-' if b is None else f'{b:.0f}'} | "
                           f"{'-' if b is None else f'{us / b:.3f}'} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", nargs="+", default=["8b", "70b"], choices=list(WIDTHS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10, help="iterations per variant per round (rounds x iters >= 50)")
    ap.add_argument("--tune", action="store_true", help="tune the coda block's kernels in its own sequence first")
    ap.add_argument("--tune-iters", type=int, default=2, help="timed steps per visit of a tuning choice")
    ap.add_argument("--tune-rounds", type=int, default=2,
                    help="visits of each tuning choice (a shuffled order, then its mirror)")
    ap.add_argument("--tune-forward", action="store_true",
                    help="tune the forward-only sites (*.infer) in the forward's own sequence (no autograd)")
    ap.add_argument("--confirm-rounds", type=int, default=4,
                    help="with --tune: rounds of the confirmation pass (0: first pass only)")
    ap.add_argument("--margin", type=float, default=0.01,
                    help="with --tune: how much faster (relative) a challenger must be to replace a site's incumbent")
    ap.add_argument("--extra-configs", nargs="*", default=[], metavar="CONFIG",
                    help="with --tune: configurations to try besides the candidate space, e.g. "
                         "128x128x64_c2x2_pingpong (where they fit a site's program)")
    ap.add_argument("--tune-configs", nargs="*", default=[], metavar="CONFIG",
                    help="with --tune: only these configurations of each site's candidate space (e.g. the "
                         "prebuilt ones: tuning then compiles nothing); default: the whole space")
    ap.add_argument("--energy-seconds", type=float, default=1.5,
                    help="sustained seconds per variant in the energy pass (NVML energy counter; 0 skips it). "
                         "Short windows are noisy: variants read 566-735 W at 0.5-1 s, 656-706 W at 1.5 s (H200)")
    ap.add_argument("--no-max-autotune", dest="max_autotune", action="store_false")
    ap.add_argument("--skip", nargs="*", default=[], metavar="VARIANT",
                    help="variants left out (e.g. coda coda-identity: no bf16 coda kernels to build)")
    ap.add_argument("--fp8", nargs="*", metavar="RECIPE", default=None,
                    help="also time FP8 variants: coda's FP8 block with these recipes (no names: blockwise), "
                         "torchao float8 tensorwise and rowwise + torch.compile (when importable) and the FP8 "
                         "cuBLAS floor (torch._scaled_mm), in the same rounds")
    ap.add_argument("--attention-inputs", nargs="*", default=[], choices=["heads", "heads_repeated"],
                    help="with --fp8: also each recipe's block with SDPA handed head-major copies of q, k, v (k and "
                         "v repeated to every head), variants coda-fp8-RECIPE@INPUTS (nn/attention.py)")
    ap.add_argument("--torchao-blockwise", action="store_true",
                    help="with --fp8: also torchao's blockwise (DeepSeek-V3) prototype as a peer (slow to compile)")
    ap.add_argument("--out", type=Path, default=Path("bench/results_block"))
    args = ap.parse_args()
    if args.fp8 is not None and not args.fp8:
        args.fp8 = ["blockwise"]
    if 0 < args.energy_seconds < MIN_ENERGY_SECONDS:
        print(f"note: --energy-seconds {args.energy_seconds} is under {MIN_ENERGY_SECONDS} s: the energy column "
              "will be noisy (docs/RESULTS.md, eighth session)", flush=True)
    require_hopper("bench/block.py")
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    results = []
    with GpuSampler() as sampler:
        for width in args.widths:
            for M in args.tokens:
                results.append(run_workload(width, M, args, device))
                (args.out / "results.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    env["sampler"] = sampler.summary()
    (args.out / "results.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    plans = {r["plan_key"]: {"sites": r["plan"], "measured": env["date"]} for r in results if "plan_key" in r}
    if plans:   # tuned plans, in the format of coda_cutlass/nn/plans/*.json
        (args.out / "plans.json").write_text(json.dumps(plans, indent=1, sort_keys=True))
    text = markdown(results, env)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
