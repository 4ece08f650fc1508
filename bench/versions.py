"""A bridge's eager call overhead in this tree against an older commit, and what checked
mode and the collectives' timeout bookkeeping cost now, measured in one run.

Two questions:

1. Is the eager per-call overhead of a ``Redistributor`` no worse in this tree than in
   an older one (``--before``, e.g. a checkout of ``380e8b4``, before the one-engine
   redesign)?
2. What do ``checked=True`` and the per-collective timeout naming cost per call now?

Cases: the ~16 KiB-per-rank rows of ``compiled_speed.py``'s table (float32, fixed sizes),
where the fixed per-call cost dominates; ``--quick`` takes the first three.

How. Each tree gets its own world of 8 gloo processes on 127.0.0.1, spawned by that
tree's ``mimo_fx.testing.run_world`` in a subprocess whose ``PYTHONPATH`` starts with an
*import root* for the tree: a temporary ``mimo_fx/`` holding symlinks to the tree's
``mimo_fx/*``, ``compiled/`` and ``reference/``, as ``pyproject.toml``'s package-dir
maps them (it comes before the editable install's finder, which setuptools appends to
``sys.meta_path``). Every rank checks that ``mimo_fx`` and ``mimo_fx.compiled`` resolve
into its tree and that no trace or profile hook is set (the worlds of this tree trace
calls only with ``MIMO_FX_TRACK_CALLS=1``, which the subprocesses do not inherit).

Both worlds are alive at once and take turns, passing a token through two FIFOs: only the
process holding it works (builds bridges, measures, tears down); every other process of
both worlds waits in a barrier or in a blocking read of its FIFO. Before any turn both worlds
have started, and after its last turn a world waits for the other's before it exits. So
a block of calls in the older tree and the same block in this tree follow each other
within milliseconds, every round, and a change of the machine's load hits both alike.
Per case:

- **Stubbed calls** (the method of ``compiled_speed.py``'s overhead column): the
  executor's comm moves nothing (each collective returns a new empty buffer of its
  output's size), and one rank times while every other process waits. A round gives
  each rank one turn per tree; in it the rank times four variants in *bursts*: one
  variant's first call, then ``--burst`` calls in a row, the variants' bursts in a random
  order (seeded: the same orders in both trees), ``--warmup`` untimed bursts each first,
  until each variant has ``--block`` timed calls after a first. Reported: per tree and
  variant the max over ranks of each rank's median over all rounds (the calls after a
  burst's first: warm calls, as in ``compiled_speed.py``'s 200 in a row); the same for
  the *first* calls (right after another variant's burst, whose work has left the
  caches: no variant always follows the same other one); ratios and differences; and,
  for noise, the range over rounds of the ratio or difference computed per round (a
  round's two turns are adjacent in time). Variants: *unchecked* (under ``no_grad``, as
  in ``compiled_speed.py``); *grad* (the same bridge, its input requiring grad: the
  ``autograd.Function`` path a training step's forward takes; the backward is not run);
  *checked* (``checked=True``; the header all-gather returns rows recorded from one real
  checked call, so the check's own CPU work is timed -- header, call counts, every rank's
  expected shape, the verdict -- without its collective); *naming off* (the unchecked
  bridge with its executor's ``name`` set to ``""`` for the burst, so it builds no
  per-collective *site* string, the name a failed or timed-out collective's error gives).
  The older tree names nothing: there *naming off* is the unchecked call again, an A/A
  control whose difference shows the method's resolution.
- **Checked with its collective** (real gloo, every rank calling, a barrier before each
  call, unchecked and checked interleaved in rotating order, ``--gloo-iters`` calls of
  each per round; per rank the median of the rounds' medians, max over ranks), in a
  world turn of its own each round.

Adapters (the two trees' APIs differ; only these lines do): the forward program is
``bridge.sizing.fwd_program`` now, ``bridge._fwd_program`` before; the executor holds a
comm per direction now (``executor.comms``; both replaced by the stub) and one
``executor.comm`` before; the stub implements each tree's comm interface
(``collective(kind, ...)`` now, a method per kind before) over one shared function, so
neither pays for the other's dispatch; the check's comm is ``bridge.guard.comm`` now,
``bridge._check_comm`` before. The stubs are this file's own rather than
``common.NullComm`` (``common.py`` imports names the old tree lacks).

Not timed: the collective's custom op (``mimo_fx::all_gather`` etc.), which now also
takes the site string, catches a failed wait to word its error and counts completed
calls (one ``Counter`` increment per collective); every stubbed call skips it in both
trees. The process groups' timeout (``MIMO_FX_TIMEOUT``) is an argument of the group,
not a per-call cost. Each rank's outputs of the unchecked, checked and naming-off calls
are compared once over real gloo.

    python bench/versions.py --before /work/wt/old-380e8b4   # writes results/versions.txt
    python bench/versions.py --before PATH --quick            # 3 cases, fewer calls
    python bench/versions.py                                   # this tree only

Make the older checkout with ``git worktree add --detach /work/wt/old-380e8b4 380e8b4``
(outside this tree). Without ``--before`` only this tree's checked and naming costs are
measured, and nothing is written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
RESULT = os.path.join(HERE, "results", "versions.txt")
WORLD = 8
ROUNDS, BLOCK, WARMUP, BURST, GLOO_ITERS = 5, 48, 2, 4, 12
QUICK_ROUNDS, QUICK_BLOCK, QUICK_GLOO_ITERS, QUICK_CASES = 3, 16, 4, 3
CASE_NAMES = ("fan-in TP2xDP4 -> TP2xCP2xDP2 zigzag", "equal TP2xDP4 -> TP4xDP2",
              "TP-sharded h -> replicated", "partial tp -> replicated",
              "pipelined disjoint 0-3 -> 4-7 (tp s)")


# -- the cases (built in the worlds, by the tree each imports) ---------------------------
def _cases() -> list[tuple]:
    """``compiled_speed.py``'s table at ~16 KiB per rank: (name, src, dst, sizes)."""
    from mimo_fx import Grid, Layout

    enc, llm = Grid(tp=2, dp=4), Grid(tp=2, cp=2, dp=2)
    small = {"b": 8, "s": 16, "h": 128}
    cases = [
        (Layout(enc, "(dp b) s h"), Layout(llm, "(dp b) (cp s) h", zigzag=("cp",)), small),
        (Layout(enc, "(dp b) s h"), Layout(Grid(tp=4, dp=2), "(dp b) s h"), small),
        (Layout(enc, "(dp b) s (tp h)"), Layout(enc, "(dp b) s h"),
         {"b": 8, "s": 16, "h": 256}),
        (Layout(enc, "(dp b) s h", partial=("tp",)), Layout(enc, "(dp b) s h"), small),
        (Layout(Grid(tp=2, dp=2), "(dp b) s h"),
         Layout(Grid(tp=2, dp=2, offset=4), "(dp b) (tp s) h"), {"b": 4, "s": 16, "h": 128}),
    ]
    return [(name, *case) for name, case in zip(CASE_NAMES, cases)]


