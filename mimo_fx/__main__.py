"""Command line: ``python -m mimo_fx plan`` prints the plan of a bridge; ``explain``
says in detail who sends what to whom, and ``explain --png FILE`` draws it.

With no options both show the sample bridge encoder TP2xDP4 -> LLM TP2xCP2xDP2 (zigzag
CP), colocated on 8 ranks. Every layout piece is an option::

    python -m mimo_fx plan --src-grid tp=2,dp=4 --src "(dp b) s h" \\
        --dst-grid tp=2,cp=2,dp=2 --dst "(dp b) (cp s) h" --dst-zigzag cp \\
        --sizes b=8,s=4096,h=4096 --dtype bfloat16
    python -m mimo_fx explain --png plan.png     # same options, plus the picture

Either side may instead be ragged, packed or a DTensor mesh::

    # ragged: dp cuts t into shards of 3, 0, 5 and 2 tokens (counts separated by ':')
    python -m mimo_fx plan --src-grid dp=4 --src "(dp t) h" --src-ragged dp \\
        --dst-grid tp=2,dp=2 --dst "(dp t) (tp h)" --sizes t=3:0:5:2,h=8
    # packed: samples of 5 and 6 tokens packed over cp=2 (zigzag); dp groups split by '/'
    python -m mimo_fx explain --src-grid dp=2 --src "(dp t) h" --src-ragged dp \\
        --dst-grid cp=2,offset=2 --dst "t h" --dst-packed 5,6 --sizes t=5:6,h=4
    # DTensor: a mesh (dim sizes, slowest first) and one placement per mesh dim; the
    # tensor's dims are the --sizes dims, in order
    python -m mimo_fx plan --src-mesh dp=2,tp=2 --src-placements "Shard(0),Replicate()" \\
        --dst-mesh cp=4,offset=4 --dst-placements "Shard(1)" --sizes b=4,s=8

Malformed input prints ``error: ...`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from math import prod

import torch

from .errors import MimoFxError
from .explain import draw_png, explain, rank_table
from .grid import Grid
from .layout import Layout
from .packed import PackedLayout
from .plan import backward_plan, plan
from .regions import Size

__all__ = ["main", "rank_table"]

AUTO = "auto"
SAMPLE_ZIGZAG = {"dst": "cp"}  # the sample bridge's zigzag (see _sample_zigzag)


def _pairs(text: str, what: str) -> dict[str, int]:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            number = int(value)
        except ValueError:
            raise MimoFxError(f"{what} {text!r}: expected name=integer pairs separated by "
                              f"commas, e.g. 'tp=2,dp=4', got {item!r}") from None
        if name.strip() in out:
            raise MimoFxError(f"{what} {text!r} names {name.strip()!r} twice; give it once")
        out[name.strip()] = number
    return out


def _sizes(text: str) -> dict[str, Size]:
    """``--sizes``: ``name=size`` pairs; a ragged dim's counts separated by ':'."""
    out: dict[str, Size] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        try:
            if not name.strip():
                raise ValueError
            counts = tuple(int(c) for c in value.split(":"))
        except ValueError:
            raise MimoFxError(f"--sizes {text!r}: expected name=size pairs separated by "
                              f"commas, e.g. 'b=8,s=4096', a ragged dim's counts separated "
                              f"by ':' (t=3:0:5), got {item!r}") from None
        if ":" in value and min(counts) < 0:
            raise MimoFxError(f"--sizes {item!r}: counts are token counts >= 0, got "
                              f"{min(counts)}")
        if ":" not in value and counts[0] < 1:
            raise MimoFxError(f"--sizes {item!r}: a size is a positive integer (a ragged "
                              f"dim's counts, which may be 0, are separated by ':')")
        if name.strip() in out:
            raise MimoFxError(f"--sizes {text!r} names {name.strip()!r} twice; give it once")
        out[name.strip()] = counts if ":" in value else counts[0]
    return out


def _ints(text: str, what: str, example: str) -> list[int]:
    try:
        return [int(p) for p in filter(None, (p.strip() for p in text.split(",")))]
    except ValueError:
        raise MimoFxError(f"{what} {text!r}: expected integers separated by commas, e.g. "
                          f"{example!r}") from None


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(filter(None, (p.strip() for p in (text or "").split(","))))


