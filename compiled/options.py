"""A bridge's options, and the compiler settings bridges need: each in one place.

:class:`Options` is every option a bridge takes (the facade, :class:`~.Redistributor`,
:func:`~mimo_fx.compiled.prepare` and DTensor interop all pass one), validated once, and
hashable: it is part of the one bridge cache's key. :func:`require_compiler` is the only
code that changes a global ``torch._dynamo`` / ``torch._inductor`` setting, and says why.

>>> Options(checked=True).names()[:4]
('dtype', 'grad_partial', 'comm_dtype', 'checked')
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mimo_fx.constants import constant
from mimo_fx.errors import MimoFxError
from mimo_fx.layout import axis_names

__all__ = ["Options", "require_compiler", "OPTION_NAMES"]


@constant
@dataclass(frozen=True)
class Options:
    """What a bridge moves and how (every option a bridge takes; keyword-only everywhere).

    Args:
        dtype: the dtype of the tensors moved (the caller's).
        grad_partial: dst replicated axes whose cotangents are summed (see the op).
        comm_dtype: move data in this dtype (e.g. bf16) and return ``dtype``.
        grad_comm_dtype: move the backward's cotangents in this dtype (None: as
            ``comm_dtype``), e.g. activations in bf16, their gradients in float32.
        checked: every rank gathers what every rank was called with before each call, so any
            rank's mistake raises on every rank (see :mod:`.guard`).
        device: where data moves and ranks without a src piece make their placeholder
            (None: the current CUDA device where the world has a CUDA backend of its
            own, NCCL; else CPU: :func:`.groups.data_device`).
        frozen: whether the source needs no gradient (a frozen encoder). ``True``: the
            backward moves nothing on any rank and no rank's result requires grad (a
            source tensor that requires grad is an error: its gradient would be lost);
            ``False``: the backward always runs, on every rank (a source tensor that
            needs no gradient takes part, its gradient dropped); ``None``: decided by
            the bridge's first call, from whether any source rank's input requires grad
            (see :meth:`~.redistributor.Redistributor.frozen`).
    """

    dtype: torch.dtype = torch.float32
    grad_partial: tuple[str, ...] = ()
    comm_dtype: torch.dtype | None = None
    checked: bool = False
    device: str | None = None
    frozen: bool | None = None
    grad_comm_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "grad_partial", axis_names(self.grad_partial, "grad_partial"))
        for name, value in (("dtype", self.dtype), ("comm_dtype", self.comm_dtype),
                            ("grad_comm_dtype", self.grad_comm_dtype)):
            if not isinstance(value, torch.dtype) and not (name != "dtype" and value is None):
                raise MimoFxError(f"{name}={value!r} must be a torch.dtype, e.g. torch.bfloat16")
        if not isinstance(self.checked, bool):
            raise MimoFxError(f"checked={self.checked!r} must be True or False")
        if self.frozen is not None and not isinstance(self.frozen, bool):
            raise MimoFxError(f"frozen={self.frozen!r} must be True (the source needs no "
                              f"gradient), False (the backward always runs) or None (decided "
                              f"by the first call)")
        if self.device is not None:
            object.__setattr__(self, "device", str(torch.device(self.device)))
        _check_comm_dtype(self.dtype, self.comm_dtype)
        _check_comm_dtype(self.dtype, self.grad_comm_dtype, "grad_comm_dtype")

    @staticmethod
    def names() -> tuple[str, ...]:
        """Every option's name, in declaration order."""
        return tuple(f.name for f in fields(Options))

    def wires(self) -> dict[str, torch.dtype | None]:
        """The dtype data moves in, by direction (None: the caller's ``dtype``)."""
        grad = self.comm_dtype if self.grad_comm_dtype is None else self.grad_comm_dtype
        return {"forward": self.comm_dtype, "backward": None if grad == self.dtype else grad}

    def resolved_device(self) -> torch.device:
        """The device data moves on."""
        if self.device is not None:
            return torch.device(self.device)
        from .groups import data_device

        return data_device()