# -- what differs between the trees ------------------------------------------------------
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _empty_output(kind: str, flat, ranks, out_splits):
    """A new buffer of a collective's output size, values unset (moves nothing). Spelled
    out per kind rather than taken from this tree's ``comm.OPS`` (as ``common.NullComm``
    does) so that both trees' stubs cost the same; :meth:`Api.stub` refuses a tree with
    a kind not here."""
    if kind == "all_gather":
        return flat.new_empty(flat.numel() * len(ranks))
    if kind == "reduce_scatter":
        return flat.new_empty(flat.numel() // len(ranks))
    if kind == "all_reduce":
        return flat.new_empty(flat.numel())
    if kind == "all_to_all":
        return flat.new_empty(sum(out_splits))
    raise ValueError(f"the stub comm knows no collective {kind!r}")


class _Posted:
    """A stubbed posted collective: its output, there at once."""

    def __init__(self, out) -> None:
        self.out = out

    def wait(self):
        return self.out


class NullComm:
    """The stub for this tree's comm interface: one method for every kind, and its
    posted form (``start``, whose handle's ``wait()`` gives the output), which trees
    since the overlap work's executor call."""

    def collective(self, kind, flat, ranks, out_splits=(), in_splits=(), site=""):
        return _empty_output(kind.value, flat, ranks, out_splits)

    def start(self, kind, flat, ranks, out_splits=(), in_splits=(), site=""):
        return _Posted(self.collective(kind, flat, ranks, out_splits, in_splits, site))


class OldNullComm:
    """The stub for the older interface: a method per kind."""

    def all_gather(self, flat, ranks):
        return _empty_output("all_gather", flat, ranks, ())

    def reduce_scatter(self, flat, ranks):
        return _empty_output("reduce_scatter", flat, ranks, ())

    def all_reduce(self, flat, ranks):
        return _empty_output("all_reduce", flat, ranks, ())

    def all_to_all(self, flat, out_splits, in_splits, ranks):
        return _empty_output("all_to_all", flat, ranks, out_splits)


class Recorder:
    """A check comm that passes the all-gather on and keeps its rows."""

    def __init__(self, real) -> None:
        self.real, self.rows = real, None

    def all_gather(self, flat, ranks):
        self.rows = self.real.all_gather(flat, ranks)
        return self.rows


class Replay:
    """A check comm that returns recorded rows (a new tensor each call, as a real one)."""

    def __init__(self, rows) -> None:
        self.rows = rows

    def all_gather(self, flat, ranks):
        return self.rows.clone()


class Api:
    """The bridge internals this bench reaches, in the tree it runs in: this tree
    (``bridge.sizing``, ``bridge.guard``, a comm per direction) or the older one."""

    def __init__(self, bridge) -> None:
        self.new = hasattr(bridge, "sizing")

    def program(self, bridge):
        return bridge.sizing.fwd_program if self.new else bridge._fwd_program

    def stub(self, bridge) -> None:
        if self.new:
            from mimo_fx.compiled.comm import OPS

            unknown = sorted(k.value for k in OPS if k.value not in KINDS)
            if unknown:
                raise RuntimeError(f"collective kinds {unknown} are new: give "
                                   f"versions._empty_output their output sizes")
            null = NullComm()
            bridge.executor.comms = {"forward": null, "backward": null}
            bridge.executor.comm = null
        else:
            bridge.executor.comm = OldNullComm()

    def check_comm(self, bridge):
        return bridge.guard.comm if self.new else bridge._check_comm

    def set_check_comm(self, bridge, comm) -> None:
        if self.new:
            bridge.guard.comm = comm
        else:
            bridge._check_comm = comm


# -- taking turns between the worlds -------------------------------------------------------
class Baton:
    """The token the worlds pass (see the module docstring): a FIFO per world; ``take``
    waits for a byte in this world's, ``give`` writes one to the other's. With no folder
    (one world) both do nothing."""

    def __init__(self, folder: str | None, mine: str, theirs: str) -> None:
        self.paths = (os.path.join(folder, mine), os.path.join(folder, theirs)) \
            if folder else None
        self.fds: tuple[int, int] | None = None

    def _open(self) -> tuple[int, int]:
        if self.fds is None:
            assert self.paths is not None
            self.fds = (os.open(self.paths[0], os.O_RDWR), os.open(self.paths[1], os.O_RDWR))
        return self.fds

    def take(self) -> None:
        if self.paths is not None:
            while not os.read(self._open()[0], 1):
                pass

    def give(self) -> None:
        if self.paths is not None:
            os.write(self._open()[1], b".")


class Turn:
    """``with Turn(rank, who, baton):`` the body runs while this world holds the token,
    taken and given back by rank ``who``, the world's ranks meeting in a barrier on both
    sides."""

    def __init__(self, rank: int, who: int, baton: Baton) -> None:
        self.rank, self.who, self.baton = rank, who, baton

    def __enter__(self) -> None:
        import torch.distributed as dist

        if self.rank == self.who:
            self.baton.take()
        dist.barrier()

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        if exc[0] is None:
            dist.barrier()
            if self.rank == self.who:
                self.baton.give()


# -- measuring (on every rank of a world) ---------------------------------------------------
def _where(tree: str) -> str:
    """Where this process's ``mimo_fx.compiled`` comes from; raises if not from ``tree``
    or if a trace or profile hook would slow the calls."""
    import mimo_fx
    import mimo_fx.compiled

    root = os.path.realpath(tree) + os.sep
    files = {m.__name__: os.path.realpath(str(m.__file__)) for m in (mimo_fx, mimo_fx.compiled)}
    wrong = {name: f for name, f in files.items() if not f.startswith(root)}
    if wrong:
        raise RuntimeError(f"imported from the wrong tree (expected {root}): {wrong}")
    if sys.gettrace() is not None or sys.getprofile() is not None:
        raise RuntimeError("a trace or profile hook is set: timings would be off")
    return files["mimo_fx.compiled"]


def _together(fns: dict, iters: int, warmup: int) -> dict[str, float]:
    """Per function, the median wall seconds of ``fn()``, every rank calling it after a
    barrier; interleaved, in rotating order (``common.timed``'s method)."""
    import torch.distributed as dist

    names = list(fns)
    wall: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            dist.barrier()
            start = time.perf_counter()
            fns[name]()
            if i >= warmup:
                wall[name].append(time.perf_counter() - start)
    return {name: statistics.median(wall[name]) for name in names}


def _block(variants: dict, block: int, warmup: int, burst: int,
           rng: random.Random) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """This rank alone: ``warmup`` untimed bursts of each variant, then bursts until each
    has ``block`` timed calls. A variant is (bridge, input, grad mode, executor name or
    None); a burst is one variant's first call and ``burst`` more in a row, the variants'
    bursts in a random order each time (what ran before a burst is then no variant's in
    particular). Returns the timed calls after a burst's first, and its first calls."""
    import torch

    names = list(variants)
    warm: dict[str, list[float]] = {name: [] for name in names}
    first: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + math.ceil(block / burst)):
        for name in rng.sample(names, len(names)):
            bridge, x, grad, executor_name = variants[name]
            torch.set_grad_enabled(grad)
            if executor_name is not None:
                saved, bridge.executor.name = bridge.executor.name, executor_name
            start = time.perf_counter()
            bridge(x)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                first[name].append(elapsed)
                for _ in range(burst):
                    start = time.perf_counter()
                    bridge(x)
                    warm[name].append(time.perf_counter() - start)
            if executor_name is not None:
                bridge.executor.name = saved
    torch.set_grad_enabled(True)
    return warm, first


