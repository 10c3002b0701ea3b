"""The whole-model training step (issue 21): transformers Llama models through coda_cutlass.nn.from_hf
against transformers eager, transformers + torch.compile and transformers + Liger-Kernel (eager),
in one process, at Llama-3.2-1B, Llama-3.2-3B and Llama-3-8B widths.

    python bench/model.py --out bench/results_model                 # 1b, 3b (full depth), 8b (4 layers)
    python bench/model.py --out /tmp/smoke --quick                  # tiny widths: every variant runs once
    python bench/model.py --out DIR --configs 1b --variants coda,coda-compile   # coda under torch.compile too

A step: forward with the loss (labels = the tokens), backward, fused AdamW (bf16 parameters and
states), zero_grad. Every variant starts from the same weights (transformers' initialisation,
seed 0) and sees the same tokens; eager and compile share one model and optimizer (torch.compile
wraps the same parameters), Liger and coda have their own. Variants run in rounds, each round in a
fresh shuffled order (same clock and power state), ``iters`` steps per visit, CUDA events around
each step; the first ``warmup`` steps of each variant (compilation included) are not timed.

Reported per config and variant: median step time, tokens/s, peak memory (the variant's own
parameters, gradients and optimizer states plus the step's transient peak above what was allocated
before it, so variants held side by side compare as if alone) and the loss of the first step
(same weights, same tokens: a wrong kernel shows there). Writes results.json, results.md and
results.png into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")   # before CUDA starts

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from coda_cutlass.timing import in_bursts, timed_call  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B / 3B (tied embeddings) and Llama-3-8B widths; rope and context length as the released
    # configs (transformers warns when the llama3 rope's original context is not below max_position_embeddings)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
               max_position_embeddings=131072,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
               max_position_embeddings=131072,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
    # 32 layers do not fit the H200 beside the other variants: 4 layers, as issue 21's table
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}
QUICK = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
VARIANTS = ("eager", "compile", "liger", "coda")
# opt-in (--variants ...,coda-fp8-tensorwise): from_hf(..., fp8=RECIPE); each holds its own weights,
# gradients, optimizer states and FP8 weight copies, so at 3B widths not every variant fits beside the rest
FP8_VARIANTS = ("coda-fp8-tensorwise", "coda-fp8-blockwise", "coda-fp8-blockwise_g16")
# opt-in: the coda model under torch.compile (--compile-mode; "reduce-overhead" adds CUDA graphs):
# whether compiling the glue between coda's kernels lifts a host-bound step (1B widths, 27th session)
CODA_COMPILE = "coda-compile"
ALL_VARIANTS = VARIANTS + FP8_VARIANTS + (CODA_COMPILE,)
# opt-in: a coda variant with its blocks' SDPA handed other inputs (nn/attention.py ATTENTION_INPUTS),
# e.g. coda@heads, coda-fp8-tensorwise@heads_repeated (twenty-eighth session: the attention lead)
ATTENTION_SUFFIXES = ("heads", "heads_repeated")


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def attention_variant(name: str) -> tuple[str, str] | None:
    """(base variant, attention inputs) of a ``BASE@INPUTS`` name, None for any other name."""
    base, _, inputs = name.partition("@")
    return (base, inputs) if inputs in ATTENTION_SUFFIXES and base in ("coda", *FP8_VARIANTS) else None


def variant_order(results: list[dict[str, Any]]) -> list[str]:
    """The variants the results hold: ALL_VARIANTS' order, then the attention variants."""
    seen = [n for r in results for n in r["variants"]]
    return [n for n in ALL_VARIANTS if n in seen] + list(dict.fromkeys(n for n in seen if n not in ALL_VARIANTS))


def fail(msg: str) -> None:
    sys.exit(f"bench/model.py: {msg}")


