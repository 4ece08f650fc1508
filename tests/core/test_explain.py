"""The plan explainer: transfer matrices against hand math and the oracle, the CLI's
text and picture, and its errors."""

from __future__ import annotations

import re
import struct
import sys
from math import prod

import pytest

from mimo_fx import Grid, Layout, plan
from mimo_fx.__main__ import main
from mimo_fx.explain import transfer_matrix
from mimo_fx.reference.oracle import shard_index

F32 = 4


@pytest.mark.parametrize("src,dst,sizes,expected", [
    # disjoint grids, same layout: each rank's whole shard to its counterpart
    (Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(dp=2, offset=2), "(dp b) h"),
     {"b": 4, "h": 8}, {(0, 2): 2 * 8 * F32, (1, 3): 2 * 8 * F32}),
    # colocated fan-in: each rank gets the other half of b
    (Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(tp=2), "b h"),
     {"b": 4, "h": 8}, {(0, 1): 2 * 8 * F32, (1, 0): 2 * 8 * F32}),
    # partial -> sharded h: each rank sends the other its partial sums of the other's half
    (Layout(Grid(tp=2), "b h", partial=("tp",)), Layout(Grid(tp=2), "b (tp h)"),
     {"b": 4, "h": 8}, {(0, 1): 4 * 4 * F32, (1, 0): 4 * 4 * F32}),
    # fan-out: a narrow of what each rank holds, nothing moves
    (Layout(Grid(tp=2, dp=1), "(dp b) h"), Layout(Grid(tp=1, dp=2), "(dp b) h"),
     {"b": 4, "h": 8}, {}),
])
def test_matrix_of_simple_bridges_by_hand(src, dst, sizes, expected):
    assert transfer_matrix(plan(src, dst, sizes, F32)) == expected


def _missing_bytes(src: Layout, dst: Layout, sizes: dict[str, int], rank: int) -> int:
    """Bytes ``rank`` needs under dst and does not hold under src, from the oracle's
    per-dim index sets (a box is the product of its dims' index sets)."""
    need = [set(i.tolist()) for i in shard_index(dst, rank, sizes)]
    total = prod(map(len, need))
    if rank in src.grid and src.holds(rank):
        held = dict(zip(src.dims, (set(i.tolist()) for i in shard_index(src, rank, sizes))))
        total -= prod(len(n & held[d]) for d, n in zip(dst.dims, need))
    return total * F32


ORACLE_CASES = [
    (Layout(Grid(tp=2, dp=4), "(dp b) s h"),
     Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag=("cp",)),
     {"b": 8, "s": 16, "h": 4}),
    (Layout(Grid(tp=2, pp=2, dp=2), "(dp b) s h", at={"pp": -1}),
     Layout(Grid(tp=2, cp=2, dp=2, offset=8), "(dp b) (cp s) h", zigzag=("cp",)),
     {"b": 8, "s": 16, "h": 4}),
    (Layout(Grid(tp=4, dp=2), "(dp b) s (tp h)"), Layout(Grid(tp=2, dp=4), "(dp b) (tp s) h"),
     {"b": 8, "s": 6, "h": 8}),
]


@pytest.mark.parametrize("src,dst,sizes", ORACLE_CASES)
def test_matrix_columns_are_what_the_oracle_says_is_missing(src, dst, sizes):
    p = plan(src, dst, sizes, F32)
    matrix = transfer_matrix(p)
    received: dict[int, int] = {}
    sent: dict[int, int] = {}
    for (s, d), n in matrix.items():
        assert s != d and n > 0
        received[d] = received.get(d, 0) + n
        sent[s] = sent.get(s, 0) + n
    for rank in dst.holders:
        assert received.get(rank, 0) == _missing_bytes(src, dst, sizes, rank), rank
    assert sent == p.bytes_sent and received == p.bytes_recv


def _printed_matrix(out: str) -> dict[tuple[int, int], float]:
    lines = out.split("transfer matrix (")[1].splitlines()
    unit = re.match(r"(\w+) sent", lines[0]).group(1)
    receivers = [int(c) for c in lines[1].split()[1:]]
    cells = {}
    for line in lines[3:]:
        if not line.strip():
            break
        sender, *row = line.split()
        cells.update({(int(sender), r): float(v) for r, v in zip(receivers, row) if v != "."})
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    return {k: v * scale for k, v in cells.items()}


