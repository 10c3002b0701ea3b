"""Benchmarks of the pairwise / log-sum-exp epilogues (issue 4) on Llama-3-8B shapes, bf16: each
fused kernel against bare cuBLAS of the same GEMM, eager PyTorch and torch.compile doing the same
work, all timed in one run (calls interleaved in a shuffled order, rotating input sets, CUDA-event
medians).

    python bench/pairwise.py --out bench/results_pairwise          # tunes on first use
    python bench/pairwise.py --workloads swiglu rope --no-tune

Writes results.json, results.md and results.png. `python -m coda_cutlass prebuild
bench/pairwise.py --all-candidates --out DIR` builds every tuning candidate ahead of time.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.timing import interleaved, sustained  # noqa: E402
from report import (GpuSampler, config_label, environment, machine_line, ratio_bars,  # noqa: E402
                    require_hopper, write_results)

D_MODEL, FFN, QKV, VOCAB, HEAD_DIM = 4096, 14336, 6144, 128256, 128


@dataclass(frozen=True)
class Workload:
    name: str
    program: Any
    N: int
    K: int
    inputs: Callable[[int, int, int, torch.Generator], dict[str, Any]]   # operands besides A, W
    eager: Callable[[dict], Any]
    what: str


def _row32(M: int, g: torch.Generator) -> torch.Tensor:
    return torch.rand(M, device="cuda", generator=g) + 0.5


def _rope_freq(N: int) -> torch.Tensor:
    """Llama-3 style: q (32 heads) and k (8 heads) rotated, v (1024 columns) not."""
    inv = 500000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device="cuda") / HEAD_DIM)
    per_head = inv.repeat_interleave(2)
    rotated = (N - 1024) // HEAD_DIM
    return torch.cat([per_head.repeat(rotated), torch.zeros(1024, device="cuda")])


def _pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x[:, 0::2], x[:, 1::2]


def eager_swiglu(x: dict) -> Any:
    z = ((x["A"] @ x["W"].t()).float() * x["r"][:, None]).to(torch.bfloat16)
    g, u = _pairs(z)
    return z, F.silu(g) * u


def eager_swiglu_only(x: dict) -> Any:
    return eager_swiglu(x)[1]


def eager_rope(x: dict) -> Any:
    z = (x["A"] @ x["W"].t()).float() * x["r"][:, None]
    theta = x["pos"][:, None] * x["freq"][None, 0::2]
    c, s = torch.cos(theta), torch.sin(theta)
    a, b = _pairs(z)
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2).to(torch.bfloat16)


def eager_lm_head(x: dict) -> Any:
    logits = (x["A"] @ x["W"].t()).float() * x["r"][:, None]
    return torch.logsumexp(logits, -1), logits.gather(1, x["target"][:, None].clamp_min(0))[:, 0]


def eager_lm_head_logits(x: dict) -> Any:
    logits = (x["A"] @ x["W"].t()).float() * x["r"][:, None]
    return logits.to(torch.bfloat16), torch.logsumexp(logits, -1), logits.gather(1, x["target"][:, None])[:, 0]


def eager_swiglu_backward(x: dict) -> Any:
    dy = x["A"] @ x["W"].t()
    g, u = x["z"][:, 0::2].float(), x["z"][:, 1::2].float()
    s = torch.sigmoid(g)
    dg = dy * u * s * (1 + g * (1 - s))
    du = dy * g * s
    dz = torch.stack((dg, du), -1).flatten(-2).to(torch.bfloat16)
    return (g * s * u).to(torch.bfloat16), dz, (g * dg + u * du).sum(-1)


def eager_qk_norm(x: dict) -> Any:
    z = (x["A"] @ x["W"].t()).float() * x["r"][:, None]
    return z.to(torch.bfloat16), z.pow(2).view(z.shape[0], -1, HEAD_DIM).sum(-1)


WORKLOADS = {w.name: w for w in [
    Workload("swiglu", E.swiglu, 2 * FFN, D_MODEL, lambda M, N, K, g: {"r": _row32(M, g)}, eager_swiglu,
             "gate/up GEMM, row scale, z (M x 2f) + SwiGLU y (M x f, half width)"),
    Workload("swiglu_only", E.swiglu_only, 2 * FFN, D_MODEL, lambda M, N, K, g: {"r": _row32(M, g)},
             eager_swiglu_only, "gate/up GEMM, row scale, SwiGLU y only (M x f, half width)"),
    Workload("rope", E.rope, QKV, D_MODEL,
             lambda M, N, K, g: {"r": _row32(M, g), "pos": torch.arange(M, device="cuda").float() % 8192,
                                 "freq": _rope_freq(N)}, eager_rope,
             "QKV GEMM, row scale, RoPE on q and k from pos x freq"),
    Workload("qk_norm_stats", E.qk_norm_stats, QKV, D_MODEL, lambda M, N, K, g: {"r": _row32(M, g)},
             eager_qk_norm, "QKV GEMM, row scale, per-head sum of squares"),
    Workload("lm_head_lse", E.lm_head_lse, VOCAB, D_MODEL,
             lambda M, N, K, g: {"r": _row32(M, g),
                                 "target": torch.randint(0, N, (M,), device="cuda", generator=g)},
             eager_lm_head, "LM head, row scale, LSE partials + target logit, logits not written"),
    Workload("lm_head_lse_logits", E.lm_head_lse_logits, VOCAB, D_MODEL,
             lambda M, N, K, g: {"r": _row32(M, g),
                                 "target": torch.randint(0, N, (M,), device="cuda", generator=g)},
             eager_lm_head_logits, "LM head as above, logits written (bf16)"),
    Workload("swiglu_backward", E.swiglu_backward, FFN, D_MODEL,
             lambda M, N, K, g: {"z": torch.randn(M, 2 * N, device="cuda", generator=g).to(torch.bfloat16)},
             eager_swiglu_backward, "down-proj dX GEMM, packed z pairs in, dz pairs + y + z.dz out"),
]}

# the workloads' programs, and the identity epilogue timed beside each (our GEMM without epilogue work)
PREBUILD = [(w.program, {"dtype": torch.bfloat16}) for w in WORKLOADS.values()] + [(E.identity, {"dtype": torch.bfloat16})]


def make_set(w: Workload, M: int, seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = {"A": (torch.randn(M, w.K, device="cuda", generator=g) * 0.5).to(torch.bfloat16),
         "W": (torch.randn(w.N, w.K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)}
    x.update(w.inputs(M, w.N, w.K, g))
    return x


def run(ms: list[int], names: list[str], tune: bool, rounds: int, sets_per_row: int) -> list[dict[str, Any]]:
    rows = []
    identity = cc.compile_epilogue(E.identity, torch.bfloat16, config="tune" if tune else None)
    for name in names:
        w = WORKLOADS[name]
        default = cc.compile_epilogue(w.program, torch.bfloat16)
        tuned = cc.compile_epilogue(w.program, torch.bfloat16, config="tune") if tune else None
        compiled = torch.compile(w.eager, dynamic=False)
        for M in ms:
            sets = [make_set(w, M, seed) for seed in range(1, sets_per_row + 1)]
            args = [a for a in sets[0] if a not in ("A", "W")]
            fns: dict[str, Callable[[dict], Any]] = {
                "cublas": lambda x: torch.mm(x["A"], x["W"].t()),
                "coda_identity": lambda x: identity(x["A"], x["W"]),
                "coda_default": lambda x: default(x["A"], x["W"], **{a: x[a] for a in args}),
                "eager": w.eager,
                "torch_compile": compiled,
            }
            row: dict[str, Any] = {"workload": name, "what": w.what, "M": M, "N": w.N, "K": w.K,
                                   "default_config": default.config.name()}
            if tune:
                identity.choice(sets[0]["A"], sets[0]["W"])
            if tuned is not None:
                choice = tuned.choice(sets[0]["A"], sets[0]["W"])
                fns["coda_tuned"] = lambda x: tuned(x["A"], x["W"], **{a: x[a] for a in args})
                row["tuned_config"] = {k: choice[k] for k in ("config", "raster", "swizzle", "tuned")}
            times = interleaved(fns, sets, rounds=rounds)
            row["us"] = times
            row["ratio"] = {k: v / times["cublas"] for k, v in times.items()}
            best_name = min(("coda_default", "coda_tuned"), key=lambda k: times.get(k, float("inf")))
            row["ratio"]["coda_best"] = times[best_name] / times["cublas"]
            held = sustained({"cublas": fns["cublas"], best_name: fns[best_name]}, sets)   # long runs of each
            row["sustained_us"] = held
            row["ratio"]["sustained"] = held[best_name] / held["cublas"]
            rows.append(row)
            r = row["ratio"]
            tuned_text = f", tuned {r['coda_tuned']:.3f}x" if "coda_tuned" in r else ""
            print(f"{name:20s} M={M:5d} N={w.N:6d} cuBLAS {times['cublas']:9.1f} us | coda {r['coda_best']:.3f}x"
                  f" (default {r['coda_default']:.3f}x{tuned_text}; identity {r['coda_identity']:.3f}x;"
                  f" sustained {r['sustained']:.3f}x)"
                  f" eager {r['eager']:.3f}x compile {r['torch_compile']:.3f}x", flush=True)
            del sets
            torch.cuda.empty_cache()
    return rows


def write_markdown(rows: list[dict[str, Any]], env: dict[str, Any], path: Path) -> None:
    lines = [f"# coda-cutlass pairwise / LSE benchmark ({env['date']})", "",
             machine_line(env) +
             "Medians of CUDA-event-timed calls queued back to back over rotating input sets, interleaved "
             "one by one in a freshly shuffled order every pass; ratios are to bare cuBLAS (`torch.mm`, no "
             "epilogue) of the same GEMM in the same run. "
             "coda = the better of the heuristic default and the autotuned config; coda identity = our GEMM "
             "with no epilogue work (autotuned), i.e. the mainloop's own gap to cuBLAS. "
             "coda, sustained = the same kernel and cuBLAS each timed in long runs of itself (bursts of 40 "
             "back-to-back calls: the GPU at its power limit, as inside a block; bench/block.py has the "
             "block's own sequence). "
             f"GPU during the run: {env.get('gpu_state', 'not sampled')}.", "",
             "| workload | M x N x K | cuBLAS us | coda | coda, sustained | coda default | coda tuned | coda identity | eager | "
             "torch.compile | tuned config |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["ratio"]
        tuned = f"{q['coda_tuned']:.3f}" if "coda_tuned" in q else "-"
        cfg = config_label(r.get("tuned_config"))
        lines.append(f"| {r['workload']} | {r['M']}x{r['N']}x{r['K']} | {r['us']['cublas']:.1f} | **{q['coda_best']:.3f}** | "
                     f"{q.get('sustained', float('nan')):.3f} | "
                     f"{q['coda_default']:.3f} | {tuned} | {q['coda_identity']:.3f} | {q['eager']:.3f} | "
                     f"{q['torch_compile']:.3f} | {cfg} |")
    lines += ["", "Workloads:"] + [f"- {w.name}: {w.what}" for w in WORKLOADS.values()]
    path.write_text("\n".join(lines) + "\n")


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    ratio_bars(rows, [f"{r['workload']}\nM={r['M']}" for r in rows],
               [("coda_best", "coda"), ("torch_compile", "torch.compile"), ("eager", "eager")],
               "Pairwise / LSE epilogues vs bare cuBLAS (H200, bf16, Llama-3-8B shapes)", path,
               figsize=(max(8, len(rows) * 0.9), 5), rotation=60, fontsize=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results_pairwise")
    ap.add_argument("--m", type=int, nargs="+", default=[8192])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--no-tune", action="store_true", help="time the heuristic default config only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sets", type=int, default=2, help="rotating input sets per workload")
    args = ap.parse_args()
    require_hopper("bench/pairwise.py")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    with GpuSampler() as sampler:
        rows = run(args.m, args.workloads, not args.no_tune, args.rounds, args.sets)
    env["gpu_state"] = sampler.summary()
    write_results(out, env, rows, write_markdown, write_plot)


if __name__ == "__main__":
    main()
