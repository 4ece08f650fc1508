"""Call validation: a caller's mistake is an error, never a hang or garbage.

Every bridge call first inspects its tensor locally -- None or a tensor, shape, dtype,
device -- against what the bridge expects of this rank, before any collective
(:class:`Guard`):

- unchecked, a mistake raises :class:`MimoFxError` on the offending rank at once (its
  peers then fail in their collective when it leaves, instead of pairing wrong data);
- checked (``checked=True``), every rank all-gathers a small header -- a marker, the
  bridge's fingerprint (layouts, sizes, dtypes, options), what its inspection found, its
  tensor's dtype, device and shape -- on a process group of its own, and every rank
  raises the same error naming every offending rank. The check runs on its own group,
  with its own timeout, so a rank that calls the bridge unchecked, or calls another
  bridge, cannot pair its data with the check: the checked ranks time out with an error.

Under ``torch.compile`` the same errors are raised with the same text: what the trace
knows (None, dtype, device, number of dims, shapes it can decide) while tracing, as a
:class:`TracedError` (a :class:`MimoFxError` that Dynamo passes through unwrapped, its
text first); what only the run knows (a learned size) by :func:`runtime_check`, an op
the compiler keeps in order, which raises the eager error when the graph runs, before
any collective after it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch._dynamo.exc import UserError, UserErrorType

from mimo_fx.errors import MimoFxError
from mimo_fx.local import int_tensor

from .live import named
from .ops import define

__all__ = ["Expect", "inspect", "problem_text", "Header", "fingerprint", "MAGIC", "OK",
           "HEADER_LEN", "dtype_code", "calls_differ", "Guard", "TracedError",
           "runtime_check", "raise_now", "int_tensor"]

OK, NONE_HOLDS, NOT_EMPTY, NOT_TENSOR, SHAPE, DTYPE, DEVICE, FAILED = range(8)
MAGIC = 0x6D696D6F  # "mimo": a header, not data
MAGIC_SIZES = 0x6D696D73  # "mims": a row of the size gather (the same width)
MAX_DIMS = 8        # shape entries carried in a header (for messages)
# marker, fingerprint, code, dtype, device, ndim, dims; then the call's state: its side
# (0 forward, 1 backward), the bridge's forward and backward calls so far on this rank,
# whether it runs a backward, its batch (a row bridge's plan digest)
HEADER_LEN = 6 + MAX_DIMS + 5
SIDES = ("src", "dst")  # a header's side: the forward checks src, the backward dst


@dataclass(frozen=True)
class Expect:
    """What a rank's tensor must be for one side of a bridge.

    ``shape`` is its local shape, None where it holds no piece (it passes None or an
    empty tensor); ``what`` names the side for messages (``"src (dp b) h"``).
    """

    shape: tuple[int, ...] | None
    dtype: torch.dtype
    device: torch.device
    what: str


def inspect(x, expect: Expect) -> int:
    """The first problem with ``x`` (a code), or ``OK``."""
    if x is None:
        return NONE_HOLDS if expect.shape is not None else OK
    if not isinstance(x, torch.Tensor):
        return NOT_TENSOR
    if expect.shape is None:
        if x.numel():
            return NOT_EMPTY
    elif tuple(x.shape) != expect.shape:
        return SHAPE
    if x.dtype != expect.dtype:
        return DTYPE
    if x.device.type != expect.device.type:
        return DEVICE
    return OK


def problem_text(code: int, rank: int, expect: Expect, shape=None, dtype=None,
                 device=None) -> str:
    """What went wrong on ``rank`` and how to fix it."""
    if code == FAILED:
        return (f"rank {rank} could not make this call: its sizes or batch do not fit the "
                f"layouts (its own error says why)")
    if code == NONE_HOLDS:
        return (f"rank {rank} holds a piece of {expect.what} (local shape {expect.shape}) "
                f"but passed None; pass its piece")
    if code == NOT_EMPTY:
        return (f"rank {rank} holds no piece of {expect.what} but passed a tensor of shape "
                f"{shape}; pass None (or an empty tensor, inside torch.func)")
    if code == NOT_TENSOR:
        return f"rank {rank} passed a {shape or 'non-tensor'}, not a tensor or None"
    if code == SHAPE:
        return (f"rank {rank}: local tensor has shape {shape} but {expect.what} gives it "
                f"shape {expect.shape}; check the layout and the tensor. A tensor of "
                f"other sizes needs a bridge built for those sizes")
    if code == DTYPE:
        return (f"rank {rank}: tensor dtype {dtype} but the bridge moves {expect.dtype}; "
                f"build it with dtype={dtype} or cast the tensor")
    if code == DEVICE:
        return (f"rank {rank}: tensor on {device} but the bridge moves data on "
                f"{expect.device.type}; build it with device= that device, or move the "
                f"tensor")
    raise AssertionError(code)


def fingerprint(*parts) -> int:
    """A 31-bit digest of what makes two ranks' calls one collective call."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def dtype_code(dtype) -> int:
    """A small number naming ``dtype`` (a table lookup, so it traces)."""
    return _DTYPE_CODES.get(dtype, len(_DTYPES) + 1)


