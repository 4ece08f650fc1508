"""A bridge's sizes: fixed, given per call, or learned; its templates and programs.

Dims whose sizes a bridge is built with are *fixed*; the others are *free*: a call gives
them (``bridge(x, s=4096)``) or, where it does not, every rank learns them from the
ranks holding src (one small all-gather of int64 shapes, see :mod:`.learn`; the bridge
runs it, this part only says when and reads the answer). With free dims the bridge
plans once, at sizes its layouts choose, a *template* (:mod:`mimo_fx.templates`) whose
lowered programs hold polynomials in the sizes: every size the template serves (free
even sizes multiples of :attr:`Sizing.granules`) runs those programs with no planning,
and under ``torch.compile`` one graph serves them all. Other sizes (uneven cuts, counts
that an even cut splits) are planned one by one and cached (at most
:data:`CACHED_SIZES`); under ``torch.compile`` each such size is its own graph.

Pure but for its cache: no collective, no process group (the groups it *needs*, per
direction, are listed in :attr:`Sizing.groups` for the lease to create).
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace
from math import lcm
from typing import Any, NamedTuple

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.plan import backward_layouts, check_sizes, plan_for_rank, plan_groups, size_arguments
from mimo_fx.symbolic import Expr
from mimo_fx.templates import Template, canonical_sizes

from . import lowering, straight
from .guard import TracedError, raise_formatted, raise_now, runtime_check
from .live import named

__all__ = ["CallSizes", "Programs", "Sizing", "CACHED_SIZES", "CALL_OPTIONS"]

CACHED_SIZES = 64   # sizes whose programs a bridge keeps (least recently used go)
CALL_OPTIONS = ("sizes",)


def _size_key(sizes: dict) -> tuple:
    return tuple(sorted(sizes.items()))


class Programs(NamedTuple):
    """What a call runs, from any sizing: its forward and backward programs, the numbers
    a template or row program is evaluated at (``env``, in :attr:`CallSizes.variables`
    order; None: a plain program), a row program's index vectors (``indices``), and
    the digest of the call's batch (0 without one; checked mode compares it)."""

    fwd: Any
    bwd: Any
    env: tuple | None
    indices: tuple = ()
    digest: Any = 0


def _large(pairs: Iterable[tuple[Layout, Layout]], sizes: dict,
           free: tuple[str, ...]) -> dict:
    """``sizes`` with their free even dims doubled until the plans' groups change (a
    large exchange's rounds), or up to 2**20 times: the groups a bridge of free sizes
    creates also for its large calls (``pairs``: its directions' layouts)."""
    even = [d for d in free if not isinstance(sizes[d], tuple)]
    first = [plan_groups(a, b, sizes) for a, b in pairs]
    at = dict(sizes)
    for _ in range(20 if even else 0):
        at = {d: n * 2 if d in even else n for d, n in at.items()}
        if [plan_groups(a, b, at) for a, b in pairs] != first:
            break
    return at


def _plain(sizes, dim_sizes: dict) -> tuple | None:
    """A call's given sizes as a hashable key, where every value is a plain int (or a
    tuple of them); None otherwise (tensors, SymInts, lists: checked afresh)."""
    if sizes is not None and not isinstance(sizes, dict):
        return None
    items = [*(sizes or {}).items(), *dim_sizes.items()]
    for _, n in items:
        if type(n) is not int and not (type(n) is tuple and all(type(c) is int for c in n)):
            return None
    return tuple(items), sizes is None


