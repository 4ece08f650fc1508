"""Every mimo_fx benchmark in one command, results written under ``bench/results/``.

    python bench/all.py            # full runs (about 14 minutes on 2 cores)
    python bench/all.py --quick    # fewer sizes and calls, results not written
    python bench/all.py --before /work/wt/old-380e8b4   # versions.py against that checkout

Runs, one after the other so they do not disturb each other's timings:

1. ``plan_quality.py``: bytes per rank vs the lower bound and a leader-based bridge at
   8-4096 ranks, the alpha-beta cluster model, image-token delivery vs the seed scheme;
   writes ``plan_quality.txt`` and ``.png``.
2. ``plan_speed.py``: planning time, whole world to 4096 ranks and one rank's part to
   65,536 ranks -> ``plan_speed.txt``.
3. ``dtensor_compare.py``: measured on 8 gloo processes, mimo_fx vs DTensor vs an
   eager leader-based bridge vs the bare collectives -> ``dtensor_compare_gloo8.txt``.
4. ``compiled_speed.py``: redistribute vs the bare collectives it lowers to, call
   overhead, compile time -> ``compiled_speed_gloo8.txt``.
5. ``variable_sizes.py``: a new size per rank at 8-4096 ranks, the size gather's cost,
   a compiled training loop with the length changing every step vs a fixed length
   -> ``variable_sizes.txt``.
6. ``vlm_step.py``: a real VLM step (a tiny HF LLaVA, FSDP2 + DTensor TP, 4 gloo ranks):
   mimo_fx vs a hand-written isend/irecv bridge vs all-gathering every image row
   -> ``vlm_step.txt`` (skipped without transformers).
7. ``balance.py``: balanced MIMO batches over 100 steps of a skewed multimodal
   distribution: the busiest rank's cost over the mean (encoder and LLM), naive vs
   balanced, the bytes balancing moves, and the step time on 8 gloo processes
   -> ``balance.txt``.
8. ``megatron_compare.py``: Megatron-Core's own bridge communicators (colocated and
   pipelined) beside mimo_fx's Redistributor (eager, compiled) and Bridge, 8 gloo ranks,
   64 KiB to 16 MiB -> ``megatron_compare.txt`` (needs Megatron-Core: ``--megatron
   PATH`` or ``--fetch``, passed on).
9. ``overlap.py``: a posted bridge call overlapping independent compute against the
   serial step, 4 gloo ranks -> ``overlap.txt``.
10. ``versions.py``: a bridge's eager call overhead in this tree against an older checkout
   (``--before PATH``, passed on), and what checked mode and the per-collective naming
   cost now -> ``versions.txt``. Without ``--before`` it measures this tree alone and
   writes nothing.
11. ``gather_messages.py``: an all-gather of one row per rank on 4 and 8 gloo ranks,
   through the group's first member, direct, and gloo's own -> ``gather_messages.txt``.

Each results file starts with the command, the date and the machine (CPUs, load
average, torch); the load matters: 8 processes on a busy 2-core machine time noise.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# (script, results file or None when the script writes its own)
SUITE = (
    ("plan_quality.py", None),
    ("plan_speed.py", "plan_speed.txt"),
    ("dtensor_compare.py", None),  # writes dtensor_compare_gloo8.txt itself
    ("compiled_speed.py", "compiled_speed_gloo8.txt"),
    ("variable_sizes.py", "variable_sizes.txt"),
    ("vlm_step.py", None),  # writes vlm_step.txt itself
    ("balance.py", "balance.txt"),
    ("megatron_compare.py", None),  # writes megatron_compare.txt itself
    ("overlap.py", "overlap.txt"),
    ("overlap.py --ranks 2", "overlap_2.txt"),
    ("versions.py", None),  # writes versions.txt itself, given --before
    ("gather_messages.py", "gather_messages.txt"),
)


def _machine() -> str:
    import torch

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, load average {load}, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="each script's --quick; nothing is written")
    parser.add_argument("--only", nargs="+", metavar="SCRIPT",
                        choices=sorted({s.split()[0] for s, _ in SUITE}),
                        help="run only these scripts")
    parser.add_argument("--megatron", metavar="PATH",
                        help="megatron_compare.py: a megatron_core wheel or tree (else its "
                             "cache, or --fetch)")
    parser.add_argument("--fetch", action="store_true",
                        help="megatron_compare.py: pip-download Megatron-Core if not cached")
    parser.add_argument("--before", metavar="PATH",
                        help="versions.py: a checkout of the older commit to compare against")
    args = parser.parse_args(argv)
    failed = []
    for script, out in SUITE:
        if args.only and script.split()[0] not in args.only:
            continue
        name, *extra = script.split()
        cmd = [sys.executable, os.path.join(HERE, name), *extra]
        if args.quick:
            cmd.append("--quick")
            if script == "plan_quality.py":
                cmd.append("--no-save")
        if script == "megatron_compare.py":
            cmd += (["--megatron", args.megatron] if args.megatron else []) + (
                ["--fetch"] if args.fetch else [])
        if script == "versions.py" and args.before:
            cmd += ["--before", args.before]
        header = (f"# python bench/{name}{' '.join([''] + cmd[2:])}, "
                  f"{datetime.date.today().isoformat()}; machine: {_machine()}")
        print(f"\n== {script} ==\n{header}", flush=True)
        start = time.perf_counter()
        # stderr (progress) goes straight to the terminal; stdout is the report
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        print(proc.stdout, end="", flush=True)
        print(f"[{script}: {time.perf_counter() - start:.0f} s, exit {proc.returncode}]")
        if proc.returncode != 0:
            failed.append(script)
        elif out and not args.quick:
            with open(os.path.join(RESULTS, out), "w") as f:
                f.write(header + "\n" + proc.stdout)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    if not args.quick:
        print(f"\nresults written under {os.path.relpath(RESULTS)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