def _case(rank: int, world: int, case: tuple, p: dict, baton: Baton) -> dict:
    import torch

    from mimo_fx.compiled import Redistributor

    name, src, dst, sizes = case
    with Turn(rank, 0, baton):  # build the bridges; one real call of each, compared
        plain = Redistributor(src, dst, sizes, torch.float32)
        checked = Redistributor(src, dst, sizes, torch.float32, checked=True)
        api = Api(plain)
        shape = api.program(plain).src_shape
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(shape, generator=gen) if shape is not None else None
        xg = x.detach().clone().requires_grad_() if x is not None else None
        with torch.no_grad():
            ys = [plain(x), checked(x)]
            if api.new:  # the same bridge, naming off
                named, plain.executor.name = plain.executor.name, ""
                ys.append(plain(x))
                plain.executor.name = named
        same = all(torch.equal(ys[0], y) for y in ys[1:])
        # one call under autograd by every rank together: the bridge decides there, once,
        # whether its source is frozen (a collective), which a stubbed "grad" burst later
        # run by one rank alone must find made
        plain(xg)
    gloo: dict[str, list[float]] = {"unchecked": [], "checked": []}
    for _ in range(p["rounds"]):  # checked mode with its collective
        with Turn(rank, 0, baton), torch.no_grad():
            medians = _together({"unchecked": lambda: plain(x), "checked": lambda: checked(x)},
                                p["gloo_iters"], 2)
        for k, v in medians.items():
            gloo[k].append(v)
    with Turn(rank, 0, baton), torch.no_grad():  # the check's rows, then the stubs
        recorder = Recorder(api.check_comm(checked))
        api.set_check_comm(checked, recorder)
        checked(x)
        api.set_check_comm(checked, Replay(recorder.rows))
        for b in (plain, checked):
            api.stub(b)
    # the same four variants in both trees; "naming off" in the older one (which names
    # nothing) is the unchecked call again: an A/A control of the method's noise
    variants = {"unchecked": (plain, x, False, None), "grad": (plain, xg, True, None),
                "checked": (checked, x, False, None),
                "naming off": (plain, x, False, "" if api.new else None)}
    rounds: dict[str, list[float]] = {k: [] for k in variants}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    firsts: dict[str, list[float]] = {k: [] for k in variants}
    rng = random.Random(p["seed"] * 1000 + rank)  # the same orders in both trees
    for _ in range(p["rounds"]):
        for turn in range(world):
            with Turn(rank, turn, baton):
                if rank == turn:
                    warm, first = _block(variants, p["block"], p["warmup"], p["burst"], rng)
                    for k, times in warm.items():
                        rounds[k].append(statistics.median(times))
                        samples[k] += times
                        firsts[k] += first[k]
    with Turn(rank, 0, baton):
        for b in (plain, checked):
            b.destroy()
    stubbed = {k: {"median": statistics.median(samples[k]), "rounds": rounds[k],
                   "first": statistics.median(firsts[k])} for k in variants}
    return {"case": name, "ops": len(api.program(plain).ops), "same": same,
            "stubbed": stubbed, "gloo": gloo}


