"""mimo_fx: one functional op to move tensors between differently-parallelised modules."""

from .errors import MimoFxError
from .grid import Grid
from .layout import Layout

__all__ = ["Grid", "Layout", "MimoFxError"]
