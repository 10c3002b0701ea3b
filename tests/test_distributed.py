"""coda models on PyTorch's distributed engines, on the CPU: 2 and 4 processes (gloo on 127.0.0.1)
run the reference interpreter under FSDP2 and DDP (tests/distributed_worker.py, one launch per
world size for all its scenarios), and every loss and gradient is compared with the same model in
this process. FP8 "tensorwise" models (2 ranks, each on its own tokens) reduce their delayed
scales' amaxes over the ranks: every rank keeps one scale state, and a DCP resume is exact.

Tolerances. fp32 parameters compute exactly: the distributed runs differ from one process only in
the order of sums over tokens (the weight gradients, the loss mean, the ranks' average), so they
agree to fp32 rounding: 4e-6 of each tensor's largest value (about 30 ulps of sums over ~100
terms). Under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) each rank computes in bf16
what one process computes with ``compute_dtype=bf16`` on that rank's rows (the same bf16 weights:
FSDP rounds the shards, the model rounds the whole tensor, elementwise alike), and FSDP averages
the ranks' bf16 gradients in fp32: the reference does that average in this process, so the same
fp32 tolerance holds. No token occurs twice in a batch, so no embedding row sums gradients (FSDP2
sums them in bf16, one process in fp32). Against one fp32 process the bf16 runs are only within
bf16 error (checked at 5%).
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed_cases import LAYERS, build, build_fp8, fp8_batch, global_batch, optimizer, rank_rows, resume_batch

from coda_cutlass.nn import LlamaModel
from coda_cutlass.nn.parallel import checkpoint_blocks, shard_model

WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
BF16 = torch.bfloat16
FP32_TOL = 4e-6
BOTH = ["fsdp", "fsdp_bf16", "fsdp_checkpointed", "accumulation", "ddp"]
ONLY_2 = ["fsdp_shard_dim1", "fsdp_whole", "ddp_checkpointed", "refuse_unregistered", "refuse_cast_inputs", "dcp_save",
          "fp8_reduced_scales", "fp8_empty_batch", "fp8_two_backwards", "fp8_validation_on_one_rank",
          "fp8_tensor_on_one_rank",
          "fp8_forward_on_one_rank_between_two_backwards", "fp8_dcp_resume", "fp8_amax_group_destroyed"]
ONLY_4 = ["dcp_load", "fp8_amax_subgroups"]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, out: Path, names: list[str], dcp_dir: Path) -> None:
    """``world`` worker processes over gloo; fails with their output when one fails or hangs."""
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1", "DCP_DIR": str(dcp_dir),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    logs = [out / f"rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out), ",".join(names)],
                                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                          stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.wait()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- rank {r} (exit {p.returncode}):\n{logs[r].read_text()[-3000:]}"
                          for r, p in enumerate(procs))
        pytest.fail(f"the {world}-process run failed or ran past {TIMEOUT_S} s:\n{tails}")


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="module")
def run2(tmp_path_factory, dcp_dir) -> Path:
    out = tmp_path_factory.mktemp("world2")
    launch(2, out, BOTH + ONLY_2, dcp_dir)
    return out


@pytest.fixture(scope="module")
def run4(tmp_path_factory, dcp_dir, run2) -> Path:
    out = tmp_path_factory.mktemp("world4")      # after run2: it loads run2's checkpoint
    launch(4, out, BOTH + ONLY_4, dcp_dir)
    return out


def result(out: Path, name: str) -> dict[str, Any]:
    errors = sorted(out.glob(f"{name}.rank*.err"))
    if errors:
        pytest.fail(f"scenario {name} failed:\n" + "\n".join(e.read_text() for e in errors))
    return torch.load(out / f"{name}.pt", weights_only=False)


def run_of(request, world: int) -> Path:
    return request.getfixturevalue(f"run{world}")


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = FP32_TOL,
                 what: str = "") -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        err = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
        assert err <= tol, f"{what}{name}: relative error {err:.2e} > {tol:.0e}"


# ---------------------------------------------------------------------------------------- references
def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def reference_fp32(world: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, fp32, the whole global batch: (loss, grads)."""
    model = build()
    loss = model(*global_batch(world))
    loss.backward()
    return loss.detach(), _grads(model)


