"""``python -m mimo_fx.gpu_check``: its answer on a machine without CUDA, and its
one-GPU checks rehearsed on the CPU (``--device cpu``), the code it runs on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mimo_fx import gpu_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks what a machine without CUDA says")
def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu_check.txt"
    done = subprocess.run([sys.executable, "-m", "mimo_fx.gpu_check", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device on this machine" in done.stdout
    assert out.read_text().splitlines()[-1].startswith("no CUDA device")


@pytest.mark.slow
def test_the_one_gpu_checks_pass_rehearsed_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.txt"
    done = subprocess.run([sys.executable, "-m", "mimo_fx.gpu_check", "--device", "cpu",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    lines = out.read_text().splitlines()
    assert done.returncode == 0, "\n".join(lines) + done.stderr[-3000:]
    verdicts = [line for line in lines if line.startswith(("ok", "FAIL"))]
    assert [v.split(":")[0] for v in verdicts] == [
        "ok   lowered table", "ok   row route", "ok   one-rank world"], lines
    assert lines[-1] == "3 passed, 0 failed"


def test_the_checks_adapt_to_the_gpus_present():
    names = {n: [name for name, _ in gpu_check.checks(n, torch.device("cpu"))]
             for n in (0, 1, 2, 8)}
    one = ["lowered table", "row route", "one-rank world"]
    assert names[0] == names[1] == one
    assert names[2] == [*one, "NCCL table sample"]
    assert names[8] == [*one, "NCCL table sample", "Megatron side by side"]
