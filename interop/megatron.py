"""Megatron-Core's MIMO bridge communicators on mimo_fx: a training script changes one import.

::

    # from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator
    # from megatron.core.models.mimo.comm.colocated_communicator import (
    #     ColocatedBridgeCommunicator)
    from mimo_fx.interop.megatron import BridgeCommunicator, ColocatedBridgeCommunicator

Both classes take Megatron-Core 0.19's constructor arguments and give its methods' results
(shapes, dtypes, which ranks get a tensor and which get None), built on mimo_fx's bridges
(:class:`~mimo_fx.compiled.Bridge` for the pipelined one, a
:class:`~mimo_fx.compiled.Redistributor` for the colocated one) and nothing beside them.
A grid is Megatron's own ``HyperCommGrid`` or any object with its ``shape``,
``dim_names`` and ``rank_offset`` (read, never imported: megatron-core is not a
dependency). How the pieces map:

1. A grid is :class:`~mimo_fx.grid.Grid` of the same axes and ranks (both count the
   first dim fastest).
2. The tensor's layout is Megatron's: each DP replica holds its part of the batch dim
   (``dim_mapping['b']``; dim 0 of a 2-D ``[B*S, H]`` tensor), replicated over the other
   axes, cut as ``torch.tensor_split`` cuts it; with CP > 1 the sequence dim is cut over
   ``cp``, zigzag as Megatron's CP splits it (``zigzag=False``: in order).
3. A pipelined grid with PP > 1 moves data at its boundary stage only (the source's last,
   the destination's first): the layout is pinned there (``at={"pp": ...}``). Only
   those ranks take part in a call; the other stages' ranks may make the calls (they
   return None at once, as there) or skip them, as Megatron's multi-module schedules do.

Beyond Megatron, each a keyword whose default is Megatron's behaviour: CP > 1 on either
side; ``variable_tokens=True`` (each DP replica its own token count, learned per call);
``frozen=True`` (no backward transfer on any rank, agreed when built); ``sizes=`` (fixed
sizes: no shape exchange per call); ``thd=True`` (the destination gets its samples packed,
``[T, H]``, each a sequence cut over CP as Megatron's THD format cuts it). Sends are
asynchronous already: ``send_forward`` returns once its messages are posted. See
``docs/megatron.md``.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimo_fx.errors import MimoFxError
from mimo_fx.grid import Grid
from mimo_fx.layout import Layout

__all__ = ["BridgeCommunicator", "ColocatedBridgeCommunicator", "SliceInfo", "grid_of",
           "megatron_layout"]

DEFAULT_MAPPING = {"b": 0, "s": 1, "h": 2}


def grid_of(grid) -> Grid:
    """The mimo_fx grid of a Megatron ``HyperCommGrid`` (or any object with its
    ``shape``, ``dim_names`` and ``rank_offset``)."""
    try:
        shape, names, offset = list(grid.shape), list(grid.dim_names), grid.rank_offset
    except (AttributeError, TypeError):
        raise MimoFxError(f"{grid!r} is not a grid: a Megatron HyperCommGrid (or an object "
                          f"with its shape, dim_names and rank_offset) is needed") from None
    if len(shape) != len(names) or len(set(names)) != len(names):
        raise MimoFxError(f"grid shape {shape} and dim_names {names} must pair one size with "
                          f"each of distinct names")
    return Grid(offset=int(offset), **{str(n): int(s) for n, s in zip(names, shape)})


def _size(grid: Grid, axis: str) -> int:
    return grid.axis_size(axis) if axis in grid.names else 1


def _check_mapping(dim_mapping: dict | None, keys: Sequence[set]) -> dict:
    mapping = dict(DEFAULT_MAPPING if dim_mapping is None else dim_mapping)
    if set(mapping) not in keys or sorted(mapping.values()) != list(range(len(mapping))):
        raise MimoFxError(
            f"dim_mapping={dim_mapping!r} must map "
            f"{' or '.join(repr(sorted(k)) for k in keys)} to the tensor dims 0.. each "
            f"once, e.g. {{'b': 0, 's': 1, 'h': 2}} for [B, S, H] or {{'s': 0, 'b': 1, "
            f"'h': 2}} for [S, B, H]")
    return mapping


def megatron_layout(grid, dim_mapping: dict | None = None, tensor_ndim: int = 3, *,
                    stage: int | None = None, zigzag: bool = True,
                    variable_tokens: bool = False) -> Layout:
    """The layout Megatron's communicators give a tensor on ``grid``: the batch dim
    (``dim_mapping['b']``, or dim 0 of a 2-D tensor, ``[B*S, H]``, named ``t``) cut over
    ``dp`` with ``torch.tensor_split``'s sizes (ragged, one count per replica, with
    ``variable_tokens``), the sequence dim over ``cp`` (zigzag unless ``zigzag=False``),
    the rest replicated; pinned to pipeline stage ``stage`` (e.g. -1) where the grid has
    ``pp`` > 1.

    >>> from mimo_fx.grid import Grid
    >>> megatron_layout(Grid(tp=2, cp=2, pp=2, dp=2), {"s": 0, "b": 1, "h": 2}, stage=0)
    Layout(Grid(tp=2, cp=2, pp=2, dp=2), '(cp s) (dp b) h', at={'pp': 0}, zigzag=('cp',))
    """
    g = grid if isinstance(grid, Grid) else grid_of(grid)
    if tensor_ndim == 2:
        return _layout(g, {"t": 0, "h": 1}, "t", stage, zigzag, variable_tokens)
    if tensor_ndim == 3:
        mapping = _check_mapping(dim_mapping, ({"b", "s", "h"},))
        return _layout(g, mapping, "b", stage, zigzag, variable_tokens)
    raise MimoFxError(f"tensor_ndim={tensor_ndim!r} must be 2 ([B*S, H]) or 3 "
                      f"([B, S, H] in dim_mapping's order)")


def _layout(g: Grid, mapping: dict, batch: str, stage: int | None, zigzag: bool,
            variable_tokens: bool) -> Layout:
    """The layout of a tensor whose dims ``mapping`` places: ``batch`` cut over ``dp``,
    ``s`` over ``cp``, the rest whole (see :func:`megatron_layout`)."""
    dp, cp = ("dp" if "dp" in g.names else None), _size(g, "cp")
    if cp > 1 and "s" not in mapping:
        raise MimoFxError(
            f"a 2-D [B*S, H] tensor on {g!r} with cp={cp}: its sequence is folded into "
            f"dim 0, so CP cannot cut it; bridge the 3-D [B, S, H] (or [S, B, H]) "
            f"tensor, or build the grid with CP=1")
    dims = [""] * len(mapping)
    for name, axis in mapping.items():
        dims[axis] = (f"({dp} {name})" if name == batch and dp else
                      "(cp s)" if name == "s" and cp > 1 else name)
    at = {"pp": stage} if stage is not None and _size(g, "pp") > 1 else None
    return Layout(g, " ".join(dims), at=at, zigzag=("cp",) if cp > 1 and zigzag else (),
                  ragged=(dp,) if variable_tokens and dp else ())


def _wires(wire_dtypes, dtype: torch.dtype) -> dict:
    """A bridge's ``comm_dtype``/``grad_comm_dtype`` for ``wire_dtypes`` (``(forward,
    backward)``, None for ``dtype``) on data of ``dtype``."""
    if wire_dtypes is None:
        return {}
    if not (isinstance(wire_dtypes, tuple) and len(wire_dtypes) == 2 and all(
            w is None or isinstance(w, torch.dtype) for w in wire_dtypes)):
        raise MimoFxError(f"wire_dtypes={wire_dtypes!r} must be a pair (forward, backward) of "
                          f"torch dtypes or None, e.g. (torch.bfloat16, None)")
    forward, backward = wire_dtypes
    return {"comm_dtype": forward, "grad_comm_dtype": dtype if backward is None else backward}


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the pipelined communicators not yet destroyed


class _Counts:
    """Fan-out with variable tokens: the destination replicas' counts, which the source's
    one count per replica cannot give. Each source boundary replica splits its tokens
    (its activation's ``_mimo_bridge_split_sizes``, per sample or per destination replica,
    as Megatron reads it; else ``torch.tensor_split``'s sizes) and the counts move as data
    on two bridges of their own: to every destination rank (``frozen``: no backward) and
    to every source rank, so every rank gives the main bridge the same counts."""

    def __init__(self, src: Layout, dst: Layout, fine: int) -> None:
        from mimo_fx.compiled import Bridge, Redistributor

        self.fine, self.per = fine, fine // _size(src.grid, "dp")
        pinned = Layout(src.grid, "(dp c)" if "dp" in src.grid.names else "c",
                        at=dict(src.at) or None)
        # (each pinned to its side's boundary stage: the other stages take no part)
        self.to_dst = Bridge(pinned, Layout(dst.grid, "c", at=dict(dst.at) or None),
                             {"c": fine}, torch.int64, frozen=True)
        self.to_src = Redistributor(pinned, Layout(src.grid, "c", at=dict(src.at) or None),
                                    {"c": fine}, torch.int64, frozen=True)

    def split(self, x: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        """This boundary rank's counts for its replica (None off the boundary)."""
        if x is None:
            return None
        n = int(x.shape[batch])
        given = getattr(x, "_mimo_bridge_split_sizes", None)
        if given is None:
            counts = [len(r) for r in torch.arange(n).tensor_split(self.per)]
        else:
            counts = [int(c) for c in given]
            if len(counts) > self.per and len(counts) % self.per == 0:
                step = len(counts) // self.per
                counts = [sum(counts[i:i + step]) for i in range(0, len(counts), step)]
            if len(counts) != self.per or sum(counts) != n:
                raise MimoFxError(
                    f"[Bridge Communicator] _mimo_bridge_split_sizes={list(given)}: "
                    f"{len(counts)} counts summing to {sum(counts)}, but this fan-out "
                    f"sends {self.per} pieces of the {n} tokens on its batch dim; give one "
                    f"count per sample or per destination replica, summing to {n}")
        return torch.tensor(counts, dtype=torch.int64, device=self.to_dst.device)

    def send(self, x: torch.Tensor | None, batch: int) -> tuple:
        """The counts of every destination replica, posted to the destination too."""
        mine = self.split(x, batch)
        self.to_dst.send_forward(mine)
        return tuple(self.to_src(mine).tolist())

    def recv(self) -> tuple:
        return tuple(self.to_dst.recv_forward().tolist())

    def destroy(self) -> None:
        self.to_dst.destroy()
        self.to_src.destroy()


class BridgeCommunicator:
    """Megatron-Core's pipelined ``BridgeCommunicator`` (source and destination on
    different ranks, called from the pipeline schedule), on a mimo_fx
    :class:`~mimo_fx.compiled.Bridge`.

    Megatron's arguments: ``src_grid``, ``dest_grid``, ``dim_mapping`` (keys ``s``, ``b``,
    ``h``; default ``[B, S, H]``), ``comm_dtype`` (the dtype moved and returned; default
    the default dtype, as there), ``src_module_name``, ``dest_module_name``,
    ``tensor_ndim`` (3, or 2 for ``[B*S, H]``). Every rank of the world builds it, as
    there; the calls involve the boundary stages' ranks only (the source's last, the
    destination's first): elsewhere they return None at once, and may be skipped, as
    Megatron's multi-module schedules do.

    Beyond Megatron (keyword-only; defaults are Megatron's behaviour): ``zigzag`` (how a
    CP > 1 side cuts the sequence; Megatron's own communicator refuses CP > 1),
    ``variable_tokens`` (each DP replica its own count on the batch dim, learned per
    call), ``frozen`` (the source needs no gradient: no backward transfer; the backward
    calls return None), ``sizes`` (fixed ``{"b": .., "s": .., "h": ..}``, or ``t``/``h``
    in 2-D: no per-call shape exchange), ``thd`` (see :meth:`thd_packing`: the destination
    gets ``[T, H]``, its replica's samples one after another, each one sequence of the
    packed THD format, cut over the destination's CP per sequence, zigzag unless
    ``zigzag=False``; 3-D tensors whose sequence length CP cuts evenly, as Megatron's THD
    split needs; the gradient sent back in the same format), ``checked`` (every call's
    shapes checked on every rank first), ``wire_dtypes`` (``(forward, backward)``: the
    dtypes activations and gradients travel in, None for ``comm_dtype``; results keep
    ``comm_dtype``).
    """

    def __init__(self, src_grid, dest_grid, dim_mapping: dict | None = None,
                 comm_dtype: torch.dtype | None = None, src_module_name: str | None = None,
                 dest_module_name: str | None = None, tensor_ndim: int = 3, *,
                 zigzag: bool = True, variable_tokens: bool = False, frozen: bool = False,
                 sizes: dict | None = None, checked: bool = False,
                 wire_dtypes: tuple | None = None, thd: bool = False) -> None:
        from mimo_fx.compiled import Bridge

        if tensor_ndim not in (2, 3):
            raise MimoFxError(f"tensor_ndim must be 2 or 3, got {tensor_ndim!r}")
        if not isinstance(thd, bool) or (thd and tensor_ndim != 3):
            raise MimoFxError(f"thd={thd!r} with tensor_ndim={tensor_ndim}: a THD "
                              f"destination packs the samples of a 3-D [B, S, H] (or [S, B, "
                              f"H]) tensor; pass thd=True with tensor_ndim=3, or thd=False")
        self.src_grid, self.dest_grid = src_grid, dest_grid
        self.src_module_name, self.dest_module_name = src_module_name, dest_module_name
        self.comm_dtype, self.tensor_ndim = comm_dtype, tensor_ndim
        self.dim_mapping = (_check_mapping(dim_mapping, ({"b", "s", "h"},))
                            if tensor_ndim == 3 or dim_mapping is not None else
                            dict(DEFAULT_MAPPING))
        self.current_rank = dist.get_rank()
        kw = {"zigzag": zigzag, "variable_tokens": variable_tokens}
        self.src = megatron_layout(src_grid, self.dim_mapping, tensor_ndim, stage=-1, **kw)
        self.dst = megatron_layout(dest_grid, self.dim_mapping, tensor_ndim, stage=0, **kw)
        if set(self.src.grid.ranks) & set(self.dst.grid.ranks):
            raise MimoFxError(
                f"BridgeCommunicator's grids share ranks ({self.src.grid!r} and "
                f"{self.dst.grid!r}); for modules on the same ranks use "
                f"ColocatedBridgeCommunicator")
        dtype = comm_dtype if comm_dtype is not None else torch.get_default_dtype()
        self._batch = self.dim_mapping.get("b", 0) if tensor_ndim == 3 else 0
        self._batch_name = "b" if tensor_ndim == 3 else "t"
        self._counts = None
        src_dp, dst_dp = _size(self.src.grid, "dp"), _size(self.dst.grid, "dp")
        if variable_tokens and sizes is None and dst_dp > src_dp:  # (fan-out: see _Counts)
            self._counts = _Counts(self.src, self.dst, math.lcm(src_dp, dst_dp))
        # Megatron's shape exchange: the source's boundary ranks know each call's sizes
        # (its batch even over DP), the destination learns them from one message each
        self._told = sizes is None and not variable_tokens
        self._bridge = Bridge(self.src, self.dst, sizes, dtype, frozen=frozen,
                              checked=checked, told=self._told, **_wires(wire_dtypes, dtype))
        self.frozen, self.thd, self._zigzag = frozen, thd, zigzag
        # a THD destination: the box shapes of the received activations whose gradient
        # has not gone back yet (the backward calls take THD gradients)
        self._thd_shapes: deque[torch.Size] = deque()
        self._packing: tuple[int, int, int] | None = None  # (samples, length, cp)
        _LIVE.add(self)

    # -- Megatron's queries -------------------------------------------------------------
    def is_current_rank_in_grid(self, grid) -> bool:
        """Whether this rank is in ``grid`` (any stage)."""
        return grid.rank_offset <= self.current_rank < grid.rank_offset + grid_of(grid).size

    def _check(self, grid, call: str, side: str) -> None:
        """Raise as Megatron does where this rank is not in the grid ``call`` belongs to."""
        if not self.is_current_rank_in_grid(grid):
            raise MimoFxError(f"[Bridge Communicator] [{call}] rank {self.current_rank} is not "
                              f"in the {side} grid ({grid_of(grid)!r}); {call} runs on the "
                              f"{side} grid's ranks")

    def _off(self, grid, call: str, side: str) -> bool:
        """Raise as Megatron does where this rank is not in ``grid``; whether it is off the
        boundary stage, where a call moves nothing and returns None at once."""
        self._check(grid, call, side)
        return self.current_rank not in self._bridge.party

    # -- the calls ----------------------------------------------------------------------
    def send_forward(self, tensor_to_send: torch.Tensor) -> None:
        """Send this rank's activation to the destination grid; returns once it is
        posted (the data in flight)."""
        if self._off(self.src_grid, "send_forward", "source"):
            return None
        self._bridge.send_forward(tensor_to_send, self._sizes(tensor_to_send))
        self._thd_length(tensor_to_send)

    def recv_forward(self) -> torch.Tensor | None:
        """This rank's activation from the source grid (None off the first stage)."""
        if self._off(self.dest_grid, "recv_forward", "destination"):
            return None
        return self._packed(self._bridge.recv_forward(sizes=self._got_sizes()))

    def send_backward(self, grad_tensor: torch.Tensor) -> None:
        """Send the gradient of this rank's activation back to the source grid."""
        if self._off(self.dest_grid, "send_backward", "destination"):
            return None
        if not self.frozen:
            self._bridge.send_backward(self._unpacked(grad_tensor))

    def recv_backward(self) -> torch.Tensor | None:
        """The gradient of this rank's sent activation (None off the last stage, or for
        a frozen source)."""
        if self._off(self.src_grid, "recv_backward", "source"):
            return None
        if self.frozen:
            return None
        return self._bridge.recv_backward()

    def send_forward_recv_backward(self, input_tensor: torch.Tensor,
                                   grad_shape: tuple | None = None) -> torch.Tensor | None:
        """Send an activation, then receive the gradient of the oldest one sent (the
        source's 1F1B step). ``grad_shape`` is accepted and unused, as there."""
        if self._off(self.src_grid, "send_forward_recv_backward", "source"):
            return None
        x = input_tensor
        if self.frozen or self.thd:  # (THD: the length checked before a backward waits)
            self._bridge.send_forward(x, self._sizes(x))
            self._thd_length(x)
            return None if self.frozen else self._bridge.recv_backward()
        return self._bridge.send_forward_recv_backward(x, sizes=self._sizes(x))

    def send_backward_recv_forward(self, grad_tensor: torch.Tensor,
                                   forward_shape: tuple | None = None) -> torch.Tensor | None:
        """Send a gradient back, then receive the next activation (the destination's
        1F1B step). ``forward_shape`` is accepted and unused, as there."""
        if self._off(self.dest_grid, "send_backward_recv_forward", "destination"):
            return None
        if self.frozen:
            return self._packed(self._bridge.recv_forward(sizes=self._got_sizes()))
        y = self._bridge.send_backward_recv_forward(self._unpacked(grad_tensor),
                                                    sizes=self._got_sizes())
        return self._packed(y)

    def _sizes(self, x: torch.Tensor | None) -> dict | None:
        """A told call's sizes, from this boundary rank's piece (each dim's local size
        times its shards: Megatron's even split); None elsewhere. A fan-out with variable
        tokens: the destination replicas' counts (see :class:`_Counts`)."""
        if self._counts is not None:
            return {self._batch_name: self._counts.send(x, self._batch)}
        if not self._told or x is None:
            return None
        if x.dim() != len(self.src.dims):
            raise MimoFxError(f"[Bridge Communicator] rank {self.current_rank}: a "
                              f"{x.dim()}-D tensor of shape {tuple(x.shape)} but the source "
                              f"layout {self.src.describe()!r} has {len(self.src.dims)} dims; "
                              f"pass this rank's activation (tensor_ndim="
                              f"{self.tensor_ndim})")
        return {d: int(n) * self.src.shards(d) for d, n in zip(self.src.dims, x.shape)}

    # -- a THD destination -------------------------------------------------------------
    def _packed(self, y: torch.Tensor | None) -> torch.Tensor | None:
        """The received box piece ``y`` (this rank's replica's samples, each one's CP
        chunks), as THD where built so: its samples one after another, a leaf of its own
        (Megatron's schedule reads its ``.grad``)."""
        if y is None or not self.thd:
            return y
        m = self.dim_mapping
        b, s = y.shape[m["b"]], y.shape[m["s"]]
        self._thd_length(y)
        if not self.frozen:
            self._thd_shapes.append(y.shape)
        cp = self.dst.shards("s")
        self._packing = (b, s * cp, cp)
        packed = y.detach().permute(m["b"], m["s"], m["h"]).reshape(b * s, -1)
        return packed.requires_grad_(y.requires_grad)

    def _thd_length(self, piece: torch.Tensor | None) -> None:
        """Raise, on both sides once the data moved (so no rank waits for another), where
        THD's per-sequence CP cut differs from the box's: a sequence length the
        destination's CP does not cut into equal chunks (THD pads each sequence to them,
        as Megatron's THD split needs its lengths padded)."""
        if not self.thd or piece is None:
            return
        cp = self.dst.shards("s")
        chunks = 2 * cp if self._zigzag and cp > 1 else cp
        length = self._bridge.last_sizes["s"]  # (the call's: a CP cut may be uneven)
        if length % chunks:
            raise MimoFxError(
                f"[Bridge Communicator] rank {self.current_rank}: thd=True with sequence "
                f"length {length}, which the destination's cp={cp} does not cut into "
                f"{chunks} equal chunks; pad each sample's sequence to a multiple of "
                f"{chunks} (Megatron's THD context-parallel split needs the same)")

    def _unpacked(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """A THD gradient back in the box shape of the oldest activation still waiting
        for it."""
        if grad is None or not self.thd:
            return grad
        if not self._thd_shapes:
            raise MimoFxError(f"[Bridge Communicator] rank {self.current_rank}: a THD "
                              f"gradient with no received activation waiting for it; every "
                              f"send_backward follows its recv_forward")
        shape = self._thd_shapes.popleft()
        m = self.dim_mapping
        order = (m["b"], m["s"], m["h"])
        box = [shape[d] for d in order]
        if tuple(grad.shape) != (box[0] * box[1], box[2]):
            raise MimoFxError(
                f"[Bridge Communicator] rank {self.current_rank}: a THD gradient of shape "
                f"{tuple(grad.shape)}, but its activation was ({box[0] * box[1]}, {box[2]}) "
                f"({box[0]} samples of {box[1]} local tokens); pass the gradient of what "
                f"recv_forward returned")
        return grad.reshape(box).permute(*[order.index(d) for d in range(3)])

    def thd_packing(self):
        """The :class:`mimo_fx.packed.Packing` of the last activation this destination rank
        received with ``thd=True`` (None before): its sequences' boundaries
        (``cu_seqlens``, ``local_cu_seqlens``), positions for RoPE, and so on."""
        from mimo_fx.packed import Packing

        if self._packing is None:
            return None
        b, s, cp = self._packing
        return Packing([s] * b, cp, self._zigzag)

    def _got_sizes(self) -> dict | None:
        """What a receiving call gives: a fan-out with variable tokens, the counts."""
        if self._counts is None:
            return None
        return {self._batch_name: self._counts.recv()}

    # -- lifetime -----------------------------------------------------------------------
    @property
    def bridge(self):
        """The mimo_fx :class:`~mimo_fx.compiled.Bridge` underneath."""
        return self._bridge

    def destroy(self) -> None:
        """Release this communicator's process groups (after its sends were received)."""
        self._bridge.destroy()
        if self._counts is not None:
            self._counts.destroy()
        _LIVE.discard(self)

    @classmethod
    def destroy_broadcast_pgs(cls) -> None:
        """Megatron's cleanup of its cached groups: destroys every live communicator's."""
        for comm in list(_LIVE):
            comm.destroy()

    destroy_bridge_pgs = destroy_broadcast_pgs


@dataclass
class SliceInfo:
    """This rank's slice of the batch dim on the narrowing side (Megatron's type)."""

    start: int
    size: int


class ColocatedBridgeCommunicator:
    """Megatron-Core's ``ColocatedBridgeCommunicator`` (source and destination modules on
    the same ranks; ``communicate`` is differentiable), on a mimo_fx
    :class:`~mimo_fx.compiled.Redistributor`.

    Megatron's arguments: ``src_grid``, ``dest_grid`` (the same ranks), ``src_module_name``,
    ``dest_module_name``, ``dim_mapping`` (``{'b', 's', 'h'}`` for 3-D, ``{'b', 'h'}`` for a
    2-D ``[S*B, H]``; default ``[B, S, H]``). Each call's sizes come from this rank's
    input, as there (the batch even over DP; no communication for them).

    Beyond Megatron (keyword-only): CP > 1 on either side (``zigzag`` as above; Megatron
    requires CP = 1), ``variable_tokens`` (each DP replica its own count on the batch dim,
    learned per call), ``frozen`` (as :class:`~mimo_fx.compiled.Redistributor`'s; default:
    decided by whether the source requires grad), ``checked``, ``wire_dtypes``
    (``(forward, backward)``: the dtypes activations and gradients travel in, None for
    the input's; results keep the input's dtype).
    """

    def __init__(self, src_grid, dest_grid, src_module_name: str = "src",
                 dest_module_name: str = "dest", dim_mapping: dict | None = None, *,
                 zigzag: bool = True, variable_tokens: bool = False,
                 frozen: bool | None = None, checked: bool = False,
                 dtype: torch.dtype | None = None, wire_dtypes: tuple | None = None) -> None:
        from mimo_fx.compiled import Redistributor

        self.src_grid, self.dest_grid = src_grid, dest_grid
        self.src_module_name, self.dest_module_name = src_module_name, dest_module_name
        self.dim_mapping = _check_mapping(dim_mapping, ({"b", "s", "h"}, {"b", "h"}))
        self.current_rank = dist.get_rank()
        src, dst = grid_of(src_grid), grid_of(dest_grid)
        if src.ranks != dst.ranks:
            raise MimoFxError(f"ColocatedBridgeCommunicator's grids must span the same ranks: "
                              f"src {src!r} holds {src.ranks.start}..{src.ranks.stop - 1}, "
                              f"dest {dst!r} {dst.ranks.start}..{dst.ranks.stop - 1}")
        for side, g in (("src", src), ("dest", dst)):
            for axis in ("tp", "dp"):
                if axis not in g.names:
                    raise MimoFxError(f"{side} grid must have a {axis!r} dim, got dim_names="
                                      f"{list(g.names)}")
            if _size(g, "pp") != 1:
                raise MimoFxError(f"{side} grid has pp={g.axis_size('pp')}: colocated modules "
                                  f"run one pipeline stage (use BridgeCommunicator between "
                                  f"stages)")
        self.src_tp_size, self.src_dp_size = src.axis_size("tp"), src.axis_size("dp")
        self.dest_tp_size, self.dest_dp_size = dst.axis_size("tp"), dst.axis_size("dp")
        self.src, self.dst = (_layout(g, self.dim_mapping, "b", None, zigzag, variable_tokens)
                              for g in (src, dst))
        big, small = max(self.src_dp_size, self.dest_dp_size), min(self.src_dp_size,
                                                                   self.dest_dp_size)
        self.scale = big // small if big % small == 0 else None
        self.direction = ("fan_in" if self.src_dp_size > self.dest_dp_size else
                          "fan_out" if self.dest_dp_size > self.src_dp_size else "equal")
        self._ragged = variable_tokens
        self._dtype = dtype
        self._red: dict = {}  # dtype -> Redistributor (built on first use of a dtype)
        self._last: tuple | None = None  # ((shape, dtype), its bridge, its sizes)
        self._checked, self._frozen = checked, frozen
        _wires(wire_dtypes, torch.float32)  # (checked now; applied per dtype)
        self._wire_dtypes = wire_dtypes
        self._make = Redistributor
        if dtype is not None:
            self._bridge_for(dtype)

    def _bridge_for(self, dtype: torch.dtype):
        red = self._red.get(dtype)
        if red is None:
            red = self._red[dtype] = self._make(self.src, self.dst, None, dtype,
                                                frozen=self._frozen, checked=self._checked,
                                                **_wires(self._wire_dtypes, dtype))
        return red

    def is_fan_in(self) -> bool:
        """True if src DP > dest DP (forward all-gathers)."""
        return self.direction == "fan_in"

    def is_fan_out(self) -> bool:
        """True if src DP < dest DP (forward narrows)."""
        return self.direction == "fan_out"

    def get_slice_info(self, batch_size: int) -> SliceInfo:
        """This rank's slice of ``batch_size`` on the narrowing side, as Megatron's."""
        if self.direction == "equal":
            return SliceInfo(0, batch_size)
        scale = self.scale or 1
        if batch_size % scale:
            raise MimoFxError(f"ColocatedBridgeCommunicator: batch dim size {batch_size} is not "
                              f"divisible by {self.direction} scale={scale}")
        grid = self.dst.grid if self.direction == "fan_out" else self.src.grid
        slot = grid.coord(self.current_rank)["dp"] % scale
        return SliceInfo(slot * (batch_size // scale), batch_size // scale)

    def _sizes(self, tensor: torch.Tensor) -> dict:
        """The call's sizes from this rank's piece (the batch even over DP, the sequence
        even over CP; ragged counts are learned instead)."""
        sizes, shape = {}, tensor.shape
        for name, axis in self.dim_mapping.items():
            if axis >= tensor.dim():
                raise MimoFxError(f"communicate: a {tensor.dim()}-D tensor for dim_mapping "
                                  f"{self.dim_mapping}")
            n = int(shape[axis])
            if name == "b":
                if self._ragged:
                    continue
                n *= self.src_dp_size
            elif name == "s":
                n *= _size(self.src.grid, "cp")
            sizes[name] = n
        return sizes

    def communicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (this rank's piece under the source's layout) under the
        destination's; differentiable (its gradient runs the reverse move)."""
        if not isinstance(tensor, torch.Tensor):
            raise MimoFxError(f"communicate needs this rank's tensor, got {tensor!r}")
        key = (tensor.shape, tensor.dtype)  # (a step's calls repeat one shape)
        last = self._last
        if last is None or last[0] != key:
            if self.direction == "fan_out" and not self._ragged and tensor.dim() > max(
                    self.dim_mapping.values()):
                self.get_slice_info(int(tensor.shape[self.dim_mapping["b"]]))
            last = self._last = (key, self._bridge_for(self._dtype or tensor.dtype),
                                 self._sizes(tensor))
        return last[1](tensor, last[2])

    def destroy(self) -> None:
        """Release this communicator's process groups."""
        for red in self._red.values():
            red.destroy()
        self._red.clear()
        self._last = None
