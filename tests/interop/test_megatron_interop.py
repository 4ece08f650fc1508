"""mimo_fx.interop.megatron against Megatron-Core 0.19.2's own communicators.

One spawned 8-rank gloo world runs Megatron's ``BridgeCommunicator`` and
``ColocatedBridgeCommunicator`` (imported from the release's wheel, fetched once into the
user cache with pip, without the package's ``__init__``) and the drop-ins on the same
grids (Megatron's own ``HyperCommGrid``) and the same tensors, with the same calls.
Every rank's every returned tensor -- activations, gradients (the colocated input's
``.grad``) -- must equal Megatron's exactly, dtype and shape included, and where Megatron
returns None so must the drop-in. Inputs follow Megatron's precondition (replicated over
the axes other than DP), built from Megatron's own rank enumeration, never from mimo_fx's
layouts.

Where Megatron refuses (CP > 1, variable token counts per replica, a dst that is
frozen-aware) the drop-in is compared with full-tensor math written here: zigzag CP
chunks cut by hand, rows concatenated by hand. The docs example
(``docs/examples/megatron_switch.py``) runs as written and with its one import changed
back to Megatron's, and with ``--dest-cp 2`` and ``--variable-tokens``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from mimo_fx import MimoFxError
from mimo_fx.testing import megatron_core

B, S, H = 8, 8, 3
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "megatron_switch.py"
NAMES = ["tp", "cp", "pp", "dp"]


# -- inputs, from Megatron's view of a grid ----------------------------------------------------
def _coords(grid, rank: int) -> dict:
    """``{dim: index}`` of ``rank`` in a HyperCommGrid (its first dim fastest)."""
    local, out = rank - grid.rank_offset, {}
    for name, size in zip(grid.dim_names, grid.shape):
        out[name], local = local % size, local // size
    return out


def _in(grid, rank: int) -> bool:
    return grid.rank_offset <= rank < grid.rank_offset + grid.size


def _size(grid, name: str) -> int:
    return grid.shape[grid.dim_names.index(name)] if name in grid.dim_names else 1


def _replica_piece(full, grid, rank: int, bdim: int):
    """Megatron's input on ``rank``: its DP replica's part of the batch dim, as
    ``torch.tensor_split`` cuts it (the replicas in the order Megatron enumerates them)."""
    groups = grid._gen_rank_enum([d for d in grid.dim_names if d != "dp"])
    index = next(i for i, g in enumerate(groups) if rank in g)
    return torch.tensor_split(full, len(groups), dim=bdim)[index].contiguous()


def _zigzag(full, cp: int, c: int, sdim: int):
    """Chunks ``c`` and ``2cp-1-c`` of ``2cp`` along ``sdim``, by hand."""
    chunks = full.chunk(2 * cp, dim=sdim)
    return torch.cat([chunks[c], chunks[2 * cp - 1 - c]], dim=sdim)


def _full(shape, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


# -- comparing ---------------------------------------------------------------------------------
def _same(got, want, what: str) -> str | None:
    if want is None or got is None:
        return None if got is None and want is None else (
            f"{what}: got {None if got is None else tuple(got.shape)}, want "
            f"{None if want is None else tuple(want.shape)}")
    got, want = got.detach(), want.detach()
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    if not torch.equal(got, want):
        return f"{what}: values differ (max |diff| {(got - want).abs().max().item()})"
    return None


def _compare(got: list, want: list, what: str) -> tuple[list, int]:
    problems = [p for i, (a, b) in enumerate(zip(got, want))
                if (p := _same(a, b, f"{what} result {i}")) is not None]
    if len(got) != len(want):
        problems.append(f"{what}: {len(got)} results, want {len(want)}")
    return problems, sum(1 for t in want if t is not None)


# -- the pipelined communicator ----------------------------------------------------------------
def _grid(mods, tp=1, cp=1, pp=1, dp=1, offset=0):
    return mods["hyper_comm_grid"].HyperCommGrid([tp, cp, pp, dp], NAMES, rank_offset=offset)


def _boundary(grid, rank: int, src: bool) -> bool:
    pp = _size(grid, "pp")
    return _in(grid, rank) and _coords(grid, rank).get("pp", 0) == (pp - 1 if src else 0)


def _pipelined_run(comm, rank, src_grid, dst_grid, xs, gs, order: str):
    """The calls of ``order`` on this rank; the list of what they returned. ``boundary``:
    1F1B made by the boundary stages' ranks only (the source's last, the destination's
    first), as Megatron's multi-module schedules call a bridge; the others skip it."""
    if order == "boundary":
        on_src, on_dst = _boundary(src_grid, rank, True), _boundary(dst_grid, rank, False)
    else:
        on_src, on_dst = _in(src_grid, rank), _in(dst_grid, rank)
    if order == "plain":
        if on_src:
            return [comm.send_forward(xs[0]), comm.recv_backward()]
        if on_dst:
            return [comm.recv_forward(), comm.send_backward(gs[0])]
        return []
    n = len(xs)
    if on_src:  # 1F1B: warm-up forward, steady-state steps, the cool-down backward
        return ([comm.send_forward(xs[0])]
                + [comm.send_forward_recv_backward(xs[i]) for i in range(1, n)]
                + [comm.recv_backward()])
    if on_dst:
        return ([comm.recv_forward()]
                + [comm.send_backward_recv_forward(gs[i - 1]) for i in range(1, n)]
                + [comm.send_backward(gs[n - 1])])
    return []


