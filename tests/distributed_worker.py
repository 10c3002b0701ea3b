"""One process of tests/test_distributed.py's runs: gloo on 127.0.0.1, the coda model through the
reference interpreter under FSDP2 / DDP. Every scenario runs on every rank; rank 0 writes what it
gathered to OUT/<scenario>.pt, a failing rank its traceback to OUT/<scenario>.rank<r>.err.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python tests/distributed_worker.py OUT fsdp,ddp
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

START = time.monotonic()
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from distributed_cases import LayoutCheckingRunner, build, global_batch, optimizer, rank_rows, resume_batch

from coda_cutlass.nn.parallel import coda_blocks, shard_model

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def every_rank(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.detach().contiguous())
    return torch.stack(out)


def share(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rank_rows(dist.get_rank(), dist.get_world_size(), batch[0].shape[0])
    return batch[0][rows], batch[1][rows]


def local_batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return share(global_batch(dist.get_world_size(), step))


def one_step(model: torch.nn.Module, runner: LayoutCheckingRunner | None = None) -> dict[str, Any]:
    tokens, targets = local_batch()
    loss = model(tokens, targets)
    loss.backward()
    out = {"loss": mean_over_ranks(loss), "local_losses": every_rank(loss.detach().float()), "grads": grads(model)}
    if runner is not None:
        out.update(problems=runner.problems, weights_seen=runner.weights_seen)
    return out


# ---------------------------------------------------------------------------------------- scenarios
def fsdp() -> dict[str, Any]:
    """shard_model, fp32, reshard after forward; the blocks' runners are made once and kept."""
    model = shard_model(build())
    first = model.blocks[0]
    out = one_step(model)
    runners = dict(first._runners)
    model.zero_grad()
    model(*local_batch()).backward()
    out["runner_kept"] = torch.tensor(first._runners == runners and len(runners) == 1)
    return out


def fsdp_bf16() -> dict[str, Any]:
    """MixedPrecisionPolicy(bf16, fp32): the unsharded parameters the kernels get, checked."""
    model = build()
    runner = LayoutCheckingRunner(torch.bfloat16)
    model.set_runner(runner)
    shard_model(model, mp_policy=BF16_POLICY)
    return one_step(model, runner)


def fsdp_shard_dim1() -> dict[str, Any]:
    """Weights sharded along their second dimension: the unsharded ones are still row-major."""
    from torch.distributed.tensor import Shard
    model = build()
    runner = LayoutCheckingRunner(torch.bfloat16)
    model.set_runner(runner)
    shard_model(model, mp_policy=BF16_POLICY, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
    return one_step(model, runner)


def fsdp_checkpointed() -> dict[str, Any]:
    """Activation checkpointing of every block (recomputed in the backward after the re-gather)."""
    return one_step(shard_model(build(), mp_policy=BF16_POLICY, activation_checkpointing=True))


def fsdp_whole() -> dict[str, Any]:
    """torch's fully_shard on the whole model only: one unit, no coda helper needed."""
    model = build()
    fully_shard(model, reshard_after_forward=True)
    return one_step(model)


def accumulation() -> dict[str, Any]:
    """Two micro-batches (the first without gradient sync), then one optimizer step."""
    model = shard_model(build())
    opt = optimizer(model.parameters())
    tokens, targets = local_batch()
    for i in range(2):
        model.set_requires_gradient_sync(i == 1)
        (model(tokens[i:i + 1], targets[i:i + 1]) / 2).backward()
    out = {"grads": grads(model)}
    opt.step()
    out["params"] = params(model)
    return out


def ddp() -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel
    return one_step(DistributedDataParallel(build()))


def ddp_checkpointed() -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel
    from coda_cutlass.nn.parallel import checkpoint_blocks
    return one_step(DistributedDataParallel(checkpoint_blocks(build())))


def _error_of(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except Exception as e:      # the refusal under test
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": ""}


def refuse_unregistered() -> dict[str, Any]:
    """Blocks sharded by hand without registering run: refused, naming the fix."""
    model = build()
    for b in coda_blocks(model):
        fully_shard(b)
    fully_shard(model)
    return _error_of(lambda: model(*local_batch()))


def refuse_cast_inputs() -> dict[str, Any]:
    """Blocks sharded by hand with cast_forward_inputs=True: their fp32 inputs would be rounded."""
    model = build()
    for b in coda_blocks(model):
        fully_shard(b, mp_policy=BF16_POLICY)
        register_fsdp_forward_method(b, "run")
    fully_shard(model, mp_policy=BF16_POLICY)
    return _error_of(lambda: model(*local_batch()))


def _sharded_with_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard_model(build(seed))
    return model, optimizer(model.parameters())


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    model(*share(resume_batch(step))).backward()
    opt.step()
    opt.zero_grad()


def dcp_save() -> dict[str, Any]:
    """One optimizer step, a DCP checkpoint of the sharded model and optimizer, one more step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    model, opt = _sharded_with_optimizer(0)
    _train(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.environ["DCP_DIR"])
    saved = params(model)
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _train(model, opt, 2)
    return {"saved": saved, "full_state_dict": whole, "next": params(model)}


def dcp_load() -> dict[str, Any]:
    """Another world size loads the checkpoint into a model built from another seed and takes the
    same next step (the same global batch, split over its ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _sharded_with_optimizer(1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.environ["DCP_DIR"])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = params(model)
    _train(model, opt, 2)
    return {"loaded": loaded, "next": params(model)}


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f for f in (fsdp, fsdp_bf16, fsdp_shard_dim1, fsdp_checkpointed, fsdp_whole, accumulation, ddp,
                            ddp_checkpointed, refuse_unregistered, refuse_cast_inputs, dcp_save, dcp_load)}


def main(out: Path, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    print(f"rank {rank}: started {time.monotonic() - START:.1f} s after launch", flush=True)
    try:
        for name in names:
            t0 = time.monotonic()
            print(f"rank {rank}: {name}", end="", flush=True)
            try:
                result = SCENARIOS[name]()
            except Exception:       # the test names the scenario and shows this; the others still run
                (out / f"{name}.rank{rank}.err").write_text(traceback.format_exc())
            else:
                if rank == 0:
                    torch.save(result, out / f"{name}.pt")
            dist.barrier()
            print(f" {time.monotonic() - t0:.1f} s", flush=True)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every scenario ran and wrote its result or its traceback, and every rank passed the last
    # barrier: leave without gloo's teardown. Under load (the whole suite on 2 cores) rank 0 once
    # aborted in it after the DCP scenarios ("terminate called without an active exception",
    # SIGABRT), which failed 22 tests whose results were all written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
