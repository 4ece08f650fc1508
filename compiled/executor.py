"""Run one rank's lowered program (see :mod:`.lowering`) through a comm.

The executor decides nothing: it views its src piece as stored boxes, packs each
collective's input buffer, issues the collective through its :class:`~.comm.Comm`
(ordered functional collectives in production, see :mod:`.comm`), unpacks the output,
and finally assembles the dst piece -- a straight line of tensor ops and collectives
that Dynamo traces without a graph break.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mimo_fx.symbolic import Expr

from . import timeouts
from .comm import Comm
from .lowering import AddAt, Cat, Node, Op, Program, Take, View

__all__ = ["CompiledExecutor", "Started", "issue", "NumbersAt", "take", "add_at"]


class NumbersAt:
    """A program's numbers: as they are (a plain program, ``env`` None), or a template's
    polynomials evaluated at ``env`` -- SymInts under ``torch.compile``, where a program
    holding them cannot be built (Dynamo specialises a SymInt stored in an object)."""

    def __init__(self, env: dict | None = None) -> None:
        self.env = env

    def __call__(self, x: Any) -> Any:
        return x.eval(self.env) if self.env is not None and isinstance(x, Expr) else x

    def all(self, xs: tuple) -> Any:
        env = self.env
        if env is None:
            return xs
        return tuple([x.eval(env) if isinstance(x, Expr) else x for x in xs])

    def index(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        env = self.env
        if env is None:
            return index
        return tuple([slice(s.start.eval(env) if isinstance(s.start, Expr) else s.start,
                            s.stop.eval(env) if isinstance(s.stop, Expr) else s.stop)
                      for s in index])


AS_WRITTEN = NumbersAt()


def _build(entries: list, node: Node, num: NumbersAt, inputs: tuple = ()) -> torch.Tensor:
    if isinstance(node, View):
        t = entries[node.entry]
        return t if node.index is None else t[num.index(node.index)]
    if isinstance(node, Cat):
        return torch.cat([_build(entries, part, num, inputs) for part in node.parts], node.dim)
    if isinstance(node, Take):
        return take(_build(entries, node.node, num, inputs), inputs[node.index])
    if isinstance(node, AddAt):
        return add_at(_build(entries, node.node, num, inputs), num.all(node.shape),
                      inputs[node.index])
    out = entries[0].new_empty(num.all(node.shape))
    for entry, src, dst in node.writes:
        out[num.index(dst)] = entries[entry][num.index(src)]
    return out


def _none(t: torch.Tensor) -> bool:
    """Whether ``t`` has no rows, known while tracing (a static 0)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return guard_or_false(t.shape[0] == 0)


def take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A :class:`Take`: ``rows`` at ``index`` (interpreted and straight-line programs alike)."""
    # (no rows: its index is empty too, and a compiler cannot index no rows)
    return rows if _none(rows) else rows.index_select(0, index)


def add_at(rows: torch.Tensor, shape: tuple, index: torch.Tensor) -> torch.Tensor:
    """An :class:`AddAt`: a zero tensor of ``shape`` with ``rows`` added at ``index``."""
    out = rows.new_zeros(shape)
    # nothing to add to (a rank off that side): no op a compiler sees
    return out if _none(out) else out.index_add_(0, index, rows)


def _pad(entries: list, item, num: NumbersAt) -> torch.Tensor:
    return entries[0].new_zeros(num(item))


def _pack(entries: list, op: Op, wire, num: NumbersAt, inputs: tuple = ()) -> torch.Tensor:
    items = op.pack
    if len(items) == 1 and not isinstance(items[0], int | Expr):
        flat = _build(entries, items[0], num, inputs).reshape(-1)
    elif op.stack:
        flat = torch.stack([_build(entries, item, num) for item in items
                            if not isinstance(item, int | Expr)]).view(-1)
    elif items:
        flat = torch.cat([_pad(entries, item, num) if isinstance(item, int | Expr)
                          else _build(entries, item, num).reshape(-1) for item in items])
    else:
        flat = entries[0].new_zeros(0)
    return flat.to(wire) if wire is not None else flat


def issue(comm: Comm, op: Op, flat: torch.Tensor, num: NumbersAt = AS_WRITTEN,
          site: str = "") -> torch.Tensor:
    """Run ``op``'s collective on its packed input through ``comm`` (whose table,
    keyed by the op's kind, says how)."""
    return comm.collective(op.kind, flat, op.ranks, num.all(op.out_splits),
                           num.all(op.in_splits), site)


