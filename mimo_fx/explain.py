"""The plan explainer: who sends what to whom, as text and as a picture.

:func:`explain` renders a :class:`~mimo_fx.plan.Plan` for a reader: the steps, what each
rank holds under src and needs under dst (in the pattern's own dims), a rank x rank
matrix of bytes sent, the individual transfers, and bytes per rank against the lower bound.
:func:`draw_png` draws the same with matplotlib (an optional dependency, imported only
there): the src and dst grids as rank boxes coloured by the region they hold, and the
transfer matrix as a heat map.

The matrix is the plan's *logical* traffic: an all-to-all piece goes from its sender to
its receiver; in an all-gather each member's share reaches every other member; in a
reduce-scatter each member sends every other member the partial sums of that member's
share (an all-reduce is both). Row sums are ``plan.bytes_sent``, column sums
``plan.bytes_recv``; how a collective's ring or tree relays the data is the library's
business and not shown.

A plan with a packed layout on a side is explained alike: its one dim is the rows (the
row dims flattened), so what each rank holds and needs, and each transfer, are runs of
rows, and its one step the all-to-all of them.

>>> from mimo_fx import Grid, Layout, plan
>>> p = plan(Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(tp=2), "b h"), {"b": 4, "h": 8})
>>> transfer_matrix(p)
{(0, 1): 64, (1, 0): 64}
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Hashable

from tabulate import tabulate

from .errors import MimoFxError
from .grid import Grid
from .plan import Exchange, Plan, Step, format_bytes
from .regions import Box, box_volume
from .steps import Holdings

__all__ = ["step_matrix", "transfer_matrix", "explain", "rank_table", "draw_png"]

MATRIX_RANKS = 16   # print the full matrix up to this many ranks, else the heaviest pairs
TRANSFERS_SHOWN = 24  # sending pairs of an all-to-all listed per step
HOLDINGS_SHOWN = 64  # ranks listed in the holdings table
BOXES_SHOWN = 8  # boxes (a row plan: runs of rows) shown per rank
PNG_MATRIX_CELLS = 512  # above this many ranks the heat map shows blocks of ranks


# -- the numbers --------------------------------------------------------------------------
def step_matrix(p: Plan, step: Step) -> dict[tuple[int, int], int]:
    """``{(sender, receiver): bytes}`` of one step of ``p`` (logical traffic)."""
    out: dict[tuple[int, int], int] = defaultdict(int)
    for sender, receiver, n in step.pairs():
        out[sender, receiver] += n * p.itemsize
    return dict(out)


def transfer_matrix(p: Plan) -> dict[tuple[int, int], int]:
    """Nonzero ``{(sender, receiver): bytes}`` over ``p``'s steps (row plans: the forward)."""
    return _Account(p).matrix()


def _ranks(p: Plan) -> list[int]:
    return sorted(set(p.src.grid.ranks) | set(p.dst.grid.ranks))


def _coord(grid: Grid, rank: int) -> str:
    return " ".join(f"{a}{i}" for a, i in grid.coord(rank).items()) if rank in grid else "-"


def src_tiling(p: Plan) -> Holdings:
    """What each rank holds under src, before any reduction (``p.hold`` is after it)."""
    return p.source


def _region(p: Plan, boxes: tuple[Box, ...]) -> str:
    if not boxes:
        return "nothing"
    more = f" + ... ({len(boxes)} boxes)" if len(boxes) > BOXES_SHOWN else ""
    return " + ".join(p.describe_box(b) for b in boxes[:BOXES_SHOWN]) + more


# -- text -----------------------------------------------------------------------------------
def rank_table(p: Plan) -> str:
    """Per rank: coordinates on both grids, bytes sent and received, the lower bound."""
    rows = []
    for r in _ranks(p):
        lower = p.lower_bound.get(r)
        recv = p.bytes_recv.get(r, 0)
        rows.append([r, _coord(p.src.grid, r), _coord(p.dst.grid, r),
                     format_bytes(p.bytes_sent.get(r, 0), 2), format_bytes(recv, 2),
                     "-" if lower is None else format_bytes(lower, 2),
                     "-" if not lower else f"{recv / lower:.2f}"])
    return tabulate(rows, disable_numparse=True, tablefmt="simple",
                    headers=["rank", "src coord", "dst coord", "sent", "received",
                             "lower bound", "recv/bound"])


