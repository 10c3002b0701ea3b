"""One rank of test_distributed_gpu.py's amax-reduction check: a "tensorwise" LlamaModel under DDP,
each rank on its own tokens, three training steps; writes the rank's losses and every block's scale
state to OUT/rank{RANK}-{reduce}.pt. Run as ``python amax_ranks_worker.py OUT DEVICE`` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. DEVICE "cuda": rank r on cuda:r over NCCL when there
are as many GPUs as ranks, else every rank on cuda:0 over gloo (which reduces CUDA tensors through
the host), so one GPU runs the real kernels and the amax reduction of device tensors; "cpu": the
interpreter over gloo (how this script is checked without a GPU)."""

from __future__ import annotations

import dataclasses
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from coda_cutlass.nn import LlamaModel
from coda_cutlass.nn.fp8.recipe import RECIPES
from coda_cutlass.nn.parallel import coda_blocks

# the widths of test_fp8_block_gpu.py's model test, so its prebuilt kernels serve
V, D, LAYERS, HEADS, KV, F, HEAD_DIM, TOKENS = 1024, 512, 2, 4, 2, 1024, 128, (2, 256)


def main(out: Path, kind: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    own_gpus = kind == "cuda" and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank if own_gpus else 0) if kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if own_gpus else "gloo", timeout=timedelta(seconds=120),
                            **({"device_id": device} if own_gpus else {}))
    for reduce in (True, False):
        torch.manual_seed(3)
        model = LlamaModel(V, D, LAYERS, HEADS, KV, F, head_dim=HEAD_DIM, device=device, dtype=torch.bfloat16,
                           fp8=dataclasses.replace(RECIPES["tensorwise"], reduce_amax=reduce))
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator(device=device).manual_seed(100 + rank)        # each rank its own tokens
        losses = []
        for _ in range(3):
            tok = torch.randint(0, V, TOKENS, device=device, generator=gen)
            # a different magnitude per rank, so the ranks' amaxes differ from the first step on
            loss = ddp(tok, tok.roll(-1, 1)) * (1.0 + rank)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        states = []
        for b in coda_blocks(model):
            sc = b.fp8_path().scales
            states.append({**sc.state(), "scales": sc._scales.cpu().clone()})
        torch.save({"losses": losses, "states": states, "backend": dist.get_backend(), "device": str(device)},
                   out / f"rank{rank}-{reduce}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
