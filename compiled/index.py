"""Index-mapped bridges on one process per rank: :class:`IndexBridge`.

An index plan (:mod:`mimo_fx.index`) moves rows in ONE uneven ``all_to_all`` over its
ranks per direction. The plan changes whenever the rows do (a new packing every step),
so a call takes this rank's :class:`~mimo_fx.index.Route`, the plan as tensors: under
``torch.compile`` the index vectors are graph inputs and the counts become symbolic ints
(``.tolist()``, captured as unbacked SymInts), so one graph serves every plan and no
graph bakes a plan in. Eagerly the same code runs on Python ints.

>>> # on every rank of ``ranks`` (e.g. the union of the encoder and LLM grids):
>>> # bridge = IndexBridge(ranks)                      # creates the group, eagerly
>>> # plan = bridge.plan(src_rows, dst_rows, n_rows)   # identical on every rank
>>> # y = bridge(x, bridge.route(plan))                # inside a compiled step or not
>>> # bridge.destroy()

:func:`index_bridge` is the same call through any comm object (the comm seam,
:class:`~mimo_fx.compiled.comm.Comm`; the tests pass a thread-emulated world).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from mimo_fx import vjp
from mimo_fx.errors import MimoFxError
from mimo_fx.index import (
    IndexPlan,
    Route,
    backward_send,
    backward_take,
    check_piece,
    forward_send,
    forward_take,
    plan_rows,
)

from . import groups
from .comm import Comm, FunctionalComm

__all__ = ["IndexBridge", "index_bridge"]

TAG = "index"  # the tag of index bridges' groups (never shared with a plan's data group)


class _OneRank:
    """A vjp executor: this rank's piece; the rows move in one all_to_all per direction.
    ``env`` holds the route's counts by position."""

    def __init__(self, comm: Comm, route: Route) -> None:
        self.comm, self.route = comm, route

    def run(self, direction, tensors, env=None, aux=()):
        (t,) = tensors
        values = [env[k] for k in range(len(env))]
        fsend, frecv, bsend, brecv, n_unique, n_src = self.route.split(values)
        row = math.prod(t.shape[1:])
        if direction == "forward":
            if torch.compiler.is_compiling():  # (eagerly, index_bridge raised already)
                torch._check(t.shape[0] == n_src, lambda: "the src piece's rows differ from "
                             "the route's n_src: pass this rank's piece and route")
            send, out_splits, in_splits = forward_send(aux, t), frecv, fsend
        else:
            send, out_splits, in_splits = backward_send(aux, t, n_unique), brecv, bsend
        flat = self.comm.all_to_all(send.reshape(-1), [n * row for n in out_splits],
                                    [n * row for n in in_splits], self.route.ranks)
        got = flat.view(-1, *t.shape[1:])
        if direction == "forward":
            return (forward_take(aux, got),)
        return (backward_take(aux, got, n_src),)


def index_bridge(x: torch.Tensor, route: Route, *, comm: Comm, rank: int | None = None
                 ) -> torch.Tensor:
    """This rank's dst piece ``x_global[dst_rows[rank]]`` from its src piece ``x`` (a rank
    without src rows passes an empty ``(0, *row_shape)`` tensor), one all_to_all over
    ``route.ranks`` per direction through ``comm``. Differentiable; every rank of the
    route must call it. ``rank`` only names the rank in errors."""
    if not isinstance(route, Route):
        raise MimoFxError(f"index_bridge takes this rank's Route (plan.route(rank)), got "
                          f"{type(route).__name__}")
    counts = route.counts.tolist()
    compiling = torch.compiler.is_compiling()
    # under compile the row count is symbolic: a run-time assert in the forward checks it
    if not compiling or not isinstance(x, torch.Tensor) or x.dim() == 0:
        check_piece(counts[-1], "this rank" if rank is None else f"rank {rank}", x)
    if compiling:
        for c in counts:
            torch._check(c >= 0)
    values = tuple(counts)
    (y,) = vjp.apply(_OneRank(comm, route), "forward", "backward", (x,), values=values,
                     variables=tuple(range(len(values))), aux=route.index)
    return y