OPTION_NAMES = Options.names()

_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _check_comm_dtype(dtype: torch.dtype, wire: torch.dtype | None,
                      name: str = "comm_dtype") -> None:
    """``comm_dtype`` only where it is lossless, or an explicit lower-precision float for
    float data: it never changes values by accident."""
    if wire is None or wire == dtype:
        return
    if dtype in _FLOATS and wire in _FLOATS:
        return  # a float for float data: lower precision is what it is asked for
    if _holds(wire, dtype):
        return  # every value of dtype exactly (int32 data moved as int64, say)
    wider = "complex" if dtype.is_complex else "integer"
    fix = ("a lower-precision float (torch.bfloat16 or torch.float16)"
           if dtype in _FLOATS else f"None (move {dtype} as it is), or a wider {wider} type")
    raise MimoFxError(f"{name}={wire} would change {dtype} data (it cannot hold every "
                      f"{dtype} value); use {fix}")


def _holds(wire: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether every value of ``dtype`` is a value of ``wire``."""
    if dtype.is_complex or wire.is_complex:
        return dtype.is_complex and wire.is_complex and wire.itemsize >= dtype.itemsize
    if dtype == torch.bool:
        return True  # 0 and 1 are values of every dtype
    if dtype.is_floating_point or wire.is_floating_point:
        return False  # (float to float is allowed above; ints and floats do not mix)
    ints = [torch.int8, torch.int16, torch.int32, torch.int64]
    if dtype == torch.uint8:
        return wire in (torch.int16, torch.int32, torch.int64)
    return dtype in ints and wire in ints and ints.index(wire) >= ints.index(dtype)


def require_compiler(*, scalar_outputs: bool = False, unbacked_tensors: bool = False,
                     late_waits: bool = False) -> None:
    """Set the global compiler options a bridge needs; the only place that sets any.

    ``scalar_outputs``: Dynamo's ``capture_scalar_outputs``, so sizes read back from a
    tensor in a compiled step (``.tolist()`` of the size gather, a row route's counts)
    stay in the graph as unbacked ints instead of breaking it.
    ``unbacked_tensors``: inductor's ``joint_graph_constant_folding`` off: in torch 2.13
    that pass asks whether a zero tensor of unbacked length (a row backward's per-row
    sums, a ragged dim's empty piece or gradient) is contiguous (``Eq(16*u78, 0)``), a
    data-dependent question it cannot answer, and the compile fails; the pass only
    replaces constant tensors by fill calls. Set by every bridge with a packed or a
    ragged side, with Dynamo's ``capture_dynamic_output_shape_ops``: a row route's index
    vectors are outputs whose length the batch sets, which a compile without
    ``fullgraph=True`` would otherwise break the graph at.
    ``late_waits``: inductor's ``sink_waits`` pass (``reorder_for_compute_comm_overlap``
    with it among its passes), which moves each collective's wait to just before its
    output's first use: compute a step runs between a bridge call and the use of its
    result then overlaps the transfer. It moves waits only, never the ordered
    collectives, and is added to whatever passes are set already.
    """
    if scalar_outputs:
        from torch._dynamo import config as dynamo_config

        dynamo_config.capture_scalar_outputs = True
    if unbacked_tensors:
        from torch._dynamo import config as dynamo_config
        from torch._inductor import config as inductor_config

        inductor_config.joint_graph_constant_folding = False
        dynamo_config.capture_dynamic_output_shape_ops = True
    if late_waits:
        from torch._inductor import config as inductor_config

        passes = list(inductor_config.reorder_for_compute_comm_overlap_passes)
        if not inductor_config.reorder_for_compute_comm_overlap:
            passes = []  # (passes set but off: they were not meant to run)
        if "sink_waits" not in passes:
            inductor_config.reorder_for_compute_comm_overlap_passes = [*passes, "sink_waits"]
        inductor_config.reorder_for_compute_comm_overlap = True