PIPELINED = {  # name: (src grid, dst grid, dim_mapping, tensor_ndim, dtype)
    "equal": (dict(tp=2, dp=2), dict(tp=2, dp=2), None, 3, torch.float32),
    "fan_in": (dict(dp=4), dict(tp=2, dp=2), None, 3, torch.float32),
    "fan_out": (dict(tp=2, dp=2), dict(dp=4), None, 3, torch.float32),
    "tp_only_dst": (dict(dp=4), dict(tp=4), None, 3, torch.float32),
    "pp2_src": (dict(pp=2, dp=2), dict(tp=2, dp=2), None, 3, torch.float32),
    "pp2_dst": (dict(dp=4), dict(tp=2, pp=2), None, 3, torch.float32),
    "pp2_both": (dict(pp=2, dp=2), dict(tp=2, pp=2), None, 3, torch.float32),
    "sbh_fan_in": (dict(dp=4), dict(tp=2, dp=2), {"s": 0, "b": 1, "h": 2}, 3, torch.float32),
    "bsh_fan_out": (dict(tp=2, dp=2), dict(dp=4), {"b": 0, "s": 1, "h": 2}, 3, torch.float32),
    "2d_fan_in": (dict(dp=4), dict(tp=2, dp=2), None, 2, torch.float32),
    "2d_fan_out": (dict(tp=2, dp=2), dict(dp=4), None, 2, torch.float32),
    "bf16_fan_out": (dict(tp=2, dp=2), dict(tp=1, dp=4), None, 3, torch.bfloat16),
}


ORDERS = ("plain", "1f1b")
THD = ("bsh", "sbh in order", "bad length", "bad length in order")
BOUNDARY = {  # the PP > 1 cases also run with only the boundary stages calling
    f"{n} boundary{' checked' if checked else ''}": (n, checked)
    for n in PIPELINED if n.startswith("pp") for checked in (False, True)}


def _pipelined_case(mods, rank: int, name: str, order: str,
                    checked: bool = False) -> tuple[list, int]:
    from mimo_fx.interop.megatron import BridgeCommunicator

    src_axes, dst_axes, mapping, ndim, dtype = PIPELINED[name]
    src_grid, dst_grid = _grid(mods, **src_axes), _grid(mods, **dst_axes, offset=4)
    m = mapping or {"b": 0, "s": 1, "h": 2}
    shape = [0, 0, 0]
    shape[m["b"]], shape[m["s"]], shape[m["h"]] = B, S, H
    bdim = m["b"]
    if ndim == 2:
        shape, bdim = [B * S, H], 0
    n = {"plain": 1, "1f1b": 2, "boundary": 4}[order]  # (4: the told sizes guessed too)
    xs = [_replica_piece(_full(shape, 10 + i, dtype), src_grid, rank, bdim)
          if _boundary(src_grid, rank, True) else None for i in range(n)]
    gs = [_replica_piece(_full(shape, 20 + i, dtype), dst_grid, rank, bdim)
          if _boundary(dst_grid, rank, False) else None for i in range(n)]
    kw = dict(dim_mapping=mapping, comm_dtype=dtype, tensor_ndim=ndim,
              src_module_name="encoder", dest_module_name="llm")
    theirs = mods["bridge_communicator"].BridgeCommunicator(src_grid, dst_grid, **kw)
    want = _pipelined_run(theirs, rank, src_grid, dst_grid, xs, gs, order)
    ours = BridgeCommunicator(src_grid, dst_grid, **kw, checked=checked)
    problems: list[str] = []
    try:
        got = _pipelined_run(ours, rank, src_grid, dst_grid, xs, gs, order)
        ours.bridge.flush()
        guessed = [2, 0] if rank in ours.bridge.party and not checked else [0, 0]
        if order == "boundary" and ours.bridge.guesses != guessed:  # (3rd, 4th calls)
            problems = [f"guesses held and failed {ours.bridge.guesses}, not {guessed}"]
    finally:
        ours.destroy()
    more, count = _compare(got, want, f"{name} {order}")
    return problems + more, count


