"""The command lines: the sample bridge's plan, any layout pair, clear errors; the main
job's arguments."""

from __future__ import annotations

import re

import pytest

from mimo_fx.__main__ import main


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


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "(default: tp=2,cp=2,dp=2)" in capsys.readouterr().out


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
