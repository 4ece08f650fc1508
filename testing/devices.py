"""Where the tensors of a run live: every op's operands on one device, and the tensors
made from nothing (factory ops: ``empty``, ``zeros``, ``arange``, ...) on the data's.

On a GPU an op with a CUDA operand and a CPU one (an index, a mask) fails, and a buffer
made on the CPU for CUDA data is a copy and a sync later. :class:`Devices`, a dispatch
mode, records both while it is entered, in the thread that enters it; a CPU scalar
(0-dim) operand is allowed, as torch allows it. Run with the data on ``meta`` (shapes
only, no values) it checks a lowering, a route or a guard without a GPU.

>>> import torch
>>> from mimo_fx.testing.devices import Devices
>>> with Devices("meta") as seen:
...     x = torch.empty(4, device="meta")
...     y = x.index_select(0, torch.tensor([0, 2]))   # a CPU index for meta data
...     z = torch.zeros(3)                               # made on the CPU
>>> seen.problems
['aten.index_select.default mixes devices [cpu, meta]', 'aten.zeros.default made a tensor on cpu']
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Devices"]


class Devices(TorchDispatchMode):
    """Record ops whose operands lie on several devices, and tensors made on another
    device than ``device`` (the data's) by an op with no tensor operand."""

    def __init__(self, device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.problems: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        operands = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = sorted({t.device.type for t in operands
                          if not (t.device.type == "cpu" and t.dim() == 0)})
        if len(devices) > 1:
            self._problem(f"{func} mixes devices [{', '.join(devices)}]")
        out = func(*args, **kwargs)
        if not devices:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != self.device.type \
                        and t.dim() > 0:
                    self._problem(f"{func} made a tensor on {t.device.type}")
        return out

    def _problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)
