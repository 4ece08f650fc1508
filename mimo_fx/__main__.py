"""Command line: ``python -m mimo_fx plan`` prints the plan of a bridge.

With no options it shows the sample bridge encoder TP2xDP4 -> LLM TP2xCP2xDP2 (zigzag
CP), colocated on 8 ranks. Every layout piece is an option::

    python -m mimo_fx plan --src-grid tp=2,dp=4 --src "(dp b) s h" \\
        --dst-grid tp=2,cp=2,dp=2 --dst "(dp b) (cp s) h" --dst-zigzag cp \\
        --sizes b=8,s=4096,h=4096 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

from .errors import MimoFxError
from .grid import Grid
from .layout import Layout
from .plan import Plan, format_bytes, plan

__all__ = ["main"]


def _pairs(text: str, what: str) -> dict[str, int]:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = int(value)
        except ValueError:
            raise MimoFxError(f"{what} {text!r}: expected name=integer pairs separated by "
                              f"commas, e.g. 'tp=2,dp=4', got {item!r}") from None
    return out


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(filter(None, (p.strip() for p in (text or "").split(","))))


def _layout(args, side: str) -> Layout:
    grid = Grid(**_pairs(getattr(args, f"{side}_grid"), f"--{side}-grid"))
    at = _pairs(getattr(args, f"{side}_at") or "", f"--{side}-at") or None
    return Layout(grid, getattr(args, side), partial=_names(getattr(args, f"{side}_partial")),
                  at=at, zigzag=_names(getattr(args, f"{side}_zigzag")))


def _fmt2(n: int) -> str:
    return format_bytes(n, 2)


def rank_table(p: Plan) -> str:
    """Per rank: coordinates on both grids, bytes sent and received, the lower bound."""
    ranks = sorted(set(p.src.grid.ranks) | set(p.dst.grid.ranks))
    rows = []
    def coord(grid: Grid, r: int) -> str:
        return " ".join(f"{a}{i}" for a, i in grid.coord(r).items()) if r in grid else "-"

    for r in ranks:
        lower = p.lower_bound.get(r)
        recv = p.bytes_recv.get(r, 0)
        rows.append([r, coord(p.src.grid, r), coord(p.dst.grid, r), _fmt2(p.bytes_sent.get(r, 0)),
                     _fmt2(recv), "-" if lower is None else _fmt2(lower),
                     "-" if not lower else f"{recv / lower:.2f}"])
    return tabulate(rows, disable_numparse=True,
                    headers=["rank", "src coord", "dst coord", "sent", "received",
                                   "lower bound", "recv/bound"], tablefmt="simple")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mimo_fx",
                                     description="Plans of mimo_fx redistributions.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the plan of one bridge, step by step and per rank")
    p.add_argument("--src-grid", default="tp=2,dp=4", help="e.g. tp=2,dp=4[,offset=0]")
    p.add_argument("--src", default="(dp b) s h", help="src pattern")
    p.add_argument("--src-partial", help="comma-separated partial axes of src")
    p.add_argument("--src-at", help="pin src, e.g. pp=-1")
    p.add_argument("--src-zigzag", help="zigzag axes of src")
    p.add_argument("--dst-grid", default="tp=2,cp=2,dp=2")
    p.add_argument("--dst", default="(dp b) (cp s) h")
    p.add_argument("--dst-partial")
    p.add_argument("--dst-at")
    p.add_argument("--dst-zigzag", default="cp")
    p.add_argument("--sizes", default="b=8,s=4096,h=4096", help="global dim sizes")
    p.add_argument("--dtype", default="bfloat16", help="torch dtype name")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise MimoFxError(f"--dtype {args.dtype!r} is not a torch dtype; e.g. bfloat16, "
                              f"float32")
        src, dst = _layout(args, "src"), _layout(args, "dst")
        p = plan(src, dst, _pairs(args.sizes, "--sizes"), dtype)
    except MimoFxError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(p)
    print()
    print(rank_table(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
