"""Every ``mimo_fx::`` custom op is registered here, on the library's one fragment.

The modules that own an op (the collectives in :mod:`.comm`, the size gather in
:mod:`.size_gather`, the checks in :mod:`.guard`, the row route in :mod:`.row_sizing`)
give :func:`define` its schema, its implementation and its fake (what tracing sees), and use
the op it returns; none of them touches ``torch.library`` itself. An op is defined once
per process: a module executed twice (e.g. imported under a second name by a doctest
run) gets the op already there.

Ordered ops carry an ORDERED effect (:func:`register_ordered`): under ``torch.compile``
a token threads through them, so no graph pass moves, duplicates or reorders them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["define", "register_ordered"]

_LIB = torch.library.Library("mimo_fx", "FRAGMENT")


def define(schema: str, impl: Callable, fake: Callable, ordered: bool = False) -> Any:
    """The op ``mimo_fx::<name>`` of ``schema`` (``"<name>(<params>) -> <returns>"``),
    defined with ``impl`` (every device) and ``fake`` unless it is defined already."""
    name = schema.split("(", 1)[0]
    if not hasattr(torch.ops.mimo_fx, name):
        _LIB.define(schema)
        _LIB.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"mimo_fx::{name}", fake, lib=_LIB)
        if ordered:
            register_ordered(getattr(torch.ops.mimo_fx, name).default)
    return getattr(torch.ops.mimo_fx, name).default


def register_ordered(op) -> bool:
    """Give ``op`` an ORDERED effect; False where this torch cannot (then it is a plain
    custom op: correct eagerly, but a compiler may move it)."""
    try:
        from torch._library.effects import EffectType
        register: Any = torch.library._register_effectful_op
    except (ImportError, AttributeError):
        try:  # torch < 2.9
            from torch._higher_order_ops.effects import _EffectType as EffectType
            from torch._higher_order_ops.effects import _register_effectful_op as register
        except ImportError:
            return False
    register(op, EffectType.ORDERED)
    return True
