"""Probe: causal GQA attention, forward + backward, in the layouts the block benchmark's variants
hand it (Llama-3-8B or 1B widths, B x S = 2 x 4096, bf16), timed against each other.

Why (twenty-seventh session): in `bench/block.py`'s 8B FP8 tables the attention kernels of the
coda blocks took 2437-2578 us of device time a fwd+bwd, the cuBLAS floor's (coda's attention call)
2472-2571, but bf16 torch.compile's 2263 and torchao tensorwise's 2299 (twenty-sixth session,
`docs/results/session26/fp8_block_8b/`): the same SDPA call with `enable_gqa`, different inputs. coda
reads q, k and v as strided views of the QKV kernel's (M, q + 2 kv) output (row stride q + 2 kv) and
runs the backward with `torch.autograd.grad` of the recorded call; the standard block's q, k, v are
separate projections (row strides q, kv, kv). If the layout costs ~0.3 ms, a copy of q, k, v (~40 us
at 8B) or another backend pays for itself: "tensorwise" would move from 1.59x to ~1.63x bf16 compile.

Variants (each: fresh views of the same data, forward, then backward of a fixed gradient):
- coda: `coda_cutlass.nn.attention.Attention("sdpa")` on the (M, q + 2 kv) buffer, as the block runs it;
- separate: q, k, v as separate contiguous (B, S, heads, D) tensors, transposed, SDPA + autograd (HF's);
- coda + copies: coda's views copied to separate contiguous tensors first (copies timed too);
- (B, H, S, D): q, k, v copied to head-major contiguous tensors, SDPA + autograd, the gradients
  copied back to (B, S, H, D) (copies timed too): what torch.compile's fused RoPE kernel hands
  cuDNN in the bf16 block (its attention kernels there: the same cuDNN kernels, ~300 us faster);
- (B, H, S, D), k and v repeated to every head (transformers' repeat_kv, no GQA in the kernel):
  torch.compile's and torchao's tables show no cuDNN head reduction (fmha_reduce_head), coda's do;
- torch.compile of the same SDPA call on separate tensors and on the views (Inductor's own choice);
- coda, backend B: the coda call under `torch.nn.attention.sdpa_kernel(B)` for cuDNN, flash, efficient.
Reports the median us per fwd+bwd (shuffled rounds, `coda_cutlass.timing.interleaved`) and the attention
kernels each ran (profiler names), JSON into --out.

    python bench/probes/attention_layouts.py --width 8b --out /tmp/attn.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from coda_cutlass.nn.attention import Attention  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:      # an older torch: the forced-backend variants are left out
    SDPBackend = sdpa_kernel = None

WIDTHS = {"8b": (32, 8, 128), "1b": (32, 8, 64), "70b": (64, 8, 128)}   # heads, kv heads, head dim


def _backends() -> dict[str, Any]:
    if SDPBackend is None:
        return {}
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def variants(B: int, S: int, H: int, KV: int, D: int, device: str) -> dict[str, Callable[[Any], Any]]:
    dims = SimpleNamespace(head_dim=D, q_width=H * D, kv_width=KV * D, n_heads=H, n_kv_heads=KV)
    M, width = B * S, (H + 2 * KV) * D
    qkv = torch.randn(M, width, device=device, dtype=torch.bfloat16)
    d_out = torch.randn(M, H * D, device=device, dtype=torch.bfloat16)
    attn = Attention("sdpa")

    def coda(_: Any) -> Any:
        out, ctx = attn.forward(qkv, B, S, dims)
        return Attention.backward(ctx, d_out)

    def split() -> tuple[torch.Tensor, ...]:
        q, k, v = qkv[:, :H * D], qkv[:, H * D:(H + KV) * D], qkv[:, (H + KV) * D:]
        return tuple(t.contiguous().view(B, S, -1, D) for t in (q, k, v))

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True, enable_gqa=H != KV)
        return torch.autograd.grad(o, leaves, d_out.view(B, S, H, D).transpose(1, 2))

    def head_major(repeat: bool) -> Any:
        q, k, v = (t.transpose(1, 2).contiguous() for t in split())          # (B, heads, S, D)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        k_, v_ = leaves[1:]
        if repeat and H != KV:
            k_, v_ = (t.repeat_interleave(H // KV, dim=1) for t in (k_, v_))
        o = F.scaled_dot_product_attention(leaves[0], k_, v_, is_causal=True, enable_gqa=not repeat and H != KV)
        grads = torch.autograd.grad(o, leaves, d_out.view(B, S, H, D).transpose(1, 2))
        return tuple(g.transpose(1, 2).contiguous() for g in grads)          # back to (B, S, heads, D)

    def compiled_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                              enable_gqa=H != KV)

    compiled = torch.compile(compiled_sdpa)

    def under_compile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = compiled(*leaves)
        return torch.autograd.grad(o, leaves, d_out.view(B, S, H, D).transpose(1, 2))

    def views() -> tuple[torch.Tensor, ...]:
        return (qkv[:, :H * D].view(B, S, H, D), qkv[:, H * D:(H + KV) * D].view(B, S, KV, D),
                qkv[:, (H + KV) * D:].view(B, S, KV, D))

    parts = split()
    fns: dict[str, Callable[[Any], Any]] = {
        "coda (views of the QKV output)": coda,
        "separate contiguous q, k, v": lambda _: sdpa(*parts),
        "coda + copies to separate tensors": lambda _: sdpa(*split()),
        "coda + copies to (B, H, S, D)": lambda _: head_major(False),
        "coda + copies to (B, H, S, D), k and v repeated": lambda _: head_major(True),
        # what Inductor makes of the same call (the bf16 compile block's attention is ~300 us faster)
        "torch.compile, separate contiguous q, k, v": lambda _: under_compile(*parts),
        "torch.compile, views of the QKV output": lambda _: under_compile(*views()),
    }
    for name, b in _backends().items():
        def forced(_: Any, b: Any = b) -> Any:
            with sdpa_kernel(b):
                return coda(None)
        fns[f"coda, backend {name}"] = forced
    return fns


def kernels_of(fn: Callable[[Any], Any]) -> dict[str, float]:
    """The device kernels one call runs, us by name (first 70 characters)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(None)
        torch.cuda.synchronize()
    us: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name[:70]] += e.device_time
    return dict(sorted(us.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", default="8b", choices=list(WIDTHS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: run each variant once at the given sizes (a smoke test)")
    args = ap.parse_args()
    H, KV, D = WIDTHS[args.width]
    fns = variants(args.batch, args.seq, H, KV, D, args.device)
    ok: dict[str, Callable[[Any], Any]] = {}
    ref = None
    for name, fn in fns.items():          # a backend that cannot run these inputs says so and is left out
        try:
            grads = fn(None)
        except RuntimeError as e:
            print(f"{name}: not run ({str(e).splitlines()[0][:120]})")
            continue
        ok[name] = fn
        ref = grads if ref is None else ref
        # per gradient: the largest difference, and it over the first variant's largest value (the
        # thirty-first session saw torch.compile's differ by 17.8 on the H100, the eager ones by 2.4e-4: torch
        # 2.11's compiled backward of this call is wrong when the output's gradient has the output's own
        # (B, S, H, D) strides, as here; whole compiled models are right, docs/results/session32/compile_gradients.md)
        errs = [(float((a.float() - b.float()).abs().max()), float(b.float().abs().max())) for a, b in zip(grads, ref)]
        print(f"{name}: " + ", ".join(f"{g} within {e:.3g} ({e / max(m, 1e-30):.2g} of its largest {m:.3g})"
                                      for g, (e, m) in zip(("dq", "dk", "dv"), errs)) + " of the first variant's")
    if args.device != "cuda":
        print(f"ran once each: {', '.join(ok)}")
        return
    times = interleaved(ok, [None], rounds=args.rounds, warmup=3, reps=5)
    out: dict[str, Any] = {"width": args.width, "batch": args.batch, "seq": args.seq,
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
    base = times.get("coda (views of the QKV output)")
    for name in ok:
        ks = kernels_of(ok[name])
        out["variants"][name] = {"us": times[name], "kernels_us": ks}
        rel = f" ({times[name] / base:.3f}x coda)" if base else ""
        print(f"{name:40s} {times[name]:9.1f} us{rel}")
        for k, v in list(ks.items())[:4]:
            print(f"      {v:9.1f}  {k}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