class IndexBridge:
    """Index-mapped bridges over a fixed set of ranks: one process group, created on
    construction (on every rank, in the same order as other groups), serving every plan
    over those ranks.

    ``ranks``: every rank that holds src rows or needs dst rows in any plan this bridge
    runs (e.g. the union of the encoder's and the LLM's grids). Every one of them calls
    the bridge, in the same order, whether or not it holds or needs rows this time.

    Building one sets two global compiler options: Dynamo's ``capture_scalar_outputs``
    (the route's counts are read as ints) and, off, inductor's
    ``joint_graph_constant_folding`` (it fails on the zero tensors of unbacked length the
    backward builds).
    """

    def __init__(self, ranks, *, device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise MimoFxError("IndexBridge needs torch.distributed initialised first "
                              "(torch.distributed.init_process_group)")
        ranks = tuple(sorted(set(ranks)))
        world = dist.get_world_size()
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < world]
        if not ranks or bad:
            raise MimoFxError(f"IndexBridge ranks must be ranks of this {world}-rank world, "
                              f"got {list(ranks)}")
        self.ranks, self.rank = ranks, dist.get_rank()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        groups.acquire([ranks], TAG)
        self._live = True
        self.comm = FunctionalComm({ranks: groups.group_name(ranks, TAG)}) \
            if self.rank in ranks else None
        from torch._dynamo import config as dynamo_config

        # a route's counts are read as Python ints (``.tolist()``), which a compiled graph
        # can only hold as captured scalars
        dynamo_config.capture_scalar_outputs = True
        from torch._inductor import config as inductor_config

        # inductor's uniform-value constant folding asks whether a zero tensor of an
        # unbacked length (the backward's per-row sums) is contiguous, a data-dependent
        # question it cannot answer, and fails the compile (torch 2.13); the pass only
        # replaces constant tensors by fill calls
        inductor_config.joint_graph_constant_folding = False

    def plan(self, src_rows: Mapping, dst_rows: Mapping, n_rows: int) -> IndexPlan:
        """:func:`mimo_fx.index.plan_rows` over this bridge's ranks (a rank missing from
        both mappings takes part with no rows)."""
        strangers = sorted((set(src_rows) | set(dst_rows)) - set(self.ranks))
        if strangers:
            raise MimoFxError(f"ranks {strangers} hold or need rows but are not among this "
                              f"IndexBridge's ranks {list(self.ranks)}; build the bridge over "
                              f"every rank that takes part")
        return plan_rows({r: src_rows.get(r, ()) for r in self.ranks},
                         {r: dst_rows.get(r, ()) for r in self.ranks}, n_rows)

    def route(self, plan: IndexPlan) -> Route:
        """This rank's route through ``plan`` (outside a compiled region: it builds
        tensors from the plan; pass the route into the compiled step)."""
        if plan.ranks != self.ranks:
            raise MimoFxError(f"the plan's ranks {list(plan.ranks)} are not this "
                              f"IndexBridge's ranks {list(self.ranks)}; plan with "
                              f"bridge.plan(...)")
        return plan.route(self.rank, self.device)

    def __call__(self, x: torch.Tensor, route: Route | IndexPlan) -> torch.Tensor:
        """This rank's dst piece. ``route``: this rank's :class:`Route` (one compiled
        graph for every plan), or the plan itself (eager use; under ``torch.compile`` a
        plan passed in is a constant, one graph per plan)."""
        if not self._live:
            raise MimoFxError("this IndexBridge was destroyed; build a new one")
        if self.comm is None:
            raise MimoFxError(f"rank {self.rank} is not among this IndexBridge's ranks "
                              f"{list(self.ranks)}; only they call it")
        if isinstance(route, IndexPlan):
            route = self.route(route)
        elif isinstance(route, Route) and route.ranks != self.ranks:
            raise MimoFxError(f"the route's ranks {list(route.ranks)} are not this "
                              f"IndexBridge's ranks {list(self.ranks)}; plan with "
                              f"bridge.plan(...)")
        return index_bridge(x, route, comm=self.comm, rank=self.rank)

    def destroy(self) -> None:
        """Release the bridge's group (idempotent)."""
        if self._live:
            self._live = False
            groups.release([self.ranks], TAG)
