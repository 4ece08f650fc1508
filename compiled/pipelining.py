"""Pipeline stages joined by bridges, for ``torch.distributed.pipelining`` schedules.

A pipeline of S stages has S-1 *boundaries*; boundary i moves stage i's output (layout
``src``, on stage i's grid) to stage i+1's input (layout ``dst``, on stage i+1's grid)
forward, and its gradient back, through one :class:`~mimo_fx.compiled.Bridge`. Stages
may differ in parallelism: an encoder on TP2 sending ``"b (tp h)"`` to a language model
on DP2 taking ``"(dp b) h"``.

:class:`BridgedPipeline` holds the boundaries (built on every rank, in one order: a
bridge creates process groups) and makes this rank's :class:`BridgedStage`, a
``torch.distributed.pipelining.PipelineStage`` that torch's schedules (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``) drive unchanged.

**Pipeline ranks are grids.** torch places stage i on pipeline rank ``i mod P`` and
reads a stage's pipeline rank and P from a process group with one member per pipeline
rank. Here a pipeline rank is the set of ranks of a grid: P is the number of distinct
rank sets among the stages, stage i runs on the ranks of stage ``i mod P`` (one stage
each when S == P, several for interleaved schedules), and rank sets of different
pipeline ranks are disjoint. The ranks of one grid are not pipeline peers: each runs
the schedule as the same pipeline rank, on its own piece of every micro-batch. No
process group of P members exists and torch sends nothing itself: the stage's
``get_*_ops`` run the bridges and return no point-to-point ops.

**The order of transfers.** A bridge call blocks until the peer grid makes the matching
call, and both grids must make them in the same order. torch's schedules post sends
and receives asynchronously, in two styles:

- Schedules over several stages per rank (``ScheduleInterleaved1F1B`` and the other
  ``PipelineScheduleMulti`` schedules) lower their plan so that every rank posts the
  transfers it shares with another rank in the same relative order. A stage runs each
  transfer when torch asks for it.
- Single-stage schedules (``ScheduleGPipe``, ``Schedule1F1B``) post a send together with
  the next receive, and the two sides of a boundary pair the same two transfers in
  opposite orders (1F1B: micro-batch i+w's activation and micro-batch i's gradient).
  A stage defers each send to this rank's next stage call and runs it first, except
  that a deferred gradient send waits for a forward receive of the same stage that
  follows it: wherever torch pairs the two, both sides move the activation first. In
  1F1B on two stages with four micro-batches both sides issue ``f0 f1 b0 f2 b1 f3 b2 b3``.

torch tells a stage which style drives it only by the first style assigning each of its
stages the stage -> pipeline rank map; a stage takes that assignment as the sign.

**Sizes and metadata.** Every dim of every boundary has a fixed per-micro-batch size
(``sizes=``), as torch's fixed receive buffers assume. Stage inputs and outputs are
described from the layouts, so no example arguments are needed and no metadata is
sent; received activations require grad whenever the schedule has a loss.

**Losses and gradients.** Each rank of the last grid computes ``loss_fn(output, target)``
on its piece of the micro-batch; :meth:`BridgedPipeline.loss` hands ``loss_fn`` this
rank's piece of the target under the ``output=`` layout. Gradients of a micro-batch
are summed over micro-batches. With the schedule's ``scale_grads=False``, write each
micro-batch's loss as a sum divided by the *step's* global token count (mimo_fx's
convention); with ``scale_grads=True`` (torch's default) torch divides gradients by the
number of micro-batches, so divide by the *micro-batch's* global token count instead.
Parameters replicated over a data axis (dp, cp) still need their gradients summed over
that axis after the step, as without pipelining.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _TensorMeta

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.local import local_indices, local_shape
from mimo_fx.regions import Tiling

from .bridge import Bridge
from .lease import require_world

__all__ = ["Boundary", "BridgedPipeline", "BridgedStage"]

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class Boundary:
    """Stage i's output (``src``, on stage i's grid) -> stage i+1's input (``dst``).

    ``grad_partial``: axes of ``dst`` replicating the input whose gradients each replica
    holds only a part of, summed on the way back (a column-parallel stage's input).
    ``frozen``: stage i needs no gradient (a frozen encoder): nothing crosses the
    boundary backward, and stage i+1's input requires none.
    """

    src: Layout
    dst: Layout
    grad_partial: tuple[str, ...] = ()
    frozen: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.src, Layout) or not isinstance(self.dst, Layout):
            raise MimoFxError(f"a boundary needs two Layouts (stage i's output, stage i+1's "
                              f"input), got {self.src!r} and {self.dst!r}")
        partial = self.grad_partial
        object.__setattr__(self, "grad_partial",
                           (partial,) if isinstance(partial, str) else tuple(partial))
        if not isinstance(self.frozen, bool):
            raise MimoFxError(f"Boundary(frozen={self.frozen!r}) must be True or False")


class Direction(enum.Enum):
    """Which way a transfer crosses a boundary."""

    FORWARD = "forward"    # an activation, stage i -> stage i+1
    BACKWARD = "backward"  # its gradient, stage i+1 -> stage i


# -- the pipeline's shape (no torch.distributed) ---------------------------------------------


def _ranks(layout: Layout) -> Ranks:
    return tuple(layout.grid.ranks)


def _span(ranks: Ranks) -> str:
    return f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"


def _boundaries(boundaries) -> tuple[Boundary, ...]:
    """Boundaries from ``Boundary`` values or ``(src, dst)`` pairs."""
    if isinstance(boundaries, Boundary | Layout) or (
            isinstance(boundaries, tuple | list) and boundaries
            and isinstance(boundaries[0], Layout)):
        raise MimoFxError("boundaries must be a list of (src, dst) pairs or Boundary values, "
                          "one per pair of consecutive stages, e.g. [(enc_out, llm_in)]")
    out = []
    for i, b in enumerate(boundaries):
        if isinstance(b, Boundary):
            out.append(b)
        elif isinstance(b, tuple | list) and len(b) == 2:
            out.append(Boundary(*b))
        else:
            raise MimoFxError(f"boundary {i} is {b!r}; give a (src, dst) pair of Layouts or "
                              f"a Boundary(src, dst, grad_partial=...)")
    if not out:
        raise MimoFxError("a pipeline needs at least one boundary (two stages)")
    return tuple(out)


def stage_ranks(boundaries: Sequence[Boundary]) -> tuple[Ranks, ...]:
    """The ranks of each stage; consecutive boundaries must agree on the stage between."""
    stages = [_ranks(boundaries[0].src)]
    for i, b in enumerate(boundaries):
        if i and _ranks(b.src) != stages[i]:
            raise MimoFxError(
                f"stage {i} takes its input on {_span(stages[i])} (boundary {i - 1}: "
                f"{boundaries[i - 1].dst.describe()!r}) but gives its output on "
                f"{_span(_ranks(b.src))} (boundary {i}: {b.src.describe()!r}); a stage runs "
                f"on one set of ranks: boundary {i - 1}'s dst and boundary {i}'s src must "
                f"be on grids over the same ranks")
        stages.append(_ranks(b.dst))
    return tuple(stages)


def pipeline_ranks(stages: Sequence[Ranks]) -> tuple[Ranks, ...]:
    """The distinct rank sets, pipeline rank k's being stage k's; checks that stage i runs
    on pipeline rank ``i mod P`` and that no rank is on two pipeline ranks."""
    distinct = tuple(dict.fromkeys(stages))
    width = len(distinct)
    owner: dict[int, int] = {}
    for k, ranks in enumerate(distinct):
        for r in ranks:
            if r in owner:
                raise MimoFxError(
                    f"rank {r} is on two stages' grids that are not the same ranks "
                    f"({_span(distinct[owner[r]])} and {_span(ranks)}); a rank runs one "
                    f"pipeline rank, so stages on different ranks must not overlap "
                    f"(colocated modules exchange tensors with mimo_fx.redistribute)")
            owner[r] = k
    if width < 2:
        raise MimoFxError(f"every stage runs on {_span(distinct[0])}: a pipeline needs "
                          f"stages on at least two disjoint sets of ranks")
    for i, ranks in enumerate(stages):
        if ranks != distinct[i % width]:
            placement = ", ".join(_span(r) for r in stages)
            raise MimoFxError(
                f"stage {i} runs on {_span(ranks)} but torch's schedules place stage i on "
                f"pipeline rank i mod {width}, here {_span(distinct[i % width])}; stages run "
                f"on: {placement}. Order the stages so that the rank sets repeat with "
                f"period {width}")
    return distinct


def _check_sizes(boundaries: Sequence[Boundary], sizes) -> dict[str, int]:
    if not isinstance(sizes, Mapping):
        raise MimoFxError(f"sizes={sizes!r} must be a dict {{dim: size of one micro-batch}}")
    for i, b in enumerate(boundaries):
        dims = tuple(dict.fromkeys(b.src.dims + b.dst.dims))
        missing = [d for d in dims if d not in sizes]
        if missing:
            raise MimoFxError(
                f"boundary {i} ({b.src.describe()!r} -> {b.dst.describe()!r}) needs the "
                f"size of {', '.join(map(repr, missing))} in one micro-batch; torch's "
                f"schedules use fixed shapes, so give every dim's size: sizes={{"
                + ", ".join(f"{d!r}: ..." for d in dims) + "}")
    return dict(sizes)


# -- deferred sends ---------------------------------------------------------------------------


class _Outbox:
    """This rank's transfers, in the order both sides of each boundary make them (see
    the module docstring, "The order of transfers"); shared by all stages of the rank.

    ``in_order``: run every transfer when asked (schedules over several stages per rank);
    else defer each send to the next stage call (single-stage schedules)."""

    def __init__(self) -> None:
        self.in_order = False
        self._pending: tuple[Bridge, Direction, torch.Tensor] | None = None

    def send(self, bridge: Bridge, direction: Direction, tensor: torch.Tensor) -> None:
        self.flush()
        self._pending = (bridge, direction, tensor)
        if self.in_order:
            self.flush()

    def flush(self) -> None:
        """Run the deferred send, if any."""
        if self._pending is None:
            return
        bridge, direction, tensor = self._pending
        self._pending = None
        if direction is Direction.FORWARD:
            bridge.send_forward(tensor)
        else:
            bridge.send_backward(tensor)

    def receive(self, bridge: Bridge, direction: Direction) -> torch.Tensor:
        if direction is Direction.BACKWARD:
            self.flush()
            g = bridge.recv_backward()
            assert g is not None  # (None only off both grids)
            return g
        # the same stage's deferred gradient waits for the activation torch pairs it with
        pending = self._pending
        if pending is None or pending[1] is Direction.FORWARD or pending[0] is not bridge:
            self.flush()
        y = bridge.recv_forward()
        self.flush()
        assert y is not None  # (None only off both grids)
        return y


# -- the pipeline ------------------------------------------------------------------------------


class BridgedPipeline:
    """The boundaries of one pipeline, built on every rank (all of them, in one order).

    Args:
        boundaries: one per pair of consecutive stages, ``(src, dst)`` or
            :class:`Boundary`; boundary i's ``src`` is stage i's output layout, its
            ``dst`` stage i+1's input layout.
        sizes: the global size of every dim of every boundary in one micro-batch
            (a dim named alike in two boundaries has one size).
        dtype: the dtype of the activations and gradients crossing the boundaries.
        output: the layout of the last stage's output (what the loss sees), for
            :meth:`loss`.
        comm_dtype, checked, device: as for :class:`~mimo_fx.compiled.Redistributor`.

    Example (4 ranks; an encoder on TP2 feeding a model on DP2)::

        pipe = BridgedPipeline(
            [(Layout(Grid(tp=2), "b (tp h)"), Layout(Grid(dp=2, offset=2), "(dp b) h"))],
            sizes={"b": 4, "h": 8}, output=Layout(Grid(dp=2, offset=2), "(dp b) h"))
        stage = pipe.stage(encoder if rank < 2 else model)
        schedule = Schedule1F1B(stage, 4, loss_fn=pipe.loss(loss), scale_grads=False)
    """

    def __init__(self, boundaries: Sequence[Boundary | tuple[Layout, Layout]],
                 sizes: Mapping[str, int], dtype: torch.dtype = torch.float32, *,
                 output: Layout | None = None, comm_dtype: torch.dtype | None = None,
                 checked: bool = False, device=None) -> None:
        self.boundaries = _boundaries(boundaries)
        self.stage_ranks = stage_ranks(self.boundaries)
        self.pipeline_ranks = pipeline_ranks(self.stage_ranks)
        self.sizes = _check_sizes(self.boundaries, sizes)
        if output is not None and (not isinstance(output, Layout)
                                   or _ranks(output) != self.stage_ranks[-1]):
            raise MimoFxError(f"output={output!r} must be a Layout on the last stage's "
                              f"ranks ({_span(self.stage_ranks[-1])})")
        self.output, self.dtype = output, dtype
        self.rank = require_world("BridgedPipeline")
        self._options = {"comm_dtype": comm_dtype, "checked": checked, "device": device}
        self.bridges = tuple(self._make_bridge(b) for b in self.boundaries)
        self.device = self.bridges[0].device
        self.outbox = _Outbox()

    def _make_bridge(self, boundary: Boundary) -> Bridge:
        """The bridge of one boundary (built on every rank: it creates process groups)."""
        dims = dict.fromkeys(boundary.src.dims + boundary.dst.dims)
        return Bridge(boundary.src, boundary.dst, {d: self.sizes[d] for d in dims},
                      self.dtype, grad_partial=boundary.grad_partial,
                      frozen=boundary.frozen or None, **self._options)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def pipeline_rank(self) -> int | None:
        """This rank's pipeline rank (the index of its grid), None if it runs no stage."""
        for k, ranks in enumerate(self.pipeline_ranks):
            if self.rank in ranks:
                return k
        return None

    @property
    def local_stages(self) -> tuple[int, ...]:
        """The stage indices this rank runs (several for an interleaved schedule)."""
        return tuple(i for i, ranks in enumerate(self.stage_ranks) if self.rank in ranks)

    def stage(self, module: torch.nn.Module, index: int | None = None) -> BridgedStage:
        """This rank's stage ``index`` running ``module`` (default: its only stage)."""
        mine = self.local_stages
        if index is None:
            if len(mine) != 1:
                raise MimoFxError(
                    f"rank {self.rank} runs stages {list(mine)}; say which: "
                    f"pipe.stage(module, index)" if mine else
                    f"rank {self.rank} runs no stage of this pipeline (stages run on "
                    f"{', '.join(_span(r) for r in self.stage_ranks)})")
            index = mine[0]
        if index not in mine:
            raise MimoFxError(f"rank {self.rank} cannot run stage {index!r}: it runs stages "
                              f"{list(mine)} (stages run on "
                              f"{', '.join(_span(r) for r in self.stage_ranks)})")
        return BridgedStage(module, index, self)

    def target_piece(self, target: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a micro-batch's target (dims in the ``output`` pattern's
        order) under the ``output`` layout."""
        if self.output is None:
            raise MimoFxError("the pipeline was built without output=...; give the layout "
                              "of the last stage's output to cut targets")
        return local_piece(target, self.output, self.rank)

    def loss(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A ``loss_fn`` for the schedule: ``fn(output, target_piece(target), **kw)``."""

        def loss_fn(output, target, **kwargs):
            return fn(output, self.target_piece(target), **kwargs)

        return loss_fn

    def destroy(self) -> None:
        """Release the bridges' process groups; safe to call twice."""
        for bridge in self.bridges:
            bridge.destroy()