def _zigzag(text: str | None, grid: Grid, pattern: str) -> tuple[str, ...]:
    if text != AUTO:
        return () if text in (None, "none") else _names(text)
    # auto: cp zigzag when the layout cuts a dim over cp, as Megatron's CP does
    return ("cp",) if "cp" in grid.names and "cp" in re.findall(r"\w+", pattern) else ()


def _option(side: str, dest: str) -> str:
    return f"--{side}" + (f"-{dest}" if dest else "")


def _refuse(args, side: str, dests: tuple[str, ...], why: str) -> None:
    """Refuse the options of ``side`` given on the command line that ``why`` replaces."""
    given: set[str] = getattr(args, "given", set())
    names = [_option(side, d) for d in dests if (f"{side}_{d}" if d else side) in given]
    if names:
        raise MimoFxError(f"{' and '.join(names)}: {why}; drop "
                          f"{'them' if len(names) > 1 else 'it'}")


def _layout(args, side: str, sizes: dict[str, Size]) -> Layout | PackedLayout:
    """``side``'s layout: a DTensor's, a packed one, or a box layout (ragged or not)."""
    opts = {k[len(side) + 1:]: v for k, v in vars(args).items() if k.startswith(f"{side}_")}
    if opts["mesh"] is not None or opts["placements"] is not None:
        return _mesh_layout(args, side, sizes)
    if opts["select"] is not None and opts["packed"] is None:
        raise MimoFxError(f"--{side}-select {opts['select']!r} picks tokens of a packed "
                          f"layout; give the sample lengths with --{side}-packed too")
    grid = Grid(**_pairs(opts["grid"], f"--{side}-grid"))
    pattern = getattr(args, side)
    if opts["packed"] is not None:
        return _packed_layout(args, side, grid, pattern)
    at = _pairs(opts["at"] or "", f"--{side}-at") or None
    return Layout(grid, pattern, partial=_names(opts["partial"]), at=at,
                  zigzag=_zigzag(_sample_zigzag(args, side, opts["zigzag"]), grid, pattern),
                  ragged=_names(opts["ragged"]))


def _sample_zigzag(args, side: str, zigzag: str | None) -> str | None:
    """``--{side}-zigzag``, or, for the sample bridge's side (neither its pattern nor its
    grid given), the sample's zigzag: a layout given on the command line zigzags only
    when told, as ``Layout`` does."""
    given: set[str] = getattr(args, "given", set())
    if zigzag is None and not {side, f"{side}_grid"} & given:
        return SAMPLE_ZIGZAG.get(side)
    return zigzag


def _packed_layout(args, side: str, grid: Grid, pattern: str) -> PackedLayout:
    """``--{side}-packed``: one packing of the given sample lengths per dp group."""
    _refuse(args, side, ("partial", "at", "ragged"), f"--{side}-packed lays out whole "
            f"samples (cut over cp per sequence, replicated over the other axes)")
    text = getattr(args, f"{side}_packed")
    lengths = [_ints(g, f"--{side}-packed", "5,6/3,2") for g in text.split("/")]
    groups = grid.axis_size("dp") if "dp" in grid.names else 1
    if len(lengths) != groups:
        raise MimoFxError(f"--{side}-packed {text!r} gives {len(lengths)} group(s) of sample "
                          f"lengths but --{side}-grid has {groups} dp group(s); give one per "
                          f"dp group, separated by '/', e.g. {'/'.join(['5,6'] * groups)!r}")
    axes = sorted(set(re.findall(r"\w+", pattern)) & set(grid.names))
    if axes:
        raise MimoFxError(f"--{side} {pattern!r} names grid axes {axes}; a packed pattern "
                          f"names the token dim and the features only, e.g. 't h' (the cut "
                          f"over cp follows from the lengths)")
    zigzag = getattr(args, f"{side}_zigzag")
    if zigzag not in (None, AUTO, "none", "cp"):
        raise MimoFxError(f"--{side}-zigzag {zigzag!r}: a packed layout zigzags over cp or "
                          f"not at all; give 'cp' or 'none'")
    try:
        layout = PackedLayout(grid, pattern, lengths,
                              zigzag="cp" in grid.names if zigzag in (None, AUTO)
                              else zigzag == "cp")
    except MimoFxError as err:
        raise MimoFxError(f"--{side}-packed {text!r}: {err}") from None
    select = getattr(args, f"{side}_select")
    if select is None:
        return layout
    try:
        return layout.select(_ints(select, f"--{side}-select", "0,1,2,7"))
    except MimoFxError as err:
        raise MimoFxError(f"--{side}-select {select!r}: {err}") from None