def _unpacked(flat: torch.Tensor, op: Op, num: NumbersAt) -> list:
    out: list = []
    for u in op.unpack:
        if u is None:
            out.append(None)
            continue
        offset, shape = num(u[0]), num.all(u[1])
        n = 1
        for k in shape:
            n = n * k
        out.append(flat[offset:offset + n].view(shape))
    return out


class CompiledExecutor:
    """Runs programs for one rank through ``comm``; ``tensors`` is always ``(local,)``.

    ``local`` is the rank's src piece, or an empty placeholder on ranks holding none;
    the result is the dst piece, or an empty tensor where it holds none. With
    ``comm_dtype`` data moves in that dtype and comes back in the caller's (``wires``:
    a dtype per direction, as :meth:`.options.Options.wires` gives them). A bridge's
    executor has a comm per direction (``backward_comm``: its backward's own groups, so
    a forward can never pair with a backward) and names its collectives (``name``, see
    :mod:`.timeouts`).
    """

    def __init__(self, comm: Comm, comm_dtype: torch.dtype | None = None,
                 backward_comm: Comm | None = None, name: str = "",
                 wires: dict | None = None) -> None:
        self.comm = comm
        self.comms = {"forward": comm, "backward": backward_comm or comm}
        self.comm_dtype = comm_dtype
        # the dtype each direction moves data in (None: the caller's; Options.wires)
        self.wires = wires or {"forward": comm_dtype, "backward": comm_dtype}
        self.name = name
        self._named: dict[tuple[int, str], tuple[Program, list[str]]] = {}  # see _sites
        # checked mode's check of a backward call: (cotangent, program, numbers) -> ok
        self.check: Callable[..., bool] | None = None

    def _sites(self, program: Program, direction: str) -> list[str]:
        """The names of ``program``'s collectives for :mod:`.timeouts` (an eager run's:
        built once per program)."""
        if not self.name:
            return [""] * len(program.ops)
        key = (id(program), direction)
        sites = self._named.get(key)
        if sites is None or sites[0] is not program:
            if len(self._named) >= 64:  # (programs made per call are not kept forever)
                self._named.clear()
            sites = self._named[key] = (program, [
                timeouts.at(self.name, direction, i, op.ranks_text)
                for i, op in enumerate(program.ops)])
        return sites[1]

    def run(self, program: Program, tensors: tuple[torch.Tensor, ...], env: dict | None = None,
            inputs: tuple[torch.Tensor, ...] = (), *, direction: str = "forward"
            ) -> tuple[torch.Tensor, ...]:
        """``program`` on ``(local,)``; a template program's numbers at ``env``; a row
        program's index vectors are ``inputs``; ``direction`` picks the comm."""
        if torch.compiler.is_compiling():
            return self._traced(program, tensors, env, inputs, direction)
        return self.start(program, tensors, env, inputs, direction=direction).finish()

    def _traced(self, program: Program, tensors: tuple[torch.Tensor, ...], env: dict | None,
                inputs: tuple[torch.Tensor, ...], direction: str) -> tuple[torch.Tensor, ...]:
        """:meth:`run` under ``torch.compile``: the program's straight-line function
        where it has one (:mod:`.straight`: far fewer instructions for Dynamo to trace),
        else the same steps as :meth:`start` and :meth:`Started.finish` in one line (the
        compiler places each wait; no run objects for Dynamo to trace)."""
        (local,) = tensors
        if self.check is not None and direction == "backward" and not self.check(
                local, program, AS_WRITTEN if env is None else NumbersAt(env)):
            return (local.new_zeros((0,) * program.out_ndim),)  # (raises when it runs)
        comm, wire = self.comms[direction], self.wires[direction]
        straight = program.straight
        if straight is not None:
            return (straight.run(local, env, inputs, comm, self.name, direction, wire),)
        num = AS_WRITTEN if env is None else NumbersAt(env)
        entries = [_canonical(local, program, num)]
        for i, op in enumerate(program.ops):
            site = timeouts.at(self.name, direction, i, op.ranks_text) if self.name else ""
            flat = issue(comm, op, _pack(entries, op, wire, num, inputs), num, site)
            entries += _unpacked(flat if wire is None else flat.to(local.dtype), op, num)
        return (_output(entries, program, num, inputs, local),)

    def start(self, program: Program, tensors: tuple[torch.Tensor, ...],
              env: dict | None = None, inputs: tuple[torch.Tensor, ...] = (), *,
              direction: str = "forward") -> Started:
        """:meth:`run` up to its first collective, which is posted and not waited for
        (:meth:`Started.finish` waits for it and runs the rest): what lets a transfer
        overlap the caller's compute."""
        (local,) = tensors
        num = AS_WRITTEN if env is None else NumbersAt(env)
        if self.check is not None and direction == "backward" \
                and not self.check(local, program, num):
            return Started.done(local.new_zeros((0,) * program.out_ndim))  # (raises later)
        run = Started(self, program, local, [_canonical(local, program, num)], num, inputs,
                      direction)
        if program.ops:
            run.post(0)
        return run