class CallSizes:
    """The one interface a bridge asks about its sizes and programs, whatever its
    layouts: :class:`Sizing` for boxes, :class:`~.row_sizing.RowSizing` where a side is a row
    layout. ``src``, ``dst``, ``fixed`` (sizes built in), ``free`` (dims a call gives or
    learns), ``union`` (both grids' ranks), ``groups`` (per direction, the groups it
    needs), the programs it was lowered to, and ``context`` (its errors' prefix)."""

    src: Any
    dst: Any
    fixed: dict
    free: tuple
    context: str
    union: tuple[int, ...]
    groups: dict[str, tuple]
    fwd_program: Any
    bwd_program: Any
    template: Template | None
    fingerprint: int
    name: str

    @property
    def granules(self) -> dict[str, int]:
        return {}

    @property
    def variables(self) -> tuple:
        return ()

    @property
    def unbacked(self) -> bool:
        """Whether a traced call holds run-time-length tensors (ragged pieces, row indices)."""
        return bool(getattr(self.src, "ragged", ()) or getattr(self.dst, "ragged", ()))

    def programs(self, full: dict, learned: frozenset, x=None, src=None,
                 dst=None) -> Programs:
        """This rank's :class:`Programs` at ``full`` sizes (``learned``: the dims gathered)."""
        raise NotImplementedError

    def size_values(self, x) -> list:
        """This rank's size-gather row (:mod:`.learn`): ints, or SymInts when compiling."""
        raise NotImplementedError

    def size_record(self, x) -> torch.Tensor:
        """:meth:`size_values` as an int64 vector on the host (size records are metadata: a
        call reads them back, and a read of a host tensor never waits for a GPU)."""
        from .guard import int_tensor

        return int_tensor(self.size_values(x), "cpu")

    def sizes_from(self, rows: torch.Tensor | list, known: dict, ranks=None) -> dict:
        """Every size from ``rows`` of ``ranks``, ``known`` first; a bad row raises on all ranks."""
        raise NotImplementedError

    def shape(self, side: str, rank: int, full: dict) -> tuple | None:
        """``rank``'s local shape on ``side`` at ``full`` sizes (what the guard's errors
        say a rank was to pass); None where the side holds nothing there."""
        from mimo_fx.local import local_shape
        from mimo_fx.regions import Tiling

        layout = self.src if side == "src" else self.dst
        if not layout.holds(rank):
            return None
        return local_shape(layout, Tiling.of(layout, self.src.dims, full), rank)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The forward output as the call's result (rows: :meth:`.row_sizing.RowSizing.finish`)."""
        return y

    def summary(self) -> list[str]:
        """The debug log's lines on the bridge's programs (each starts ``": "`` or ``" "``)."""
        return []

    def forget(self) -> None:
        """Drop what it cached (the bridge is destroyed)."""

    def given(self, sizes, dim_sizes: dict) -> dict:
        """The sizes a call gives, checked against the fixed ones (an eager call giving
        the same plain ints as the last one reuses its answer: a bridge called every
        micro-batch checks its sizes once)."""
        if sizes is None and not dim_sizes:
            return {}
        key = None if torch.compiler.is_compiling() else _plain(sizes, dim_sizes)
        last = self.__dict__.get("_given_memo")
        if key is not None and last is not None and last[0] == key:
            return dict(last[1])
        given = self._given(sizes, dim_sizes)
        if key is not None:
            self._given_memo = (key, dict(given))
        return given

    def _given(self, sizes, dim_sizes: dict) -> dict:
        given = size_arguments(self.src, self.dst, sizes, dim_sizes, "bridge call",
                               CALL_OPTIONS)
        for d, n in given.items():
            if torch.compiler.is_compiling():
                self._check_traced(d, n)  # (plan's checks leave traced sizes to this)
            if d in self.fixed and not _same(n, self.fixed[d]):
                raise_formatted(
                    self.context + f"{d}={{!r}} but the bridge was built with {d}="
                    f"{self.fixed[d]!r}; build it without {d!r} to vary it", n)
        return given

    def _check_traced(self, d: str, n) -> None:
        """A size the call gives while Dynamo traces: positive (a ragged dim's counts
        not negative), with words made from its example value."""
        from torch.fx.experimental.symbolic_shapes import guard_or_false

        if isinstance(n, tuple):
            if any(guard_or_false(c < 0) for c in n):
                raise_formatted(self.context + f"dim {d!r} is cut ragged: its counts "
                                f"{d}={{!r}} must be non-negative integers", n)
        elif guard_or_false(n <= 0):
            raise_formatted(self.context + f"size {d}={{!r}} must be a positive integer "
                            f"(the global size)", n)

    def missing(self, given: dict) -> tuple[str, ...]:
        """The free dims a call with ``given`` sizes must learn."""
        return tuple(d for d in self.free if d not in given)

    def batch_of(self, src, dst) -> dict:
        """Keywords giving a call the batch of ``src``/``dst``: none (box layouts are the batch)."""
        return {}

    def call_batch(self, src, dst, context: str) -> dict:
        """A call's batch from its ``src=``/``dst=`` keywords (None: not given): a box
        bridge serves its layouts only, so it takes none."""
        raise MimoFxError(context + "src=/dst= give a row bridge its batch; this bridge "
                          "moves boxes: build a Redistributor for other layouts")

    def batch(self, layouts: dict) -> list[torch.Tensor]:
        """A call's batch data (its ``src=``/``dst=``) for its size record's fingerprint: empty."""
        return []

    def batch_values(self, layouts: dict) -> list[tuple[int, ...]]:
        """:meth:`batch` as host ints (an eager call folds them in, reading no tensor)."""
        return []

    @property
    def varies(self) -> bool:
        """Whether a call may move other sizes or another batch than the last one."""
        return bool(self.free)

    def gathers_sizes(self, missing: tuple) -> bool:
        """Whether a call missing ``missing`` sizes gathers size records (checked on every rank)."""
        return bool(missing)