def local_piece(x: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """``rank``'s piece of the global ``x`` (dims in the pattern's order) under ``layout``."""
    if layout.partial or layout.ragged_dims or not layout.holds(rank):
        raise MimoFxError(f"cannot cut a target by {layout.describe()!r} on rank {rank}: it "
                          f"must hold a piece and be neither partial nor ragged")
    if x.dim() != len(layout.dims):
        raise MimoFxError(f"the target has shape {tuple(x.shape)} but {layout.pattern!r} names "
                          f"{len(layout.dims)} dims {layout.dims}; give one target dim per "
                          f"dim, in that order")
    sizes = dict(zip(layout.dims, x.shape))
    index = [torch.tensor(local_indices(layout, rank, d, sizes[d]), dtype=torch.long,
                          device=x.device) for d in layout.dims]
    piece = x[torch.meshgrid(*index, indexing="ij")]
    lengths = dict(zip(layout.dims, piece.shape))
    return piece.reshape(tuple(prod(lengths[f.dim] for f in g) for g in layout.local_dims))


# -- the stage ---------------------------------------------------------------------------------


class BridgedStage(PipelineStage):
    """Stage ``index`` of a :class:`BridgedPipeline` on this rank, running ``module``.

    ``module`` takes this rank's piece of the stage's input (the first stage: the
    schedule's micro-batch arguments) and returns one tensor, this rank's piece of the
    stage's output under the next boundary's ``src`` layout (the last stage: anything
    its loss takes).
    """

    def __init__(self, module: torch.nn.Module, index: int, pipe: BridgedPipeline) -> None:
        if not isinstance(pipe, BridgedPipeline):
            raise MimoFxError(f"BridgedStage needs a BridgedPipeline, got {pipe!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not (
                0 <= index < pipe.num_stages):
            raise MimoFxError(f"stage index {index!r} must be an int in "
                              f"[0, {pipe.num_stages}): the pipeline has {pipe.num_stages} "
                              f"stages")
        if pipe.rank not in pipe.stage_ranks[index]:
            raise MimoFxError(f"rank {pipe.rank} is not on stage {index}'s grid "
                              f"({_span(pipe.stage_ranks[index])}); use pipe.stage(module)")
        self._pipe = pipe
        last = index == pipe.num_stages - 1
        # the bridges that bring this stage's input and take its output, and their layouts
        self._in = pipe.bridges[index - 1] if index > 0 else None
        self._out = pipe.bridges[index] if not last else None
        self._in_layout = pipe.boundaries[index - 1].dst if index > 0 else None
        self._out_layout = pipe.boundaries[index].src if not last else None
        # a frozen boundary: nothing crosses it backward
        self._in_frozen = index > 0 and pipe.boundaries[index - 1].frozen
        self._out_frozen = not last and pipe.boundaries[index].frozen
        super().__init__(module, index, pipe.num_stages, pipe.device)

    # torch reads the pipeline rank and the number of pipeline ranks from a process
    # group (``group``, by default the world); here a pipeline rank is a grid, so both come
    # from the pipeline and the values torch assigns from the world are dropped
    @property  # type: ignore[override]
    def group_rank(self) -> int:
        rank = self._pipe.pipeline_rank
        assert rank is not None  # a stage is made only on its own ranks
        return rank

    @group_rank.setter
    def group_rank(self, _world_value: int) -> None:
        pass

    @property  # type: ignore[override]
    def group_size(self) -> int:
        return len(self._pipe.pipeline_ranks)

    @group_size.setter
    def group_size(self, _world_value: int) -> None:
        pass

    # schedules over several stages per rank assign each stage the stage -> pipeline rank
    # map after construction (single-stage schedules never do): their transfers run in
    # the order torch asks for them
    @property
    def stage_index_to_group_rank(self) -> dict[int, int]:
        return self._stage_to_rank

    @stage_index_to_group_rank.setter
    def stage_index_to_group_rank(self, mapping: dict[int, int]) -> None:
        if hasattr(self, "_stage_to_rank"):  # not the base class's own, at construction
            self._pipe.outbox.in_order = True
        self._stage_to_rank = mapping

    # -- set-up: shapes come from the layouts, nothing is sent ---------------------------------
    def _warmup_forward_vote(self, has_backward: bool, received_acc=None) -> torch.Tensor:
        """Every stage's metadata is static (1): no vote crosses the pipeline."""
        return torch.ones(1, dtype=torch.int32)

    def _warmup_backward_result(self, received_result=None) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32)

    def _meta(self, layout: Layout, requires_grad: bool) -> _TensorMeta:
        """This rank's piece of a boundary tensor, as torch describes a stage tensor."""
        dims = layout.dims
        shape = torch.Size(local_shape(layout, Tiling.of(layout, dims, self._pipe.sizes),
                                       self._pipe.rank) if layout.holds(self._pipe.rank)
                           else (0,) * len(layout.local_dims))
        dtype = self._pipe.dtype
        return _TensorMeta(shape=shape, stride=torch.empty(shape, device="meta").stride(),
                           dtype=dtype, requires_grad=requires_grad and dtype.is_floating_point)

    def _prepare_forward_infra(self, num_microbatches: int, args, kwargs=None,
                               has_backward: bool = False):
        """Describe the stage's input and output from the layouts, then let torch build
        its receive and send records from them."""
        mine = self._pipe.local_stages
        if len(mine) > 1 and not self._pipe.outbox.in_order:
            raise MimoFxError(
                f"rank {self._pipe.rank} runs stages {list(mine)} of this pipeline but a "
                f"single-stage schedule drives stage {self.stage_index} alone; drive them "
                f"all with a schedule over several stages per rank (e.g. "
                f"ScheduleInterleaved1F1B), or give every stage its own ranks")
        if self.is_first:
            if not isinstance(args, tuple) or not all(isinstance(a, torch.Tensor) for a in args):
                raise MimoFxError(f"the first stage takes tensors as the schedule's "
                                  f"positional arguments, got {args!r}")
            inputs = tuple(_TensorMeta.from_tensor(a) for a in args)
        else:
            assert self._in_layout is not None
            inputs = (self._meta(self._in_layout, has_backward and not self._in_frozen),)
        self._user_meta.inputs = inputs
        self._user_meta.outputs = (() if self._out_layout is None else (
            self._meta(self._out_layout, has_backward and not self._out_frozen),))
        return super()._prepare_forward_infra(num_microbatches, args, kwargs, has_backward)

    def _resolve_peer_global_rank(self, stage_idx: int) -> int:
        raise MimoFxError(
            f"stage {self.stage_index}: torch asked for a point-to-point peer of stage "
            f"{stage_idx}, but a bridged stage moves tensors only through its bridges; this "
            f"torch version drives stages in a way BridgedStage does not support")

    # -- transfers -------------------------------------------------------------------------------
    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """Receive micro-batch ``fwd_chunk_id``'s input through the bridge (no ops)."""
        if self._in is None:
            self._pipe.outbox.flush()
            return []
        (info,) = self.args_recv_info[fwd_chunk_id]
        info.buffer = self._pipe.outbox.receive(self._in, Direction.FORWARD)
        return []

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """Send micro-batch ``fwd_chunk_id``'s output (deferred, see the module docstring)."""
        if self._out is None or self._out_layout is None:
            self._pipe.outbox.flush()
            return []
        output, _ = self.fwd_cache[fwd_chunk_id]
        if len(output) != 1 or not isinstance(output[0], torch.Tensor):
            raise MimoFxError(
                f"stage {self.stage_index} returned {len(output)} values "
                f"({', '.join(type(o).__name__ for o in output)}); a stage before the last "
                f"returns one tensor, its piece of {self._out_layout.describe()!r}")
        self._pipe.outbox.send(self._out, Direction.FORWARD, output[0].detach())
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """Receive the gradient of micro-batch ``bwd_chunk_id``'s output (no ops)."""
        if not self.has_backward or self._out is None or self._out_frozen:
            self._pipe.outbox.flush()
            return []
        (info,) = self.grad_recv_info[bwd_chunk_id]
        info.buffer = self._pipe.outbox.receive(self._out, Direction.BACKWARD)
        return []

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """Send the gradient of micro-batch ``bwd_chunk_id``'s input (deferred)."""
        if not self.has_backward or self._in is None or self._in_frozen:
            self._pipe.outbox.flush()
            if self._in_frozen and self.has_backward:
                self._check_chunk_id(bwd_chunk_id)
                self.bwd_cache.pop(bwd_chunk_id, None)
            return []
        self._check_chunk_id(bwd_chunk_id)
        (grad,) = self.bwd_cache.pop(bwd_chunk_id)
        if grad is None:  # the input did not reach the output: its gradient is zero
            (meta,) = self._stage_meta.inputs or (None,)
            assert meta is not None
            grad = torch.zeros(meta.shape, dtype=meta.dtype, device=self.device)
        self._pipe.outbox.send(self._in, Direction.BACKWARD, grad)
        return []

    # -- every other step of a schedule first runs the deferred send ----------------------------
    def clear_runtime_states(self) -> None:
        self._pipe.outbox.flush()
        super().clear_runtime_states()

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...],
                          kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True):
        self._pipe.outbox.flush()
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward=False):
        self._pipe.outbox.flush()
        return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        self._pipe.outbox.flush()
        return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def scale_grads(self, grad_scale_factor: int) -> None:
        self._pipe.outbox.flush()
        super().scale_grads(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self._pipe.outbox.flush()
        super().perform_reduce_grad(grad_scale_factor)
