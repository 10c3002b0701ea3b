"""Model types that from_hf refuses, each with the reason: what their layers compute that the
block does not (yet). A family leaves this table when its own module implements it."""

from __future__ import annotations

MOE = "its MLP is a mixture of experts (a router and expert MLPs), which is not implemented"

REFUSED: dict[str, str] = {
    "mixtral": MOE,
    "qwen2_moe": MOE,
    "qwen3_moe": MOE,
    "deepseek_v2": MOE,
    "deepseek_v3": MOE,
    "olmoe": MOE,
    "phimoe": MOE,
}
