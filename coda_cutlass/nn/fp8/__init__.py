"""FP8 training of coda_cutlass.nn blocks: recipes (``recipe.py``), the weights' FP8 copies made once
per optimizer step (``weights.py``), and the block's forward and backward with every GEMM operand
quantised by the kernel that produces it (``functional.py``)."""

from .recipe import RECIPES, Fp8Recipe, as_recipe

__all__ = ["RECIPES", "Fp8Recipe", "as_recipe"]
