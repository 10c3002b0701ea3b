"""FSDP2 on the GPU (skips without an sm_90 GPU): one process over NCCL (world size 1), so the real
kernels, not the interpreter, get FSDP2's unsharded bf16 parameters (a layout the kernels cannot
read would raise CallError), keep their runner across steps, and compute what the unsharded model
with compute_dtype=bf16 computes; activation checkpointing too. Several GPUs: bench/distributed.py."""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch

from coda_cutlass.nn import KernelRunner, LlamaModel
from conftest import hopper_available

pytestmark = pytest.mark.skipif(not hopper_available(), reason="needs an sm_90 GPU (H100/H200)")
BF16 = torch.bfloat16
V = 2048


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def nccl_world_of_one(monkeypatch):
    import torch.distributed as dist
    port = _free_port()
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                 "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
        monkeypatch.setenv(k, v)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _model() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(V, 1024, 2, 16, 4, 2816, rope_theta=1e4, device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp2_bf16_policy_runs_the_kernels_and_matches_the_unsharded_model(nccl_world_of_one, checkpointing):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from coda_cutlass.nn.parallel import shard_model
    twin = _model()
    twin.compute_dtype = BF16
    model = shard_model(_model(), mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32),
                        activation_checkpointing=checkpointing)
    tokens = torch.randint(0, V, (2, 256), device="cuda")
    targets = torch.randint(0, V, (2, 256), device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # no interpreter fallback warning
        loss = model(tokens, targets)
        loss.backward()
        runners = dict(model.blocks[0]._runners)
        model.zero_grad()
        model(tokens, targets).backward()           # a second step: the same runner, kernels cached
    assert len(runners) == 1 and model.blocks[0]._runners == runners
    runner = next(iter(runners.values()))
    assert isinstance(runner, KernelRunner) and runner.dtype == BF16
    loss2 = twin(tokens, targets)
    loss2.backward()
    assert abs(loss.item() - loss2.item()) <= 1e-3 * abs(loss2.item())
    for (name, p), p2 in zip(model.named_parameters(), twin.parameters()):
        g = p.grad.full_tensor()
        assert g.dtype == torch.float32, name
        assert rel(g, p2.grad) < 1e-2, name



def _launch_two_ranks(out, device: str) -> None:
    """tests/gpu/amax_ranks_worker.py on two ranks; fails with their output when one fails or hangs."""
    import subprocess
    import sys
    from pathlib import Path
    port = _free_port()
    worker = Path(__file__).resolve().parent / "amax_ranks_worker.py"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    procs = [subprocess.Popen([sys.executable, str(worker), str(out), device], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two ranks ran past 400 s (a collective one rank never joined?)")
    if any(p.returncode for p in procs):
        pytest.fail("\n".join(f"--- rank {r} (exit {p.returncode}):\n{log[-3000:]}"
                              for r, (p, log) in enumerate(zip(procs, logs))))


def test_fp8_ranks_reduce_their_amaxes_with_the_kernels(tmp_path):
    """Fp8Recipe.reduce_amax with the real kernels: two ranks under DDP on their own tokens (one GPU
    each over NCCL where there are two, else both on cuda:0 over gloo, which reduces the device
    tensors through the host) keep the same histories, amaxes and scales; without the reduction
    they differ. The CPU tests (tests/test_distributed.py) check the same through the interpreter."""
    _launch_two_ranks(tmp_path, "cuda")
    for reduce in (True, False):
        a, b = (torch.load(tmp_path / f"rank{r}-{reduce}.pt") for r in range(2))
        assert all(v == v and abs(v) < 1e4 for v in a["losses"] + b["losses"]), (a["losses"], b["losses"])
        assert a["losses"] != b["losses"]                 # the ranks saw other tokens
        same = all(torch.equal(sa[k], sb[k]) for sa, sb in zip(a["states"], b["states"])
                   for k in ("history", "amax", "scales", "pending"))
        assert same == reduce, (reduce, a["backend"], a["states"][0]["history"][:, :3], b["states"][0]["history"][:, :3])
        assert all((s["history"] > 0).any() for s in a["states"])      # amaxes were recorded at all
