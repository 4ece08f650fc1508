"""Command line: ``python -m mimo_fx plan`` prints the plan of a bridge; ``explain``
says in detail who sends what to whom, and ``explain --png FILE`` draws it.

With no options both show the sample bridge encoder TP2xDP4 -> LLM TP2xCP2xDP2 (zigzag
CP), colocated on 8 ranks. Every layout piece is an option::

    python -m mimo_fx plan --src-grid tp=2,dp=4 --src "(dp b) s h" \\
        --dst-grid tp=2,cp=2,dp=2 --dst "(dp b) (cp s) h" --dst-zigzag cp \\
        --sizes b=8,s=4096,h=4096 --dtype bfloat16
    python -m mimo_fx explain --png plan.png     # same options, plus the picture

Malformed input prints ``error: ...`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from .errors import MimoFxError
from .explain import draw_png, explain, rank_table
from .grid import Grid
from .layout import Layout
from .plan import plan

__all__ = ["main", "rank_table"]


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


def _zigzag(text: str | None, grid: Grid, pattern: str) -> tuple[str, ...]:
    if text != AUTO:
        return () if text in (None, "none") else _names(text)
    # auto: cp zigzag when the layout cuts a dim over cp, as Megatron's CP does
    return ("cp",) if "cp" in grid.names and "cp" in re.findall(r"\w+", pattern) else ()


def _layout(args, side: str) -> Layout:
    grid = Grid(**_pairs(getattr(args, f"{side}_grid"), f"--{side}-grid"))
    at = _pairs(getattr(args, f"{side}_at") or "", f"--{side}-at") or None
    pattern = getattr(args, side)
    return Layout(grid, pattern, partial=_names(getattr(args, f"{side}_partial")),
                  at=at, zigzag=_zigzag(getattr(args, f"{side}_zigzag"), grid, pattern))


AUTO = "auto"


def _add_layout_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src-grid", default="tp=2,dp=4", help="axis=size pairs[,offset=N]")
    p.add_argument("--src", default="(dp b) s h", help="src pattern")
    p.add_argument("--src-partial", help="comma-separated partial axes of src")
    p.add_argument("--src-at", help="pin src to a slice of its grid, e.g. pp=-1")
    p.add_argument("--src-zigzag", default=None,
                   help=f"zigzag axes of src, '{AUTO}' for cp when src cuts a dim over cp")
    p.add_argument("--dst-grid", default="tp=2,cp=2,dp=2", help="axis=size pairs[,offset=N]")
    p.add_argument("--dst", default="(dp b) (cp s) h", help="dst pattern")
    p.add_argument("--dst-partial", help="comma-separated partial axes of dst")
    p.add_argument("--dst-at", help="pin dst to a slice of its grid, e.g. pp=0")
    p.add_argument("--dst-zigzag", default=AUTO,
                   help=f"zigzag axes of dst ('none' for none); '{AUTO}': cp when dst cuts "
                        f"a dim over cp")
    p.add_argument("--sizes", default="b=8,s=4096,h=4096", help="global dim sizes")
    p.add_argument("--dtype", default="bfloat16", help="torch dtype name")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mimo_fx",
                                     description="Plans of mimo_fx redistributions.")
    sub = parser.add_subparsers(dest="command", required=True)
    formatter = argparse.ArgumentDefaultsHelpFormatter
    _add_layout_options(sub.add_parser(
        "plan", formatter_class=formatter,
        help="print the plan of one bridge, step by step and per rank"))
    explain_parser = sub.add_parser(
        "explain", formatter_class=formatter,
        help="who sends what to whom: holdings, transfer matrix, transfers, bytes vs the lower "
             "bound; --png draws it")
    _add_layout_options(explain_parser)
    explain_parser.add_argument("--png", metavar="FILE",
                                help="also draw the grids and the transfer matrix "
                                     "(needs matplotlib)")
    return parser


def _plan(args):
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise MimoFxError(f"--dtype {args.dtype!r} is not a torch dtype; e.g. bfloat16, "
                          f"float32")
    src, dst = _layout(args, "src"), _layout(args, "dst")
    return plan(src, dst, _pairs(args.sizes, "--sizes"), dtype)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        p = _plan(args)
        if args.command == "explain":
            print(explain(p), end="")
            if args.png:
                draw_png(p, args.png)
                print(f"\nwrote {args.png}")
            return 0
    except MimoFxError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(p)
    print()
    print(rank_table(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
