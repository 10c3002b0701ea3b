"""Probe: the host work of a whole-model forward + backward, measured without a GPU.

The model's kernels are the real built kernels (default configurations, from the kernel cache or
prebuilt) called through their real Python call paths (argument checks, output allocation,
partials finishing) with the launch itself a no-op and the tensors on the CPU. At tiny widths the
CPU's own tensor work stays small, so the step's wall time is roughly the host work a GPU step
needs whatever its widths (the call paths do not depend on them), and cProfile says where it goes.
Left out: the CUDA launch latency (~5 us a launch) and torch.compile'd helpers (eager here; their
time is reported apart), the optimizer step (one fused launch per group on a GPU).

    python bench/probes/host_work.py --variants coda,coda-fp8-tensorwise --top 30 --ops 25

Question it answers (twenty-seventh session): at Llama-3.2-1B widths a "tensorwise" step took 137
ms of wall time on the H100 against 109 ms of kernels (`model_step_profile.py`); how much host work
does an FP8 block add to a bf16 one, and where?"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import model as bench_model  # noqa: E402  (bench/model.py)

import coda_cutlass as cc  # noqa: E402
from coda_cutlass.nn import runner as nn_runner  # noqa: E402
from coda_cutlass.nn.fp8 import compiled as fp8_compiled  # noqa: E402
from coda_cutlass.runtime import kernel as rt_kernel  # noqa: E402
from coda_cutlass.runtime import map_kernel as rt_map  # noqa: E402


class _NoLaunch:
    """A kernel library whose launch does nothing."""
    description = None

    def workspace_size(self, M: int, N: int, K: int) -> int:
        return 0

    def run(self, *args: Any) -> int:
        return 0


@contextlib.contextmanager
def _cpu_as_gpu():
    """The kernels' call paths on CPU tensors: the GPU checks pass, the stream is 0."""
    saved = (torch.Tensor.__dict__.get("is_cuda"), rt_kernel.ensure_gpu, rt_kernel.current_stream,
             rt_map.current_stream, torch.cuda.current_device, torch.cuda.is_current_stream_capturing)
    torch.Tensor.is_cuda = property(lambda self: True)        # shadows TensorBase's getter
    rt_kernel.ensure_gpu = lambda device, what: None
    rt_kernel.current_stream = rt_map.current_stream = lambda device: 0
    torch.cuda.current_device = lambda: None                   # a CPU tensor's device index
    torch.cuda.is_current_stream_capturing = lambda: False
    try:
        yield
    finally:
        if saved[0] is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = saved[0]
        (rt_kernel.ensure_gpu, rt_kernel.current_stream, rt_map.current_stream, torch.cuda.current_device,
         torch.cuda.is_current_stream_capturing) = saved[1:]


