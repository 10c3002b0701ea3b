"""Training across GPUs (issue 22): FSDP2 over NCCL on N H200s at Llama-3-8B widths, the coda model
(nn.parallel.shard_model) against a plain PyTorch Llama + torch.compile (per block) + FSDP2.

    python bench/distributed.py --gpus 8 --out bench/results_distributed          # 8B widths, 32 layers
    python bench/distributed.py --gpus 2 --out /tmp/smoke --quick                  # tiny widths, a few steps

Both models: fp32 master parameters, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), each
block its own FSDP unit (resharded after its forward) plus the root, AdamW (fp32 states, foreach),
``--batch`` x ``--seq`` tokens per GPU, random tokens. Three phases, each in fresh processes
(torch.multiprocessing spawn; NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in every one):

1. throughput on N GPUs at full depth (the model built on the meta device, sharded, then
   materialised on the GPUs): ``--warmup`` untimed steps (compilation and kernel builds), then
   ``--steps`` timed ones (a barrier and a CUDA sync around each; the slowest rank's time counts);
   tokens/s per GPU, peak memory (the largest rank's max_memory_allocated);
2. the loss over ``--loss-steps`` steps on N GPUs at ``--loss-layers`` layers (both models from the
   same seeded weights, four batches cycled so the loss falls);
3. the same on one GPU with the same global batch (N micro-batches accumulated per step): the curve
   FSDP2 must reproduce (a full-depth 8B model with fp32 states does not fit one GPU).

Writes results.json and results.md into --out. Fails fast: too few GPUs, no Hopper GPU, a coda
kernel that does not build. ``--device cpu`` runs the same code over gloo with the reference
interpreter (the script's own test; no torch.compile there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
os.environ.update(MULTICAST_OFF)      # this process and every one it starts, before NCCL is loaded
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS: dict[str, dict[str, Any]] = {
    "8b": dict(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, theta=500000.0),
}
QUICK = dict(vocab=4096, dim=256, layers=2, heads=4, kv_heads=2, ffn=512, theta=500000.0)
VARIANTS = ("coda", "compile", "eager")
LOSS_BATCHES = 4


def fail(msg: str) -> None:
    sys.exit(f"bench/distributed.py: {msg}")


# ---------------------------------------------------------------------------------------------- plain model
class PlainBlock(nn.Module):
    """A Llama decoder layer in plain PyTorch (standard layout: separate q/k/v, gate/up; half-split
    RoPE; F.rms_norm; SDPA), the block torch.compile and FSDP2 wrap."""

    def __init__(self, dims: Any, device: Any = None):
        super().__init__()
        d, kw = dims, {"device": device, "dtype": torch.float32}
        self.dims = d
        self.q = nn.Parameter(torch.empty(d.q_width, d.dim, **kw))
        self.k = nn.Parameter(torch.empty(d.kv_width, d.dim, **kw))
        self.v = nn.Parameter(torch.empty(d.kv_width, d.dim, **kw))
        self.o = nn.Parameter(torch.empty(d.dim, d.q_width, **kw))
        self.gate = nn.Parameter(torch.empty(d.ffn_dim, d.dim, **kw))
        self.up = nn.Parameter(torch.empty(d.ffn_dim, d.dim, **kw))
        self.down = nn.Parameter(torch.empty(d.dim, d.ffn_dim, **kw))
        self.attn_norm = nn.Parameter(torch.ones(d.dim, **kw))
        self.mlp_norm = nn.Parameter(torch.ones(d.dim, **kw))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from coda_cutlass.nn.reference import rotate_half
        d = self.dims
        B, S, D = x.shape
        h = F.rms_norm(x, (D,), weight=self.attn_norm, eps=d.eps)
        q = (h @ self.q.t()).view(B, S, d.n_heads, d.head_dim).transpose(1, 2)
        k = (h @ self.k.t()).view(B, S, d.n_kv_heads, d.head_dim).transpose(1, 2)
        v = (h @ self.v.t()).view(B, S, d.n_kv_heads, d.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=d.n_heads != d.n_kv_heads)
        x1 = x + o.transpose(1, 2).reshape(B, S, -1) @ self.o.t()
        h1 = F.rms_norm(x1, (D,), weight=self.mlp_norm, eps=d.eps)
        return x1 + (F.silu(h1 @ self.gate.t()) * (h1 @ self.up.t())) @ self.down.t()


class PlainLlama(nn.Module):
    """Embedding, PlainBlocks, final norm, LM head and cross-entropy on the whole logits (in fp32)."""

    def __init__(self, cfg: dict[str, Any], device: Any = None):
        super().__init__()
        from coda_cutlass.nn.functional import BlockDims
        self.dims = BlockDims(cfg["dim"], cfg["heads"], cfg["kv_heads"], cfg["dim"] // cfg["heads"], cfg["ffn"], 1e-5)
        kw = {"device": device, "dtype": torch.float32}
        self.embed = nn.Parameter(torch.empty(cfg["vocab"], cfg["dim"], **kw))
        self.blocks = nn.ModuleList(PlainBlock(self.dims, device) for _ in range(cfg["layers"]))
        self.norm = nn.Parameter(torch.ones(cfg["dim"], **kw))
        self.lm_head = nn.Parameter(torch.empty(cfg["vocab"], cfg["dim"], **kw))
        self.theta = cfg["theta"]
        self.head_loss = head_loss           # torch.compile'd in the compile variant

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from coda_cutlass.nn.rope import Rope
        x = F.embedding(tokens, self.embed)
        S = tokens.shape[1]
        inv = Rope.default(self.dims.head_dim, self.theta).inv_freq().to(x.device, torch.float32)   # as coda's
        theta = torch.arange(S, dtype=torch.float32, device=x.device)[:, None] * inv[None]
        emb = torch.cat((theta, theta), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)       # fp32 angles, as transformers
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head_loss(x, self.norm, self.lm_head, targets, self.dims.eps)


def head_loss(x: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor,
              eps: float) -> torch.Tensor:
    logits = F.rms_norm(x, (x.shape[-1],), weight=norm, eps=eps) @ lm_head.t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def plain_from_coda(coda: Any, cfg: dict[str, Any]) -> PlainLlama:
    """The plain twin of a coda LlamaModel: the same weights in the standard layout."""
    from coda_cutlass.nn.reference import standard_weights
    plain = PlainLlama(cfg)
    with torch.no_grad():
        for name in ("embed", "norm", "lm_head"):
            getattr(plain, name).copy_(getattr(coda, name))
        for pb, cb in zip(plain.blocks, coda.blocks):
            for name, t in standard_weights(cb).items():
                getattr(pb, name).copy_(t)
    return plain


def init_weights(model: nn.Module) -> None:
    """Random weights for a materialised meta model (norm gains 1, matrices N(0, 1 / fan_in), the
    embedding N(0, 1)): throughput does not depend on the values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith("embed"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)