_DEVICES = MappingProxyType({"cpu": 1, "cuda": 2, "meta": 3, "xpu": 4, "mps": 5})


def _device_code(device) -> int:
    return _DEVICES.get(getattr(device, "type", device), len(_DEVICES) + 1)


class Header:
    """One rank's check header, and every rank's decoded back into messages."""

    @staticmethod
    def encode(x, code: int, fingerprint: int, state: tuple = (0, 0, 0, 0, 0)) -> list[int]:
        """``state``: side, forward and backward calls so far, grad, batch."""
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else ()
        dtype = dtype_code(x.dtype) if isinstance(x, torch.Tensor) else 0
        device = _device_code(x.device) if isinstance(x, torch.Tensor) else 0
        dims = list(shape[:MAX_DIMS]) + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))
        return [MAGIC, fingerprint, code, dtype, device, len(shape), *dims, *state]

    @staticmethod
    def problems(rows: list[list[int]], ranks: tuple[int, ...], fingerprint: int,
                 expects: dict[int, Expect]) -> list[str]:
        """Messages for every rank whose header shows a problem (the same on every rank:
        ranks that disagree on the call itself are named in groups, not against this
        rank's own call)."""
        out = []
        dtypes = {dtype_code(d): d for d in _DTYPES}
        split = _desync(rows, ranks) or calls_differ(rows, ranks,
                                                     "layouts, sizes, dtypes or options")
        if split:
            out.append(split)
        for rank, row in zip(ranks, rows):
            magic, theirs, code, dtype, device, ndim, *dims = row[:6 + MAX_DIMS]
            if magic == MAGIC_SIZES:
                out.append(f"rank {rank} is learning this call's sizes instead (it gave "
                           f"fewer sizes than the others, or is a call behind or ahead)")
            elif magic != MAGIC:
                out.append(f"rank {rank} sent no check header: it called another "
                           f"collective, or this bridge with checked=False")
            elif split:
                continue  # what a rank expects depends on a call they do not share
            elif code != OK:
                expect = expects[rank]
                shape = tuple(dims[:min(ndim, MAX_DIMS)])
                out.append(problem_text(code, rank, expect, shape, dtypes.get(dtype, "?"),
                                        "another device"))
        if not out:
            late = _differ_late(rows, ranks)
            out += [late] if late else []
        return out


def _ranks_by(rows, ranks, column: int) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for rank, row in zip(ranks, rows):
        if row[0] == MAGIC:
            groups.setdefault(row[column], []).append(rank)
    return groups


def _named(ranks: list[int]) -> str:
    return f"ranks {ranks}" if len(ranks) > 1 else f"rank {ranks[0]}"