def _holdings(p: Plan) -> str:
    hold = src_tiling(p)
    partial = f" (partial sums over {','.join(p.src.partial)})" if p.src.partial else ""
    ranks = _ranks(p)
    rows = [[r, _coord(p.src.grid, r), _region(p, hold.boxes(r)), _coord(p.dst.grid, r),
             _region(p, p.need.boxes(r))] for r in ranks[:HOLDINGS_SHOWN]]
    text = tabulate(rows, disable_numparse=True, tablefmt="simple",
                    headers=["rank", "src coord", f"holds{partial}", "dst coord", "needs"])
    if len(ranks) > HOLDINGS_SHOWN:
        text += f"\n... {len(ranks) - HOLDINGS_SHOWN} more ranks"
    return text


def _unit(largest: int) -> tuple[str, int]:
    for name, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if largest >= scale:
            return name, scale
    return "B", 1


def _matrix_text(p: Plan, matrix: dict[tuple[int, int], int]) -> str:
    if not matrix:
        return "transfer matrix: no rank sends anything"
    unit, scale = _unit(max(matrix.values()))
    ranks = sorted({r for pair in matrix for r in pair} | set(_ranks(p)))
    if len(ranks) <= MATRIX_RANKS:
        def cell(s: int, d: int) -> str:
            n = matrix.get((s, d), 0)
            return "." if not n else f"{n / scale:.6g}"

        rows = [[s, *(cell(s, d) for d in ranks)] for s in ranks]
        head = (f"transfer matrix ({unit} sent; row = sender, column = receiver; "
                f"'.' = nothing):")
        return head + "\n" + tabulate(rows, headers=["from\\to", *ranks], tablefmt="simple",
                                      disable_numparse=True, stralign="right")
    heaviest = sorted(matrix.items(), key=lambda kv: (-kv[1], kv[0]))[:MATRIX_RANKS]
    rows = [[s, d, f"{n / scale:.6g}"] for (s, d), n in heaviest]
    head = (f"transfer matrix: {len(matrix)} sending pairs over {len(ranks)} ranks; "
            f"the {len(heaviest)} heaviest ({unit}):")
    return head + "\n" + tabulate(rows, headers=["from", "to", unit], tablefmt="simple",
                                  disable_numparse=True)


def _transfers_text(p: Plan) -> list[str]:
    """Per exchange step, each sending pair: elements (a row plan's: rows), bytes, boxes."""
    lines = []
    for i, step in enumerate(p.steps, 1):
        if not isinstance(step, Exchange):
            continue
        pairs: dict[tuple[int, int], list[Box]] = defaultdict(list)
        for t in step.transfers:
            pairs[t.src, t.dst].append(t.box)
        lines.append(f"transfers of step {i} (sender -> receiver: {p.element}s, bytes, "
                     f"region):")
        for (s, d), boxes in list(pairs.items())[:TRANSFERS_SHOWN]:
            n = sum(map(box_volume, boxes))
            lines.append(f"  {s} -> {d}: {n} {p.element}s, {format_bytes(n * p.itemsize, 2)}: "
                         f"{_region(p, tuple(boxes))}")
        if len(pairs) > TRANSFERS_SHOWN:
            lines.append(f"  ... {len(pairs) - TRANSFERS_SHOWN} more sending pairs")
    return lines


def _collectives_text(p: Plan) -> str:
    if not p.steps:
        return "collectives: none (every dst rank slices what it holds)"
    return "collectives: " + ", then ".join(step.summary() for step in p.steps)


