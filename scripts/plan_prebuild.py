"""Build, on a machine without a GPU, every GEMM and map kernel a Llama model launches at given
widths, with the configurations its shipped (or stored) H200 plan picks, so that a later GPU run
finds them all in the cache and compiles nothing while it is timed:

    python scripts/plan_prebuild.py --widths 8b 70b --fp8 tensorwise blockwise --tokens 8192
    python scripts/plan_prebuild.py --widths 1b 3b 8b --bf16 --tokens 8192 --list
    python scripts/plan_prebuild.py --gpu-tests    # the nn and Hugging Face GPU tests' kernels
    python scripts/plan_prebuild.py --widths 8b --fp8 tensorwise --candidates   # and every tuning candidate

The launch sites are found by running a small model of the same kind (3 layers: a first, a middle
and a last block, the LM head) through the reference interpreter on the CPU with a runner that
records every launch; each site's configuration is then the one a KernelRunner prepared for the
real widths would choose (its plan, else the default configuration). With ``--gpu-tests`` the
launches are those of the small models ``tests/gpu/test_nn_gpu.py`` (bf16 and fp16, with and without
autograd) and ``tests/gpu/test_hf_gpu.py`` (every family, through ``from_hf``) run, at their default
configurations (no plan exists at those widths): the kernels those tests otherwise build on the GPU
machine one by one, out of the device time."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import coda_cutlass as cc  # noqa: E402
from coda_cutlass.nn import LlamaBlock, LlamaModel  # noqa: E402
from coda_cutlass.nn.runner import KernelRunner, ReferenceRunner, fp8_parts  # noqa: E402
from block import WIDTHS  # noqa: E402  (the block benchmark's Llama-3 widths)
DEVICE = "NVIDIA H200|sm90|cuda13.0"   # the plans' device tag (nn.plan_store.plan_key)
TINY = dict(dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512)


class RecordingRunner(ReferenceRunner):
    """The reference interpreter, noting every GEMM site and map kernel it is asked to run."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(dtype)
        # (site, program, layout, partial, fp8) -> (program, layout, partial, fp8): a site name may
        # run different programs in the first, middle and last blocks
        self.gemms: dict[tuple[Any, ...], tuple[Any, str, bool, Any]] = {}
        self.maps: dict[tuple[Any, bool, torch.dtype], None] = {}

    def gemm(self, site, program, A, W, *, layout="nk", partial=False, out=None, fp8=None, **operands):
        self.gemms.setdefault((site, program, layout, partial, fp8), (program, layout, partial, fp8))
        return super().gemm(site, program, A, W, layout=layout, partial=partial, out=out, fp8=fp8, **operands)

    def map(self, site, program, X, *, partial=False, out=None, **operands):
        self.maps.setdefault((program, partial, self.dtype), None)
        return super().map(site, program, X, partial=partial, out=out, **operands)