def _mesh_layout(args, side: str, sizes: dict[str, Size]) -> Layout:
    """``--{side}-mesh`` and ``--{side}-placements``: DTensor's layout, as
    :func:`~mimo_fx.interop.dtensor.layout_from_dtensor` maps it."""
    from .interop.dtensor import layout_from_dtensor

    _refuse(args, side, ("grid", "", "partial", "at", "ragged", "packed", "select"),
            f"--{side}-mesh and --{side}-placements give {side}'s grid and layout (a Partial() "
            f"placement makes a mesh dim partial)")
    mesh, placements = getattr(args, f"{side}_mesh"), getattr(args, f"{side}_placements")
    if mesh is None or placements is None:
        raise MimoFxError(f"a DTensor {side} needs both --{side}-mesh (e.g. dp=2,tp=2) and "
                          f"--{side}-placements (one per mesh dim, e.g. 'Shard(0),Replicate()')")
    if getattr(args, f"{side}_zigzag") not in (None, AUTO, "none"):
        raise MimoFxError(f"--{side}-zigzag: a DTensor shard is contiguous; drop it")
    shape = {d: n for d, n in sizes.items() if isinstance(n, int)}
    for d, n in sizes.items():
        if isinstance(n, tuple):
            raise MimoFxError(f"--sizes {d}={':'.join(map(str, n))} gives counts, but a "
                              f"DTensor (--{side}-mesh) has one size per dim; give {d}={sum(n)}")
    if not shape:
        raise MimoFxError(f"--sizes {args.sizes!r} names no dims; a DTensor {side} takes its "
                          f"tensor dims from --sizes, in order (e.g. b=4,s=8)")
    dims = _pairs(mesh, f"--{side}-mesh")
    offset = dims.pop("offset", 0)
    bad = {n: k for n, k in dims.items() if k < 1}
    if not dims or bad or offset < 0:
        raise MimoFxError(f"--{side}-mesh {mesh!r}: give each mesh dim's size (>= 1), slowest "
                          f"first, and an optional offset >= 0, e.g. 'dp=2,tp=2,offset=4'")
    clash = [n for n in dims if n in shape]
    if clash:
        raise MimoFxError(f"--{side}-mesh {mesh!r} names mesh dim {clash[0]!r}, which --sizes "
                          f"names as a tensor dim too; rename one of them")
    ranks = torch.arange(offset, offset + prod(dims.values())).reshape(tuple(dims.values()))
    text = [p.strip() for p in re.split(r",(?![^(]*\))", placements) if p.strip()]
    try:
        layout, _ = layout_from_dtensor(ranks, text, tuple(shape.values()), dims=tuple(shape),
                                        mesh_dim_names=tuple(dims))
    except MimoFxError as err:
        raise MimoFxError(f"--{side}-mesh {mesh!r} --{side}-placements {placements!r}: "
                          f"{err}") from None
    return layout