def _pipelined_varying(mods, rank: int) -> tuple[list, int]:
    """Fan-in DP4 -> TP2xDP2 in 1F1B order over 8 micro-batches whose sequence length
    changes (8, 8, 8, 8, 4, 4, 4, 8): the shape exchange learns each, and where two calls
    in a row moved the same, the next call's transfer is posted at their sizes before the
    shapes arrive (a guess that holds on the 3rd, 4th and 7th call and fails on the 5th
    and 8th). Every returned tensor equal to Megatron's."""
    from mimo_fx.interop.megatron import BridgeCommunicator

    src_grid, dst_grid = _grid(mods, dp=4), _grid(mods, tp=2, dp=2, offset=4)
    lengths = (8, 8, 8, 8, 4, 4, 4, 8)
    xs = [_replica_piece(_full([B, s, H], 150 + i), src_grid, rank, 0)
          if _in(src_grid, rank) else None for i, s in enumerate(lengths)]
    gs = [_replica_piece(_full([B, s, H], 170 + i), dst_grid, rank, 0)
          if _in(dst_grid, rank) else None for i, s in enumerate(lengths)]
    kw = dict(comm_dtype=torch.float32)
    theirs = mods["bridge_communicator"].BridgeCommunicator(src_grid, dst_grid, **kw)
    want = _pipelined_run(theirs, rank, src_grid, dst_grid, xs, gs, "1f1b")
    ours = BridgeCommunicator(src_grid, dst_grid, **kw)
    try:
        got = _pipelined_run(ours, rank, src_grid, dst_grid, xs, gs, "1f1b")
        ours.bridge.flush()
        if ours.bridge.guesses != [3, 2]:  # (held, failed: both paths ran)
            got.append(f"guesses held and failed {ours.bridge.guesses}, not [3, 2]")
    finally:
        ours.destroy()
    problems = got[len(want):]
    more, count = _compare(got[:len(want)], want, "varying lengths 1f1b")
    return problems + more, count


# -- the colocated communicator ----------------------------------------------------------------
COLOCATED = {  # name: (src grid, dst grid, dim_mapping)
    "fan_in": (dict(tp=2, dp=4), dict(tp=4, dp=2), None),
    "fan_out": (dict(tp=4, dp=2), dict(tp=2, dp=4), None),
    "dp8_to_tp8": (dict(tp=1, dp=8), dict(tp=8, dp=1), None),
    "equal": (dict(tp=2, dp=4), dict(tp=2, dp=4), None),
    "2d_fan_in": (dict(tp=2, dp=4), dict(tp=4, dp=2), {"b": 0, "h": 1}),
    "sbh_fan_out": (dict(tp=4, dp=2), dict(tp=2, dp=4), {"s": 0, "b": 1, "h": 2}),
}


def _colocated_run(comm, x, g):
    leaf = x.clone().requires_grad_()
    y = comm.communicate(leaf)
    y.backward(g)
    return [y, leaf.grad]


def _colocated_case(mods, rank: int, name: str) -> tuple[list, int]:
    from mimo_fx.interop.megatron import ColocatedBridgeCommunicator

    src_axes, dst_axes, mapping = COLOCATED[name]
    grid = mods["hyper_comm_grid"].HyperCommGrid
    src_grid = grid(list(src_axes.values()), list(src_axes))
    dst_grid = grid(list(dst_axes.values()), list(dst_axes))
    m = mapping or {"b": 0, "s": 1, "h": 2}
    shape = [0] * len(m)
    for d, n in (("b", B), ("s", S), ("h", H)):
        if d in m:
            shape[m[d]] = n * (S if d == "b" and len(m) == 2 else 1)
    x = _replica_piece(_full(shape, 30), src_grid, rank, m["b"])
    # the destination's gradient, replicated over its TP ranks like its activation
    g = _replica_piece(_full(shape, 31), dst_grid, rank, m["b"])
    theirs = mods["colocated_communicator"].ColocatedBridgeCommunicator(
        src_grid, dst_grid, dim_mapping=mapping)
    try:
        want = _colocated_run(theirs, x, g)
    finally:
        theirs.destroy()
    ours = ColocatedBridgeCommunicator(src_grid, dst_grid, dim_mapping=mapping)
    try:
        got = _colocated_run(ours, x, g)
        # its queries answer as Megatron's
        for q in ("is_fan_in", "is_fan_out"):
            if getattr(ours, q)() != getattr(theirs, q)():
                got.append(f"{q} differs")
        mine, megatron = ours.get_slice_info(8), theirs.get_slice_info(8)
        if (mine.start, mine.size) != (megatron.start, megatron.size):
            got.append(f"get_slice_info(8): {mine}, Megatron's {megatron}")
    finally:
        ours.destroy()
    problems = [p for p in got[2:]]
    more, count = _compare(got[:2], want, f"colocated {name}")
    return problems + more, count


def _colocated_compiled(mods, rank: int, backend: str) -> tuple[list, int]:
    """The colocated drop-in's ``communicate`` inside a ``torch.compile``'d step
    (``fullgraph=True``), fan-in TP2xDP4 -> TP4xDP2, 2 steps of other inputs with
    ``loss.backward()``: each step's activation and input gradient equal Megatron's
    eager ones (the compiled loss is not compared: inductor may sum in another order)."""
    from mimo_fx.interop.megatron import ColocatedBridgeCommunicator

    grid = mods["hyper_comm_grid"].HyperCommGrid
    src_grid, dst_grid = grid([2, 4], ["tp", "dp"]), grid([4, 2], ["tp", "dp"])
    theirs = mods["colocated_communicator"].ColocatedBridgeCommunicator(src_grid, dst_grid)
    ours = ColocatedBridgeCommunicator(src_grid, dst_grid, dtype=torch.float32)
    problems, count = [], 0
    try:
        w = _replica_piece(_full([B, S, H], 120), dst_grid, rank, 0)

        def step(comm, x):
            y = comm.communicate(x * 2)
            return (y * w).sum(), y
        compiled = torch.compile(lambda x: step(ours, x), backend=backend, fullgraph=True)
        for k in range(2):
            x = _replica_piece(_full([B, S, H], 121 + k), src_grid, rank, 0)
            outs = []
            for fn in (lambda v: step(theirs, v), compiled):
                leaf = x.clone().requires_grad_()
                loss, y = fn(leaf)
                loss.backward()
                outs.append([y.detach(), leaf.grad])
            more, n = _compare(outs[1], outs[0], f"compiled ({backend}) step {k}")
            problems += more
            count += n
    finally:
        ours.destroy()
        theirs.destroy()
    return problems, count