def _differ_late(rows, ranks: tuple[int, ...]) -> str | None:
    """What else makes good calls not one call: a backward some ranks will run and
    others not (ranks passing None follow the others), another batch."""
    state = 6 + MAX_DIMS
    grads = _ranks_by([r for r in rows if r[3]], [k for k, r in zip(ranks, rows) if r[3]],
                      state + 3)  # (ranks that passed a tensor: a dtype code)
    if len(grads) > 1:
        return (f"autograd differs by rank: {_named(grads.get(1, []))} will run this "
                f"call's backward, {_named(grads.get(0, []))} will not (it calls the bridge "
                f"under torch.no_grad()); the ranks would wait for each other in the "
                f"backward")
    batches = _ranks_by(rows, ranks, state + 4)
    if len(batches) > 1:
        ordered = sorted(batches.values(), key=lambda g: (-len(g), g[0]))
        return ("the ranks passed different batches (packed layouts or row sizes): one on "
                + ", another on ".join(_named(g) for g in ordered)
                + "; every rank passes the same batch")
    return None


def _desync(rows, ranks: tuple[int, ...]) -> str | None:
    """What makes the ranks' calls not one call: a rank in another direction, a call or
    backward behind."""
    state = 6 + MAX_DIMS
    sides = _ranks_by(rows, ranks, state)
    if len(sides) > 1:
        fwd, bwd = sides.get(0, []), sides.get(1, [])
        return (f"{_named(bwd)} checked the backward of a call while {_named(fwd)} checked "
                f"a forward: a rank skipped a backward (every rank runs the backward of "
                f"every call, source-only ranks included) or a call")
    for column, what in ((state + 1, "forward calls"), (state + 2, "backward calls")):
        counts = _ranks_by(rows, ranks, column)
        if len(counts) > 1:
            return ("the ranks are at different calls of this bridge: " + ", ".join(
                f"{_named(r)} made {n} {what} before this one"
                for n, r in sorted(counts.items())) + "; a rank skipped a call or a "
                "backward")
    return None


def calls_differ(rows, ranks: tuple[int, ...], what: str, magic: int = MAGIC) -> str | None:
    """One message naming the groups of ranks whose rows (marked ``magic``) carry
    different call fingerprints (column 1), the largest group first; None if they all
    agree."""
    groups: dict[int, list[int]] = {}
    for rank, row in zip(ranks, rows):
        if row[0] == magic:
            groups.setdefault(row[1], []).append(rank)
    if len(groups) < 2:
        return None
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    names = [f"ranks {g}" if len(g) > 1 else f"rank {g[0]}" for g in ordered]
    return (f"the ranks made different calls ({what} differ): one on {names[0]}, "
            + ", ".join(f"another on {n}" for n in names[1:])
            + "; every rank must make the same call")


_DTYPES = tuple(getattr(torch, n) for n in ("float64", "float32", "float16", "bfloat16",
                                            "int64", "int32", "int16", "int8", "uint8",
                                            "bool", "complex64", "complex128"))
_DTYPE_CODES = MappingProxyType({d: i + 1 for i, d in enumerate(_DTYPES)})


# -- the same errors under torch.compile -------------------------------------------------
class TracedError(MimoFxError, UserError):
    """A :class:`MimoFxError` found while ``torch.compile`` traces a call: Dynamo raises
    user errors of this kind as they are (it appends where in the user's code)."""

    def __init__(self, message: str) -> None:
        UserError.__init__(self, UserErrorType.INVALID_INPUT, message)


@torch.compiler.assume_constant_result
def _raise_traced(message: str) -> int:
    # run (not traced) while Dynamo traces: the way out of a trace that keeps the type
    raise TracedError(message)


def raise_now(message: str) -> None:
    """Raise ``MimoFxError(message)``: eagerly as it is, while tracing as a
    :class:`TracedError` (the same text first, catchable as :class:`MimoFxError`).
    ``message`` must be made without tracing planning code (a constant string)."""
    if torch.compiler.is_compiling():
        _raise_traced(message)
    raise MimoFxError(message)