class HostRunner(nn_runner.Runner):
    """The model's kernels, launched by nothing: their real call paths on CPU tensors."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self.recorder = None
        self.calls = 0
        self._gemms: dict[tuple, Any] = {}
        self._maps: dict[tuple, Any] = {}

    def gemm(self, site, program, A, W, *, layout="nk", partial=False, out=None, fp8=None, **operands):
        key = (program, layout, partial, fp8)
        k = self._gemms.get(key)
        if k is None:
            dtype, scaling, fast = nn_runner.fp8_parts(fp8) if fp8 is not None else (self.dtype, None, False)
            k = self._gemms[key] = cc.compile_epilogue(program, dtype, weight_layout=layout, scaling=scaling,
                                                       fast_accum=fast, partial_reductions=partial, verbose=False)
            k.__dict__["library"] = _NoLaunch()
        self.calls += 1
        with _cpu_as_gpu():
            return k.run(A, W, operands, out=out)

    def map(self, site, program, X, *, partial=False, out=None, **operands):
        key = (program, partial)
        k = self._maps.get(key)
        if k is None:
            k = self._maps[key] = cc.compile_map(program, self.dtype, partial_reductions=partial, verbose=False)
        self.calls += 1
        with _cpu_as_gpu():
            M, N, ptrs, views, scalars, results, partials = k._prepare(X, operands, out)
            k._ptr_array(*ptrs), k._view_array(*views), k._scalar_array(*scalars)
            for name, buf in partials:
                results[name] = buf if k.partial_reductions else k._finish(name, buf, M, N)
            return {n: results[n] for n in k.outputs}


def _time_compiled(inside: list[int]) -> dict[str, float]:
    """Seconds spent in the torch.compile'd helpers (eager on the CPU), by name; ``inside[0]`` counts
    the helper calls under way (the op count leaves their ops out: one graph each on a GPU),
    ``inside[1]`` the calls made."""
    spent: dict[str, float] = {}
    original = fp8_compiled.on_device

    def on_device(fn, t, key, what):
        f = original(fn, t, key, what)

        def timed(*a, **k):
            t0 = time.perf_counter()
            inside[0] += 1
            inside[1] += 1
            try:
                return f(*a, **k)
            finally:
                inside[0] -= 1
                spent[what] = spent.get(what, 0.0) + time.perf_counter() - t0
        return timed
    for mod in list(sys.modules.values()):
        if getattr(mod, "on_device", None) is original and mod.__name__.startswith("coda_cutlass"):
            mod.on_device = on_device
    return spent


# aten ops that make no kernel on a GPU (views, metadata); allocations are counted apart
_NO_KERNEL = frozenset({"view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "slice",
                        "select", "unsqueeze", "squeeze", "detach", "alias", "_reshape_alias", "split", "unbind",
                        "reshape", "split_with_sizes", "chunk", "narrow", "unflatten", "lift_fresh"})
_ALLOC = frozenset({"empty", "empty_strided", "empty_like", "new_empty"})


class _OpCount(TorchDispatchMode):
    """The aten ops a step dispatches outside the compiled helpers (which are one graph each on a GPU),
    by op and by the coda source line that issued it: on a GPU each is (about) one kernel launch,
    allocations aside. The CPU's count of what the GPU's profile calls launches, without the GPU."""

    def __init__(self, inside: list[int]):
        super().__init__()
        self.inside = inside
        self.ops: collections.Counter[str] = collections.Counter()
        self.where: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_KERNEL and not self.inside[0]:
            self.ops[name] += 1
            if name not in _ALLOC:
                frames = [f for f in traceback.extract_stack() if "coda_cutlass" in f.filename]
                line = f"{frames[-1].filename.split('coda_cutlass/')[-1]}:{frames[-1].lineno}" if frames else "torch"
                self.where[f"{name} @ {line}"] += 1
        return func(*args, **(kwargs or {}))


def _step(v: Any, tokens: torch.Tensor) -> None:
    loss = v.call(input_ids=tokens, labels=tokens).loss
    loss.backward()
    for p in v.params:
        p.grad = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="coda,coda-fp8-tensorwise,coda-fp8-blockwise_g16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=0, help="also cProfile's N functions with the most own time")
    ap.add_argument("--ops", type=int, default=0,
                    help="also the aten ops of one step outside the compiled helpers (about a launch each on a "
                         "GPU), with the N most frequent op @ coda source line")
    ap.add_argument("--out", type=Path, default=None, help="a JSON file for the figures")
    args = ap.parse_args()
    fields = dict(bench_model.QUICK, num_hidden_layers=args.layers)
    names = [n for n in args.variants.split(",") if n]
    ns = argparse.Namespace(compile_mode=None, ce_chunk_mib=None, device="cpu", seq=args.tokens)
    variants = bench_model.build_variants(fields, names, ns)
    tokens = torch.randint(0, fields["vocab_size"], (1, args.tokens))
    inside = [0, 0]
    spent = _time_compiled(inside)
    out: dict[str, Any] = {}
    for name, v in variants.items():
        runner = HostRunner()
        v.model.coda.set_runner(runner)
        for _ in range(3):
            _step(v, tokens)
        spent.clear()
        runner.calls = 0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            _step(v, tokens)
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        compiled = {k: s / args.steps * 1e3 for k, s in spent.items()}
        row = {"host_ms": wall, "compiled_ms": compiled, "kernel_calls": runner.calls / args.steps,
               "per_layer_ms": (wall - sum(compiled.values())) / args.layers}
        print(f"{name}: {wall:.2f} ms per step ({args.layers} layers), {row['kernel_calls']:.0f} kernel calls, "
              f"compiled helpers (eager here) {sum(compiled.values()):.2f} ms -> {row['per_layer_ms']:.3f} ms "
              "a layer without them (the embedding and LM head shared out)", flush=True)
        if args.ops:
            counter = _OpCount(inside)
            calls, runner.calls, inside[1] = runner.calls, 0, 0
            with counter:
                _step(v, tokens)
            allocs = sum(counter.ops[n] for n in _ALLOC)
            kernels = sum(counter.ops.values()) - allocs
            row["ops"] = {"coda_kernel_calls": runner.calls, "aten_kernel_ops": kernels, "allocations": allocs,
                          "compiled_helper_calls": inside[1], "by_line": dict(counter.where.most_common(args.ops))}
            print(f"  one step: {runner.calls} coda kernel calls, {kernels} other aten ops that launch a kernel on a "
                  f"GPU, {inside[1]} compiled helper calls (a graph each), {allocs} allocations")
            for k, n in counter.where.most_common(args.ops):
                print(f"    {n:5d}  {k}")
            runner.calls = calls
        if args.top:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                _step(v, tokens)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
            row["profile"] = text.getvalue()
            print(row["profile"])
        out[name] = row
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
