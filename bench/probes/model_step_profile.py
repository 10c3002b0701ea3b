"""Probe: where a whole-model training step's time goes (bench/model.py's step: from_hf model,
forward with the loss, backward, fused AdamW), per variant: wall time per step against the GPU's
kernel time (a step whose wall time exceeds its kernel time is bound by the host), kernel launches
per step, and the share of the step in the FP8 weight copies (their kernels and their host time).

    python bench/probes/model_step_profile.py --config 1b --variants coda,coda-fp8-tensorwise,coda-fp8-blockwise_g16

Question it answers (twenty-sixth session): at Llama-3.2-1B widths "tensorwise" stepped in 137 ms
against 126 for coda bf16, though its GEMMs are FP8; is the host the limit, and how much of the step
is the weight copies made again after every optimizer step? Since the thirtieth session it also sums
each step's kernel time by kind (coda and cuBLAS GEMMs, attention, map kernels, the torch kernels
between them) and lists the 25 kernels with the most time: where a bf16 step's last percent is."""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
import time
import zlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import model as bench_model  # noqa: E402  (bench/model.py)

from coda_cutlass.nn.fp8 import support as fp8_support  # noqa: E402
from coda_cutlass.nn.fp8 import tensorwise  # noqa: E402
from coda_cutlass.nn.fp8 import weights as fp8_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="1b", choices=[*bench_model.CONFIGS, "quick"])
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the probe itself (the interpreter)")
    ap.add_argument("--variants", default="coda,coda-fp8-tensorwise,coda-fp8-blockwise_g16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="a JSON file for the figures")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also the N Python functions with the most host time per step (cProfile)")
    ap.add_argument("--weight-copies", choices=tensorwise.WEIGHT_COPIES, default=tensorwise.weight_copies_by,
                    help="how the \"tensorwise\" blocks remake their weight copies (nn/fp8/tensorwise.py)")
    ap.add_argument("--copies-per-call", type=int, default=tensorwise.copies_blocks_per_call, metavar="N",
                    help="blocks whose compiled weight copies one call makes (nn/fp8/tensorwise.py "
                         "copies_blocks_per_call; 1: a call a block)")
    ap.add_argument("--folds-together", action="store_true",
                    help="fold the blocks' delayed scales in one call before the first block "
                         "(nn/fp8/tensorwise.py folds_together)")
    args = ap.parse_args()
    if args.copies_per_call < 1:
        ap.error(f"--copies-per-call must be >= 1, got {args.copies_per_call}")
    tensorwise.weight_copies_by = args.weight_copies
    tensorwise.copies_blocks_per_call = args.copies_per_call
    tensorwise.folds_together = args.folds_together
    args.compile_mode, args.ce_chunk_mib = None, None
    names = [n for n in args.variants.split(",") if n]
    fields = dict(bench_model.QUICK if args.config == "quick" else bench_model.CONFIGS[args.config])
    variants = bench_model.build_variants(fields, names, args)
    tokens = torch.randint(0, fields["vocab_size"], (args.batch, args.seq), device=args.device)
    sync = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)

    inside = [False]

    def marked(fn):                              # the weight copies, marked in the profile (once:
        def call(self, *a, **k):                 # get_all's own get calls are not marked again)
            if inside[0]:
                return fn(self, *a, **k)
            inside[0] = True
            try:
                with record_function("fp8_weight_copies"):
                    return fn(self, *a, **k)
            finally:
                inside[0] = False
        return call
    # one at a time, and a block's four together (what the blocks call since the twenty-sixth session)
    fp8_weights.Fp8Weights.get = marked(fp8_weights.Fp8Weights.get)
    fp8_weights.Fp8Weights.get_all = marked(fp8_weights.Fp8Weights.get_all)
    # and several blocks' before the model's first block (--copies-per-call above 1)
    fp8_support.make_tensor_copies_together = marked(fp8_support.make_tensor_copies_together)

    out = {}
    for name, v in variants.items():
        for _ in range(3):
            v.step(tokens)
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            v.step(tokens)
        sync()
        wall = (time.perf_counter() - t) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                v.step(tokens)
            sync()
        # the device's kernels, not the GPU-side spans of record_function ranges ("fp8_weight_copies",
        # "Optimizer.step#..."), which the profiler lists as CUDA events too: counted as kernels they
        # put the copies' and the optimizer's spans in twice (thirty-first session: ~18 ms of a 1B step)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False)]
        gpu_ms = sum(e.device_time for e in kernels) / 1e3 / args.steps
        counts = collections.Counter(e.name[:70] for e in kernels)
        kinds, by_kernel = collections.Counter(), collections.Counter()
        for e in kernels:
            kinds[kernel_kind(e.name)] += e.device_time / 1e3 / args.steps
            by_kernel[kernel_label(e.name)] += e.device_time / 1e3 / args.steps
        copies = [e for e in prof.events() if e.name == "fp8_weight_copies"       # the host's range: its
                  and e.device_type == torch.autograd.DeviceType.CPU]             # kernels, once
        copies_cpu = sum(e.cpu_time_total for e in copies) / 1e3 / args.steps
        copies_gpu = sum(e.device_time_total for e in copies) / 1e3 / args.steps
        out[name] = {"wall_ms": wall, "kernel_ms": gpu_ms, "launches": len(kernels) / args.steps,
                     "weight_copies_host_ms": copies_cpu, "weight_copies_kernel_ms": copies_gpu,
                     "top_launches": {k: c / args.steps for k, c in counts.most_common(15)},
                     "kernel_ms_by_kind": dict(kinds.most_common()),
                     "top_kernels_ms": dict(by_kernel.most_common(25))}
        print(f"{name}: {wall:.1f} ms wall per step, {gpu_ms:.1f} ms of kernels, {len(kernels) / args.steps:.0f} "
              f"launches; weight copies {copies_cpu:.1f} ms host / {copies_gpu:.1f} ms kernels", flush=True)
        for k, c in counts.most_common(15):
            print(f"    {c / args.steps:6.0f}  {k}")
        print("    kernel ms / step by kind: " + ", ".join(f"{k} {ms:.2f}" for k, ms in kinds.most_common()))
        for k, ms in by_kernel.most_common(25):
            print(f"    {ms:8.2f} ms  {k}")
        if args.host_profile:
            # the host's own time by op (aten ops, CUDA runtime calls such as cudaLaunchKernel, marked
            # regions): what cProfile below cannot see inside C++
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.host_profile]
            out[name]["host_ops"] = [[e.key, e.self_cpu_time_total / 1e3 / args.steps, e.count / args.steps]
                                     for e in ops]
            print("    host ms / step, calls / step, op (self CPU time)")
            for key, ms, n in out[name]["host_ops"]:
                print(f"    {ms:8.2f} {n:7.0f}  {key[:90]}")
            out[name]["host_profile"] = host_profile(v, tokens, args.steps, args.host_profile, sync)
            print(out[name]["host_profile"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


# (substring of a kernel's name, its kind) in the order tried: what is a GEMM, attention, a coda map
# kernel, and the torch kernels between them (the 1B step's lever against Liger: thirtieth session)
# (attention first: torch's flash and memory-efficient kernels carry cutlass types in their names; coda's
# GEMMs are CUTLASS's GemmUniversal, cuBLAS's own CUTLASS kernels are not)
KINDS = (("fmha", "attention"), ("sdpa", "attention"), ("flash", "attention"), ("GemmUniversal", "coda GEMM"),
         ("nvjet", "cuBLAS GEMM"), ("gemm", "cuBLAS GEMM"), ("cutlass", "cuBLAS GEMM"), ("gemv", "cuBLAS gemv"),
         ("map_kernel", "coda map kernel"),
         ("Memset", "memset"), ("Memcpy", "memcpy"), ("multi_tensor_apply", "optimizer"),
         ("reduce_kernel", "torch reduction"), ("triton", "triton"))


def kernel_kind(name: str) -> str:
    return next((kind for key, kind in KINDS if key in name), "torch elementwise / other")


def kernel_label(name: str) -> str:
    """A kernel's name cut short, with a hash of the whole (coda's GEMMs differ only past the cut)."""
    return f"{name[:60]} #{zlib.crc32(name.encode()):08x}" if len(name) > 60 else name


def host_profile(v, tokens: torch.Tensor, steps: int, top: int, sync) -> str:
    """cProfile's table of the functions with the most host time of their own (tottime), then
    those with the most in total (cumtime), over ``steps`` steps."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        v.step(tokens)
    sync()
    prof.disable()
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


if __name__ == "__main__":
    main()
