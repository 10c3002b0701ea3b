"""What tests/test_distributed.py and the processes it starts (tests/distributed_worker.py) share:
the tiny model, every rank's rows of the global batch, the runner that checks what the kernels
would be handed."""

from __future__ import annotations

from typing import Any

import torch

from coda_cutlass.errors import CallError
from coda_cutlass.nn import LlamaModel, ReferenceRunner
from coda_cutlass.runtime.checks import check_tma_matrix

# vocab 250 does not divide by 4: FSDP2 pads the embedding's and the LM head's shards
VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN = 250, 64, 2, 4, 2, 96
ROWS, SEQ = 2, 16          # each rank's batch
WORLD_SIZES = (2, 4)


def build(seed: int = 0) -> LlamaModel:
    """The model every process builds: the same fp32 weights for a seed (norm gains off 1)."""
    torch.manual_seed(seed)
    model = LlamaModel(VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, rope_theta=1e4, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def global_batch(world: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), (world * ROWS, SEQ): rank r takes rows [r * ROWS, (r + 1) * ROWS). No token
    occurs twice, so an embedding gradient sums no rows (in bf16 under FSDP2, in fp32 in one process)."""
    g = torch.Generator().manual_seed(1000 + 10 * world + step)
    n = world * ROWS * SEQ
    tokens = torch.randperm(VOCAB, generator=g)[:n].view(world * ROWS, SEQ)
    targets = torch.randint(0, VOCAB, (world * ROWS, SEQ), generator=g)
    return tokens, targets


# the FP8 scenarios' model: the smallest FP8 widths (128 wide, one head of 128), fp32 parameters
# computing in bf16; each rank's batch is 128 tokens (FP8 blocks take multiples of 128)
FP8_VOCAB, FP8_SEQ = 256, 128


def build_fp8(recipe: Any, seed: int = 0, layers: int = 2) -> LlamaModel:
    torch.manual_seed(seed)
    return LlamaModel(FP8_VOCAB, 128, layers, 1, 1, 128, head_dim=128, fp8=recipe, dtype=torch.float32,
                      compute_dtype=torch.bfloat16)


def fp8_batch(rank: int, step: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (tokens, targets) of a step: other tokens on every rank (other amaxes);
    ``empty``: no tokens at all."""
    t = torch.randint(0, FP8_VOCAB, (1, FP8_SEQ + 1), generator=torch.Generator().manual_seed(3000 + 10 * step + rank))
    if empty:
        return t[:, :0], t[:, :0]
    return t[:, :-1], t[:, 1:]


def optimizer(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: its update is linear in the gradients, so steps of runs whose gradients
    agree to fp32 rounding agree as well (AdamW's first steps turn the sign of a gradient near zero
    into a whole step), and it keeps a state to checkpoint."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def rank_rows(rank: int, world: int, rows: int) -> slice:
    """Rank ``rank``'s share of ``rows`` rows split over ``world`` ranks."""
    n = rows // world
    return slice(rank * n, (rank + 1) * n)


def resume_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint tests' global batch: the same for every world size (each takes its share)."""
    return global_batch(max(WORLD_SIZES), 100 + step)


class LayoutCheckingRunner(ReferenceRunner):
    """The reference interpreter, noting every weight operand the compiled kernels would refuse
    (a DTensor, a layout TMA cannot read: unit column stride, 16-byte rows and base pointer)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        super().__init__(dtype)
        self.problems: list[str] = []
        self.weights_seen = 0

    def gemm(self, site, program, A, W, *, layout="nk", **kw):
        self.weights_seen += 1
        try:
            if type(W) not in (torch.Tensor, torch.nn.Parameter):
                raise CallError(f"W is a {type(W).__name__}")
            check_tma_matrix("W", W, W.shape[0], W.shape[1], W.element_size())
        except CallError as e:
            self.problems.append(f"{site}: {e}")
        return super().gemm(site, program, A, W, layout=layout, **kw)