def _summary(p: Plan) -> str:
    bound = p.max_lower_bound
    ratio = f"{p.max_recv / bound:.2f}" if bound else ("1.00" if not p.max_recv else "inf")
    worst = [r for r, n in p.bytes_recv.items() if n > p.lower_bound.get(r, 0)]
    extra = "" if not worst else (f"; {len(worst)} rank(s) receive more than their own "
                                  f"bound (partial inputs are reduced first): "
                                  f"{', '.join(map(str, worst[:8]))}")
    return (f"max received {format_bytes(p.max_recv, 2)}/rank vs lower bound "
            f"{format_bytes(bound, 2)} (ratio {ratio}); max sent "
            f"{format_bytes(p.max_sent, 2)}/rank; total {format_bytes(p.total_bytes, 2)}{extra}")


def explain(p: Plan, backward: Plan | None = None) -> str:
    """A readable account of ``p``: steps, holdings, transfer matrix, transfers, bytes;
    and of its ``backward`` (:func:`~mimo_fx.plan.backward_plan`), where given: its steps,
    collectives, bytes and transfer matrix."""
    account = _Account(p)
    sections = [
        str(p),
        account.collectives(),
        _summary(p),
        "what each rank holds (src) and needs (dst):\n" + account.holdings(),
        _matrix_text(p, account.matrix()),
        account.transfers(),
        "bytes per rank:\n" + rank_table(p),
    ]
    if backward is not None:
        back = _Account(backward)
        sections += [
            "the backward: gradients from dst back to src (the adjoint plan)\n"
            + str(backward),
            back.collectives(),
            _summary(backward),
            _matrix_text(backward, back.matrix()),
        ]
    return "\n\n".join(s for s in sections if s) + "\n"


class _Account:
    """What explain and the picture say of a plan (a row plan's boxes: runs of rows)."""

    def __init__(self, p: Plan) -> None:
        self.p = p

    def matrix(self) -> dict[tuple[int, int], int]:
        total: dict[tuple[int, int], int] = defaultdict(int)
        for step in self.p.steps:
            for pair, n in step_matrix(self.p, step).items():
                total[pair] += n
        return dict(sorted(total.items()))

    def collectives(self) -> str:
        return _collectives_text(self.p)

    def holdings(self) -> str:
        return _holdings(self.p)

    def transfers(self) -> str:
        return "\n".join(_transfers_text(self.p))

    def picture(self) -> tuple[_Regions, _Regions, int, str]:
        p = self.p
        sizes = " ".join(f"{d}={n}" for d, n in p.sizes)
        return (_box_regions(p, src_tiling(p)), _box_regions(p, p.need), len(p.steps),
                f"mimo_fx plan ({sizes}, {p.itemsize} B/{p.element}): {_collectives_text(p)}")


# -- picture --------------------------------------------------------------------------------
def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MimoFxError("--png needs matplotlib, which is not installed: "
                          "pip install matplotlib (or pip install 'mimo-fx[plot]')") from None
    return Figure