def launches(recipe: str | None) -> RecordingRunner:
    """The launches of one training step (forward with the loss, backward) of a small model."""
    torch.manual_seed(0)
    model = LlamaModel(512, n_layers=3, fp8=recipe, dtype=torch.bfloat16, **TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
        model.norm.fill_(1.0)
        for b in model.blocks:
            b.attn_norm.fill_(1.0)
            b.mlp_norm.fill_(1.0)
    rec = RecordingRunner()
    model.set_runner(rec)
    tokens = torch.randint(0, 512, (2, 128))
    model(tokens, torch.randint(0, 512, (2, 128))).backward()
    return rec


def nn_test_launches() -> list[RecordingRunner]:
    """The launches of tests/gpu/test_nn_gpu.py's blocks and model: a training step and a forward
    without autograd (the forward-only sites), in bf16 and fp16."""
    recs = []
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        model = LlamaModel(512, n_layers=3, dtype=dtype, **TINY)
        rec = RecordingRunner(dtype)
        model.set_runner(rec)
        tokens = torch.randint(0, 512, (2, 128))
        model(tokens, tokens).backward()
        with torch.no_grad():
            model(tokens)
        print(f"nn {dtype}: {len(rec.gemms)} GEMM sites, {len(rec.maps)} map kernels")
        recs.append(rec)
    return recs


def hf_test_launches() -> list[RecordingRunner]:
    """The launches of one training step of each family in tests/gpu/test_hf_gpu.py (its configs,
    in bf16 on the CPU: the kernels depend on the programs, not the sizes)."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    sys.path.insert(0, str(ROOT / "tests"))
    import test_hf_gpu as hf_tests
    import transformers

    import coda_cutlass.nn as cnn
    recs = []
    for family, (cls, extra) in sorted(hf_tests.FAMILIES.items()):
        dims = dict(hf_tests.DIMS, num_hidden_layers=2)
        if family == "phi3":
            dims.pop("head_dim")
        cfg = getattr(transformers, cls)(**dims, **extra, attn_implementation="eager" if family == "gemma2" else "sdpa")
        torch.manual_seed(0)
        model = cnn.from_hf(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16))
        rec = RecordingRunner()
        model.coda.set_runner(rec)
        tokens = torch.randint(1, dims["vocab_size"], (1, 128))
        model(input_ids=tokens, labels=tokens).loss.backward()
        print(f"hf {family}: {len(rec.gemms)} GEMM sites, {len(rec.maps)} map kernels")
        recs.append(rec)
    return recs


def default_items(rec: RecordingRunner) -> list[tuple[Any, dict]]:
    """Each recorded GEMM site at its default configuration (a KernelRunner without a plan)."""
    return items_with(KernelRunner(rec.dtype), rec)


def context(width: str, recipe: str | None) -> str:
    """The plan context of a block at these widths (LlamaBlock.context, of a block with no storage)."""
    return LlamaBlock(**WIDTHS[width], fp8=recipe, device="meta", dtype=torch.bfloat16).context()


def items_for(width: str, recipe: str | None, tokens: int, rec: RecordingRunner) -> list[tuple[Any, dict]]:
    runner = KernelRunner(torch.bfloat16)
    runner.prepare(context(width, recipe), tokens, device=DEVICE)
    out = items_with(runner, rec)
    print(f"{width} {recipe or 'bf16'}: {len(out)} GEMM sites, plan {runner.plan_source or 'none (default configs)'}")
    return out


def items_with(runner: KernelRunner, rec: RecordingRunner) -> list[tuple[Any, dict]]:
    """(program, compile options) of each recorded GEMM site with the configuration ``runner`` picks."""
    out = []
    for (site, *_), (program, layout, partial, fp8) in rec.gemms.items():
        config = runner.choice(site, program, layout, fp8).config
        opts: dict[str, Any] = {"dtype": runner.dtype, "weight_layout": layout, "config": config,
                                "partial_reductions": partial}
        if fp8 is not None:
            dtype, scaling, fast = fp8_parts(fp8)
            opts.update(dtype=dtype, scaling=scaling, fast_accum=fast)
        out.append((program, opts))
    return out


def candidate_items(rec: RecordingRunner) -> list[tuple[Any, dict]]:
    """Each recorded GEMM site at every configuration in-sequence tuning tries there
    (nn/tuning.py: the site's candidate space, tuning/space.py), so a tuning run on the GPU machine
    builds nothing."""
    from coda_cutlass.nn.tuning import Site, _fp8_compile_options, _site_candidates
    out = []
    for (site, *_), (program, layout, partial, fp8) in rec.gemms.items():
        for config in _site_candidates(Site(site, program, layout, partial, fp8), rec.dtype, None, ()):
            opts: dict[str, Any] = {"dtype": rec.dtype, "weight_layout": layout, "config": config,
                                    "partial_reductions": partial, **_fp8_compile_options(fp8)}
            out.append((program, opts))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", nargs="+", default=[], choices=list(WIDTHS))
    ap.add_argument("--gpu-tests", action="store_true", help="also the nn and Hugging Face GPU tests' kernels")
    ap.add_argument("--fp8", nargs="*", default=[], help="FP8 recipes (nn.fp8.RECIPES)")
    ap.add_argument("--bf16", action="store_true", help="also the bf16 model's kernels")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step (the plans' M bucket)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--candidates", action="store_true",
                    help="also every tuning candidate of each site of the recipes given (bench/block.py --tune, "
                         "model.tune() then build nothing on the GPU machine)")
    ap.add_argument("--list", action="store_true", help="list the kernels, build nothing")
    args = ap.parse_args()
    from coda_cutlass.nn.fp8 import RECIPES
    unknown = [r for r in args.fp8 if r not in RECIPES]
    if unknown:
        ap.error(f"unknown FP8 recipe(s) {unknown}; known: {', '.join(sorted(RECIPES))}")
    if bool(args.widths) != bool(args.bf16 or args.fp8):
        ap.error("--widths and --bf16 / --fp8 RECIPE ... go together (the models' kernels at those widths)")
    if not args.gpu_tests and not args.widths:
        ap.error("nothing to build: give --widths with --bf16 and / or --fp8 RECIPE ..., or --gpu-tests")
    recipes: list[str | None] = ([None] if args.bf16 else []) + list(args.fp8)
    items: list[tuple[Any, dict]] = []
    maps: dict[tuple[Any, bool, torch.dtype], None] = {}
    for recipe in recipes:
        rec = launches(recipe)
        maps.update(rec.maps)
        for width in args.widths:
            items += items_for(width, recipe, args.tokens, rec)
        if args.candidates:
            cands = candidate_items(rec)
            print(f"{recipe or 'bf16'}: {len(cands)} tuning candidates over {len(rec.gemms)} GEMM sites")
            items += cands
    if args.gpu_tests:
        for rec in nn_test_launches() + hf_test_launches():
            maps.update(rec.maps)
            items += default_items(rec)
    seen, unique = set(), []
    for program, opts in items:      # sites sharing a program and options share a kernel
        key = (id(program), tuple(sorted((k, str(v)) for k, v in opts.items())))
        if key not in seen:
            seen.add(key)
            unique.append((program, opts))
    print(f"{len(unique)} distinct GEMM kernels, {len(maps)} map kernels")
    if args.list:
        for program, opts in unique:
            print(f"  {program.name} {opts}")
        return 0
    t = time.time()
    for program, partial, dtype in maps:
        cc.compile_map(program, dtype, partial_reductions=partial, verbose=False)
    built = cc.compile_many(unique, jobs=args.jobs, skip_failed=True)
    failed = [p.name for (p, _), k in zip(unique, built) if k is None]
    print(f"built in {time.time() - t:.0f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