def check_environment(variants: list[str]) -> dict[str, Any]:
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        fail("needs a Hopper GPU (sm_90): the coda kernels target it")
    try:
        import transformers
    except ImportError:
        fail("needs transformers (pip install transformers)")
    versions = {"transformers": transformers.__version__}
    if "liger" in variants:
        try:
            import liger_kernel
            from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401
        except Exception as e:  # noqa: BLE001 - missing, or no Triton
            fail(f"the liger variant needs liger-kernel (pip install liger-kernel==0.8.5): {e}; "
                 f"or leave it out with --variants")
        # liger_kernel has no __version__: the installed distribution's metadata says it
        versions["liger_kernel"] = getattr(liger_kernel, "__version__", None) or _dist_version("liger-kernel")
    from report import environment
    return {**environment(), **versions}


# ---------------------------------------------------------------------------------------------- variants
@contextlib.contextmanager
def module_globals(module: Any, values: dict[str, Any]) -> Iterator[None]:
    """Set attributes of a module for the duration (Liger patches transformers' module globals)."""
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def liger_model(base: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A copy of ``base`` patched by Liger (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy).
    Liger also replaces globals of transformers' modeling_llama; they are put back at once and set
    again only around the Liger model's own calls (returned), so the other variants stay plain."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama
    model = copy.deepcopy(base)
    before = dict(vars(modeling_llama))
    class_forward = modeling_llama.LlamaForCausalLM.forward
    apply_liger_kernel_to_llama(model=model)
    changed = {k: v for k, v in vars(modeling_llama).items() if before.get(k) is not v}
    for k in changed:
        setattr(modeling_llama, k, before[k])
    if modeling_llama.LlamaForCausalLM.forward is not class_forward:
        modeling_llama.LlamaForCausalLM.forward = class_forward
        fail("Liger replaced LlamaForCausalLM.forward for every model, not only the one given; the variants "
             "would not be separate")
    return model, changed


class Variant:
    def __init__(self, name: str, model: torch.nn.Module, call: Callable[..., Any], params: list[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, patch: Callable[[], Any] = contextlib.nullcontext):
        self.name, self.model, self.call, self.params = name, model, call, params
        self.opt, self.patch = optimizer, patch

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        with self.patch():
            loss = self.call(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def resident_bytes(self) -> int:
        """Parameters, gradients (as during a step) and optimizer states."""
        n = sum(p.numel() * p.element_size() for p in self.params)
        states = sum(t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
        return 2 * n + states


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, fused=params[0].is_cuda)


def chunk_lm_head(model: Any, args: argparse.Namespace) -> None:
    """--ce-chunk-mib: the coda LM head's logits chunk (its dlogits chunk is as large)."""
    mib = getattr(args, "ce_chunk_mib", None)
    if mib is not None:
        model.coda.ce_chunk_bytes = mib << 20


def build_variants(fields: dict[str, Any], names: list[str], args: argparse.Namespace) -> dict[str, Variant]:
    import transformers
    import coda_cutlass.nn as cnn
    fields = {**fields, "max_position_embeddings": max(fields.get("max_position_embeddings", 8192), args.seq)}
    cfg = transformers.LlamaConfig(**fields, rms_norm_eps=1e-5, attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)      # initialised in place on the device, in bf16 (3B: seconds, not minutes)
    try:
        with torch.device(getattr(args, "device", "cuda")):
            base = transformers.LlamaForCausalLM(cfg).train()
    finally:
        torch.set_default_dtype(default)
    out: dict[str, Variant] = {}
    shared = None
    if "eager" in names or "compile" in names:
        params = [p for p in base.parameters()]
        shared = adamw(params)
        if "eager" in names:
            out["eager"] = Variant("eager", base, base, params, shared)
        if "compile" in names:
            compiled = torch.compile(base, mode=args.compile_mode)
            out["compile"] = Variant("compile", base, compiled, params, shared)
    if "liger" in names:
        model, changed = liger_model(base)
        from transformers.models.llama import modeling_llama
        out["liger"] = Variant("liger", model, model, list(model.parameters()), adamw(list(model.parameters())),
                               lambda: module_globals(modeling_llama, changed))
    for name in (n for n in names if n in ("coda", CODA_COMPILE, *FP8_VARIANTS) or attention_variant(n)):
        kind, inputs = attention_variant(name) or (name, "views")
        model = cnn.from_hf(base, fp8=kind.removeprefix("coda-fp8-") if kind in FP8_VARIANTS else None)
        for block in model.coda.blocks:
            block.attention.inputs = inputs
        chunk_lm_head(model, args)
        call = torch.compile(model, mode=args.compile_mode) if name == CODA_COMPILE else model
        out[name] = Variant(name, model, call, list(model.parameters()), adamw(list(model.parameters())))
    if "eager" not in names and "compile" not in names:
        del base
    return out


# ---------------------------------------------------------------------------------------------- timing
def run_config(label: str, fields: dict[str, Any], args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    variants = build_variants(fields, names, args)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, fields["vocab_size"], (args.batch, args.seq), device="cuda", generator=g)
    first_loss = {}
    for v in variants.values():               # the same weights: no optimizer step has run yet
        compiling = v.name in ("compile", CODA_COMPILE)
        print(f"[{label}] first step of {v.name}{' (compiling)' if compiling else ''}", flush=True)
        with v.patch():
            loss = v.call(input_ids=tokens, labels=tokens).loss
        loss.backward()
        v.opt.zero_grad(set_to_none=True)
        first_loss[v.name] = float(loss)
    for v in variants.values():
        for _ in range(args.warmup):
            v.step(tokens)
        torch.cuda.synchronize()
    events = in_bursts(list(variants), lambda n, i: timed_call(variants[n].step, tokens),
                       rounds=args.rounds, burst=args.iters, seed=args.seed)
    torch.cuda.synchronize()
    times = {n: [s.elapsed_time(e) for s, e in ev] for n, ev in events.items()}
    peaks = {}
    for v in variants.values():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        v.step(tokens)
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - before
        peaks[v.name] = (v.resident_bytes() + max(transient, 0)) / 2**30
    tok = args.batch * args.seq
    rows = {}
    for n, t in times.items():
        med = statistics.median(t)
        rows[n] = {"ms": med, "ms_all": t, "tokens_per_s": tok / med * 1000.0, "peak_gib": peaks[n],
                   "first_loss": first_loss[n]}
    result = {"config": label, "layers": fields["num_hidden_layers"], "hidden": fields["hidden_size"],
              "batch": args.batch, "seq": args.seq, "variants": rows, "seconds": time.perf_counter() - t0}
    if "coda" in variants:
        runner = variants["coda"].model.coda.blocks[0].get_runner()
        result["coda_plan"] = getattr(runner, "plan_source", None)
    del variants
    torch.cuda.empty_cache()
    return result


def ratios(r: dict[str, Any]) -> dict[str, float]:
    v = r["variants"]
    if "coda" not in v:
        return {}
    out = {f"{c}/{n}": v[c]["tokens_per_s"] / v[n]["tokens_per_s"]
           for c in v if c.startswith("coda") for n in v if not n.startswith("coda")}
    for c in v:                         # an attention-inputs variant against its base, same run
        base = (attention_variant(c) or ("",))[0]
        if base in v:
            out[f"{c}/{base}"] = v[c]["tokens_per_s"] / v[base]["tokens_per_s"]
    return out


def markdown(results: list[dict[str, Any]], env: dict[str, Any], path: Path) -> None:
    from report import machine_line
    names = variant_order(results)
    lines = [f"# Whole-model training step (forward + loss, backward, fused AdamW)\n",
             machine_line(env) + f"transformers {env.get('transformers')}, "
             f"liger-kernel {env.get('liger_kernel', '-')}.",
             "Median step time (ms), tokens/s, peak memory (GiB: own parameters, gradients and optimizer states + the "
             "step's transient peak), loss of the first step.\n",
             "| config | " + " | ".join(names) + " | coda vs |", "|---|" + "---|" * (len(names) + 1)]
    for r in results:
        cells = []
        for n in names:
            v = r["variants"].get(n)
            cells.append("-" if v is None else f"{v['ms']:.1f} ms, {v['tokens_per_s']:.0f} tok/s, "
                                               f"{v['peak_gib']:.1f} GiB, loss {v['first_loss']:.4f}")
        vs = ", ".join(f"{k.replace('/', ' vs ')} {x:.3f}x" for k, x in ratios(r).items())
        lines.append(f"| {r['config']} ({r['layers']} layers, {r['batch']} x {r['seq']}) | " + " | ".join(cells) +
                     f" | {vs} |")
    lines.append("\nTargets (issue 21): coda >= 1.05x Liger and >= 1.10x torch.compile tokens/s, peak memory <= "
                 "Liger's.")
    path.write_text("\n".join(lines) + "\n")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = variant_order(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(results))]
        axes[0].bar(xs, [r["variants"].get(n, {}).get("tokens_per_s", 0) / 1e3 for r in results], width, label=n)
        axes[1].bar(xs, [r["variants"].get(n, {}).get("peak_gib", 0) for r in results], width, label=n)
    for ax, ylabel in zip(axes, ("k tokens / s", "peak GiB")):
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels([r["config"] for r in results])
        ax.set_ylabel(ylabel)
    axes[0].legend()
    fig.suptitle("training step: forward + loss, backward, fused AdamW (bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for results.json, results.md, results.png")
    p.add_argument("--configs", default="1b,3b,8b", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(ALL_VARIANTS)} (the FP8 ones are opt-in), and coda[-fp8-RECIPE]@heads "
                        "or @heads_repeated (SDPA handed head-major q, k, v; opt-in)")
    p.add_argument("--layers", type=int, default=None, help="override every config's number of layers")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=3, help="steps per visit of a variant in a round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ce-chunk-mib", type=int, default=None,
                   help="the coda LM head's logits chunk in MiB (default: the model's, 1024)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default: torch's default)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny widths, 1 x 256 tokens, one round "
                   "(the first coda run builds the kernels its cache lacks, about a minute each)")
    args = p.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    bad = [n for n in names if n not in ALL_VARIANTS and not attention_variant(n)]
    if bad:
        fail(f"unknown variant(s) {bad}; known: {', '.join(ALL_VARIANTS)}, and coda or coda-fp8-RECIPE with "
             f"@{' or @'.join(ATTENTION_SUFFIXES)} (SDPA's inputs)")
    configs = {"quick": dict(QUICK)} if args.quick else {}
    if not args.quick:
        for c in (c.strip() for c in args.configs.split(",") if c.strip()):
            if c not in CONFIGS:
                fail(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
            configs[c] = dict(CONFIGS[c])
    if args.quick:
        args.batch, args.seq, args.rounds, args.iters, args.warmup = 1, 256, 1, 1, 1
    if args.layers is not None:
        for f in configs.values():
            f["num_hidden_layers"] = args.layers
    env = check_environment(names)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for label, fields in configs.items():
        print(f"[{label}] {fields['num_hidden_layers']} layers, hidden {fields['hidden_size']}, "
              f"{args.batch} x {args.seq} tokens: {', '.join(names)}", flush=True)
        results.append(run_config(label, fields, args, names))
        for n, v in results[-1]["variants"].items():
            print(f"[{label}] {n:8s} {v['ms']:8.1f} ms  {v['tokens_per_s']:9.0f} tok/s  {v['peak_gib']:6.1f} GiB  "
                  f"loss {v['first_loss']:.4f}", flush=True)
    from report import write_results
    write_results(args.out, {**env, "args": {k: str(v) for k, v in vars(args).items()}}, results,
                  markdown, plot)


if __name__ == "__main__":
    main()