class Sizing(CallSizes):
    """Sizes and programs of one ``src -> dst`` bridge for ``rank`` (see the module
    docstring). ``context`` prefixes its errors (the bridge's description)."""

    def __init__(self, src: Layout, dst: Layout, fixed: dict | None, dtype: torch.dtype,
                 grad_partial: tuple[str, ...], rank: int, context: str) -> None:
        self.src, self.dst, self.dtype, self.rank = src, dst, dtype, rank
        self.context = context
        self.fingerprint = 0  # the bridge's fingerprint, which size records carry (set by it)
        self.fixed = size_arguments(src, dst, fixed, {}, "Redistributor", ()) if fixed else {}
        self.free = tuple(d for d in src.dims if d not in self.fixed)
        self.adjoint = backward_layouts(src, dst, grad_partial)
        self.union = tuple(sorted(set(src.grid.ranks) | set(dst.grid.ranks)))
        self.template: Template | None = None
        sizes = self._plan_shapes(grad_partial)
        # every rank lists the same groups in the same order, from the decisions the
        # plans share (no rank plans another's transfers): per direction, each issued
        # on groups of its own (a forward never pairs with a backward); free sizes
        # also get the groups of their large sizes' plans (see programs_at)
        directions = {"forward": (src, dst), "backward": self.adjoint}
        self._shaped = {k: plan_groups(a, b, sizes) for k, (a, b) in directions.items()}
        large = _large(list(directions.values()), sizes, self.free) if self.free else sizes
        self.groups = {k: self._groups(pair, (sizes, large))
                       for k, pair in directions.items()}
        self._lower_programs()
        self._cache: OrderedDict[tuple, tuple] = OrderedDict()
        self.name = ""  # its bridge's (see .live), set by the bridge

    # -- building ------------------------------------------------------------------------
    def _groups(self, layouts: tuple[Layout, Layout], sizes: tuple[dict, ...]
                ) -> tuple[tuple[int, ...], ...]:
        groups = list(dict.fromkeys(g for at in sizes for g in plan_groups(*layouts, at)))
        if self.free and len(self.union) > 1 and self.union not in groups:
            groups.append(self.union)  # for sizes whose gathers find no group
        return tuple(groups)

    def _plan_shapes(self, grad_partial: tuple[str, ...]) -> dict:
        """This rank's parts of the plans the bridge is built on: at its sizes when all
        are fixed, else at the template sizes its layouts choose (then also the
        template). Returns those sizes."""
        src, dst, dtype = self.src, self.dst, self.dtype
        sizes: dict
        if not self.free:
            sizes = self.fixed
        else:
            ragged = set(src.ragged_dims) | set(dst.ragged_dims)
            counts = {d: lcm(src.shards(d), dst.shards(d)) for d in self.free if d in ragged}
            sizes = canonical_sizes(src, dst, self.fixed, counts)
        check_sizes(src, dst, sizes)
        self.fwd = plan_for_rank(src, dst, sizes, dtype, rank=self.rank)
        self.bwd = plan_for_rank(*self.adjoint, sizes, dtype, rank=self.rank)
        if self.free:
            self.template = Template.build(src, dst, sizes, dtype.itemsize, grad_partial,
                                           self.free, rank=self.rank)
        return sizes

    def _lower_programs(self) -> None:
        t = self.template
        if not self.free:
            self.fwd_program = lowering.lower(self.fwd, self.rank)
            self.bwd_program = lowering.lower(self.bwd, self.rank)
        elif t is not None:
            self.fwd_program = lowering.lower(t.fwd, self.rank, t.fwd_sym)
            self.bwd_program = lowering.lower(t.bwd, self.rank, t.bwd_sym)
            lowering.prime((self.fwd_program, self.bwd_program))
            # a new size evaluates only this rank's polynomials
            self._at = (lowering.evaluator(self.fwd_program),
                        lowering.evaluator(self.bwd_program))
        else:
            self.fwd_program = self.bwd_program = None  # type: ignore[assignment]
            self.rows_hint = self._rows_hint()  # (said while a trace fails: made now)
        straight.attach(self.fwd_program, self.bwd_program)

    @property
    def granules(self) -> dict[str, int]:
        """Per free even dim, the size step one compiled graph serves (empty without a template)."""
        return dict(self.template.granules) if self.template else {}

    @property
    def variables(self) -> tuple:
        """The template's variables (the env's keys, in order); () without one."""
        return self.template.variables if self.template is not None else ()

    # -- a call's sizes (given, missing: CallSizes) ----------------------------------------
    def size_values(self, x) -> list:
        from .learn import Record

        return Record.encode(x, len(self.src.local_dims), self.fingerprint)

    def sizes_from(self, rows: torch.Tensor | list, known: dict, ranks=None) -> dict:
        from .learn import learn_sizes

        return learn_sizes(rows, ranks or self.union, self.src, known,
                           self.fingerprint, self.dtype, self.context)

    # -- programs ------------------------------------------------------------------------
    def programs(self, full: dict, learned: frozenset, x=None, src=None,
                 dst=None) -> Programs:
        """This rank's forward and adjoint programs for ``full`` sizes, and the env a
        template program's numbers are evaluated at (None: a plain program); ``x`` is
        this rank's src tensor (it names learned sizes its shape shows). A box bridge
        takes no batch (the redistributor refuses ``src=``/``dst=`` before this)."""
        if not self.free:
            return Programs(self.fwd_program, self.bwd_program, None)
        if not torch.compiler.is_compiling():
            fwd, bwd = self.programs_at(_size_key(full))
            return Programs(fwd, bwd, None)
        t = self.template
        if t is not None and self._fits_compiled(t, full, learned):
            env = t.env(full)
            values = tuple(env[v] for v in t.variables)
            if learned:
                values = self._fresh(values, t.variables, x)
                values = self._from_local(x, values, t, full)
            return Programs(self.fwd_program, self.bwd_program, values)
        if learned:
            raise_now(
                self.context + f"sizes learned under torch.compile must fit the bridge's "
                f"template ({t.describe() if t else 'none: its plan depends on the sizes'}); "
                f"give the sizes in the call, or run these sizes eagerly"
                + getattr(self, "rows_hint", ""))
        # sizes the template does not serve: a graph of their own (Dynamo specialises)
        key = _size_key({d: _concrete(n) for d, n in full.items()})
        fwd, bwd = _programs_for(self.name, key)
        return Programs(fwd, bwd, None)

    def _rows_hint(self) -> str:
        """How this bridge would move every count in one graph, where its layouts allow:
        built with the sizes of the features its dst cuts (it then moves whole rows)."""
        from mimo_fx.rows import ragged_rows

        ragged = {*self.src.ragged_dims, *self.dst.ragged_dims}
        features = {d: 1 for d in self.src.dims if d not in self.fixed and d not in ragged}
        rows = ragged_rows(self.src, self.dst, {**self.fixed, **features})
        cut = [d for d in features if self.dst.sharding[d]]
        if not rows or not cut:
            return ""
        return (f"; or build the bridge with the sizes of {', '.join(map(repr, cut))} (e.g. "
                f"{{{', '.join(f'{d!r}: ...' for d in cut)}}}): it then moves whole rows of "
                f"{rows[0]!r}, one graph for every count")

    def _fits_compiled(self, t: Template, full: dict, learned: frozenset) -> bool:
        """Whether traced sizes fit the template: a learned size is asserted to (the
        graph then serves every size that does, and fails on one that does not), a given
        one is tested (Dynamo guards on the test: a size that fails it recompiles)."""
        for d, granule in t.granules.items():
            n = full[d]
            if d in learned:
                message = (f"{self.context}the learned size {d}={{}} is not a positive "
                           f"multiple of {granule} (bridge.granules), which a compiled call "
                           f"with learned sizes needs; pad it, or give the sizes in the call")
                runtime_check("multiple", (n, granule), message)
            elif n % granule != 0:
                return False
        return all(len(full[d]) == m for d, m in t.counts.items())

    def _fresh(self, values: tuple, variables: tuple, x) -> tuple:
        """Learned values as fresh symbols: the size gather's sizes are sums and quotients
        of the rows' unbacked entries, which the compiler's shape reasoning handles
        badly (slices of unknown length); one symbol per variable, tied to its value by
        a run-time check, keeps every program number a plain polynomial."""
        from .guard import int_tensor

        fresh = int_tensor(values, "cpu").tolist()  # (host values: no device read)
        for new, old, var in zip(fresh, values, variables):
            torch._check(new == old)
            torch._check(new >= (1 if var[0] == "u" else 0))
        return tuple(fresh)

    def _from_local(self, x, values: tuple, t: Template, full: dict) -> tuple:
        """On a rank holding src, each variable its own tensor shows -- a local dim that is
        ``c * u[d]``, or its own ragged count -- taken from the tensor's (backed) shape,
        asserted equal to the learned size: the program's slices of that tensor are then
        in the tensor's own sizes, which the compiler can bound."""
        shape = self.fwd_program.src_shape
        if not isinstance(x, torch.Tensor) or shape is None or x.dim() != len(shape):
            return values
        out = list(values)
        message = (f"{self.context}rank {self.rank}: the local tensor's shape does not fit "
                   f"the learned sizes (sizes learned under torch.compile must be multiples "
                   f"of bridge.granules); run the call eagerly to see why")
        for have, want in zip(x.shape, shape):
            if not isinstance(want, Expr) or len(want.terms) != 1:
                continue
            (mono, coef), = want.terms
            if len(mono) != 1:
                continue
            var = mono[0]
            if have % coef != 0:  # known while tracing (Dynamo guards on it if symbolic)
                # off the template: the learned size fails the check _fits_compiled put
                # before this when the graph runs, on every rank alike (raising here,
                # while tracing, would leave the other ranks waiting in the size gather)
                return values
            # an ordered check (MimoFxError on every rank, before any data moves), not
            # torch._check: inductor evaluates a failing torch._check as soon as its
            # symbols exist, ahead of the ordered checks, as a raw RuntimeError
            if var[0] == "u":  # have == coef * n / granules, without a quotient
                learned = full[var[1]]
                runtime_check("equal", (have * t.granules[var[1]], coef * learned), message)
            else:
                runtime_check("equal", (have, coef * full[var[1]][var[2]]), message)
            out[t.variables.index(var)] = have // coef if coef != 1 else have
        return tuple(out)

    def programs_at(self, key: tuple) -> tuple[Any, Any]:
        """Plain programs for concrete sizes: the template's evaluated, or a plan of their
        own; the least recently used of ``CACHED_SIZES`` sizes are kept."""
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        full = dict(key)
        t = self.template
        if t is not None and t.fits(full) and self._template_shaped(full):
            env = t.env(full)
            progs = (self._at[0](env), self._at[1](env))
        else:
            check_sizes(self.src, self.dst, full)
            progs = (lowering.lower(self._rank_plan((self.src, self.dst), full), self.rank),
                     lowering.lower(self._rank_plan(self.adjoint, full), self.rank))
        self._cache[key] = progs
        if len(self._cache) > CACHED_SIZES:
            self._cache.popitem(last=False)
        return progs

    def _template_shaped(self, full: dict) -> bool:
        """Whether the plans at ``full`` take the template's groups (a large exchange may take two
        rounds where the template's took one; it is then planned at its own sizes)."""
        return all(plan_groups(a, b, full) == self._shaped[k] for k, (a, b) in
                   (("forward", (self.src, self.dst)), ("backward", self.adjoint)))

    def _rank_plan(self, layouts: tuple[Layout, Layout], sizes: dict):
        """This rank's part of the plan at ``sizes``; where it would gather over groups
        the bridge did not create, the exchange is one all-to-all over the union (created
        for this): process groups never depend on sizes, and every rank decides alike."""
        made = set(self.groups["forward" if layouts == (self.src, self.dst) else "backward"])
        missing = not set(plan_groups(*layouts, sizes)) <= made
        return plan_for_rank(*layouts, sizes, self.dtype, rank=self.rank, all_to_all=missing)

    def summary(self) -> list[str]:
        if self.free:
            t = self.template
            return [f": sizes of {', '.join(self.free)} learned or given per call; "
                    f"template: {t.describe() if t else 'none (each size planned by itself)'}"]
        from mimo_fx.plan import format_bytes
        from mimo_fx.plan import plan as whole_plan

        out = []
        for what, layouts, program in (("forward", (self.src, self.dst), self.fwd_program),
                                       ("backward", self.adjoint, self.bwd_program)):
            # the bytes need the whole plan: planned here only when someone asks for them
            p = whole_plan(layouts[0], layouts[1], self.fixed, self.dtype)
            calls = ", ".join(f"{op.kind.value} over {len(op.ranks)} ranks"
                              for op in program.ops) or "no collective"
            out.append(f" {what}: {calls}; sends {format_bytes(p.bytes_sent.get(self.rank, 0))}"
                       f", receives {format_bytes(p.bytes_recv.get(self.rank, 0))}")
        return out

    def forget(self) -> None:
        """Drop the cached programs (the bridge is destroyed)."""
        self._cache.clear()