def test_explain_prints_the_sample_matrix_and_bound(capsys):
    assert main(["explain", "--sizes", "b=8,s=64,h=32", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    src = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    dst = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag=("cp",))
    sizes = {"b": 8, "s": 64, "h": 32}
    cells = _printed_matrix(out)
    # rank 0 (dp0 tp0 on the encoder) misses samples 2:4 on its zigzag half of s, which
    # only ranks 2 and 3 hold; the plan takes them from its own tp index, rank 2
    assert cells[2, 0] == 2 * 32 * 32 * F32
    for rank in range(8):
        column = sum(n for (_, d), n in cells.items() if d == rank)
        assert column == _missing_bytes(src, dst, sizes, rank)
    assert "ratio 1.00" in out and "collectives: all_gather in 4 group(s) of 2" in out
    assert re.search(r"^0\s+tp0 dp0\s+b\[0:2\]\s+tp0 cp0 dp0\s+b\[0:4\] s\[0:16\] \+ "
                     r"b\[0:4\] s\[48:64\]$", out, flags=re.M)


def test_explain_lists_transfers_of_an_all_to_all(capsys):
    args = ["explain", "--src-grid", "tp=2,pp=2,dp=2", "--src-at", "pp=-1",
            "--dst-grid", "tp=2,cp=2,dp=2,offset=8", "--dst-zigzag", "cp",
            "--sizes", "b=8,s=64,h=32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "transfers of step 1 (sender -> receiver: elements, bytes, region):" in out
    # dst replica dp0 (ranks 8-11) takes samples 0:4 from src dp0's last stage (ranks 2, 3)
    pieces = re.findall(r"^  (\d+) -> (\d+): ", out, flags=re.M)
    assert pieces and all(int(d) in range(8, 12) for s, d in pieces if int(s) in (2, 3))
    assert ("all_to_all as messages in 4 group(s) of 16 ranks (16 transfers), then all_gather "
            "in 4 group(s) of 2") in out


def test_png_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert main(["explain", "--sizes", "b=8,s=64,h=32", "--png", str(path)]) == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > height > 200
    assert f"wrote {path}" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--src-grid", "tp=2,dp=x"], "expected name=integer pairs"),
    (["--dst-grid", "tp=0,dp=2"], "axis sizes must be positive"),
    (["--dst", "(dp b) (cp s h"], "(dp b) (cp s h"),
    (["--sizes", "b=8,s=4096"], "sizes miss dims ['h']"),
    (["--sizes", "b=8,s=4095,h=4"], "not divisible by 4"),
    (["--dtype", "float99"], "not a torch dtype"),
    (["--png", "/nonexistent-folder/plan.png"], "does not exist"),
])
def test_errors_exit_2_with_message(args, message, capsys):
    assert main(["explain", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_png_into_a_directory_is_an_error(tmp_path, capsys):
    assert main(["explain", "--png", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_missing_matplotlib_names_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["explain", "--png", str(tmp_path / "p.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def _zigzag_tokens(lengths: list[int], cp: int, c: int, offset: int = 0) -> list[int]:
    """The tokens cp rank ``c`` holds of sequences of ``lengths`` packed from ``offset``:
    each padded to a multiple of 2*cp, chunks c and 2*cp-1-c, padding dropped."""
    out = []
    for n in lengths:
        chunk = -(-n // (2 * cp))
        for k in (c, 2 * cp - 1 - c):
            out += [offset + i for i in range(k * chunk, (k + 1) * chunk) if i < n]
        offset += n
    return out


def test_row_plan_lists_rows_per_transfer_and_draws(tmp_path):
    """Encoder DP2 holding 5 and 6 rows -> samples of 5 and 6 tokens packed over CP2."""
    pytest.importorskip("matplotlib")
    from mimo_fx.explain import draw_png, explain
    from mimo_fx.packed import PackedLayout

    src = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    dst = PackedLayout(Grid(cp=2, offset=2), "t h", [[5, 6]])
    p = plan(src, dst, {"t": (5, 6), "h": 4}, F32)
    text = explain(p)
    assert "(t=11, 16 B/row)" in text  # one dim, the rows: an element is a row
    held = {0: set(range(5)), 1: set(range(5, 11))}
    for c in range(2):
        need = set(_zigzag_tokens([5, 6], 2, c))
        assert p.lower_bound[2 + c] == len(need) * 4 * F32  # none of it held
        for s in (0, 1):
            rows = sorted(need & held[s])
            line = re.search(rf"^  {s} -> {2 + c}: (\d+) rows, (\d+) B: ", text, flags=re.M)
            assert line and line.groups() == (str(len(rows)), str(len(rows) * 4 * F32))
    # rank 2 takes tokens 0,1 of the first sample and 0,1 (rows 5,6) of the second
    assert "2 -> 2" not in text and "  1 -> 2: 2 rows, 32 B: t[5:7]" in text
    assert re.search(r"^2 +- +nothing +cp0 +t\[0:2\] \+ t\[5:7\]$", text, flags=re.M)
    path = tmp_path / "rows.png"
    draw_png(plan(src, dst, {"t": (5, 6), "h": 4}, F32), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