def _canonical(local: torch.Tensor, program: Program, num: NumbersAt) -> torch.Tensor:
    """The src piece viewed with one axis per dim, in canonical order."""
    if program.src_expand is not None:
        local = local.reshape(num.all(program.src_expand))
    if program.src_perm is not None:
        local = local.permute(program.src_perm)
    return local


def _output(entries: list, program: Program, num: NumbersAt, inputs: tuple,
            local: torch.Tensor) -> torch.Tensor:
    """The dst piece from a program's entries (an empty tensor where it holds none)."""
    if program.out is None:
        return local.new_empty((0,) * program.out_ndim)
    out = _build(entries, program.out, num, inputs)
    if program.out_clone and torch.compiler.is_compiling():
        # (eagerly a view of the input is returned as it is: a custom Function may
        # return one; a traced graph's output must not alias its input)
        out = out.clone()
    if program.out_perm is not None:
        out = out.permute(program.out_perm)
    if program.out_local is not None:
        out = out.reshape(num.all(program.out_local))
    return out.contiguous()


class Started:
    """A program run up to a posted collective (:meth:`CompiledExecutor.start`)."""

    def __init__(self, executor: CompiledExecutor, program: Program | None,
                 local: torch.Tensor, entries: list, num: NumbersAt, inputs: tuple,
                 direction: str) -> None:
        self.executor, self.program, self.local = executor, program, local
        self.entries, self.num, self.inputs, self.direction = entries, num, inputs, direction
        self.pending: Any = None  # (op index, handle) of the posted collective
        self.result: tuple[torch.Tensor, ...] | None = None

    @staticmethod
    def done(out: torch.Tensor) -> Started:
        run = Started(None, None, out, [], AS_WRITTEN, (), "")  # type: ignore[arg-type]
        run.result = (out,)
        return run

    def post(self, i: int) -> None:
        ex = self.executor
        program = self.program
        assert program is not None
        op = program.ops[i]
        site = ex._sites(program, self.direction)[i]
        flat = _pack(self.entries, op, ex.wires[self.direction], self.num, self.inputs)
        self.pending = (i, ex.comms[self.direction].start(
            op.kind, flat, op.ranks, self.num.all(op.out_splits),
            self.num.all(op.in_splits), site))

    def _take(self) -> int:
        i, handle = self.pending
        self.pending = None
        flat = handle.wait()
        if self.executor.wires[self.direction] is not None:
            flat = flat.to(self.local.dtype)
        assert self.program is not None
        self.entries += _unpacked(flat, self.program.ops[i], self.num)
        return i

    def finish(self) -> tuple[torch.Tensor, ...]:
        """Wait for the posted collective, run the rest; the dst piece (once)."""
        if self.result is not None:
            return self.result
        program, num, entries, local = self.program, self.num, self.entries, self.local
        assert program is not None
        if self.pending is not None:
            i = self._take()
            for j in range(i + 1, len(program.ops)):
                self.post(j)
                self._take()
        self.result = (_output(entries, program, num, self.inputs, local),)
        return self.result