def raise_formatted(message: str, *values) -> None:
    """Raise ``MimoFxError(message.format(*values))`` for values a call gave: eagerly as
    it is; while Dynamo traces, made at trace time from the values' example values (the
    traced code cannot format a size Dynamo made symbolic) and raised as a
    :class:`TracedError`."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(_format_traced)  # reads this frame's locals
    raise MimoFxError(message.format(*values))


def _format_traced(ctx) -> None:
    message = ctx.get_local("message").as_python_constant()
    raise TracedError(message.format(*_example(ctx.get_local("values"))))


def _guard(bridge: str) -> Guard:
    """Live bridge ``bridge``'s guard, by name (a string Dynamo never makes symbolic)."""
    return named(bridge).guard


def _fail_traced(key: str, code: int, side: str, x, sizes: tuple) -> None:
    """Raise guard ``key``'s error ``code`` for ``x`` while Dynamo traces: the message is
    made at trace time, from the example values behind ``x`` and ``sizes``, exactly as
    eagerly (the guard's own code cannot be traced: it plans regions)."""
    from torch._dynamo.comptime import comptime

    comptime(_explain)  # reads this frame's locals


def _explain(ctx) -> None:
    key, code, side = (ctx.get_local(n).as_python_constant() for n in ("key", "code", "side"))
    x = _example(ctx.get_local("x"))
    sizes = dict(_example(ctx.get_local("sizes")))
    raise TracedError(_guard(key).problem(code, side, sizes, x))


def _example(var) -> Any:
    """The value behind a traced local: constants as they are, a tensor as a tensor of
    its example shape, a symbolic int as its example value."""
    if var.is_python_constant():
        return var.as_python_constant()
    if var.is_proxy() and issubclass(var.python_type(), torch.Tensor):
        fake = var.as_fake()
        return _Example(tuple(_hint(n) for n in fake.shape), fake.dtype, fake.device)
    inner = var._i_will_not_complain_if_bc_breaks_VariableTracker()
    inner = inner.realize() if hasattr(inner, "realize") else inner
    if hasattr(inner, "sym_num"):
        return _hint(inner.sym_num)
    if hasattr(inner, "items"):
        return tuple(_example(_Wrapped(item)) for item in inner.items)
    return "?"