def _world(rank: int, world: int, p: dict) -> dict:
    """One world's run (every rank): the cases in turns, then one empty turn so the
    other world's last turn finishes before this one exits."""
    import torch.distributed as dist

    where = _where(p["tree"])
    baton = Baton(p["baton"], p["mine"], p["theirs"])
    dist.barrier()
    if rank == 0 and p["ready"]:  # every rank is up: the driver may start the turns
        fd = os.open(p["ready"], os.O_RDWR)
        os.write(fd, b".")
        os.close(fd)
    cases = _cases()
    out = []
    for i in p["cases"]:
        start = time.perf_counter()
        out.append(_case(rank, world, cases[i], p, baton))
        if rank == 0:
            print(f"[progress] {p['label']}: {cases[i][0]}: {time.perf_counter() - start:.1f} s",
                  file=sys.stderr, flush=True)
    with Turn(rank, 0, baton):
        pass
    return {"where": where, "cases": out}


def _serve(params: dict) -> None:
    """A subprocess's part: this tree's world, its results as JSON."""
    from mimo_fx.testing import run_world

    where = _where(params["tree"])
    print(f"[progress] {params['label']}: mimo_fx.compiled from {where}", file=sys.stderr,
          flush=True)
    results = run_world(WORLD, _world, params, timeout=params["timeout"])
    with open(params["out"], "w") as f:
        json.dump(results, f)


