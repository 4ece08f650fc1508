"""Sizes as polynomials: how one lowered program serves every size of a regime.

A bridge whose sizes change lowers its plan once, at *template* sizes, with every
position written as a polynomial in a few variables: ``("u", d)``, the number of
granules of an even dim ``d`` (its size is ``granule * u``), and ``("c", d, i)``, the
``i``-th count of a ragged dim (its shard boundaries are prefix sums of counts). A
program's slices, shapes and split sizes are then :class:`Expr` s that a call evaluates
at its own sizes -- plain ints eagerly, ``SymInt`` s under ``torch.compile`` -- so the
program's *structure* (which collectives, which blocks) is fixed by the layouts while
its numbers follow the sizes.

Lowering decides with these polynomials only what holds for *every* value of the
variables (``u >= 1``, ``c >= 0``): equality is identity of polynomials, and an order
is known only when the difference has a provable sign (:func:`known_ge`); ``<`` orders
positions that may coincide for some sizes (a ragged shard can be empty). A question
the variables leave open raises :class:`Undecided`; the caller then takes the choice
that is right either way, or gives up the template.

>>> u = Expr.var(("u", "s"), hint=4)
>>> c = Expr.var(("c", "t", 0), hint=3)
>>> e = 2 * u * (c + 1) - 2 * u
>>> e, e.hint, e.eval({("u", "s"): 5, ("c", "t", 0): 7})
(2*c[t,0]*u[s], 24, 70)
>>> known_ge(2 * u, u), known_ge(c, 1)
(True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

__all__ = ["Expr", "Undecided", "known_ge", "known_le", "known_eq", "smax", "smin",
           "hint", "evaluate", "Num"]

Var = tuple  # ("u", dim) or ("c", dim, index)
Mono = tuple  # sorted variables, with repetition
Num = Union[int, "Expr"]


class Undecided(Exception):
    """A comparison whose answer depends on the values of the size variables."""


def _lower(var: Var) -> int:
    """The least value a variable takes: a unit count is at least 1, a count at least 0."""
    return 1 if var[0] == "u" else 0


class Expr:
    """A polynomial with integer coefficients over size variables, and its value at the
    template (``hint``). Constants are plain ints: an Expr always has a variable."""

    __slots__ = ("terms", "hint", "_hash", "_at")

    def __init__(self, terms: dict, hint: int) -> None:
        self.terms: tuple = tuple(sorted(terms.items()))
        self.hint = hint
        self._hash = hash(self.terms)
        self._at: Any = None  # its value as one Python expression (see prime)

    @staticmethod
    def var(var: Var, hint: int) -> Expr:
        return Expr({(var,): 1}, hint)

    # -- construction --------------------------------------------------------------------
    @staticmethod
    def _make(terms: dict, hint: int) -> Num:
        terms = {m: c for m, c in terms.items() if c}
        if not terms:
            return 0
        if len(terms) == 1 and () in terms:
            return terms[()]
        return Expr(terms, hint)

    def _dict(self) -> dict:
        return dict(self.terms)

    def __add__(self, other: Num) -> Num:
        if isinstance(other, int):
            if other == 0:
                return self
            terms = self._dict()
            terms[()] = terms.get((), 0) + other
            return Expr._make(terms, self.hint + other)
        if not isinstance(other, Expr):
            return NotImplemented
        terms = self._dict()
        for m, c in other.terms:
            terms[m] = terms.get(m, 0) + c
        return Expr._make(terms, self.hint + other.hint)

    __radd__ = __add__

    def __neg__(self) -> Num:
        return Expr._make({m: -c for m, c in self.terms}, -self.hint)

    def __sub__(self, other: Num) -> Num:
        if isinstance(other, int):
            return self + (-other)
        if not isinstance(other, Expr):
            return NotImplemented
        return self + (-other)

    def __rsub__(self, other: Num) -> Num:
        return (-self) + other

    def __mul__(self, other: Num) -> Num:
        if isinstance(other, int):
            if other == 1:
                return self
            return Expr._make({m: c * other for m, c in self.terms}, self.hint * other)
        if not isinstance(other, Expr):
            return NotImplemented
        terms: dict = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                m = tuple(sorted(m1 + m2))
                terms[m] = terms.get(m, 0) + c1 * c2
        return Expr._make(terms, self.hint * other.hint)

    __rmul__ = __mul__

    # -- comparison ----------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Expr) and self.terms == other.terms

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return self._hash

    def __lt__(self, other: Num) -> bool:
        return _order(self, other, strict=True)

    def __le__(self, other: Num) -> bool:
        return _order(self, other, strict=False)

    def __gt__(self, other: Num) -> bool:
        return _order(other, self, strict=True)

    def __ge__(self, other: Num) -> bool:
        return _order(other, self, strict=False)

    def __bool__(self) -> bool:
        raise TypeError(f"the symbolic size {self} has no truth value; compare it with "
                        f"known_ge / known_eq")

    # -- values --------------------------------------------------------------------------
    def eval(self, env: Mapping) -> Any:
        """The value at ``env`` (``{variable: int or SymInt}``)."""
        if self._at is not None:
            return self._at(env)
        total: Any = 0
        for mono, coef in self.terms:
            term: Any = coef
            for var in mono:
                term = term * env[var]
            total = total + term
        return total

    def __repr__(self) -> str:
        parts = []
        for mono, coef in self.terms:
            names = "*".join(_var_name(v) for v in mono)
            if not names:
                parts.append(str(coef))
            elif coef == 1:
                parts.append(names)
            elif coef == -1:
                parts.append("-" + names)
            else:
                parts.append(f"{coef}*{names}")
        return " + ".join(parts).replace("+ -", "- ")


    def prime(self) -> None:
        """Make :meth:`eval` one compiled Python expression (the same products and sums,
        in the same order): what a traced call evaluates, where Dynamo would otherwise
        trace the loop over the terms at every number of a program."""
        if self._at is None:
            terms = " + ".join("*".join([repr(coef), *(f"env[{var!r}]" for var in mono)])
                               for mono, coef in self.terms)
            self._at = eval(f"lambda env: {terms}")  # (variables are tuples of str, int)


def _var_name(var: Var) -> str:
    return f"{var[0]}[{','.join(map(str, var[1:]))}]"


def _lower_bound(x: Num) -> float:
    """The least value ``x`` can take over every value of its variables."""
    if isinstance(x, int):
        return x
    total = 0.0
    for mono, coef in x.terms:
        if not mono:
            total += coef
            continue
        if coef < 0:
            return float("-inf")
        low = 1
        for var in mono:
            low *= _lower(var)
        total += coef * low
    return total


def known_ge(a: Num, b: Num) -> bool:
    """Whether ``a >= b`` for every value of the variables."""
    if isinstance(a, int) and isinstance(b, int):
        return a >= b
    return _lower_bound(a - b) >= 0


def known_le(a: Num, b: Num) -> bool:
    return known_ge(b, a)


def known_eq(a: Num, b: Num) -> bool:
    return a == b


def _order(a: Num, b: Num, strict: bool) -> bool:
    """``a < b`` (or ``<=``) as an order of positions: true when ``a`` comes first for
    every size (they may coincide for some: ``c[t,0] < c[t,0] + c[t,1]``), false when
    ``b`` does; sorting, ``max`` and overlap tests need nothing stronger. Emptiness
    needs more: ask :func:`known_ge` whether ``lo >= hi`` for every size."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b if strict else a <= b
    if a == b:
        return not strict
    if known_ge(b, a):
        return True
    if known_ge(a, b):
        return False
    raise Undecided(f"the order of {a} and {b} depends on the sizes")


def smax(a: Num, b: Num) -> Num:
    """The larger of ``a`` and ``b`` when that is the same one for every size."""
    if known_ge(a, b):
        return a
    if known_ge(b, a):
        return b
    raise Undecided(f"max({a}, {b}) depends on the sizes")


def smin(a: Num, b: Num) -> Num:
    """The smaller of ``a`` and ``b`` when that is the same one for every size."""
    return b if smax(a, b) is a else a


def hint(x: Num) -> int:
    """The value at the template sizes."""
    return x if isinstance(x, int) else x.hint


def evaluate(x: Num, env: Mapping) -> Any:
    return x if isinstance(x, int) else x.eval(env)