def _check_sizes(sizes: dict[str, Size], src, dst) -> None:
    """Sizes for dims of the layouts only; counts (``t=3:5``) exactly for the dims a
    layout cuts ragged."""
    unknown = [d for d in sizes if d not in src.dims and d not in dst.dims]
    if unknown:
        raise MimoFxError(f"--sizes names {unknown}, which neither layout has; src "
                          f"{src.describe()!r} has dims {list(src.dims)}")
    ragged = {d: lay for lay in (dst, src) if isinstance(lay, Layout) for d in lay.ragged_dims}
    for d, n in sizes.items():
        if isinstance(n, tuple) and d not in ragged:
            raise MimoFxError(f"--sizes {d}={':'.join(map(str, n))} gives counts, but no layout "
                              f"cuts {d!r} ragged: give one size ({d}={sum(n)}), or name the "
                              f"axes cutting it with --src-ragged / --dst-ragged")
    for d, lay in ragged.items():
        given = sizes.get(d)
        if not isinstance(given, tuple):
            k = lay.shards(d)
            whole = given if isinstance(given, int) else 2 * k
            example = ":".join(str(whole // k + (i < whole % k)) for i in range(k))
            raise MimoFxError(f"--sizes {d}={'?' if given is None else given}: "
                              f"{lay.describe()!r} cuts {d!r} ragged, so give its counts "
                              f"separated by ':', one per shard ({k}), e.g. {d}={example}")


class _Given(argparse.Action):
    """Store the value and note the option as given (a mesh or a packed layout refuses
    the options it replaces)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def _add_side(p: argparse.ArgumentParser, side: str, grid: str, pattern: str,
              zigzag: str | None) -> None:
    def add(name: str, **kw) -> None:
        p.add_argument(_option(side, name), action=_Given, **kw)

    add("grid", default=grid, help="axis=size pairs[,offset=N]")
    add("", default=pattern, help=f"{side} pattern")
    add("partial", help=f"comma-separated partial axes of {side}")
    add("at", help=f"pin {side} to a slice of its grid, e.g. pp={-1 if side == 'src' else 0}")
    add("zigzag", default=zigzag,
        help=f"zigzag axes of {side} ('none' for none, as a Layout has by default; the "
             f"sample bridge, with neither --{side} nor --{side}-grid given, zigzags "
             f"{SAMPLE_ZIGZAG.get(side) or 'nothing'}); '{AUTO}': cp when {side} cuts a "
             f"dim over cp (a packed {side}: when its grid has cp)")
    add("ragged", metavar="AXES",
        help=f"axes cutting a dim of {side} into shards of given counts (e.g. dp); the dim's "
             f"--sizes are its counts, e.g. t=3:0:5:2")
    add("packed", metavar="LENGTHS",
        help=f"make {side} a packed layout of samples of these lengths, one packing per dp "
             f"group, cut over cp per sequence: lengths by ',', dp groups by '/' (e.g. "
             f"5,6/3,2); the pattern names the token dim and features ('t h')")
    add("select", metavar="TOKENS",
        help=f"keep only these tokens of the packed {side} (e.g. image tokens 0,1,2,7)")
    add("mesh", metavar="DIMS",
        help=f"make {side} a DTensor on a mesh of these dim sizes, slowest first (as "
             f"init_device_mesh), e.g. dp=2,tp=2[,offset=N]; tensor dims are the --sizes "
             f"dims, in order")
    add("placements", metavar="PLACEMENTS",
        help=f"one DTensor placement per dim of --{side}-mesh, e.g. 'Shard(0),Replicate()' "
             f"(Shard(i), Replicate(), Partial())")


def _add_layout_options(p: argparse.ArgumentParser) -> None:
    _add_side(p, "src", "tp=2,dp=4", "(dp b) s h", None)
    _add_side(p, "dst", "tp=2,cp=2,dp=2", "(dp b) (cp s) h", None)
    p.add_argument("--sizes", default="b=8,s=4096,h=4096",
                   help="global dim sizes; a ragged dim's counts separated by ':' (t=3:0:5)")
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
    sizes = _sizes(args.sizes)
    src, dst = _layout(args, "src", sizes), _layout(args, "dst", sizes)
    _check_sizes(sizes, src, dst)
    return (plan(src, dst, sizes, dtype),  # type: ignore[arg-type]
            backward_plan(src, dst, sizes, dtype))  # type: ignore[arg-type]


def _print_meshes(args, p) -> None:
    """For a DTensor side, the layout its mesh and placements map to."""
    for side in ("src", "dst"):
        mesh = getattr(args, f"{side}_mesh")
        if mesh is not None:
            layout = getattr(p, side)
            print(f"{side}: DTensor on mesh {mesh} with {getattr(args, f'{side}_placements')} "
                  f"is {layout.describe()} on {layout.grid!r}")
    if args.src_mesh is not None or args.dst_mesh is not None:
        print()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        p, back = _plan(args)
        _print_meshes(args, p)
        if args.command == "explain":
            print(explain(p, back), end="")
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
    print()
    print("backward (gradients from dst back to src):")
    print(back)
    return 0


if __name__ == "__main__":
    sys.exit(main())