# -- beyond Megatron: against full-tensor math ---------------------------------------------------
def _beyond_cp(mods, rank: int, side: str) -> tuple[list, int]:
    """Pipelined TP2xDP2 -> CP2xDP2 (``side="dst"``) or CP2xDP2 -> TP2xDP2 (``"src"``), 3-D
    [B, S, H], zigzag: each CP rank's piece is chunks c and 2cp-1-c of its replica's
    sequence; forward and backward checked by hand."""
    from mimo_fx.interop.megatron import BridgeCommunicator

    cp_grid = dict(cp=2, dp=2)
    src_axes, dst_axes = (cp_grid, dict(tp=2, dp=2)) if side == "src" else (
        dict(tp=2, dp=2), cp_grid)
    src_grid, dst_grid = _grid(mods, **src_axes), _grid(mods, **dst_axes, offset=4)
    X, G = _full([B, S, H], 40), _full([B, S, H], 41)

    def piece(full, grid):
        if not _in(grid, rank):
            return None
        rows = _replica_piece(full, grid, rank, 0)
        cp = _size(grid, "cp")
        return rows if cp == 1 else _zigzag(rows, cp, _coords(grid, rank)["cp"], 1)

    comm = BridgeCommunicator(src_grid, dst_grid, comm_dtype=torch.float32)
    try:
        got = _pipelined_run(comm, rank, src_grid, dst_grid, [piece(X, src_grid)],
                             [piece(G, dst_grid)], "plain")
    finally:
        comm.destroy()
    want = [None, piece(G, src_grid)] if _in(src_grid, rank) else [piece(X, dst_grid), None]
    return _compare(got, want, f"cp at {side}")


