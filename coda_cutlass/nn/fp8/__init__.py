"""FP8 training of coda_cutlass.nn blocks: recipes (``recipe.py``), the weights' FP8 copies made once
per optimizer step (``weights.py``; ``weights_changed()`` after edits no optimizer or version
counter shows), and the block's forward and backward with every operand quantised by the kernel
that produces it (``functional.py``, ``tensorwise.py``)."""

from .amax_reduce import amax_group, set_amax_group
from .recipe import RECIPES, Fp8Recipe, as_recipe
from .weights import weights_changed

__all__ = ["RECIPES", "Fp8Recipe", "amax_group", "as_recipe", "set_amax_group", "weights_changed"]
