"""A lowered program written once as a straight-line Python function: what a compiled
call runs.

Dynamo traces every Python instruction a compiled call runs, on every rank, at every
compile of every step that calls a bridge, and with dynamic sizes each instruction
costs symbolic-shape work too. Interpreting a program (:mod:`.executor`) steps it
through a loop over the program's ops and nodes, an ``isinstance`` per node and the
evaluation of every number. Here a program is written once as Python source -- its
tensor ops and collectives in order, its numbers as literals or, in a template program,
as expressions of the size variables, each distinct one computed once -- and compiled
with :func:`compile`, so a trace steps through the program's own ops and little else.
The function computes what the executor's interpretation computes, op for op.

:func:`attach` writes a program's function onto it (``program.straight``), where a
compiled call finds it through its bridge: built before any trace, when the bridge
lowers its programs. A program without one (made while tracing, for sizes a template
does not serve) is interpreted as before.
"""

from __future__ import annotations

from typing import Any

import torch

from mimo_fx.symbolic import Expr

from .executor import add_at, take
from .lowering import AddAt, Cat, Node, Op, Program, Scatter, Take, View
from .timeouts import at

__all__ = ["Straight", "attach", "source"]


class Straight:
    """A program's function, ``run``: held by a plain object (Dynamo traces a call of a
    function read from a frozen dataclass's field as a method call it cannot trace)."""

    __slots__ = ("run",)

    def __init__(self, run) -> None:
        self.run = run


def attach(*programs: Program | None) -> None:
    """Write each program's straight-line function onto it (``program.straight.run``)."""
    for program in programs:
        if program is not None and program.straight is None:
            object.__setattr__(program, "straight", Straight(_function(program)))


class _Writer:
    """The source of one program's function: statements in order, and the names of its
    numbers (a size variable read once, a polynomial computed once)."""

    def __init__(self) -> None:
        self.head: list[str] = []   # variables and polynomials, computed first
        self.body: list[str] = []
        self.names: dict[Any, str] = {}
        self.consts: dict[str, Any] = {}
        self.temps = 0

    def num(self, x: Any) -> str:
        if isinstance(x, int):
            return repr(x)
        if not isinstance(x, Expr):
            raise TypeError(f"a program number of type {type(x).__name__}: {x!r}")
        name = self.names.get(x)
        if name is None:
            terms = []
            for mono, coef in x.terms:
                factors = [self._var(v) for v in mono]
                terms.append("*".join(factors if coef == 1 and factors
                                      else [repr(coef), *factors]))
            if len(terms) == 1 and terms[0] in self.names.values():
                name = self.names[x] = terms[0]  # (a variable itself)
            else:
                name = self.names[x] = f"n{len(self.names)}"
                self.head.append(f"{name} = {' + '.join(terms)}")
        return name

    def _var(self, var: tuple) -> str:
        key = ("var", var)
        name = self.names.get(key)
        if name is None:
            name = self.names[key] = f"v{len(self.names)}"
            self.head.append(f"{name} = env[{var!r}]")
        return name

    def nums(self, xs: tuple) -> str:
        return "(" + "".join(f"{self.num(x)}, " for x in xs) + ")"

    def index(self, index: tuple[slice, ...]) -> str:
        parts = []
        for s in index:
            lo = "" if s.start is None else self.num(s.start)
            hi = "" if s.stop is None else self.num(s.stop)
            parts.append(f"{lo}:{hi}")
        return "[" + ", ".join(parts) + ("," if len(parts) == 1 else "") + "]"

    def const(self, value: Any) -> str:
        name = f"K{len(self.consts)}"
        self.consts[name] = value
        return name

    def temp(self) -> str:
        self.temps += 1
        return f"t{self.temps}"

    def node(self, node: Node) -> str:
        """An expression of ``node``'s tensor (statements it needs first go to body)."""
        if isinstance(node, View):
            return f"e{node.entry}" + ("" if node.index is None else self.index(node.index))
        if isinstance(node, Cat):
            parts = ", ".join(self.node(p) for p in node.parts)
            return f"torch.cat([{parts}], {node.dim})"
        if isinstance(node, Take):
            return f"take({self.node(node.node)}, inputs[{node.index}])"
        if isinstance(node, AddAt):
            return f"add_at({self.node(node.node)}, {self.nums(node.shape)}, " \
                   f"inputs[{node.index}])"
        assert isinstance(node, Scatter)
        out = self.temp()
        self.body.append(f"{out} = e0.new_empty({self.nums(node.shape)})")
        for entry, src, dst in node.writes:
            self.body.append(f"{out}{self.index(dst)} = e{entry}{self.index(src)}")
        return out

    def pack(self, op: Op) -> str:
        items = op.pack
        if len(items) == 1 and not isinstance(items[0], int | Expr):
            return f"{self.node(items[0])}.reshape(-1)"
        if op.stack:
            parts = ", ".join(self.node(it) for it in items if not isinstance(it, int | Expr))
            return f"torch.stack([{parts}]).view(-1)"
        if items:
            parts = ", ".join(f"e0.new_zeros({self.num(it)})" if isinstance(it, int | Expr)
                              else f"{self.node(it)}.reshape(-1)" for it in items)
            return f"torch.cat([{parts}])"
        return "e0.new_zeros(0)"