# ---------------------------------------------------------------------------------------------- one process
def build(variant: str, cfg: dict[str, Any], device: torch.device, *, meta: bool, seed: int,
          checkpoint: bool) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from coda_cutlass.nn import LlamaModel
    from coda_cutlass.nn.parallel import shard_model
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    args = (cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["kv_heads"], cfg["ffn"])
    if meta:       # no memory yet; the blocks make their RoPE tables again when materialised
        coda = LlamaModel(*args, rope_theta=cfg["theta"], device="meta", dtype=torch.float32) \
            if variant == "coda" else None
        plain = PlainLlama(cfg, device="meta") if variant != "coda" else None
    else:
        torch.manual_seed(seed)       # the same weights in every process and for both models
        coda = LlamaModel(*args, rope_theta=cfg["theta"], dtype=torch.float32)
        plain = plain_from_coda(coda, cfg) if variant != "coda" else None
    if variant == "coda":
        model = shard_model(coda, mp_policy=policy, activation_checkpointing=checkpoint)
    else:       # activation checkpointing, torch.compile, FSDP2: per block, in that order
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        model = plain
        for i, b in enumerate(model.blocks):
            if checkpoint:
                b = checkpoint_wrapper(b)
            if variant == "compile":
                b = torch.compile(b)
            model.blocks[i] = b
            fully_shard(b, mp_policy=policy)
        if variant == "compile":
            model.head_loss = torch.compile(head_loss)
        fully_shard(model, mp_policy=policy)
    if meta:
        model.to_empty(device=device)
        init_weights(model)
    else:
        model.to(device)
    return model


def batches(cfg: dict[str, Any], rows: int, seq: int, count: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``count`` global batches of ``rows`` x ``seq`` random tokens (targets: the next token), the
    same in every process."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(count):
        t = torch.randint(0, cfg["vocab"], (rows, seq + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].contiguous().to(device)))
    return out