def _beyond_thd(mods, rank: int, variant: str) -> tuple[list, int]:
    """Pipelined DP4 -> CP2xDP2 with ``thd=True``, two micro-batches in 1F1B order: each
    destination rank gets its replica's samples one after another, each sample's CP
    chunks (c and 2cp-1-c, or c with ``zigzag=False``) by hand, as ``[T, H]``, with its
    Packing's boundaries; it sends its gradient back in that format and each encoder rank
    gets its rows of the full gradient. ``bad length``: a sequence of 6 tokens, which
    CP2's zigzag cannot cut into 4 equal chunks, raises on every rank of both grids (the
    zigzag layout refuses it); ``in order``, 7 tokens in 2 chunks."""
    from mimo_fx.interop.megatron import BridgeCommunicator

    src_grid, dst_grid = _grid(mods, dp=4), _grid(mods, cp=2, dp=2, offset=4)
    zigzag = not variant.endswith("in order")
    mapping = {"s": 0, "b": 1, "h": 2} if variant == "sbh in order" else None
    bad = variant.startswith("bad")
    length = (6 if zigzag else 7) if bad else S
    bdim, sdim = (1, 0) if mapping else (0, 1)
    shape = [length, B, H] if mapping else [B, length, H]
    xs_full = [_full(shape, 60 + i) for i in range(2)]
    gs_full = [_full(shape, 70 + i) for i in range(2)]

    def thd(full):  # this destination rank's piece of ``full``, packed by hand
        rows = _replica_piece(full, dst_grid, rank, bdim)
        c = _coords(dst_grid, rank)["cp"]
        samples = rows.unbind(bdim)  # each (s, h)
        return torch.cat([_zigzag(x, 2, c, 0) if zigzag else x.chunk(2)[c]
                          for x in samples])

    on_src, on_dst = _in(src_grid, rank), _in(dst_grid, rank)
    xs = [_replica_piece(x, src_grid, rank, bdim) if on_src else None for x in xs_full]
    gs = [thd(g) if on_dst and not bad else None for g in gs_full]
    comm = BridgeCommunicator(src_grid, dst_grid, mapping, torch.float32, thd=True,
                              zigzag=zigzag)
    try:
        if bad:
            words = ("s=6 is not divisible by 4; pad 's' to a multiple of 4" if zigzag else
                     "sequence length 7, which the destination's cp=2 does not cut into 2 "
                     "equal chunks; pad each sample's sequence to a multiple of 2")
            try:
                _pipelined_run(comm, rank, src_grid, dst_grid, xs, gs, "1f1b")
            except MimoFxError as err:
                return ([] if words in str(err) else [f"{variant}: {err}"]), 1
            return [f"{variant}: no error"], 1
        got = _pipelined_run(comm, rank, src_grid, dst_grid, xs, gs, "1f1b")
        packing = comm.thd_packing()
    finally:
        comm.destroy()
    if on_src:
        want = [None, _replica_piece(gs_full[0], src_grid, rank, bdim),
                _replica_piece(gs_full[1], src_grid, rank, bdim)]
    else:
        want = [thd(xs_full[0]), thd(xs_full[1]), None]
    problems, count = _compare(got, want, f"thd {variant}")
    if on_dst and packing.cu_seqlens.tolist() != [S * i for i in range(B // 2 + 1)]:
        problems.append(f"thd {variant}: cu_seqlens {packing.cu_seqlens.tolist()}")
    if on_dst and got[0] is not None and not (got[0].requires_grad and got[0].is_leaf):
        problems.append(f"thd {variant}: the activation is not a leaf requiring grad")
    return problems, count


def _beyond_tokens(mods, rank: int) -> tuple[list, int]:
    """Pipelined DP4 -> TP2xDP2, 2-D [T, H], each encoder replica its own token count, two
    micro-batches of other counts in 1F1B order: destination replica d gets replicas 2d
    and 2d+1's rows concatenated; each encoder rank its rows of the gradient."""
    from mimo_fx.interop.megatron import BridgeCommunicator

    src_grid, dst_grid = _grid(mods, dp=4), _grid(mods, tp=2, dp=2, offset=4)
    counts = [(3, 1, 4, 2), (0, 2, 5, 1)]
    xs_full = [[_full([t, H], 50 + 10 * k + i) for i, t in enumerate(c)]
               for k, c in enumerate(counts)]
    gs_full = [[_full([t, H], 90 + 10 * k + i) for i, t in enumerate(c)]
               for k, c in enumerate(counts)]
    src_i = _coords(src_grid, rank)["dp"] if _in(src_grid, rank) else None
    dst_d = _coords(dst_grid, rank)["dp"] if _in(dst_grid, rank) else None
    xs = [x[src_i] if src_i is not None else None for x in xs_full]
    gs = [torch.cat(g[2 * dst_d:2 * dst_d + 2]) if dst_d is not None else None
          for g in gs_full]
    comm = BridgeCommunicator(src_grid, dst_grid, comm_dtype=torch.float32, tensor_ndim=2,
                              variable_tokens=True)
    try:
        got = _pipelined_run(comm, rank, src_grid, dst_grid, xs, gs, "1f1b")
    finally:
        comm.destroy()
    if src_i is not None:
        want = [None, gs_full[0][src_i], gs_full[1][src_i]]
    else:
        want = [torch.cat(xs_full[0][2 * dst_d:2 * dst_d + 2]),
                torch.cat(xs_full[1][2 * dst_d:2 * dst_d + 2]), None]
    return _compare(got, want, "variable tokens")


def _beyond_tokens_fan_out(mods, rank: int) -> tuple[list, int]:
    """Pipelined TP2xDP2 -> DP4, 2-D [T, H], each encoder replica its own token count, two
    micro-batches in 1F1B order: replica 0 splits its tokens by per-sample sizes (the
    ``_mimo_bridge_split_sizes`` Megatron reads), replica 1 as ``torch.tensor_split`` does;
    destination replica 2i + j gets the j-th part of replica i's rows, and each encoder
    rank its replica's rows of the gradient."""
    from mimo_fx.interop.megatron import BridgeCommunicator

    src_grid, dst_grid = _grid(mods, tp=2, dp=2), _grid(mods, dp=4, offset=4)
    samples = [[(1, 2, 0, 3), None], [(0, 0, 4, 1), None]]  # per micro-batch, per replica
    counts = [(6, 5), (5, 3)]  # tokens per replica
    parts = []  # per micro-batch, the 4 destination replicas' counts
    for k in range(2):
        a = samples[k][0]
        rest = [len(r) for r in torch.arange(counts[k][1]).tensor_split(2)]
        parts.append([a[0] + a[1], a[2] + a[3], *rest])
    xs_full = [_full([sum(c), H], 130 + k) for k, c in enumerate(counts)]
    gs_full = [_full([sum(c), H], 140 + k) for k, c in enumerate(counts)]

    def rows(full, sizes, i):
        at = sum(sizes[:i])
        return full[at:at + sizes[i]]
    src_i = _coords(src_grid, rank)["dp"] if _in(src_grid, rank) else None
    dst_d = _coords(dst_grid, rank)["dp"] if _in(dst_grid, rank) else None
    xs = []
    for k in range(2):
        if src_i is None:
            xs.append(None)
            continue
        x = rows(xs_full[k], counts[k], src_i).clone()
        if samples[k][src_i] is not None:
            x._mimo_bridge_split_sizes = list(samples[k][src_i])
        xs.append(x)
    gs = [rows(gs_full[k], parts[k], dst_d) if dst_d is not None else None for k in range(2)]
    comm = BridgeCommunicator(src_grid, dst_grid, comm_dtype=torch.float32, tensor_ndim=2,
                              variable_tokens=True)
    try:
        got = _pipelined_run(comm, rank, src_grid, dst_grid, xs, gs, "1f1b")
    finally:
        comm.destroy()
    if src_i is not None:
        want = [None, rows(gs_full[0], counts[0], src_i), rows(gs_full[1], counts[1], src_i)]
    else:
        want = [rows(xs_full[0], parts[0], dst_d), rows(xs_full[1], parts[1], dst_d), None]
    return _compare(got, want, "variable tokens fan-out")


def _beyond_colocated(mods, rank: int, what: str) -> tuple[list, int]:
    """Colocated CP2xDP4 -> TP2xDP4 (3-D: each rank gathers its replica's whole sequence;
    the gradient goes back as zigzag chunks), or variable tokens TP2xDP4 -> TP4xDP2 (2-D:
    replicas' rows concatenated in pairs)."""
    from mimo_fx.interop.megatron import ColocatedBridgeCommunicator

    grid = mods["hyper_comm_grid"].HyperCommGrid
    if what == "cp":
        src_grid = grid([1, 2, 4], ["tp", "cp", "dp"])
        dst_grid = grid([2, 1, 4], ["tp", "cp", "dp"])
        X, G = _full([B, S, H], 60), _full([B, S, H], 61)
        c = _coords(src_grid, rank)["cp"]
        x = _zigzag(_replica_piece(X, src_grid, rank, 0), 2, c, 1)
        g = _replica_piece(G, dst_grid, rank, 0)
        want = [_replica_piece(X, dst_grid, rank, 0),
                _zigzag(_replica_piece(G, src_grid, rank, 0), 2, c, 1)]
        comm = ColocatedBridgeCommunicator(src_grid, dst_grid)
    else:
        src_grid, dst_grid = grid([2, 4], ["tp", "dp"]), grid([4, 2], ["tp", "dp"])
        counts = (2, 5, 0, 3)
        xs = [_full([t, H], 70 + i) for i, t in enumerate(counts)]
        gs = [_full([t, H], 80 + i) for i, t in enumerate(counts)]
        i, d = _coords(src_grid, rank)["dp"], _coords(dst_grid, rank)["dp"]
        x, g = xs[i], torch.cat(gs[2 * d:2 * d + 2])
        want = [torch.cat(xs[2 * d:2 * d + 2]), gs[i]]
        comm = ColocatedBridgeCommunicator(src_grid, dst_grid, dim_mapping={"b": 0, "h": 1},
                                           variable_tokens=True)
    try:
        got = _colocated_run(comm, x, g)
    finally:
        comm.destroy()
    return _compare(got, want, f"colocated {what}")


def _beyond_frozen(mods, rank: int) -> tuple[list, int]:
    """A frozen source (``frozen=True``): forward exact, every backward call returns None at
    once and no backward message exists (the receivers' send_backward posts nothing: a
    backward the encoder never receives would keep the bridge from closing)."""
    from mimo_fx.interop.megatron import BridgeCommunicator

    src_grid, dst_grid = _grid(mods, dp=4), _grid(mods, tp=2, dp=2, offset=4)
    X = _full([B, S, H], 100)
    x = _replica_piece(X, src_grid, rank, 0) if _in(src_grid, rank) else None
    g = torch.ones(B // 2, S, H) if _in(dst_grid, rank) else None
    comm = BridgeCommunicator(src_grid, dst_grid, frozen=True)
    try:
        got = _pipelined_run(comm, rank, src_grid, dst_grid, [x, x], [g, g], "1f1b")
        comm.bridge.flush()
        if _in(dst_grid, rank) and got[0] is not None and got[0].requires_grad:
            got.append("a frozen source's activation requires grad")
    finally:
        comm.destroy()
    if _in(src_grid, rank):
        want = [None, None, None]
    else:
        want = [_replica_piece(X, dst_grid, rank, 0)] * 2 + [None]
    problems = [p for p in got[3:]]
    more, count = _compare(got[:3], want, "frozen")
    return problems + more, count


def _beyond_wires(mods, rank: int, kind: str) -> tuple[list, int]:
    """``wire_dtypes``: activations in bf16 and gradients in float32 on the wire, then the
    other way round; results float32. Pipelined TP2xDP2 -> DP4 and colocated
    TP2xDP4 -> TP4xDP2: the rounded direction equals bf16-rounded math, the other exact
    (random values: bf16 rounding changes them)."""
    from mimo_fx.interop.megatron import BridgeCommunicator, ColocatedBridgeCommunicator

    bf = lambda t: None if t is None else t.to(torch.bfloat16).to(torch.float32)  # noqa: E731
    problems, count = [], 0
    for wires in ((torch.bfloat16, None), (None, torch.bfloat16)):
        X, G = _full([B, S, H], 110), _full([B, S, H], 111)
        Xw = bf(X) if wires[0] is not None else X
        Gw = bf(G) if wires[1] is not None else G
        if kind == "pipelined":
            src_grid, dst_grid = _grid(mods, tp=2, dp=2), _grid(mods, dp=4, offset=4)

            def piece(full, grid):
                return _replica_piece(full, grid, rank, 0) if _in(grid, rank) else None
            comm = BridgeCommunicator(src_grid, dst_grid, comm_dtype=torch.float32,
                                      wire_dtypes=wires)
            try:
                got = _pipelined_run(comm, rank, src_grid, dst_grid, [piece(X, src_grid)],
                                     [piece(G, dst_grid)], "plain")
            finally:
                comm.destroy()
            want = ([None, piece(Gw, src_grid)] if _in(src_grid, rank)
                    else [piece(Xw, dst_grid), None])
        else:
            grid = mods["hyper_comm_grid"].HyperCommGrid
            src_grid, dst_grid = grid([2, 4], ["tp", "dp"]), grid([4, 2], ["tp", "dp"])
            comm = ColocatedBridgeCommunicator(src_grid, dst_grid, wire_dtypes=wires)
            try:
                got = _colocated_run(comm, _replica_piece(X, src_grid, rank, 0),
                                     _replica_piece(G, dst_grid, rank, 0))
            finally:
                comm.destroy()
            want = [_replica_piece(Xw, dst_grid, rank, 0), _replica_piece(Gw, src_grid, rank, 0)]
        more, n = _compare(got, want, f"{kind} wire_dtypes={wires}")
        problems += more
        count += n
    return problems, count


def _beyond_async(mods, rank: int) -> tuple[list, int]:
    """send_forward returns with its data in flight: the encoder sends 4 MiB, then meets
    the LLM ranks in a barrier that they reach before their recv_forward (a send that
    waited for its receiver would deadlock here)."""
    import torch.distributed as dist

    from mimo_fx.interop.megatron import BridgeCommunicator

    src_grid, dst_grid = _grid(mods, dp=4), _grid(mods, dp=4, offset=4)
    X = _full([4, 1024, 256], 110)
    x = _replica_piece(X, src_grid, rank, 0) if _in(src_grid, rank) else None
    comm = BridgeCommunicator(src_grid, dst_grid, sizes={"b": 4, "s": 1024, "h": 256})
    try:
        if x is not None:
            comm.send_forward(x)
            dist.barrier()
            got = [None]
        else:
            dist.barrier()
            got = [comm.recv_forward()]
        comm.bridge.flush()
    finally:
        comm.destroy()
    want = [None] if x is not None else [_replica_piece(X, dst_grid, rank, 0)]
    return _compare(got, want, "async send")


def _misuse(mods, rank: int) -> tuple[list, int]:
    """A call on the wrong grid raises a MimoFxError (a ValueError, as Megatron's)."""
    from mimo_fx.interop.megatron import BridgeCommunicator

    comm = BridgeCommunicator(_grid(mods, dp=4), _grid(mods, dp=4, offset=4))
    try:
        call = comm.recv_forward if rank < 4 else (lambda: comm.send_forward(torch.ones(1)))
        try:
            call()
        except MimoFxError as err:
            ok = "not in the" in str(err) and isinstance(err, ValueError)
            return ([] if ok else [f"misuse: {err}"]), 1
        return ["misuse: no error"], 1
    finally:
        comm.destroy()


def _example(mods, rank: int, args: list[str], megatron: bool) -> tuple[list, int]:
    """The docs example as written (or with its import changed back to Megatron's)."""
    text = EXAMPLE.read_text()
    ours = "from mimo_fx.interop.megatron import BridgeCommunicator\n"
    if megatron:
        assert ours in text
        text = text.replace(ours, "from megatron.core.pipeline_parallel.bridge_communicator "
                                  "import BridgeCommunicator\n")
    space: dict = {"__name__": "megatron_switch"}
    exec(compile(text, str(EXAMPLE), "exec"), space)
    problems = space["main"](args)
    return [f"example {args} ({'Megatron' if megatron else 'mimo_fx'}): {p}"
            for p in problems], 2


def _world(rank: int, size: int, root: str) -> dict:
    mods = megatron_core.load(root)
    out: dict = {}
    with megatron_core.on_cpu():
        checks = [(f"pipelined {n} {o}", _pipelined_case, (n, o))
                  for n in PIPELINED for o in ORDERS]
        checks += [(f"pipelined {k}", _pipelined_case, (n, "boundary", c))
                   for k, (n, c) in BOUNDARY.items()]
        checks += [("pipelined varying lengths", _pipelined_varying, ())]
        checks += [(f"colocated {n}", _colocated_case, (n,)) for n in COLOCATED]
        checks += [(f"colocated compiled {b}", _colocated_compiled, (b,))
                   for b in ("aot_eager", "inductor")]
        checks += [("beyond cp dst", _beyond_cp, ("dst",)), ("beyond cp src", _beyond_cp,
                                                             ("src",)),
                   ("beyond variable tokens", _beyond_tokens, ()),
                   *[(f"beyond thd {v}", _beyond_thd, (v,)) for v in THD],
                   ("beyond variable tokens fan-out", _beyond_tokens_fan_out, ()),
                   ("beyond colocated cp", _beyond_colocated, ("cp",)),
                   ("beyond colocated tokens", _beyond_colocated, ("tokens",)),
                   ("beyond frozen", _beyond_frozen, ()),
                   ("beyond async", _beyond_async, ()), ("misuse", _misuse, ()),
                   ("beyond wires pipelined", _beyond_wires, ("pipelined",)),
                   ("beyond wires colocated", _beyond_wires, ("colocated",)),
                   ("example", _example, ([], False)),
                   ("example megatron", _example, ([], True)),
                   ("example dest cp", _example, (["--dest-cp", "2"], False)),
                   ("example tokens", _example, (["--variable-tokens"], False))]
        for name, fn, args in checks:
            start = time.perf_counter()
            try:
                problems, count = fn(mods, rank, *args)
            except Exception as err:  # noqa: BLE001 (reported as the check's failure)
                problems, count = [f"{type(err).__name__}: {err}"], 0
            out[name] = (problems, count, time.perf_counter() - start)
        cls = mods["bridge_communicator"].BridgeCommunicator
        cls.destroy_broadcast_pgs()
        cls.destroy_bridge_pgs()
    return out


@pytest.fixture(scope="module")
def world(worlds):
    try:
        root = megatron_core.megatron_root(os.environ.get("MIMO_FX_MEGATRON"),
                                           fetch_missing=True)
    except (megatron_core.NotFound, OSError) as err:
        pytest.skip(f"Megatron-Core {megatron_core.VERSION} unavailable: {err}")
    return worlds.run(8, _world, root, timeout=900)


CHECKS = ([f"pipelined {n} {o}" for n in PIPELINED for o in ORDERS]
          + [f"pipelined {k}" for k in BOUNDARY] + ["pipelined varying lengths"]
          + [f"colocated {n}" for n in COLOCATED]
          + [f"colocated compiled {b}" for b in ("aot_eager", "inductor")]
          + ["beyond cp dst", "beyond cp src", "beyond variable tokens",
             "beyond variable tokens fan-out", *[f"beyond thd {v}" for v in THD],
             "beyond colocated cp", "beyond colocated tokens", "beyond frozen",
             "beyond async", "beyond wires pipelined", "beyond wires colocated", "misuse",
             "example", "example megatron", "example dest cp",
             "example tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKS)
def test_on_8_ranks(world, name):
    problems = {rank: r[name][0] for rank, r in enumerate(world) if r[name][0]}
    assert not problems, problems
    assert sum(r[name][1] for r in world) > 0, "nothing was compared"


@pytest.mark.slow
def test_every_check_ran(world):
    """The world ran exactly the checks listed (none lost between the two lists)."""
    assert sorted(world[0]) == sorted(CHECKS)


# -- in-process: what a bad argument says ---------------------------------------------------
class _Grid:
    """An object with HyperCommGrid's three fields, as the drop-ins accept."""

    def __init__(self, shape, dim_names, rank_offset=0):
        self.shape, self.dim_names, self.rank_offset = shape, dim_names, rank_offset


@pytest.mark.parametrize("grid, kwargs, words", [
    (_Grid([2, 2], ["tp", "dp"]), {"tensor_ndim": 4}, "tensor_ndim=4 must be 2"),
    (_Grid([2, 2], ["tp", "dp"]), {"dim_mapping": {"b": 0, "s": 0, "h": 2}},
     "must map ['b', 'h', 's'] to the tensor dims 0.. each once"),
    (_Grid([1, 2, 2], ["tp", "cp", "dp"]), {"tensor_ndim": 2}, "CP cannot cut it"),
    (_Grid([2, 2], ["tp", "tp"]), {}, "distinct names"),
    (object(), {}, "is not a grid"),
])
def test_bad_arguments_say_how(grid, kwargs, words):
    from mimo_fx.interop.megatron import megatron_layout

    with pytest.raises(MimoFxError, match=words.replace("[", r"\[").replace("]", r"\]")
                       .replace(".", r"\.")):
        megatron_layout(grid, **kwargs)


@pytest.mark.parametrize("thd, ndim", [(True, 2), ("yes", 3)])
def test_a_thd_destination_needs_3d_samples(thd, ndim):
    from mimo_fx.interop.megatron import BridgeCommunicator

    with pytest.raises(MimoFxError, match=f"thd={thd!r} with tensor_ndim={ndim}: a THD "
                                          f"destination packs the samples of a 3-D"):
        BridgeCommunicator(_Grid([1, 2], ["tp", "dp"]), _Grid([1, 2], ["tp", "dp"], 2),
                           tensor_ndim=ndim, thd=thd)


def test_layouts_are_megatrons():
    """Dims placed by dim_mapping, the batch over dp, CP zigzag, PP pinned, 2-D as t h."""
    from mimo_fx.interop.megatron import megatron_layout

    g = _Grid([2, 2, 2, 2], NAMES, 4)
    sbh = megatron_layout(g, {"s": 0, "b": 1, "h": 2}, stage=-1)
    assert (sbh.pattern, sbh.zigzag, dict(sbh.at)) == ("(cp s) (dp b) h", ("cp",), {"pp": 1})
    two = megatron_layout(_Grid([2, 1, 1, 4], NAMES), None, 2, variable_tokens=True)
    assert (two.pattern, two.ragged) == ("(dp t) h", ("dp",))
    flat = megatron_layout(g, None, 3, stage=0, zigzag=False)
    assert (flat.pattern, flat.zigzag, dict(flat.at)) == ("(dp b) (cp s) h", (), {"pp": 0})