# -- the driver ------------------------------------------------------------------------------
def _import_root(tree: str, folder: str) -> str:
    """A folder whose ``mimo_fx`` is ``tree``'s package, laid out as installed."""
    pkg = os.path.join(folder, "mimo_fx")
    os.makedirs(pkg)
    source = os.path.join(tree, "mimo_fx")
    for entry in sorted(os.listdir(source)):
        if entry != "__pycache__":
            os.symlink(os.path.join(source, entry), os.path.join(pkg, entry))
    for sub in ("compiled", "reference", "mimo", "interop", "jobs", "testing"):
        # (a folder of its own since the layers' folders moved out of mimo_fx/)
        if os.path.isdir(os.path.join(tree, sub)) and not os.path.exists(os.path.join(pkg, sub)):
            os.symlink(os.path.join(tree, sub), os.path.join(pkg, sub))
    return folder


def _commit(tree: str) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True,
                              check=False).stdout.strip()

    line = git("log", "-1", "--format=%h %s") or "(not a git checkout)"
    line = line if len(line) <= 80 else line[:77].rsplit(" ", 1)[0] + " ..."
    dirty = git("status", "--porcelain", "--", "mimo_fx", "compiled", "reference", "mimo",
                "interop", "jobs", "testing")
    return line + (" + uncommitted changes in the package" if dirty else "")


