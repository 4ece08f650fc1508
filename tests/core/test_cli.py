"""The command lines: the sample bridge's plan, any layout pair, clear errors; the main
job's arguments."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

import mimo_fx.__main__ as cli
from mimo_fx.__main__ import main

F32 = 4
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def test_default_prints_sample_bridge_with_bytes_per_rank(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "(dp b) s h on Grid(tp=2, dp=4)" in out
    assert "(dp b) (cp s) h [zigzag cp] on Grid(tp=2, cp=2, dp=2)" in out
    rows = [line for line in out.splitlines() if re.match(r"\s*\d+\s+tp\d", line)]
    assert len(rows) == 8
    # b=8 s=4096 h=4096 bf16: each rank needs 2x2048x4096 and holds half of it -> 32 MiB
    assert all("32.00 MiB" in row and row.rstrip().endswith("1.00") for row in rows)


def test_pipelined_pair_on_disjoint_grids(capsys):
    args = ["plan", "--src-grid", "tp=2,pp=2,dp=2", "--src-at", "pp=-1",
            "--dst-grid", "tp=2,cp=2,dp=2,offset=8", "--sizes", "b=8,s=64,h=32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # the exchange as messages inside the groups that exchange data, not over all 16
    assert re.search(r"^\s+1\. all_to_all as messages in \(2,8,10\) \(3,9,11\) \(6,12,14\) "
                     r"\(7,13,15\) of 16 ranks", out, flags=re.M)
    assert re.search(r"^\s+2\. all_gather over \(8,9\)", out, flags=re.M)


@pytest.mark.parametrize("args,message", [
    (["--src-grid", "tp=2,dp"], "expected name=integer pairs"),
    (["--src", "(dp b) s hh"], "must name the same dims"),
    (["--dtype", "float99"], "not a torch dtype"),
    (["--sizes", "b=8,s=4095,h=4"], "not divisible by 4"),
    (["--dst-zigzag", "ep"], "unknown axis 'ep'"),
])
def test_errors_exit_2_with_message(args, message, capsys):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_dst_zigzag_defaults_to_cp_only_where_dst_cuts_over_cp(capsys):
    assert main(["plan", "--dst-grid", "tp=2,dp=2", "--dst", "(dp b) s (tp h)"]) == 0
    assert "zigzag" not in capsys.readouterr().out
    assert main(["plan", "--dst-zigzag", "none"]) == 0
    out = capsys.readouterr().out
    assert "(dp b) (cp s) h on Grid(tp=2, cp=2, dp=2)" in out and "zigzag" not in out


def test_a_given_layout_zigzags_only_when_told_as_a_layout_does(capsys):
    """Before, --dst-zigzag defaulted to 'auto', so '(cp t) h' silently became zigzag
    (unlike Layout); only the sample bridge (no --dst, no --dst-grid) zigzags now."""
    ragged = ["--src-grid", "dp=2", "--src", "(dp t) h", "--src-ragged", "dp",
              "--sizes", "t=30:18,h=4"]
    for dst in (["--dst-grid", "cp=2,offset=2", "--dst", "(cp t) h"],
                ["--dst-grid", "cp=2,offset=2"]):
        args = ragged + dst + (["--dst", "(cp t) h"] if "--dst" not in dst else [])
        assert main(["plan", *args]) == 0
        assert "zigzag" not in capsys.readouterr().out, args
    assert main(["plan", "--dst", "(dp b) (cp s) h"]) == 0
    assert "zigzag" not in capsys.readouterr().out
    assert main(["plan", "--dst-grid", "cp=2,offset=2", "--dst", "(cp t) h", "--dst-zigzag",
                 "cp", *ragged[:6], "--sizes", "t=32:16,h=4"]) == 0
    assert "(cp t) h [zigzag cp]" in capsys.readouterr().out


def test_an_exchange_counts_transfers_and_pairs_apart(capsys):
    """Before: "4 transfers: 0->1, 0->2" (two pairs)."""
    assert main(["plan", "--src-grid", "dp=1", "--src", "t h", "--dst-grid", "cp=2,offset=1",
                 "--dst", "(cp t) h", "--dst-zigzag", "cp", "--sizes", "t=8,h=4"]) == 0
    assert "4 transfers between 2 pairs of ranks: 0->1, 0->2" in capsys.readouterr().out


def test_plan_and_explain_show_the_backward(capsys):
    args = ["--src-grid", "dp=2", "--src", "(dp t) h", "--src-ragged", "dp", "--dst-grid",
            "cp=2,offset=2", "--dst", "(cp t) h", "--sizes", "t=30:18,h=4"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    back = out.split("backward (gradients from dst back to src):")[1]
    assert "plan (cp t) h on Grid(cp=2, offset=2)\n  -> (dp t) h [ragged dp]" in back
    assert "2->0, 3->0, 3->1" in back
    assert main(["explain", *args]) == 0
    out = capsys.readouterr().out
    back = out.split("the backward: gradients from dst back to src (the adjoint plan)")[1]
    assert "collectives: all_to_all as messages" in back and "transfer matrix" in back
    assert "max received 240 B/rank vs lower bound 240 B" in back


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "(default: tp=2,cp=2,dp=2)" in capsys.readouterr().out


def _bytes_table(out: str) -> dict[int, dict[str, int]]:
    """The printed rank table: per rank, bytes ``sent``, ``received`` and ``bound``."""
    lines = out.split("recv/bound")[1].splitlines()[2:]
    table = {}
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != 7 or not cells[0].isdigit():
            break

        def n(cell: str) -> int:
            value, unit = cell.split()
            return round(float(value) * UNITS[unit])

        table[int(cells[0])] = {"sent": n(cells[3]), "received": n(cells[4]),
                                "bound": None if cells[5] == "-" else n(cells[5])}
    return table


def test_ragged_src_counts_per_rank(capsys):
    """dp=4 holding 3, 0, 5 and 2 tokens -> (dp t) (tp h) on the same 4 ranks."""
    counts, h = (3, 0, 5, 2), 8
    args = ["plan", "--src-grid", "dp=4", "--src", "(dp t) h", "--src-ragged", "dp",
            "--dst-grid", "tp=2,dp=2", "--dst", "(dp t) (tp h)",
            "--sizes", f"t={':'.join(map(str, counts))},h={h}", "--dtype", "float32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "(dp t) h [ragged dp] on Grid(dp=4)" in out and "t=(3, 0, 5, 2)" in out
    table = _bytes_table(out)
    starts = [sum(counts[:k]) for k in range(5)]
    for rank in range(4):
        dp = rank // 2                                  # rank = tp + 2 * dp
        need = set(range(5 * dp, 5 * dp + 5))          # t=10 cut evenly over dp=2
        held = set(range(starts[rank], starts[rank + 1]))
        want = len(need - held) * (h // 2) * F32        # each rank keeps half of h
        assert table[rank]["received"] == table[rank]["bound"] == want, rank
    assert sum(r["sent"] for r in table.values()) == sum(r["received"] for r in table.values())


def _zigzag_tokens(lengths: list[int], cp: int, c: int, offset: int = 0) -> list[int]:
    """Tokens cp rank ``c`` holds of samples of ``lengths`` packed from ``offset``: each
    padded to a multiple of 2*cp and cut in 2*cp chunks, chunks c and 2*cp-1-c."""
    out = []
    for n in lengths:
        chunk = -(-n // (2 * cp))
        for k in (c, 2 * cp - 1 - c):
            out += [offset + i for i in range(k * chunk, (k + 1) * chunk) if i < n]
        offset += n
    return out


@pytest.mark.parametrize("select", [None, [0, 1, 2, 7, 8, 12, 17]])
def test_packed_dst_rows_per_cp_rank(select, capsys):
    """An encoder on dp=2 (11 and 7 rows) -> samples [5, 6] and [7] packed over cp=2 in
    two dp groups, on ranks 2-5; with --dst-select, only some tokens (image tokens)."""
    groups, h = [[5, 6], [7]], 4
    counts = (11, 7) if select is None else (4, 3)
    args = ["explain", "--src-grid", "dp=2", "--src", "(dp t) h", "--src-ragged", "dp",
            "--dst-grid", "cp=2,dp=2,offset=2", "--dst", "t h", "--dst-packed", "5,6/7",
            "--sizes", f"t={counts[0]}:{counts[1]},h={h}", "--dtype", "float32"]
    if select is not None:
        args += ["--dst-select", ",".join(map(str, select))]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = _bytes_table(out)
    for dp, lengths in enumerate(groups):
        for c in range(2):
            tokens = _zigzag_tokens(lengths, 2, c, offset=11 * dp)
            rows = tokens if select is None else [j for j, g in enumerate(select)
                                                  if g in tokens]
            rank = 2 + c + 2 * dp
            assert table[rank]["received"] == table[rank]["bound"] == len(rows) * h * F32
            for s in (0, 1):   # encoder rank s holds rows [0, counts[0]) or the rest
                mine = [g for g in rows if (g < counts[0]) == (s == 0)]
                line = re.search(rf"^  {s} -> {rank}: (\d+) rows, ", out, flags=re.M)
                assert (int(line.group(1)) if line else 0) == len(mine), (s, rank)
    assert table[0]["sent"] == counts[0] * h * F32 and table[1]["sent"] == counts[1] * h * F32


def test_dtensor_sides_map_like_the_interop(capsys):
    """Mesh dp x tp (2, 2), Shard(0) and Partial() -> the same mesh, Shard(0) and Shard(1):
    each rank reduce-scatters with its tp peer."""
    args = ["plan", "--src-mesh", "dp=2,tp=2", "--src-placements", "Shard(0),Partial()",
            "--dst-mesh", "dp=2,tp=2", "--dst-placements", "Shard(0), Shard(1)",
            "--sizes", "b=4,s=8", "--dtype", "float32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("src: DTensor on mesh dp=2,tp=2 with Shard(0),Partial() is (dp b) s [partial tp] "
            "on Grid(tp=2, dp=2)") in out
    assert "dst: DTensor on mesh dp=2,tp=2 with Shard(0), Shard(1) is (dp b) (tp s)" in out
    # rank 2*dp + tp: the partial sums of its b[2dp:2dp+2] x s[4tp:4tp+4] from its peer
    assert all(row["received"] == 2 * 4 * F32 for row in _bytes_table(out).values())


def test_dtensor_uneven_dim_keeps_dtensors_chunk_sizes(capsys):
    """b=5 over 4 ranks: torch.chunk gives 2, 2, 1, 0 rows (tensor_split would give 2, 1,
    1, 1); replicating it, rank r receives the rows it lacks."""
    args = ["plan", "--src-mesh", "dp=4", "--src-placements", "Shard(0)",
            "--dst-mesh", "dp=4", "--dst-placements", "Replicate()",
            "--sizes", "b=5,h=2", "--dtype", "float32"]
    assert main(args) == 0
    table = _bytes_table(capsys.readouterr().out)
    assert [table[r]["received"] for r in range(4)] == [(5 - n) * 2 * F32 for n in (2, 2, 1, 0)]


def test_dtensor_to_a_packed_llm_on_other_ranks(capsys):
    """A DTensor encoder output (mesh dp=2, Shard(0)) -> samples [3, 5] packed over cp=2
    on ranks 2-3."""
    args = ["plan", "--src-mesh", "dp=2", "--src-placements", "Shard(0)",
            "--dst-grid", "cp=2,offset=2", "--dst", "t h", "--dst-packed", "3,5",
            "--sizes", "t=8,h=2", "--dtype", "float32"]
    assert main(args) == 0
    table = _bytes_table(capsys.readouterr().out)
    for c in range(2):
        assert table[2 + c]["received"] == len(_zigzag_tokens([3, 5], 2, c)) * 2 * F32


RAGGED = ["--src-grid", "dp=4", "--src", "(dp t) h", "--dst-grid", "tp=2,dp=2",
          "--dst", "(dp t) (tp h)"]
PACKED = ["--src-grid", "dp=2", "--src", "(dp t) h", "--src-ragged", "dp",
          "--dst-grid", "cp=2,dp=2,offset=2", "--dst", "t h"]
MESH = ["--dst-mesh", "cp=4,offset=4", "--dst-placements", "Shard(1)", "--sizes", "b=4,s=8"]
SRC_MESH = ["--src-mesh", "dp=2,tp=2", "--src-placements", "Shard(0),Replicate()"]


@pytest.mark.parametrize("args,message", [
    # ragged
    ([*RAGGED, "--src-ragged", "dp", "--sizes", "t=10,h=8"],
     "--sizes t=10: '(dp t) h [ragged dp]' cuts 't' ragged, so give its counts separated by "
     "':', one per shard (4), e.g. t=3:3:2:2"),
    ([*RAGGED, "--sizes", "t=3:0:5:2,h=8"],
     "--sizes t=3:0:5:2 gives counts, but no layout cuts 't' ragged: give one size (t=10)"),
    ([*RAGGED, "--src-ragged", "dp", "--sizes", "h=8"], "--sizes t=?: "),
    ([*RAGGED, "--src-ragged", "dp", "--sizes", "t=3:x:5,h=8"], "a ragged dim's counts"),
    ([*RAGGED, "--src-ragged", "dp", "--sizes", "t=3:-1:5:3,h=8"], "counts are token counts"),
    ([*RAGGED, "--src-ragged", "dp", "--sizes", "t=3:0:5,h=8"], "give a multiple of 4 counts"),
    ([*RAGGED, "--src-ragged", "pp", "--sizes", "t=3:0:5:2,h=8"],
     "ragged= names unknown axis 'pp'"),
    ([*RAGGED, "--src-ragged", "dp", "--sizes", "t=3:0:5:2,h=8,w=2"],
     "--sizes names ['w'], which neither layout has"),
    ([*RAGGED, "--src-ragged", "dp", "--sizes", "t=3:0:5:2,h=0"],
     "--sizes 'h=0': a size is a positive integer"),
    ([*RAGGED, "--src-ragged", "dp", "--sizes", "t=3:0:5:2,h=8,t=4"], "names 't' twice"),
    # packed
    ([*PACKED, "--dst-packed", "5,6", "--sizes", "t=5:6,h=4"],
     "--dst-packed '5,6' gives 1 group(s) of sample lengths but --dst-grid has 2 dp group(s)"),
    ([*PACKED, "--dst-packed", "5,x/3", "--sizes", "t=5:6,h=4"],
     "--dst-packed '5,x': expected integers separated by commas"),
    ([*PACKED, "--dst-packed", "5,-6/3", "--sizes", "t=5:6,h=4"], "= -6 is negative"),
    ([*PACKED, "--dst-packed", "5,6/3", "--sizes", "t=5:6,h=4"],
     "holds 14 rows but the sizes of ('t',) give 11"),
    ([*PACKED, "--dst-packed", "5/6", "--dst-zigzag", "tp", "--sizes", "t=5:6,h=4"],
     "a packed layout zigzags over cp or not at all; give 'cp' or 'none'"),
    ([*PACKED, "--dst-packed", "5/6", "--dst-partial", "cp", "--sizes", "t=5:6,h=4"],
     "--dst-partial: --dst-packed lays out whole samples"),
    ([*PACKED, "--dst-packed", "5/6", "--dst", "(cp t) h", "--sizes", "t=5:6,h=4"],
     "names grid axes ['cp']; a packed pattern names the token dim and the features only"),
    ([*PACKED, "--dst-select", "1,2", "--sizes", "t=1:1,h=4"],
     "give the sample lengths with --dst-packed too"),
    ([*PACKED, "--dst-packed", "5/6", "--dst-select", "1,20", "--sizes", "t=1:1,h=4"],
     "--dst-select '1,20': selected tokens [20] fall outside the batch's 11 tokens"),
    # DTensor
    (["--src-mesh", "dp=2,tp=2", *MESH], "needs both --src-mesh (e.g. dp=2,tp=2) and "
                                         "--src-placements"),
    (["--src-placements", "Shard(0)", *MESH], "needs both --src-mesh"),
    (["--src-mesh", "dp=2,tp=2", "--src-placements", "Shard(0)", *MESH],
     "has 2 dims but 1 placements ('Shard(0)',) are given; give one per mesh dim"),
    (["--src-mesh", "dp=2,tp=2", "--src-placements", "Shard(0),Foo()", *MESH],
     "placement 'Foo()' on mesh dim 1: not a placement; use Shard(dim), Replicate() or "
     "Partial()"),
    (["--src-mesh", "dp=2,tp=2", "--src-placements", "Shard(2),Replicate()", *MESH],
     "tensor dim 2 is out of range for a 2-dim tensor"),
    (["--src-mesh", "dp=2,tp=2", "--src-placements", "Shard(0),Partial(max)", *MESH],
     "Partial reduce op 'max' is not supported"),
    (["--src-mesh", "dp=2,tp=0", "--src-placements", "Shard(0),Replicate()", *MESH],
     "--src-mesh 'dp=2,tp=0': give each mesh dim's size (>= 1)"),
    (["--src-mesh", "dp=2,b=2", "--src-placements", "Shard(0),Replicate()", *MESH],
     "names mesh dim 'b', which --sizes names as a tensor dim too; rename one of them"),
    ([*SRC_MESH, "--src-grid", "dp=4", "--src-partial", "tp", *MESH],
     "--src-grid and --src-partial: --src-mesh and --src-placements give src's grid"),
    ([*SRC_MESH, *MESH, "--dst-zigzag", "cp"], "--dst-zigzag: a DTensor shard is contiguous"),
    ([*SRC_MESH, *MESH, "--sizes", ""], "--sizes '' names no dims; a DTensor src takes its "
                                        "tensor dims from --sizes"),
    (["--src-mesh", "dp=2,dp=2", "--src-placements", "Shard(0),Replicate()", *MESH],
     "--src-mesh 'dp=2,dp=2' names 'dp' twice"),
    ([*SRC_MESH, *MESH[:4], "--sizes", "b=4:4,s=8"],
     "--sizes b=4:4 gives counts, but a DTensor (--src-mesh) has one size per dim; give b=8"),
])
@pytest.mark.parametrize("command", ["plan", "explain"])
def test_new_layout_errors_exit_2_with_message(command, args, message, capsys):
    assert main([command, *args]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: ") and message in out.err, out.err
    assert "Traceback" not in out.err and not out.out


def _documented_commands() -> list[list[str]]:
    """The command lines of this module's docstring and of docs/layouts.md."""
    from pathlib import Path

    text = cli.__doc__ + (Path(__file__).parents[2] / "docs" / "layouts.md").read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    return [shlex.split(line.strip()[len("python -m mimo_fx "):], comments=True)
            for line in joined.splitlines() if line.strip().startswith("python -m mimo_fx ")]


def test_documented_command_lines_run(tmp_path, monkeypatch, capsys):
    commands = _documented_commands()
    kinds = [" ".join(c) for c in commands]
    for option in ("--src-ragged", "--dst-packed", "--src-mesh"):
        assert any(option in k for k in kinds), option
    monkeypatch.chdir(tmp_path)  # (a --png command writes there)
    plotting = importlib.util.find_spec("matplotlib") is not None
    for argv in commands:
        if "--png" in argv and not plotting:
            continue
        assert main(argv) == 0, argv
        assert "error" not in capsys.readouterr().err


def test_the_main_job_checks_its_arguments_before_spawning(capsys, monkeypatch):
    """``python -m mimo_fx.jobs`` runs the end-to-end job's command line, which refuses a
    run without steps before any world is spawned."""
    import importlib
    import runpy

    from mimo_fx.jobs import e2e

    monkeypatch.setattr("sys.argv", ["python -m mimo_fx.jobs", "--steps", "0"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("mimo_fx.jobs", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 2
    assert "--steps 0: need at least one step" in capsys.readouterr().err
    assert importlib.import_module("mimo_fx.jobs.__main__").main is e2e.main