@functools.lru_cache(maxsize=None)
def reference_bf16(world: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, compute_dtype=bf16 on fp32 parameters, each rank's rows apart, the gradients
    averaged in fp32 (FSDP2's bf16 policy): (every rank's loss, grads)."""
    tokens, targets = global_batch(world)
    losses, total = [], None
    for r in range(world):
        model = build()
        model.compute_dtype = BF16
        rows = rank_rows(r, world, tokens.shape[0])
        loss = model(tokens[rows], targets[rows])
        loss.backward()
        losses.append(loss.detach().float())
        g = _grads(model)
        total = g if total is None else {n: total[n] + g[n] for n in g}
    return torch.stack(losses), {n: t / world for n, t in total.items()}


def train(model: LlamaModel, batches: list[tuple[torch.Tensor, torch.Tensor]],
               opt: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    opt = opt or optimizer(model.parameters())
    for b in batches:
        model(*b).backward()
        opt.step()
        opt.zero_grad()
    return opt


# ---------------------------------------------------------------------------------------- FSDP2
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_per_block_loss_and_every_gradient_equal_one_process(request, world):
    res = result(run_of(request, world), "fsdp")
    loss, grads = reference_fp32(world)
    assert abs(res["loss"].item() - loss.item()) <= FP32_TOL * abs(loss.item())
    assert_close(res["grads"], grads)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_blocks_keep_one_runner_across_steps(request, world):
    """The runner cache (compiled kernels on a GPU) survives FSDP2 swapping the parameters."""
    assert result(run_of(request, world), "fsdp")["runner_kept"].item()


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_bf16_policy_equals_one_process_in_bf16(request, world):
    res = result(run_of(request, world), "fsdp_bf16")
    losses, grads = reference_bf16(world)
    assert torch.equal(res["local_losses"], losses)      # every rank's forward, bit for bit
    assert_close(res["grads"], grads)
    _, fp32 = reference_fp32(world)
    assert_close(res["grads"], fp32, tol=5e-2, what="bf16 against fp32: ")


@pytest.mark.parametrize("world, scenario", [(2, "fsdp_bf16"), (4, "fsdp_bf16"), (2, "fsdp_shard_dim1")])
def test_fsdp_unsharded_weights_are_what_the_kernels_read(request, world, scenario):
    """Every weight a GEMM gets under FSDP2 is a plain tensor TMA can read (unit column stride,
    16-byte rows and base), also for weights sharded along dim 1 and the padded vocab shards."""
    res = result(run_of(request, world), scenario)
    assert res["weights_seen"] >= 6 * LAYERS
    assert res["problems"] == []
    if scenario == "fsdp_shard_dim1":
        assert_close(res["grads"], reference_bf16(world)[1])


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_activation_checkpointing_equals_no_checkpointing_exactly(request, world):
    """Blocks recomputed in the backward (resharded after the forward, gathered again) give the
    gradients of the uncheckpointed run bit for bit."""
    out = run_of(request, world)
    res, plain = result(out, "fsdp_checkpointed"), result(out, "fsdp_bf16")
    assert torch.equal(res["loss"], plain["loss"])
    for name, g in plain["grads"].items():
        assert torch.equal(res["grads"][name], g), name


def test_fully_shard_whole_model_equals_one_process(run2):
    res = result(run2, "fsdp_whole")
    loss, grads = reference_fp32(2)
    assert abs(res["loss"].item() - loss.item()) <= FP32_TOL * abs(loss.item())
    assert_close(res["grads"], grads)


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_accumulation_equals_one_big_batch(request, world):
    """Two micro-batches per rank (the first without gradient sync), then an optimizer step: the gradients and
    the parameters after the step equal one process's step on the whole batch."""
    res = result(run_of(request, world), "accumulation")
    _, grads = reference_fp32(world)
    assert_close(res["grads"], grads)
    model = build()
    train(model, [global_batch(world)])
    assert_close(res["params"], {n: p.detach() for n, p in model.named_parameters()})


# ---------------------------------------------------------------------------------------- DDP
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_loss_and_every_gradient_equal_one_process(request, world):
    res = result(run_of(request, world), "ddp")
    loss, grads = reference_fp32(world)
    assert abs(res["loss"].item() - loss.item()) <= FP32_TOL * abs(loss.item())
    assert_close({k.removeprefix("module."): v for k, v in res["grads"].items()}, grads)


def test_ddp_with_activation_checkpointing(run2):
    res = result(run2, "ddp_checkpointed")
    _, grads = reference_fp32(2)
    assert_close({k.removeprefix("module."): v for k, v in res["grads"].items()}, grads)


# ---------------------------------------------------------------------------------------- refusals
def test_blocks_sharded_without_their_run_registered_are_refused(run2):
    error = result(run2, "refuse_unregistered")["error"]
    assert error.startswith("RuntimeError: LlamaBlock.run got sharded (DTensor) parameters")
    assert "register_fsdp_forward_method(block, 'run')" in error and "shard_model" in error


def test_blocks_whose_fp32_inputs_fsdp_would_round_are_refused(run2):
    error = result(run2, "refuse_cast_inputs")["error"]
    assert error.startswith("TypeError: LlamaBlock.run: r (the rstd of the residual stream) must be float32, "
                            "got torch.bfloat16")
    assert "cast_forward_inputs=False" in error


def test_shard_model_refuses_what_it_cannot_shard():
    with pytest.raises(ValueError, match="holds no coda_cutlass.nn.LlamaBlock"):
        shard_model(torch.nn.Linear(4, 4))
    from torch.distributed.fsdp import MixedPrecisionPolicy
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        shard_model(build(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        shard_model(build(), mp_policy={"param_dtype": BF16})


# ---------------------------------------------------------------------------------------- checkpoints
def _resumed_reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = build()
    opt = train(model, [resume_batch(1)])
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, [resume_batch(2)], opt)
    return saved, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_dcp_saved_by_2_processes_loads_into_4_and_training_goes_on(run2, run4):
    saved, after = result(run2, "dcp_save"), result(run4, "dcp_load")
    for name, t in saved["saved"].items():
        assert torch.equal(after["loaded"][name], t), name
    assert_close(after["next"], saved["next"], what="the step after loading in 4 against 2 processes: ")
    ref_saved, ref_next = _resumed_reference()
    assert_close(saved["saved"], ref_saved)
    assert_close(after["next"], ref_next)


def test_dcp_saved_by_2_processes_loads_into_one(run2, dcp_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    saved = result(run2, "dcp_save")
    model = build(seed=1)
    opt = optimizer(model.parameters())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(dcp_dir), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved["saved"][name]), name
    train(model, [resume_batch(2)], opt)
    assert_close({n: p.detach() for n, p in model.named_parameters()}, saved["next"])


def test_full_state_dict_of_a_sharded_model_loads_with_load_state_dict(run2):
    saved = result(run2, "dcp_save")
    model = build(seed=1)
    model.load_state_dict(saved["full_state_dict"])            # strict: every key, the blocks' extra state
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved["saved"][name]), name


# ---------------------------------------------------------------------------------------- FP8 amax reduction
# "tensorwise" models (2 ranks, each on its own tokens; the reference interpreter): with reduce_amax
# (the default) every step's amaxes are reduced over the ranks, so every rank keeps the same state
SCALE_STATE = ("history", "amax", "scales", "pending", "pending_set", "slot", "steps")


def _same(a: dict[str, Any], b: dict[str, Any], k: str) -> bool:
    return torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(_same(a, b, k) for k in SCALE_STATE)


def _assert_ranks_agree(states: list[list[dict[str, Any]]]) -> None:
    """``states``: each rank's list of its blocks' states (distributed_worker.scale_states)."""
    for block, (a, b) in enumerate(zip(*states)):
        for k in SCALE_STATE:
            assert _same(a, b, k), (block, k)


@functools.lru_cache(maxsize=None)
def _first_step_amaxes(rank: int) -> list[torch.Tensor]:
    """Each block's amaxes of one process's first training step on ``rank``'s first batch (not yet
    folded): what that rank records in its first step (the same weights, scales from its own data)."""
    model = build_fp8("tensorwise")
    model(*fp8_batch(rank, 0)).backward()
    return [b.fp8_path().scales.state()["pending"] for b in model.blocks]


def test_fp8_ranks_with_other_data_keep_one_scale_state(run2):
    """Every rank's histories, amaxes, scales and not-yet-folded amaxes are the same after three
    steps under DDP; each step's history column is the largest of the ranks' amaxes (the first
    step's: one process's on each rank's batch). Without reduce_amax each rank keeps its own, as
    before (its first column is its own batch's)."""
    res = result(run2, "fp8_reduced_scales")
    _assert_ranks_agree(res["reduced"]["states"])
    for block, state in enumerate(res["reduced"]["states"][0]):
        assert torch.equal(state["history"][:, 0], torch.maximum(_first_step_amaxes(0)[block],
                                                                 _first_step_amaxes(1)[block])), block
    own = res["own"]["states"]
    assert not all(_same_state(a, b) for a, b in zip(*own))
    for rank in (0, 1):
        for block, state in enumerate(own[rank]):
            assert torch.equal(state["history"][:, 0], _first_step_amaxes(rank)[block]), (rank, block)
    assert not torch.equal(res["own"]["losses"], res["reduced"]["losses"])


def test_fp8_checkpointed_blocks_reduce_their_amaxes_alike(run2):
    """Checkpointed blocks fold (and reduce) at the end of each recompute's backward, among DDP's
    gradient reductions: the ranks agree, and the losses are the uncheckpointed run's bit for bit."""
    res = result(run2, "fp8_reduced_scales")
    _assert_ranks_agree(res["checkpointed"]["states"])
    assert torch.equal(res["checkpointed"]["losses"], res["reduced"]["losses"])


def test_fp8_a_rank_with_an_empty_batch_still_reduces_with_the_others(run2):
    """Rank 1's second batch is empty: it records no amax, yet steps, folds and reduces with rank 0
    (it would otherwise wait in no collective while rank 0 waited in one), with the blocks folding
    in their own calls or together (folds_together: one collective for all blocks); the step's
    amaxes are rank 0's on both ranks."""
    res = result(run2, "fp8_empty_batch")
    for together in (False, True):
        _assert_ranks_agree(res[together])
        for state in res[together][0]:
            assert state["steps"] == 2 and state["history"][:, 1].max() > 0
    for a, b in zip(res[False][0], res[True][0]):
        assert _same_state(a, b)


def test_fp8_a_second_backward_of_a_step_is_reduced_too(run2):
    """Two training forwards, then a backward each: the first backward's end reduces the step's
    amaxes, the second's reduces what it recorded since with them. The second's stayed this rank's
    own, so the ranks' histories parted for good at the next fold."""
    res = result(run2, "fp8_two_backwards")
    for together in (False, True):
        first, second = res[together]
        for a, b in zip(*first):        # the first step's scales are each rank's calibration
            assert all(_same(a, b, k) for k in SCALE_STATE if k != "scales"), together
        _assert_ranks_agree(second)
        assert second[0][0]["steps"] == 1      # a step's second forward folds nothing (delayed.py)


def test_fp8_a_forward_with_autograd_on_one_rank_alone_keeps_the_ranks_in_step(run2):
    """A validation loss with autograd on rank 0 alone between training steps takes no collective
    (its amaxes join the next backward's reduction): training goes on, every rank with the same
    scale state."""
    res = result(run2, "fp8_validation_on_one_rank")
    _assert_ranks_agree(res["states"])
    assert res["losses"].shape == (2, 3) and torch.isfinite(res["losses"]).all()


def test_fp8_a_forward_on_one_rank_between_two_backwards_keeps_the_ranks_in_step(run2):
    """Two training forwards, a backward each, and between the backwards a forward with autograd on
    rank 0 alone: rank 0 folds the first backward's reduction at that forward's begin, rank 1 when
    the second backward ends (the reduction tells it), so the ranks keep one scale state, the
    histories and step counts included (before, rank 1 merged the second backward's amaxes into
    that reduction: a step fewer, and the ranks' histories parted for good). Also where rank 0's
    forward raises in the second block after the model folded every block's reduction
    (folds_together): that block joins the second backward's reduction all the same (before, the
    collectives mismatched and gloo aborted)."""
    res = result(run2, "fp8_forward_on_one_rank_between_two_backwards")
    for together in (False, True, "raising"):
        after, following = res[together]
        _assert_ranks_agree(after)
        _assert_ranks_agree(following)
        assert [s["steps"] for s in after[0]] == [2, 2] and [s["steps"] for s in following[0]] == [3, 3]


def test_fp8_a_tensor_recorded_on_one_rank_only_is_folded_on_every_rank(run2):
    """One block's scales: rank 0 records a (3.0), rank 1 records b as NaN, no rank records c. After
    the reduction both ranks hold a's 3.0 and b's NaN as inf (MAX over ranks does not reliably keep a
    NaN; inf makes no scale just as well), c not pending; the fold writes the same column on both."""
    ranks = result(run2, "fp8_tensor_on_one_rank")["ranks"]
    inf = float("inf")
    for r in ranks:
        assert torch.equal(r["reduced"]["pending"], torch.tensor([3.0, inf, 0.0]))
        assert r["reduced"]["pending_set"] == [True, True, False]
        assert [r["stats_before"][n]["last_amax"] for n in "abc"] == [3.0, inf, None]
        assert torch.equal(r["folded"]["history"][:, 0], torch.tensor([3.0, inf, 0.0]))
        assert torch.equal(r["folded"]["amax"], torch.tensor([3.0, 0.0, 0.0]))
        assert r["folded"]["pending_set"] == [False] * 3 and r["folded"]["steps"] == 1
    assert torch.equal(ranks[0]["scales"], ranks[1]["scales"])
    assert ranks[0]["scales"][0].item() == 2.0 ** -7                  # pow2_up(3 / 448)


def test_fp8_a_distributed_checkpoint_resumes_every_rank_exactly(run2):
    """FSDP2, 2 ranks on their own tokens: the scale state DCP keeps (one copy, from whichever rank)
    is every rank's, the not-yet-folded amaxes included (reduced at the end of the backward, before
    the checkpoint), so the two steps after loading give the uninterrupted run's losses bit for bit;
    also with scales that are not powers of two, which any amax of another rank would move.
    Without reduce_amax the ranks' states differ and the resumed losses do too (the limit this
    lifts; by hand before: 6.0149 against 6.0089)."""
    res = result(run2, "fp8_dcp_resume")
    for name in ("reduced", "reduced_exact"):
        _assert_ranks_agree(res[name]["saved"])
        assert torch.equal(res[name]["resumed"], res[name]["straight"]), name
    assert not all(_same_state(a, b) for a, b in zip(*res["own"]["saved"]))
    assert not torch.equal(res["own"]["resumed"], res["own"]["straight"])


# ---------------------------------------------------------------------------------------- one process
def _backward_nodes(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(type(f).__name__)
        todo.extend(g for g, _ in f.next_functions)
    return names


def test_checkpointed_model_keeps_no_block_activations_and_gets_equal_gradients():
    tokens, targets = global_batch(2)
    plain, ckpt = build(), checkpoint_blocks(build())
    loss, loss_c = plain(tokens, targets), ckpt(tokens, targets)
    assert "BlockFunctionBackward" in _backward_nodes(loss)
    nodes = _backward_nodes(loss_c)
    assert "BlockFunctionBackward" not in nodes and "CheckpointFunctionBackward" in nodes
    assert torch.equal(loss, loss_c)
    loss.backward()
    loss_c.backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_checkpointed_block_with_input_not_requiring_grad_still_trains_its_weights():
    """A frozen embedding: the reentrant checkpoint differentiates through its inputs only, so the
    block makes its input require a gradient."""
    plain, ckpt = build(), checkpoint_blocks(build())
    for m in (plain, ckpt):
        m.embed.requires_grad_(False)
        m(*global_batch(2)).backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        if p.requires_grad:
            assert q.grad is not None and torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
def test_a_gradient_by_autograd_grad_through_checkpointed_blocks_is_refused_naming_the_checkpointing(how):
    """The blocks' checkpoint is torch's reentrant one, which torch.autograd.grad and backward(inputs=)
    cannot run through; torch's own error told the user to set use_reentrant=False, which they never
    passed and cannot. The error names the blocks' checkpointing and the ways out."""
    model = checkpoint_blocks(build())
    loss = model(*global_batch(2))
    with pytest.raises(RuntimeError, match=r"activation checkpointing.*checkpoint_blocks.*loss.backward\(\)"):
        if how == "autograd.grad":
            torch.autograd.grad(loss, [model.embed])
        else:
            loss.backward(inputs=[model.embed])
    block = model.blocks[0]
    x = torch.randn(1, 8, model.dims.dim, requires_grad=True)
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        torch.autograd.grad(block(x).sum(), x)
    block(x).sum().backward()               # a plain backward still runs
    assert x.grad is not None and block.qkv.grad is not None
    checkpoint_blocks(model, False)
    (g,) = torch.autograd.grad(model(*global_batch(2)), [model.embed])     # without it: works
    assert g.abs().sum() > 0


def test_torch_checkpoint_wrapper_around_blocks_is_refused_not_ignored():
    """torch's checkpoint_wrapper wraps forward; the model calls run, which the wrapper hands to the
    block inside: it would checkpoint nothing. Refused, naming checkpoint_blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from coda_cutlass.nn import LlamaBlock
    model = build()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaBlock))
    with pytest.raises(TypeError, match=r"blocks\[0\] is a CheckpointWrapper, not a LlamaBlock.*checkpoint_blocks"):
        model(*global_batch(2))


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone (an in-process store, no network)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("family, fields", [("llama", {"tie_word_embeddings": True}), ("qwen3", {}),
                                            ("gemma2", {})])
def test_from_hf_models_under_shard_model(world_of_one, family, fields):
    """from_hf models (tied embeddings; Qwen 3's per-head q/k norms; Gemma 2's sandwich norms and
    (1 + w) gains, the next block's gathered with its offset) under shard_model: every parameter
    sharded (a DTensor), loss and gradients as the unsharded model's."""
    pytest.importorskip("transformers")
    import copy

    import hf_models
    from coda_cutlass.nn import from_hf
    hf = hf_models.draw(hf_models.transformers.AutoModelForCausalLM.from_config(hf_models.config(family, **fields)))
    plain = from_hf(hf)
    sharded = shard_model(copy.deepcopy(plain))
    assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())
    tokens = torch.randint(0, hf_models.DIMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    losses = [m(input_ids=tokens, labels=tokens).loss for m in (plain, sharded)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) <= FP32_TOL * abs(losses[0].item())
    assert_close({n: p.grad.full_tensor() for n, p in sharded.named_parameters()},
                 {n: p.grad for n, p in plain.named_parameters()})


def test_from_hf_model_saves_and_converts_after_shard_model(world_of_one, tmp_path):
    """save_pretrained and to_hf of a sharded from_hf model gather its shards (every rank calls them,
    as transformers asks of its own FSDP models; rank 0 writes): they failed inside the weight
    layout conversion with "aten.index.Tensor got mixed torch.Tensor and DTensor"."""
    pytest.importorskip("transformers")
    import copy

    import hf_models
    from coda_cutlass.nn import from_hf
    hf = hf_models.draw(hf_models.transformers.AutoModelForCausalLM.from_config(hf_models.config("llama")))
    plain = from_hf(hf)
    sharded = shard_model(copy.deepcopy(plain))
    want = hf.state_dict()
    sharded.save_pretrained(tmp_path)
    loaded = hf_models.transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for got in (loaded.state_dict(), sharded.to_hf().state_dict()):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert type(got[k]) is torch.Tensor and torch.equal(got[k], v), k


def test_from_hf_save_pretrained_writes_on_rank_zero_only(tmp_path, monkeypatch):
    """Every rank of a sharded model calls save_pretrained (to gather the shards); only rank 0 writes
    (transformers 5.25 checks the rank itself; save_pretrained passes is_main_process for those that
    do not, where every rank wrote the same files at once)."""
    pytest.importorskip("transformers")
    import hf_models
    from coda_cutlass.nn import from_hf
    model = from_hf(hf_models.draw(hf_models.transformers.AutoModelForCausalLM.from_config(hf_models.config("llama"))))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 1)
    model.save_pretrained(tmp_path / "rank1")
    assert not (tmp_path / "rank1").exists() or not any((tmp_path / "rank1").iterdir())
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    model.save_pretrained(tmp_path / "rank0")
    assert (tmp_path / "rank0" / "model.safetensors").exists() and (tmp_path / "rank0" / "config.json").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_sharded_from_hf_model_loads_a_transformers_state_dict(world_of_one, family):
    """load_state_dict of a transformers state dict (what Trainer's resume or a user's checkpoint
    hands over) into a from_hf model under shard_model: the converted full tensors are sharded as the
    parameters are. It failed with torch's "mixed torch.Tensor and DTensor"."""
    pytest.importorskip("transformers")
    import copy

    import hf_models
    from coda_cutlass.nn import from_hf
    hf = hf_models.draw(hf_models.transformers.AutoModelForCausalLM.from_config(hf_models.config(family)))
    want = copy.deepcopy(hf.state_dict())
    other = hf_models.draw(hf_models.transformers.AutoModelForCausalLM.from_config(hf_models.config(family)))
    sharded = shard_model(from_hf(other))
    result = sharded.load_state_dict(want)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())
    got = sharded.hf_state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # one shard of a checkpoint, a layer given in part: the rest of the layer keeps its (gathered) values
    part = {k: v + 1 for k, v in want.items() if k.endswith("layers.0.self_attn.q_proj.weight")}
    result = sharded.load_state_dict(part, strict=False)
    assert "model.layers.0.self_attn.k_proj.weight" in result.missing_keys
    got = sharded.hf_state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], part.get(k, v)), k


