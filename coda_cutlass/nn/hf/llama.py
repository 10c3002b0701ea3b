"""Llama 2, Llama 3.x (every rope type transformers has: fields.rope_from_config): the base family."""

from __future__ import annotations

from .family import Family


class Llama(Family):
    pass


FAMILY = Llama()
