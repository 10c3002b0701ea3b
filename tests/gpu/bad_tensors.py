"""What each kind of bad tensor gets at call time (issue 5): refused before launch with a message, or
run and checked against the reference. Writes a markdown table (and JSON).

    python tests/gpu/bad_tensors.py --out bad_tensors.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import coda_cutlass as cc  # noqa: E402
from catalog import BY_NAME, compile_options  # noqa: E402
from coda_cutlass.epilogues import residual_norm_stats  # noqa: E402


def catalog_kernel(name: str) -> Any:
    keys = ("dtype", "weight_layout", "config", "input_dtypes", "output_dtypes", "constants")
    return cc.compile_epilogue(BY_NAME[name].program, **{k: v for k, v in compile_options(BY_NAME[name]).items()
                                                          if k in keys})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    k = cc.compile_epilogue(residual_norm_stats, bf)
    ka = catalog_kernel("accumulate_named")     # {"out": acc * y, "dx": accumulate(acc)}
    ks = catalog_kernel("alpha_beta")           # alpha * acc + beta * C (runtime scalars)
    M, N, K = 1000, 776, 520

    def t(*shape: int, dtype: torch.dtype = bf) -> torch.Tensor:
        return torch.randn(*shape, device=dev).to(dtype)

    A, W, R, g = t(M, K), t(N, K), t(M, N), t(N)

    def norm(A_=A, W_=W, **kw: Any) -> Callable[[], Any]:
        ops = {"resid": R, "g": g, **kw}
        return lambda: (k, A_, W_, ops)

    def acc_case(dx: torch.Tensor, y: torch.Tensor, out: Any = None, A_: torch.Tensor = A) -> Callable[[], Any]:
        return lambda: (ka, A_, W, {"y": y, "dx": dx, **({"out": out} if out is not None else {})})

    def scalar_case(alpha: Any) -> Callable[[], Any]:
        return lambda: (ks, A, W, {"C": R, "alpha": alpha, "beta": 1.0})

    big = t(M * N + 8)
    a_and_dx = t(M * K + M * N)
    padded = t(M, N + 8)[:, :N]
    shared = t(M, N)
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("A is float32 (kernel built for bf16)", norm(A_=A.float())),
        ("W on the CPU", norm(W_=W.cpu())),
        ("resid on the CPU", norm(resid=R.cpu())),
        ("A is 3-D, resid 2-D", norm(A_=A.view(1, M, K))),
        ("A (2, 500, K), resid (2, 500, N): batch dims like nn.Linear",
         norm(A_=A.view(2, M // 2, K), resid=R.view(2, M // 2, N))),
        ("resid has the wrong shape", norm(resid=R[:, :N - 8])),
        ("resid transposed (non-contiguous)", norm(resid=t(N, M).t())),
        ("resid a column-strided view x[:, ::2]", norm(resid=t(M, 2 * N)[:, ::2])),
        ("resid a row-padded view (row stride N+8)", norm(resid=padded)),
        ("resid row stride not a multiple of 16 bytes (N+4)", norm(resid=t(M, N + 4)[:, :N])),
        ("resid misaligned base (view at element offset 1)", norm(resid=big[1:M * N + 1].view(M, N))),
        ("resid broadcast with row stride 0 (expand)", norm(resid=t(1, N).expand(M, N))),
        ("A misaligned base (view at element offset 1)",
         norm(A_=t(M * K + 8)[1:M * K + 1].view(M, K))),
        ("g strided (stride 2)", norm(g=t(2 * N)[::2])),
        ("g of the wrong length", norm(g=t(N + 1))),
        ("g float32 (kernel built for bf16)", norm(g=g.float())),
        ("N = 100, not a multiple of 8", lambda: (k, A, t(100, K), {"resid": t(M, 100), "g": t(100)})),
        ("K = 516, not a multiple of 8", lambda: (k, t(M, 516), t(N, 516), {"resid": R, "g": g})),
        ("M = 0 (empty batch)", lambda: (k, t(0, K), W, {"resid": t(0, N), "g": g})),
        ("N = 0", lambda: (k, A, t(0, K), {"resid": t(M, 0), "g": t(0)})),
        ("K = 0", lambda: (k, t(M, 0), t(N, 0), {"resid": R, "g": g})),
        ("M = 1", lambda: (k, t(1, K), W, {"resid": t(1, N), "g": g})),
        ("missing operand g", lambda: (k, A, W, {"resid": R})),
        ("extra operand", lambda: (k, A, W, {"resid": R, "g": g, "bias": g})),
        ("operand given as a list", norm(g=[1.0] * N)),
        ("accumulated dx is the same tensor as input y", acc_case(shared, shared)),
        ("accumulated dx overlaps input y (shifted view)", acc_case(big[:M * N].view(M, N), big[8:M * N + 8].view(M, N))),
        ("accumulated dx overlaps A", acc_case(a_and_dx[M * K - 8:M * K - 8 + M * N].view(M, N), R,
                                               A_=a_and_dx[:M * K].view(M, K))),
        ("out= tensor aliases an input", acc_case(t(M, N), R, out={"out": R})),
        ("out= a row-padded view", acc_case(t(M, N), R, out={"out": t(M, N + 8)[:, :N]})),
        ("scalar given as a CUDA tensor", scalar_case(torch.tensor(0.5, device=dev))),
        ("scalar given as a string", scalar_case("0.5")),
        ("scalar given as a CPU 0-d tensor", scalar_case(torch.tensor(0.5))),
    ]
    rows = []
    for desc, make in cases:
        try:
            kern, A_, W_, ops = make()
        except Exception as e:  # noqa: BLE001
            rows.append((desc, "could not construct", repr(e)))
            continue
        out_arg = ops.pop("out", None)
        before = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in ops.items()}
        try:
            out = kern(A_, W_, out=out_arg, **ops)
            torch.cuda.synchronize()
        except cc.CodaError as e:
            rows.append((desc, f"refused before launch ({type(e).__name__})", str(e).splitlines()[0]))
            continue
        except Exception as e:  # noqa: BLE001 - anything else is a defect
            rows.append((desc, "CRASH", repr(e)))
            continue
        ref = kern.reference(A_, W_, precision="kernel", **{n: v for n, v in before.items()})
        worst = 0.0
        for name, r in ref.items():
            if r.numel():
                scale = r.float().abs().max().item() + 1e-6
                worst = max(worst, (out[name].float() - r.float()).abs().max().item() / scale)
        rows.append((desc, "runs, checked" if worst < 2e-2 else "RUNS BUT WRONG", f"max relative deviation {worst:.1e}"))
    lines = ["| input | outcome | detail |", "|---|---|---|"]
    lines += [f"| {d} | {o} | {m.replace('|', '/')} |" for d, o, m in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 1 if any(o in ("CRASH", "RUNS BUT WRONG") for _, o, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
