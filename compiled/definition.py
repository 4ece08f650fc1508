"""A bridge's definition: its one identity.

A :class:`Definition` is what every rank builds a bridge with -- its layouts, options,
fixed sizes, kind and name -- and everything that tells one bridge from another reads
it: the functional API's cache (:attr:`Definition.cache_key`), the agreement every rank
makes when the bridge is built (:meth:`Definition.fields`), the checked-mode fingerprint
(:attr:`Definition.fingerprint_key`), the registry's name and the prefix of its messages.

>>> from mimo_fx import Grid, Layout
>>> d = Definition(Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(dp=2), "b h"), Options())
>>> d.prefix
"redistribute '(dp b) h' -> 'b h': "
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .options import Options

__all__ = ["Definition"]


@dataclass(frozen=True)
class Definition:
    """One bridge's definition (``fixed``: its fixed sizes, sorted; ``kind``: its class's
    name; ``name``: its identity among the live bridges, see :mod:`.prepared`)."""

    src: Any
    dst: Any
    options: Options
    fixed: tuple[tuple[str, Any], ...] = ()
    kind: str = "Redistributor"
    name: str = ""

    @property
    def cache_key(self) -> tuple:
        """What the functional API keeps one bridge for: the layouts' structure and the
        options (a row layout's batch and every size come with each call)."""
        return (self.src.structure, self.dst.structure, self.options)

    def fields(self, device_type: str) -> dict[str, str]:
        """What every rank must build the bridge with, field by field (canonical strings):
        everything that decides its groups or what goes on the wire."""
        o = self.options
        return {"kind": self.kind, "src": repr(self.src.structure),
                "dst": repr(self.dst.structure), "sizes": repr(dict(self.fixed)),
                "dtype": str(o.dtype), "comm_dtype": str(o.comm_dtype),
                "grad_comm_dtype": str(o.grad_comm_dtype), "grad_partial": repr(o.grad_partial),
                "checked": str(o.checked), "device": device_type, "frozen": str(o.frozen)}

    @property
    def fingerprint_key(self) -> tuple:
        """What a checked call's fingerprint folds in (no device: ranks' devices differ)."""
        o = self.options
        return (self.src, self.dst, list(self.fixed), str(o.dtype), o.grad_partial,
                str(o.comm_dtype), str(o.grad_comm_dtype), self.name)

    @property
    def described(self) -> str:
        return f"{self.src.describe()} -> {self.dst.describe()}"

    @property
    def prefix(self) -> str:
        """How its messages start (made once: describing a row layout reads its batch,
        which Dynamo would guard on)."""
        checked = "checked " if self.options.checked else ""
        return f"{checked}redistribute {self.src.describe()!r} -> {self.dst.describe()!r}: "