def _check_writable(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise MimoFxError(f"cannot write png {path!r}: it is a directory; give a file name "
                          f"such as {os.path.join(path, 'plan.png')!r}")
    if not os.path.isdir(folder):
        raise MimoFxError(f"cannot write png {path!r}: folder {folder!r} does not exist; "
                          f"create it first")
    if not os.access(folder, os.W_OK):
        raise MimoFxError(f"cannot write png {path!r}: folder {folder!r} is not writable")


def _arrangement(grid: Grid) -> tuple[int, int]:
    """Columns and rows of rank boxes: the first axis across, the rest down (wrapped to a
    roughly square block when the grid is large)."""
    cols = grid.sizes[0] if 1 < grid.sizes[0] <= 16 else min(grid.size, 8)
    if grid.size > 64:
        cols *= max(1, round((grid.size / cols / cols) ** 0.5))
    return cols, -(-grid.size // cols)


_Regions = Callable[[int], tuple[Hashable, list[str]]]  # rank -> (what it holds, its label)


def _box_regions(p: Plan, tiling: Holdings) -> _Regions:
    def of(rank: int) -> tuple[Hashable, list[str]]:
        boxes = tiling.boxes(rank)
        return boxes, [p.describe_box(b) for b in boxes]
    return of


def _draw_grid(ax, grid: Grid, regions: _Regions, title: str, cmap) -> None:
    """Rank boxes of ``grid``, ranks holding the same region in the same colour."""
    cols, rows = _arrangement(grid)
    colours: dict[Hashable, int] = {}
    labels = grid.size <= 64
    for k, rank in enumerate(grid.ranks):
        held, lines = regions(rank)
        colour = cmap(colours.setdefault(held, len(colours)) % 20) if held else "white"
        x, y = k % cols, rows - 1 - k // cols
        ax.add_patch(_rectangle((x + 0.05, y + 0.05), 0.9, 0.9, colour, labels))
        if labels:
            text = f"{rank}\n{_coord(grid, rank)}"
            if grid.size <= 16:
                text += "\n" + "\n".join(lines)
            ax.text(x + 0.5, y + 0.5, text, ha="center", va="center",
                    fontsize=6 if grid.size <= 8 else 5)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{title}\n{grid!r}; same colour = same region", fontsize=9)


def _rectangle(xy, w, h, colour, edge: bool):
    from matplotlib.patches import Rectangle

    return Rectangle(xy, w, h, facecolor=colour, edgecolor="black", linewidth=0.5 if edge else 0)


def _heat(p: Plan, matrix: dict[tuple[int, int], int]):
    """The matrix as a dense array in ``unit`` (blocks of ranks when there are many)."""
    import numpy as np

    ranks = _ranks(p)
    index = {r: i for i, r in enumerate(ranks)}
    block = max(1, -(-len(ranks) // PNG_MATRIX_CELLS))
    n = -(-len(ranks) // block)
    dense = np.zeros((n, n))
    for (s, d), b in matrix.items():
        dense[index[s] // block, index[d] // block] += b
    unit, scale = _unit(int(dense.max()) if n else 0)
    return dense / scale, unit, ranks, block


def draw_png(p: Plan, path: str) -> None:
    """Draw ``p`` to ``path``: src grid, dst grid, and the rank x rank transfer heat map."""
    figure = _figure_class()
    _check_writable(path)
    import numpy as np
    from matplotlib import colormaps

    held, needed, steps, headline = _Account(p).picture()
    fig = figure(figsize=(16, 5.5), layout="constrained")
    left, middle, right = fig.subplots(1, 3, width_ratios=[1, 1, 1.25])
    cmap = colormaps["tab20"]
    src_partial = getattr(p.src, "partial", ())
    partial = f" (partial over {','.join(src_partial)})" if src_partial else ""
    _draw_grid(left, p.src.grid, held, f"src {p.src.describe()}{partial}", cmap)
    _draw_grid(middle, p.dst.grid, needed, f"dst {p.dst.describe()}", cmap)
    dense, unit_name, ranks, block = _heat(p, transfer_matrix(p))
    masked = np.ma.masked_equal(dense, 0.0)
    image = right.imshow(masked, cmap="viridis", interpolation="nearest", vmin=0)
    fig.colorbar(image, ax=right, label=f"{unit_name} sent")
    unit = "rank" if block == 1 else f"block of {block} ranks"
    right.set_xlabel(f"receiver ({unit})")
    right.set_ylabel(f"sender ({unit})")
    if block == 1 and len(ranks) <= 32:
        right.set_xticks(range(len(ranks)), [str(r) for r in ranks], fontsize=6)
        right.set_yticks(range(len(ranks)), [str(r) for r in ranks], fontsize=6)
    bound = format_bytes(p.max_lower_bound, 2)
    right.set_title(f"bytes sent, {steps} step(s): max recv "
                    f"{format_bytes(p.max_recv, 2)}/rank, bound {bound}", fontsize=9)
    fig.suptitle(headline, fontsize=10)
    try:
        fig.savefig(path, format="png", dpi=110)
    except OSError as err:
        raise MimoFxError(f"cannot write png {path!r}: {err.strerror or err}") from None