def flat_sizes(sizes: dict) -> tuple[list, str]:
    """Sizes as one list of ints and a spec to read them back (``b``, ``t=3``)."""
    values: list = []
    spec = []
    for d, n in sizes.items():
        if isinstance(n, tuple):
            values += list(n)
            spec.append(f"{d}={len(n)}")
        else:
            values.append(n)
            spec.append(d)
    return values, ",".join(spec)


def read_sizes(values: list, spec: str) -> dict:
    """The sizes :func:`flat_sizes` flattened, read back from its ``values`` and ``spec``
    (the one encoding of sizes as ints: size gathers and row routes use it)."""
    out: dict = {}
    at = 0
    for part in filter(None, spec.split(",")):
        d, _, n = part.partition("=")
        if n:
            out[d] = tuple(values[at:at + int(n)])
            at += int(n)
        else:
            out[d] = values[at]
            at += 1
    return out


@torch.compiler.assume_constant_result
def _programs_for(bridge: str, key: tuple) -> tuple[Any, Any]:
    """A bridge's plain programs for sizes its template does not serve, computed while tracing
    (a graph constant Dynamo guards on these sizes); refused sizes raise the eager error as a
    :class:`TracedError`. They have no straight-line functions: one read from a graph constant
    has no source Dynamo could guard it by, so these are interpreted."""
    try:
        fwd, bwd = named(bridge).sizing.programs_at(key)
    except MimoFxError as err:
        raise TracedError(str(err)) from None
    return tuple(p if p.straight is None else replace(p, straight=None) for p in (fwd, bwd))


def _check(ok, message: str) -> None:
    """``torch._check`` with a fixed message (its message must not close over traced values)."""
    torch._check(ok, lambda: message)


def _concrete(n):
    """A traced size as a Python int (Dynamo specialises the graph to it)."""
    if isinstance(n, tuple):
        return tuple(operator.index(c) for c in n)
    return operator.index(n)


def _same(a, b) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return True  # a traced size is checked against the tensor, not here
    return tuple(a) == tuple(b) if isinstance(a, tuple | list) else a == b