def _run_worlds(trees: dict[str, str], params: dict, timeout: float) -> dict[str, list]:
    """Spawn one world per tree (``before`` goes first), run them in turns, return each
    world's results."""
    with tempfile.TemporaryDirectory(prefix="mimo_fx_versions_") as tmp:
        labels = list(trees)
        two = len(labels) == 2
        for name in ["ready"] + labels:
            os.mkfifo(os.path.join(tmp, name))
        ready = os.open(os.path.join(tmp, "ready"), os.O_RDWR | os.O_NONBLOCK)
        procs, logs, outs = {}, {}, {}
        env = {k: v for k, v in os.environ.items()
               if k not in ("MIMO_FX_TRACK_CALLS", "MIMO_FX_DEBUG")}
        env["OMP_NUM_THREADS"] = "1"
        for i, label in enumerate(labels):
            root = _import_root(trees[label], os.path.join(tmp, f"root-{label}"))
            outs[label] = os.path.join(tmp, f"{label}.json")
            p = dict(params, label=label, tree=trees[label], out=outs[label],
                     ready=os.path.join(tmp, "ready"), baton=tmp if two else None,
                     mine=label, theirs=labels[1 - i] if two else label)
            sub_env = dict(env, PYTHONPATH=os.pathsep.join(
                [root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
            logs[label] = open(os.path.join(tmp, f"{label}.log"), "w+")  # noqa: SIM115
            procs[label] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve", json.dumps(p)],
                env=sub_env, stdout=logs[label], stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        started = 0
        shown = dict.fromkeys(labels, 0)
        try:
            while any(proc.poll() is None for proc in procs.values()):
                if started < len(labels):
                    try:
                        started += len(os.read(ready, 8))
                    except BlockingIOError:
                        pass
                    if started == len(labels) and two:  # both up: "before" takes the first turn
                        fd = os.open(os.path.join(tmp, labels[0]), os.O_RDWR)
                        os.write(fd, b".")
                        os.close(fd)
                _relay(logs, shown)
                failed = [lb for lb, proc in procs.items() if proc.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    why = (f"the {failed[0]} world failed" if failed
                           else f"no result within {timeout:.0f} s")
                    logs_text = "\n".join(f"--- {lb} ---\n{_tail(logs[lb])}" for lb in labels)
                    raise RuntimeError(f"{why}:\n{logs_text}")
                time.sleep(0.2)
            _relay(logs, shown)
        finally:
            for proc in procs.values():  # each in a session of its own, with its ranks
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it and its ranks are gone
                proc.wait()
            os.close(ready)
        results = {}
        for label in labels:
            with open(outs[label]) as f:
                results[label] = json.load(f)
            logs[label].close()
        return results


def _relay(logs: dict, shown: dict) -> None:
    """The worlds' progress lines, to stderr."""
    for label, log in logs.items():
        log.flush()
        with open(log.name, "rb") as f:
            f.seek(shown[label])
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        shown[label] += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith("[progress]"):
                print(" ", line[len("[progress] "):], file=sys.stderr, flush=True)


def _tail(log, lines: int = 40) -> str:
    log.flush()
    with open(log.name) as f:
        return "".join(f.readlines()[-lines:])


# -- the report --------------------------------------------------------------------------------
def _stat(results: list, case: int, part: str, variant: str) -> tuple[float, list[float]]:
    """Max over ranks of the per-rank medians (seconds), and per round the same max."""
    per_rank = [r["cases"][case][part][variant] for r in results]
    if part == "gloo":
        rounds = [max(v) for v in zip(*per_rank)]
        return max(statistics.median(v) for v in per_rank), rounds
    return (max(v["median"] for v in per_rank),
            [max(v) for v in zip(*(v["rounds"] for v in per_rank))])


def _span(values: list[float], fmt: str) -> str:
    return f"{fmt.format(min(values))} to {fmt.format(max(values))}"


def _table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    from tabulate import tabulate

    return title + "\n" + tabulate(rows, headers=headers, disable_numparse=True,
                                    colalign=("left",) + ("right",) * (len(headers) - 1))


def report(results: dict[str, list]) -> str:
    """The tables: (1) before -> after, (2) checked mode stubbed, (3) checked mode over
    real gloo, (4) the per-collective naming."""
    after = results["after"]
    before = results.get("before")
    cases = [c["case"] for c in after[0]["cases"]]
    us = 1e6

    def stat(res, i, variant, part="stubbed"):
        return _stat(res, i, part, variant)

    out = []
    if before is not None:
        rows, ratios = [], []
        for i, case in enumerate(cases):
            row = [case]
            for variant in ("unchecked", "grad"):
                (b, b_r), (a, a_r) = stat(before, i, variant), stat(after, i, variant)
                row += [f"{b * us:.1f}", f"{a * us:.1f}", f"{a / b:.2f}x",
                        _span([y / x for x, y in zip(b_r, a_r)], "{:.2f}")]
                ratios.append((variant, a / b))
                if variant == "unchecked":
                    bf, af = _first(before, i, variant), _first(after, i, variant)
                    row += [f"{bf * us:.1f}", f"{af * us:.1f}", f"{af / bf:.2f}x"]
                    ratios.append(("first", af / bf))
            rows.append(row)
        geo = {v: math.exp(statistics.fmean(math.log(r) for w, r in ratios if w == v))
               for v in ("unchecked", "first", "grad")}
        ops = [f"{case} {b} / {a}" for i, case in enumerate(cases)
               for b, a in [(before[0]["cases"][i]["ops"], after[0]["cases"][i]["ops"])]
               if b != a]
        out.append(_table(
            "1. Eager call overhead, collectives stubbed, before -> after (µs per call, max "
            "over ranks of per-rank medians; 'rounds': the after/before ratio in each round; "
            "'first': a burst's first call, right after another variant's burst)",
            ["case", "before µs", "after µs", "after/before", "rounds", "first: before µs",
             "after µs", "after/before", "grad: before µs", "after µs", "after/before",
             "rounds"], rows)
            + f"\n   geometric mean of after/before over the cases: {geo['unchecked']:.2f}x "
              f"unchecked (no_grad), {geo['first']:.2f}x its first calls, {geo['grad']:.2f}x "
              f"with grad; collectives per call " + (
                  "the same in both trees" if not ops else f"DIFFER: {'; '.join(ops)}"))
    rows = []
    for i, case in enumerate(cases):
        (u, u_r), (c, c_r) = stat(after, i, "unchecked"), stat(after, i, "checked")
        row = [case, f"{u * us:.1f}", f"{c * us:.1f}", f"{c / u:.2f}x", f"{(c - u) * us:+.1f}",
               _span([(y - x) * us for x, y in zip(u_r, c_r)], "{:+.1f}")]
        if before is not None:
            (bu, _), (bc, _) = stat(before, i, "unchecked"), stat(before, i, "checked")
            row += [f"{bu * us:.1f}", f"{bc * us:.1f}", f"{(bc - bu) * us:+.1f}",
                    f"{(c - u) / (bc - bu):.2f}x"]
        rows.append(row)
    headers = ["case", "unchecked µs", "checked µs", "checked/unchecked", "checked - unchecked",
               "rounds"]
    if before is not None:
        headers += ["before: unchecked µs", "checked µs", "checked - unchecked",
                    "after/before (of the difference)"]
    out.append(_table(
        "2. Checked mode's own CPU work, collectives stubbed (the header all-gather returns "
        "recorded rows; µs per call, max over ranks; 'rounds': the difference in each round)",
        headers, rows))
    rows = []
    for i, case in enumerate(cases):
        row = [case]
        for res in (after, before) if before is not None else (after,):
            (u, u_r), (c, c_r) = stat(res, i, "unchecked", "gloo"), stat(res, i, "checked", "gloo")
            row += [f"{u * 1e3:.2f}", f"{c * 1e3:.2f}", f"{c / u:.2f}x",
                    _span([y / x for x, y in zip(u_r, c_r)], "{:.2f}")]
        rows.append(row)
    headers = ["case", "unchecked ms", "checked ms", "checked/unchecked", "rounds"]
    if before is not None:
        headers += ["before: unchecked ms", "checked ms", "checked/unchecked", "rounds"]
    out.append(_table(
        f"3. Checked mode with its collective, real gloo ({WORLD} ranks calling, a barrier "
        f"before each call; ms per call, max over ranks of per-rank medians of the rounds)",
        headers, rows))
    rows = []
    for i, case in enumerate(cases):
        (u, u_r), (n, n_r) = stat(after, i, "unchecked"), stat(after, i, "naming off")
        row = [case, f"{u * us:.1f}", f"{n * us:.1f}", f"{(u - n) * us:+.1f}",
               _span([(x - y) * us for x, y in zip(u_r, n_r)], "{:+.1f}")]
        if before is not None:
            (bu, bu_r), (bn, bn_r) = stat(before, i, "unchecked"), stat(before, i, "naming off")
            row += [f"{(bu - bn) * us:+.1f}",
                    _span([(x - y) * us for x, y in zip(bu_r, bn_r)], "{:+.1f}"),
                    f"{n / bu:.2f}x"]
        rows.append(row)
    headers = ["case", "named µs", "naming off µs", "naming cost µs", "rounds"]
    if before is not None:
        headers += ["A/A control µs", "rounds", "naming off / before"]
    out.append(_table(
        "4. The per-collective naming (site strings for the timeout errors), this tree, "
        "collectives stubbed: the unchecked call with the executor's name and without it"
        + ("; A/A control: the before tree's unchecked call timed as two variants" if before
           is not None else ""), headers, rows))
    bad = sorted({c["case"] for res in results.values() for r in res for c in r["cases"]
                  if not c["same"]})
    out.append("Each rank's outputs of the unchecked, checked and naming-off calls over real "
               "gloo, compared once: " + (f"DIFFER in {bad}" if bad else "equal on every rank"))
    return "\n\n".join(out)


def _first(results: list, case: int, variant: str) -> float:
    """Max over ranks of the per-rank medians of a burst's first calls (seconds)."""
    return max(r["cases"][case]["stubbed"][variant]["first"] for r in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="PATH",
                        help="a checkout of the older commit to compare against (e.g. "
                             "/work/wt/old-380e8b4); without it only this tree is measured")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_CASES} cases, {QUICK_ROUNDS} rounds of "
                             f"{QUICK_BLOCK} calls; writes nothing")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--block", type=int, default=None,
                        help=f"timed stubbed calls per variant, rank and round "
                             f"(default {BLOCK})")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help=f"untimed bursts per variant, rank and round (default {WARMUP})")
    parser.add_argument("--burst", type=int, default=BURST,
                        help=f"timed calls in a row per burst (default {BURST})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gloo-iters", type=int, default=None,
                        help=f"real gloo calls per variant and round (default {GLOO_ITERS})")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--serve", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(json.loads(args.serve))
        return 0
    q = args.quick
    params = {"rounds": args.rounds or (QUICK_ROUNDS if q else ROUNDS),
              "block": args.block or (QUICK_BLOCK if q else BLOCK), "warmup": args.warmup,
              "burst": args.burst, "seed": args.seed,
              "gloo_iters": args.gloo_iters or (QUICK_GLOO_ITERS if q else GLOO_ITERS),
              "cases": list(range(QUICK_CASES if q else len(CASE_NAMES))),
              "timeout": args.timeout}
    trees = {"after": TREE}
    if args.before:
        before = os.path.realpath(args.before)
        if not os.path.isdir(os.path.join(before, "compiled")):
            parser.error(f"--before {args.before}: no compiled/ there (a checkout of the "
                         f"project?)")
        trees = {"before": before, "after": TREE}
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    head = [f"bridge call overhead across versions: {WORLD} gloo ranks per tree on 127.0.0.1, "
            f"float32, ~16 KiB per rank; {params['rounds']} rounds x {params['block']} "
            f"stubbed calls per variant and rank (bursts of {params['burst']} after an untimed "
            f"call, {params['warmup']} warm-up bursts), "
            f"{params['rounds']} x {params['gloo_iters']} real gloo calls per variant"]
    for label, tree in trees.items():
        head.append(f"{label}: {_commit(tree)}")  # (the commit, not where it is checked out)
    if not args.before:
        head.append("no --before: this tree only (checked mode and naming costs)")
    print("\n".join(head))
    machine = f"machine: {os.cpu_count()} CPUs, load average {load_before}"
    print(machine + "\n", flush=True)
    start = time.perf_counter()
    results = _run_worlds(trees, params, args.timeout)
    elapsed = time.perf_counter() - start
    text = report(results)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    tail = f"\nWorlds took {elapsed:.0f} s; load average after them {load}."
    print(text + "\n" + tail)
    if args.before and not q:
        import torch

        with open(RESULT, "w") as f:
            f.write(f"# python bench/versions.py --before CHECKOUT, "
                    f"{datetime.date.today().isoformat()}; torch {torch.__version__}\n"
                    + "\n".join(head) + "\n" + machine + "\n\n" + text + "\n" + tail + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