@dataclass(frozen=True)
class _Example:
    """What a message says of a traced tensor: its example shape, dtype and device."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device


class _Wrapped:
    """A variable tracker answering what :func:`_example` asks of a comptime variable."""

    def __init__(self, inner) -> None:
        self.inner = inner.realize() if hasattr(inner, "realize") else inner

    def is_python_constant(self) -> bool:
        return self.inner.is_python_constant()

    def as_python_constant(self):
        return self.inner.as_python_constant()

    def is_proxy(self) -> bool:
        return False

    def _i_will_not_complain_if_bc_breaks_VariableTracker(self):  # noqa: N802
        return self.inner


def _hint(n) -> Any:
    if isinstance(n, int):
        return n
    node = getattr(n, "node", None)
    return int(node.hint) if node is not None and node.has_hint() else "?"


def _check_call(header, expected, guard: str, full: dict | None = None) -> None:
    _guard(guard).checked_call([int(v) for v in header], [int(v) for v in expected], full)


# (ordered: before the collectives that follow it, in order)
_CHECK_CALL = define("check_call(SymInt[] header, SymInt[] expected, str guard) -> ()",
                     _check_call, lambda header, expected, guard: None, ordered=True)


def _violated(kind: str, values) -> bool:
    if kind == "multiple":  # values[0] a positive multiple of values[1]
        return values[0] % values[1] != 0 or values[0] < values[1]
    if kind == "equal":  # every value the same
        return any(v != values[0] for v in values)
    raise AssertionError(kind)


def _check_impl(values, kind: str, message: str) -> None:
    if _violated(kind, values):
        raise MimoFxError(message.format(*values))


_CHECK = define("check(SymInt[] values, str kind, str message) -> ()", _check_impl,
                lambda values, kind, message: None, ordered=True)


def runtime_check(kind: str, values, message: str) -> None:
    """Raise ``MimoFxError(message.format(*values))`` if ``values`` break the rule
    ``kind`` (``"multiple"``: a positive multiple; ``"equal"``: all equal). Eagerly at
    once; under ``torch.compile`` when the graph runs (an ordered op: it runs before
    the collectives that follow it), with the same type and text."""
    if torch.compiler.is_compiling():
        _CHECK(list(values), kind, message)
    else:
        _check_impl([int(v) for v in values], kind, message)


# -- a bridge's guard --------------------------------------------------------------------
class Guard:
    """The checks of one bridge's calls (see the module docstring).

    ``src``/``dst`` are the bridge's layouts, ``rank`` this rank, ``union`` every rank of
    both grids, ``comm`` the check group's comm (None where no check runs), ``key`` what
    identifies the call across ranks (hashed into the fingerprints), ``context`` the
    prefix of every message, ``name`` the bridge's (see :mod:`.live`).
    """

    def __init__(self, src, dst, rank: int, union: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, checked: bool, comm, key: tuple,
                 context: str, name: str, shape_of) -> None:
        self.shape_of = shape_of  # (side, rank, full) -> local shape (the sizing's)
        self.src, self.dst, self.rank, self.union = src, dst, rank, union
        self.dtype, self.device, self.checked, self.comm = dtype, device, checked, comm
        self.key, self.context = key, context
        self.fingerprints = {"src": fingerprint("forward", *key),
                             "dst": fingerprint("backward", *key)}
        self.name = name  # its bridge's: the key of the compiled checks' ops
        self.calls = {"src": 0, "dst": 0}  # checked forward and backward calls so far
        self._expects: dict = {}  # local shape -> what local() checks a tensor against

    # -- what a rank must pass -----------------------------------------------------------
    def expect(self, side: str, rank: int, full: dict) -> Expect:
        layout = self.src if side == "src" else self.dst
        dims = self.src.dims
        shape = None
        if layout.holds(rank):
            try:
                shape = self.shape_of(side, rank, full)
            except (MimoFxError, TypeError, ValueError):  # sizes a trace cannot know
                shape = "(unknown: sizes not known while tracing)"
        sizes = ", ".join(f"{d}={full.get(d, '?')}" for d in dims)
        return Expect(shape, self.dtype, self.device,
                      f"{side} {layout.describe()!r} on {layout.grid!r} ({sizes})")

    def problem(self, code: int, side: str, full: dict, x=None) -> str:
        """The message for problem ``code`` of this rank's ``side`` tensor ``x``."""
        return self.context + problem_text(
            code, self.rank, self.expect(side, self.rank, full), _described(x),
            getattr(x, "dtype", None), getattr(x, "device", None))

    def fail(self, code: int, side: str, full: dict, x=None) -> None:
        """Raise problem ``code``: eagerly, or while tracing with the same text."""
        if torch.compiler.is_compiling():
            _fail_traced(self.name, code, side, x, tuple(full.items()))
        raise MimoFxError(self.problem(code, side, full, x))

    # -- the checks ----------------------------------------------------------------------
    def __call__(self, x, side: str, shape, full: dict | None, fingerprint: int | None = None,
                 grad: bool = False, batch=0) -> bool:
        """Validate ``x`` as this rank's ``side`` tensor of local ``shape`` (None: it holds
        none): locally, and in checked mode with every rank of both grids (every rank
        then raises the same error). ``fingerprint``: the call's fingerprint (default: the
        bridge's, for a call at its fixed sizes); ``grad``: whether this rank runs the
        call's backward; ``batch``: a row bridge's batch digest. Returns False where a
        compiled checked call found a problem while tracing: the call then raises when
        its graph runs (on every rank, with the check), and the caller traces no data
        movement (it would not trace)."""
        if self.comm is None or not self.checked:
            if torch.compiler.is_compiling():
                self.traced(x, side, shape, full or {})
            else:
                self.local(x, side, shape, full or {})
            return True
        code = self.code(x, shape)
        fingerprint = self.fingerprints[side] if fingerprint is None else fingerprint
        state = (SIDES.index(side), 0, 0, int(grad), batch)
        header = Header.encode(x, code, fingerprint, state)
        expected = [-1] if shape is None else list(shape)
        if torch.compiler.is_compiling():
            _CHECK_CALL(header, expected, self.name)
            return code == OK
        _check_call(header, expected, self.name, full)
        return True

    def code(self, x, shape) -> int:
        """The problem with ``x`` this rank can see alone: all of them eagerly; while
        tracing, what the trace decides (a shape it cannot is compared when the check
        runs)."""
        if not torch.compiler.is_compiling():
            return inspect(x, Expect(shape, self.dtype, self.device, ""))
        if x is None:
            return NONE_HOLDS if shape is not None else OK
        if not isinstance(x, torch.Tensor):
            return NOT_TENSOR
        if x.dtype != self.dtype:
            return DTYPE
        if x.device.type != self.device.type:
            return DEVICE
        if shape is not None and x.dim() != len(shape):
            return SHAPE
        return OK

    def checked_call(self, header: list[int], expected: list[int], full: dict | None) -> None:
        """A checked call, when it runs (eagerly, or the op a compiled graph holds): this
        rank's header completed -- the shape it can only compare now, its call counts --
        gathered with every rank's, and every rank raises the same error on any
        rank's problem; else the counts move on."""
        state = 6 + MAX_DIMS
        side = SIDES[header[state]]
        shape = None if expected == [-1] else tuple(expected)
        ndim = header[5]
        dims = tuple(header[6:6 + min(ndim, MAX_DIMS)])
        if header[2] == OK and header[0] == MAGIC and header[3]:  # a tensor was passed
            if shape is None and 0 not in dims:
                header[2] = NOT_EMPTY
            elif shape is not None and dims != shape:
                header[2] = SHAPE
        header[state + 1], header[state + 2] = self.calls["src"], self.calls["dst"]
        rows = self.gather_headers(int_tensor(header, self.device))
        self.verdict(rows, side, header[1], full, shape=shape)
        self.calls[side] += 1

    def failed(self, err: MimoFxError, side: str = "src") -> None:
        """In checked mode, a call this rank could not make (``err``, raised while
        planning it) is every rank's error: its header says so, then it raises."""
        if self.comm is None or not self.checked or torch.compiler.is_compiling():
            raise err
        state = (SIDES.index(side), self.calls["src"], self.calls["dst"], 0, 0)
        mine = int_tensor(Header.encode(None, FAILED, self.fingerprints[side], state), self.device)
        rows = self.gather_headers(mine)
        try:
            self.verdict(rows, side, self.fingerprints[side], {}, expects=False)
        except MimoFxError as every:
            raise MimoFxError(f"{err}\n(every rank: {every})") from None
        raise err

    def local(self, x, side: str, shape, full: dict) -> None:
        """Raise on this rank if ``x`` is not its ``side`` tensor of local ``shape``."""
        expect = self._expects.get(shape)  # (one per shape: every call makes this check)
        if expect is None:
            if len(self._expects) >= 64:
                self._expects.clear()
            expect = self._expects[shape] = Expect(shape, self.dtype, self.device, "")
        code = inspect(x, expect)
        if code != OK:
            raise MimoFxError(self.problem(code, side, full, x))

    def header(self, x, side: str, shape, full: dict,
               fingerprint: int | None = None) -> tuple[torch.Tensor, int]:
        """This rank's check header for ``x`` (an imperative pipeline call's: its calls
        pair per channel, not by count), and the call's fingerprint."""
        code = inspect(x, Expect(shape, self.dtype, self.device, ""))
        fingerprint = self.fingerprints[side] if fingerprint is None else fingerprint
        state = (SIDES.index(side), 0, 0, 0, 0)
        return int_tensor(Header.encode(x, code, fingerprint, state), self.device), fingerprint

    def gather_headers(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's header (eagerly; a timeout or a lost peer is an error)."""
        from .timeouts import cause, wait_time

        try:
            return self.comm.all_gather(mine, self.union).view(-1, HEADER_LEN)
        except (RuntimeError, MimoFxError) as err:  # a timeout or a peer gone
            raise MimoFxError(
                self.context + f"rank {self.rank} waited in vain for every rank's check "
                f"header ({cause(err)}). A rank skipped a call of this bridge (calls pair "
                f"in order: its next call met this rank's previous one), called it with "
                f"checked=False, called another bridge or collective, or left; every rank "
                f"must make the same checked call ({wait_time()})") from None

    def verdict(self, rows: torch.Tensor, side: str, fingerprint: int, full: dict | None,
                ranks=None, expects: bool = True, shape=None) -> None:
        """Raise, the same on every rank, if the header of any rank of ``ranks`` (default:
        both grids') shows a problem. ``full``: the call's sizes, for what each rank
        was to pass (None: unknown here, as in a compiled call; ``shape``: this rank's)."""
        ranks = ranks or self.union
        listed = rows.view(-1, HEADER_LEN).tolist()
        if any(row[2] == FAILED for row in listed):
            expects = False  # a rank could not plan: what the others expect is moot

        def expect(r: int) -> Expect:
            if expects and full is not None:
                return self.expect(side, r, full)
            layout = self.src if side == "src" else self.dst
            what = f"{side} {layout.describe()!r} on {layout.grid!r}"
            mine: Any = shape if r == self.rank else "(its own)"
            return Expect(mine, self.dtype, self.device, what)

        problems = Header.problems(listed, ranks, fingerprint, {r: expect(r) for r in ranks})
        if problems:
            raise MimoFxError(self.context + "the call does not match on every rank:\n  "
                              + "\n  ".join(problems))

    def traced(self, x, side: str, shape, full: dict) -> None:
        """The checks under ``torch.compile``: what the trace decides raises now, with
        the eager error; a size relation it cannot decide is checked when the graph
        runs; checked mode gathers headers in-graph."""
        from torch.fx.experimental.symbolic_shapes import guard_or_true, statically_known_true

        if x is None:
            if shape is not None:
                self.fail(NONE_HOLDS, side, full, x)
        elif not isinstance(x, torch.Tensor):
            self.fail(NOT_TENSOR, side, full, x)
        elif x.dtype != self.dtype:
            self.fail(DTYPE, side, full, x)
        elif x.device.type != self.device.type:
            self.fail(DEVICE, side, full, x)
        elif shape is None:
            if not guard_or_true(x.numel() == 0):
                self.fail(NOT_EMPTY, side, full, x)
        elif x.dim() != len(shape):
            self.fail(SHAPE, side, full, x)
        else:
            for have, want in zip(x.shape, shape):
                if not guard_or_true(have == want):  # decided while tracing: unequal
                    self.fail(SHAPE, side, full, x)
            message = (f"{self.context}rank {self.rank}: the local tensor's shape does not "
                       f"match the sizes ({{}} != {{}} in one dim); run the call eagerly to "
                       f"see the shapes")
            for have, want in zip(x.shape, shape):
                if not statically_known_true(have == want):
                    runtime_check("equal", (have, want), message)


def _described(x):
    if isinstance(x, torch.Tensor | _Example):
        return tuple(x.shape)
    if isinstance(x, tuple):
        return x
    return type(x).__name__