def source(program: Program) -> tuple[str, dict[str, Any]]:
    """The source of ``program``'s function ``run(local, env, inputs, comm, name,
    direction, wire)`` and the constants it reads: ``local`` this rank's src piece,
    ``env`` a template's size variables (None for a plain program), ``inputs`` a row
    program's index vectors, ``comm`` the direction's comm, ``name`` and ``direction``
    its collectives' sites' (:func:`.timeouts.at`; empty name: unnamed), ``wire`` the
    dtype data moves in (None: its own)."""
    w = _Writer()
    w.body.append("e0 = local")
    if program.src_expand is not None:
        w.body.append(f"e0 = e0.reshape({w.nums(program.src_expand)})")
    if program.src_perm is not None:
        w.body.append(f"e0 = e0.permute({program.src_perm!r})")
    entries = 1
    for i, op in enumerate(program.ops):
        w.body.append(f"flat = {w.pack(op)}")
        w.body.append("if wire is not None:\n        flat = flat.to(wire)")
        site = f'at(name, direction, {i}, "{op.ranks_text}") if name else ""'
        w.body.append(f"flat = comm.collective({w.const(op.kind)}, flat, {op.ranks!r}, "
                      f"{w.nums(op.out_splits)}, {w.nums(op.in_splits)}, {site})")
        w.body.append("if wire is not None:\n        flat = flat.to(local.dtype)")
        for u in op.unpack:
            if u is not None:
                offset, shape = u
                n: Any = 1
                for k in shape:
                    n = n * k
                w.body.append(f"e{entries} = flat[{w.num(offset)}:{w.num(offset + n)}]"
                              f".view({w.nums(shape)})")
            entries += 1
    w.body.extend(_output(w, program))
    lines = ["def run(local, env, inputs, comm, name, direction, wire):"]
    lines += [f"    {s}" for s in w.head + w.body]
    return "\n".join(lines) + "\n", w.consts


def _output(w: _Writer, program: Program) -> list[str]:
    if program.out is None:
        return [f"return local.new_empty({(0,) * program.out_ndim!r})"]
    out = [f"out = {w.node(program.out)}"]
    if program.out_clone:  # (a traced graph's output must not alias its input)
        out.append("out = out.clone()")
    if program.out_perm is not None:
        out.append(f"out = out.permute({program.out_perm!r})")
    if program.out_local is not None:
        out.append(f"out = out.reshape({w.nums(program.out_local)})")
    return [*out, "return out.contiguous()"]


def _function(program: Program):
    text, consts = source(program)
    scope: dict[str, Any] = {"torch": torch, "take": take, "add_at": add_at, "at": at,
                             **consts}
    exec(compile(text, "<mimo_fx program>", "exec"), scope)
    return scope["run"]
