"""The delayed scales' amaxes reduced over the data-parallel ranks (``Fp8Recipe.reduce_amax``), as
Transformer Engine's DelayedScaling does by default: without it each rank folds only the amaxes of
its own data, so the ranks' scales drift apart and a distributed checkpoint, which keeps one copy of
the scale state, resumes every rank on one rank's.

One collective, a MAX all-reduce over the default process group (or the one ``set_amax_group``
names: the ranks that hold the same blocks, e.g. one pipeline stage's data-parallel replicas), takes
the vectors of several blocks (concatenated): at the end of the backward that finishes their step
(``at_backward_end``: one for all the blocks whose backward ran; a checkpoint's recompute, whose
fold ends its own backward, reduces there). The collectives follow the backwards, never a forward alone (nn/fp8/delayed.py). It
runs eagerly, never inside the compiled fold, and reads nothing on the host (but a flag where a
second backward of a step ends: DelayedScales.reduce_together): NCCL reduces device tensors on its
own stream; gloo takes CPU tensors (the CPU tests') and copies CUDA ones itself.

MAX with NaN is not reliably NaN in NCCL or gloo (a comparison with NaN is false either way round),
so a NaN becomes +inf before the reduction: both make no scale (delayed._kept_amax), and the history
then shows inf for the step that met it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from ...errors import ConfigError

# the process group the amaxes are reduced over (None: the default group)
_GROUP: Any = None


def set_amax_group(group: Any) -> Any:
    """Reduce the FP8 "tensorwise" amaxes of this process's blocks over ``group`` (a
    ``torch.distributed`` process group this rank belongs to; None: the default group, the
    default) and return the group set before. Every rank of the group must hold the same FP8 blocks
    and run their training backwards alike, as DDP or FSDP replicas of them do: with pipeline
    parallelism, the data-parallel group of this rank's stage (over the default group, stages
    holding different blocks would send collectives of different sizes, and gloo aborts, NCCL may
    hang; stages of as many blocks mix their amaxes, or hang where a stage waits on another's
    gradients). Set it on every rank of the group before the first training step, the same on all
    (a rank naming another group, or none, waits in its reduction until the process group's
    timeout). It outlives ``destroy_process_group``, so a process that makes a new world sets it
    again (or None): until then a training forward refuses the destroyed group by name."""
    global _GROUP
    dist = torch.distributed
    if group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("set_amax_group: torch.distributed is not initialised (call "
                              "init_process_group first, then make the group with new_group)")
        outside = f"set_amax_group: rank {dist.get_rank()} is not a member of this group"
        if group is dist.GroupMember.NON_GROUP_MEMBER:      # what new_group returns on the other ranks
            raise ConfigError(f"{outside} (new_group gave it the non-member marker): each rank names the "
                              "group it belongs to")
        if not isinstance(group, dist.ProcessGroup):
            mesh = (" (of a DeviceMesh, name a dimension's group: mesh.get_group(dim))"
                    if hasattr(group, "get_group") else "")
            raise ConfigError(f"set_amax_group: expected a torch.distributed ProcessGroup or None, got "
                              f"{type(group).__name__}{mesh}")
        rank = _rank_in(group)
        if rank is None:
            raise ConfigError("set_amax_group: this group was destroyed (destroy_process_group, of it or of "
                              "its world): name a group of the process group now initialised")
        if rank < 0:
            raise ConfigError(f"{outside} (its ranks: {dist.get_process_group_ranks(group)}): each rank "
                              "names the group it belongs to")
    previous, _GROUP = _GROUP, group
    return previous


def amax_group() -> Any:
    """The process group the amaxes are reduced over (None: the default group)."""
    return _GROUP


def _rank_in(group: Any) -> int | None:
    """This process's rank in ``group`` (-1: not a member), None where it is no group of the process
    group now initialised (destroy_process_group unregisters it, but a group object kept works on:
    gloo's connections outlive it)."""
    try:
        return torch.distributed.get_rank(group)
    except ValueError:          # torch: "Group ... is not registered"
        return None


def ranks_reduce(reduce_amax: bool) -> bool:
    """Whether amaxes are reduced now: the recipe asks for it and this process is one of several in an
    initialised torch.distributed world, and of its amax group (one process, or none initialised:
    nothing to reduce). A group ``set_amax_group`` named that was destroyed since (by
    ``destroy_process_group``, of it or of its world) is refused, before any collective: gloo's
    connections outlive it, so the reductions went on over the old world's ranks."""
    dist = torch.distributed
    if not (reduce_amax and dist.is_available() and dist.is_initialized()):
        return False
    if _GROUP is not None and _rank_in(_GROUP) is None:
        raise ConfigError("the FP8 amax group set by set_amax_group was destroyed since "
                          "(destroy_process_group): name a group of the process group now initialised "
                          "with set_amax_group, or None for the default group")
    return dist.get_world_size(_GROUP) > 1


def max_over_ranks(vectors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each 1-dim fp32 vector's elementwise maximum over the ranks (NaN as +inf), in one all-reduce a
    device (blocks on several devices: one each, in the order they first come, the same on every
    rank). Every rank must call it with vectors of the same lengths in the same order."""
    out: list[torch.Tensor | None] = [None] * len(vectors)
    by_device: dict[torch.device, list[int]] = {}
    for k, v in enumerate(vectors):
        by_device.setdefault(v.device, []).append(k)
    for ks in by_device.values():
        inf = float("inf")
        flat = torch.nan_to_num(torch.cat([vectors[k] for k in ks]), nan=inf, posinf=inf, neginf=-inf)
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=_GROUP)
        for k, part in zip(ks, flat.split([vectors[k].numel() for k in ks])):
            out[k] = part
    return out  # type: ignore[return-value]


# the items each running backward (graph task) waits to reduce at its end
_WAITING: dict[int, list[Any]] = {}
_LOCK = threading.Lock()


def in_backward() -> bool:
    """Whether this thread runs inside an autograd backward now (a checkpoint's recompute, a
    backward hook, the end-of-backward callbacks): torch's graph task id, -1 outside one."""
    return torch._C._current_graph_task_id() != -1


def at_backward_end(item: Any, finish: Callable[[list[Any]], None]) -> None:
    """``finish(items)`` once, when the backward now running ends, with every item handed in during
    it (in the order they came: the blocks' backward order, the same on every rank); outside a
    backward at once. A block's backward hands its scales in, so one collective serves all the blocks
    of a backward (a reentrant checkpoint's recompute runs a backward of its own, which ends first).
    Should the backward fail, nothing is reduced: the scales stay unreduced, their amaxes join the
    next backward's reduction, and the next step's begin forgets the items (``drop_failed_backwards``)."""
    task = torch._C._current_graph_task_id()
    if task == -1:
        finish([item])
        return
    with _LOCK:
        waiting = _WAITING.get(task)
        if waiting is None:
            waiting = _WAITING[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(lambda: finish(_take(task)))
        waiting.append(item)


def _take(task: int) -> list[Any]:
    with _LOCK:
        return _WAITING.pop(task, [])


def drop_failed_backwards() -> None:
    """Forget the items of backwards that raised (their end never came, so nothing took them). Called
    where a training step begins outside any backward: in this thread none is running then, so every
    entry left is a failed one's. Their scales are still marked unreduced, so the next backward's end
    reduces their amaxes. (Dropping another thread's running backward's entry, threads training one
    model apart, would leave its amaxes to the next backward the same way.)"""
    if _WAITING and not in_backward():
        with _LOCK:
            _WAITING.clear()
