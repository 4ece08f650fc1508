"""Host reads of tensor values, counted: what stalls a GPU's stream.

On a GPU, reading a device tensor's values on the host (``.item()``, ``.tolist()``,
``int(t)``, ``bool(t)``, ``float(t)``, ``operator.index(t)``) waits for every kernel
queued before it. :class:`HostReads` counts them while it is entered, each with the
tensor's device and the innermost library line that asked (``file:line``), so a test
can hold a bridge's steady-state calls to zero reads on CPU as on a GPU: on CPU every
read is counted, whatever its device, which is stricter than a GPU needs (a read of
host metadata costs nothing there).

Reads while a graph is traced are not counted (they are the compiler's, not the
call's); enter it after a compiled function has compiled.

>>> import torch
>>> from mimo_fx.testing.syncs import HostReads
>>> with HostReads() as reads:
...     n = int(torch.tensor(3)) + len(torch.arange(2).tolist())
>>> reads.count(), [e.method for e in reads.events]
(2, ['__int__', 'tolist'])
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["HostReads", "Read", "READS"]

READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")
_ROOT = Path(__file__).resolve().parents[1]
_LIBRARY = tuple(str(_ROOT / folder) for folder in ("mimo_fx", "compiled", "reference", "mimo",
                                                     "interop", "jobs", "testing"))
_HERE = str(Path(__file__).resolve())


@dataclass(frozen=True)
class Read:
    """One host read: the method, the tensor's device, the library line that asked
    (``"outside"`` when no library frame is on the stack)."""

    method: str
    device: str
    where: str


@dataclass
class HostReads:
    """Count host reads of tensor values while entered (see the module docstring)."""

    events: list[Read] = field(default_factory=list)
    _saved: dict = field(default_factory=dict)

    def __enter__(self) -> HostReads:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def count(self, where: str | None = None) -> int:
        """How many reads (only those asked from a line containing ``where``, if given)."""
        return sum(1 for e in self.events if where is None or where in e.where)

    def by_line(self) -> dict[str, int]:
        """Reads per library line, most first."""
        out: dict[str, int] = {}
        for e in self.events:
            out[e.where] = out.get(e.where, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _counting(self, name: str, original):
        events = self.events

        def read(tensor, *args, **kwargs):
            if not torch.compiler.is_compiling() and not _is_fake(tensor):
                events.append(Read(name, str(tensor.device), _asker()))
            return original(tensor, *args, **kwargs)

        read.__name__ = name
        return read


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _asker() -> str:
    """The innermost library frame on the stack, as ``path:line`` from the repository."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_LIBRARY) and path != _HERE:
            return f"{Path(path).relative_to(_ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside"