def step(model: nn.Module, opt: torch.optim.Optimizer, micro: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """One optimizer step over the micro-batches (mean of their losses); returns the loss."""
    total = torch.zeros((), device=micro[0][0].device)
    for i, (tokens, targets) in enumerate(micro):
        if len(micro) > 1:
            model.set_requires_gradient_sync(i == len(micro) - 1)
        loss = model(tokens, targets) / len(micro)
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def throughput(variant: str, cfg: dict[str, Any], a: Any, device: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    model = build(variant, cfg, device, meta=True, seed=0, checkpoint=a.checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    data = batches(cfg, world * a.batch, a.seq, 1, device)[0]
    mine = (data[0][rank * a.batch:(rank + 1) * a.batch], data[1][rank * a.batch:(rank + 1) * a.batch])
    for i in range(a.warmup):
        say(f"[{variant}] warm-up step {i + 1}/{a.warmup}{' (kernel builds / compilation)' if i == 0 else ''}")
        step(model, opt, [mine])
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(a.steps):
        sync(device)
        s = time.perf_counter()
        step(model, opt, [mine])
        sync(device)
        t = torch.tensor([time.perf_counter() - s], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                        device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    med = statistics.median(times)
    del model, opt
    return {"step_s": med, "steps_s": times, "tokens_per_s_per_gpu": a.batch * a.seq / med,
            "peak_gib": peak.item(), "seconds": time.perf_counter() - t0}


def loss_curve(variant: str, cfg: dict[str, Any], a: Any, device: torch.device) -> dict[str, Any]:
    """The loss of every step; the global batch is always gpus x batch rows (on one process: as
    gpus micro-batches)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(variant, cfg, device, meta=False, seed=0, checkpoint=a.checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, foreach=True)
    data = batches(cfg, a.gpus * a.batch, a.seq, LOSS_BATCHES, device)
    per = a.gpus * a.batch // world
    losses = []
    for i in range(a.loss_steps):
        tokens, targets = data[i % LOSS_BATCHES]
        mine = tokens[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]
        micro = [(mine[0][j:j + a.batch], mine[1][j:j + a.batch]) for j in range(0, per, a.batch)]
        loss = step(model, opt, micro)
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        if i % 10 == 0 or i == a.loss_steps - 1:
            say(f"[{variant}] loss step {i + 1}/{a.loss_steps}: {losses[-1]:.4f}")
    del model, opt
    return {"losses": losses}


def say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def worker(rank: int, world: int, port: int, phase: str, cfg: dict[str, Any], a: Any, out: str) -> None:
    os.environ.update(MULTICAST_OFF)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if a.device == "cuda":
        if torch.cuda.get_device_capability(rank) != (9, 0):
            raise RuntimeError(f"GPU {rank} is {torch.cuda.get_device_name(rank)}, not a Hopper GPU (sm_90): "
                               "the coda kernels target it")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=30))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    try:
        say(f"{phase}: {world} process(es), {cfg['layers']} layers, dim {cfg['dim']}, "
            f"{a.batch} x {a.seq} tokens per GPU")
        results = {}
        for v in a.variants:
            results[v] = (throughput if phase == "throughput" else loss_curve)(v, cfg, a, device)
            if phase == "throughput":
                r = results[v]
                say(f"[{v}] {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
                    f"{r['peak_gib']:.1f} GiB")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_phase(phase: str, world: int, cfg: dict[str, Any], a: Any) -> dict[str, Any]:
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = a.out / f"{phase}.{world}.json"
    out.unlink(missing_ok=True)
    mp.start_processes(worker, args=(world, port, phase, cfg, a, str(out)), nprocs=world, start_method="spawn")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------- report
def markdown(res: dict[str, Any], path: Path) -> None:
    a, cfg = res["args"], res["config"]
    lines = [f"# FSDP2 training step on {a['gpus']} GPUs\n",
             f"{res['environment'].get('gpu')} x {a['gpus']}, torch {res['environment'].get('torch')}, "
             f"CUDA {res['environment'].get('cuda')}. Widths: dim {cfg['dim']}, ffn {cfg['ffn']}, heads "
             f"{cfg['heads']}/{cfg['kv_heads']}, vocab {cfg['vocab']}; {a['batch']} x {a['seq']} tokens per GPU; "
             "fp32 master weights, MixedPrecisionPolicy(bf16, fp32), AdamW"
             f"{', activation checkpointing' if a['checkpoint'] else ''}.\n"]
    if res.get("throughput"):
        lines += [f"## Throughput ({cfg['layers']} layers)\n",
                  "| variant | step (ms) | tokens/s per GPU | peak memory (GiB) |", "|---|---|---|---|"]
        for v, r in res["throughput"].items():
            lines.append(f"| {v} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s_per_gpu']:.0f} | {r['peak_gib']:.1f} |")
        t = res["throughput"]
        if "coda" in t:
            lines.append("\n" + ", ".join(f"coda / {v}: {t['coda']['tokens_per_s_per_gpu'] / r['tokens_per_s_per_gpu']:.3f}x"
                                          for v, r in t.items() if v != "coda"))
    if res.get("loss"):
        lines += [f"\n## Loss over {a['loss_steps']} steps ({a['loss_layers']} layers): {a['gpus']} GPUs against one\n",
                  "| variant | first | last (N GPUs) | last (1 GPU) | largest difference |", "|---|---|---|---|---|"]
        for v, r in res["loss"].items():
            lines.append(f"| {v} | {r['gpus'][0]:.4f} | {r['gpus'][-1]:.4f} | {r['one'][-1]:.4f} | "
                         f"{r['max_abs_diff']:.2e} |")
    path.write_text("\n".join(lines) + "\n")


def environment(device: str) -> dict[str, Any]:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **MULTICAST_OFF}
    if device == "cuda":
        from report import environment as gpu_environment
        env.update(gpu_environment())
    else:
        env["gpu"] = "cpu (gloo, reference interpreter)"
    return env


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for results.json and results.md")
    p.add_argument("--gpus", type=int, default=None, help="processes / GPUs (default: every visible GPU)")
    p.add_argument("--config", default="8b", choices=sorted(CONFIGS))
    p.add_argument("--variants", default="coda,compile", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--phases", default="throughput,loss", help="comma list of throughput, loss")
    p.add_argument("--batch", type=int, default=1, help="rows per GPU")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--loss-steps", type=int, default=50)
    p.add_argument("--loss-layers", type=int, default=4, help="layers of the loss-curve model (it must fit one GPU)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block (coda: "
                   "nn.parallel's; plain: torch's checkpoint_wrapper)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo and the interpreter")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny widths, 2 layers, 256 tokens per GPU, "
                   "2 + 2 throughput steps, 6 loss steps (the first coda run builds the kernels its cache lacks)")
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    a.phases = [x.strip() for x in a.phases.split(",") if x.strip()]
    bad = [v for v in a.variants if v not in VARIANTS] + [x for x in a.phases if x not in ("throughput", "loss")]
    if bad:
        fail(f"unknown variant(s) or phase(s) {bad}; variants: {', '.join(VARIANTS)}; phases: throughput, loss")
    if a.batch < 1 or a.seq < 1 or a.steps < 1 or a.loss_steps < 1:
        fail("--batch, --seq, --steps and --loss-steps must be positive")
    if a.quick:
        a.seq, a.steps, a.warmup, a.loss_steps, a.loss_layers = 256, 2, 2, 6, 2
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    cfg = dict(QUICK if a.quick else CONFIGS[a.config])
    if a.device == "cuda":
        if not torch.cuda.is_available():
            fail("needs CUDA GPUs (or --device cpu for the gloo smoke run)")
        count = torch.cuda.device_count()
        a.gpus = a.gpus or count
        if a.gpus > count:
            fail(f"--gpus {a.gpus} but only {count} GPU(s) are visible")
    else:
        a.gpus = a.gpus or 2
    if "compile" in a.variants and a.device == "cpu":
        fail("the compile variant runs on GPUs only (--variants coda,eager on the CPU)")
    if a.gpus < 1:
        fail("--gpus must be positive")
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"config": cfg, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}}
    if "throughput" in a.phases:
        res["throughput"] = run_phase("throughput", a.gpus, cfg, a)
    if "loss" in a.phases:
        small = dict(cfg, layers=a.loss_layers)
        many, one = run_phase("loss", a.gpus, small, a), run_phase("loss", 1, small, a)
        res["loss"] = {v: {"gpus": many[v]["losses"], "one": one[v]["losses"],
                           "max_abs_diff": max(abs(x - y) for x, y in zip(many[v]["losses"], one[v]["losses"]))}
                       for v in a.variants}
        bad = [v for v, r in res["loss"].items() if not all(math.isfinite(x) for x in r["gpus"] + r["one"])]
        if bad:
            print(f"bench/distributed.py: non-finite losses for {bad}", file=sys.stderr)
    res["environment"] = environment(a.device)      # after the runs: this process starts no CUDA context before
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    markdown(res, a.out / "results.md")
    print((a.out / "results.md").read_text())
    print(f"wrote {a.out}/results.json, results.md")
    return res


if __name__ == "__main__":
    main()