def test_fp8_amaxes_reduce_over_the_group_set_for_them(run4):
    """4 ranks as two pipeline stages of two data-parallel replicas each, the stages holding different
    blocks (2 and 3): with ``nn.fp8.set_amax_group(its stage's group)`` each stage reduces its amaxes
    over its own two ranks, which keep one scale state, each step's history column the largest of
    those two ranks' amaxes alone (the first step's: one process's on each rank's batch); over the
    default group the stages' collectives would differ in size. A group the rank is not in, and
    anything but a process group, are refused by name."""
    res = result(run4, "fp8_amax_subgroups")
    states = res["states"]
    for a, b in ((0, 1), (2, 3)):
        _assert_ranks_agree([states[a], states[b]])
    assert len(states[0]) == 2 and len(states[2]) == 3
    for block, state in enumerate(states[0]):
        assert torch.equal(state["history"][:, 0], torch.maximum(_first_step_amaxes(0)[block],
                                                                 _first_step_amaxes(1)[block])), block
    assert not torch.equal(states[0][0]["history"], states[2][0]["history"])
    assert torch.isfinite(res["losses"]).all()
    assert res["kept"] and res["restored"]
    assert "is not a member of this group" in res["refused"]["other"]["error"]
    assert "expected a torch.distributed ProcessGroup" in res["refused"]["type"]["error"]


def test_fp8_an_amax_group_destroyed_since_is_refused_by_name(run2):
    """``set_amax_group(g)``, a step, then ``destroy_process_group(g)``: the next training forward
    refuses the group by name on both ranks, before any collective (before, the reductions went on
    over the destroyed group's connections, or crashed in gloo without naming set_amax_group);
    ``set_amax_group(None)`` then trains over the default group, the ranks keeping one state."""
    res = result(run2, "fp8_amax_group_destroyed")
    assert "ConfigError" in res["refused"]["error"] and "set_amax_group" in res["refused"]["error"], res["refused"]
    assert "destroyed" in res["refused"]["error"]
    assert res["kept"]
    _assert_ranks_agree(res["states"])
    assert torch.isfinite(res["losses"]).all()
