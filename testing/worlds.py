"""Local worlds of processes that stay alive and run one function after another.

Starting a world costs seconds (every process joins the process group and warms up its
first compile). Its processes are forked from one server that imported :data:`PRELOAD`
once (spawned for NCCL or where the platform has none), each starting with its parent's
environment and streams of that moment (:class:`_Streams`). A :class:`SpawnedWorld`
pays the start once: each of its processes initialises its process
group, then runs the functions submitted with :meth:`SpawnedWorld.run` in turn, each as
``fn(rank, size, *args)`` on every rank, and the results come back by rank.
:class:`SpawnedWorlds` keeps one per key (size, backend, threads, record, env), for a
test session; :func:`~mimo_fx.testing.run_world` is a SpawnedWorld used once.

Failures are reported, never left hanging, and end the world:

- a function that does not finish within its timeout is killed, naming the ranks that
  never finished and where each one is (its innermost frames);
- a rank that raises has its traceback re-raised, the rank that failed by itself first
  (not a peer that failed only because it lost that rank), the earliest first; a rank
  that dies is named;
- the world is then torn down (its process groups may be desynchronised) and the next
  call spawns a new one. A function that destroys the default process group, or leaves
  bridges in ``mimo_fx.compiled``'s registry, retires its world the same way once its
  results are back.

Between two functions every process puts back what the first may have changed (see
:class:`_Baseline`): environment, working directory, torch's seed, default dtype, grad
mode and threads, Dynamo's caches and counters, the Dynamo, Inductor and functorch
configs, loggers and warning filters. Environment variables that must be set before the
process group exists go in ``env`` (part of the key): a world never sees its parent's
later changes to ``os.environ``.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

from mimo_fx.errors import MimoFxError

from . import touched

__all__ = ["SpawnedWorld", "WorldError", "SpawnedWorlds"]

FR_ENV = "TORCH_FR_BUFFER_SIZE"  # Flight Recorder, read by mimo_fx.compiled.trace
FR_ENTRIES = "20000"
# a Flight Recorder dump (compiled.trace.mark/since) reads every entry it holds, about
# 0.1 ms each: a world holding more than this many is not given another function
FR_REUSE_LIMIT = 1000
# what a world's processes start with: they are forked from one server that imported these
# once, where a process started afresh imports torch and its compiler itself (4-6
# CPU-seconds each, 8 processes for a world of 8 sharing 2 cores)
PRELOAD = ("torch", "torch.distributed", "torch.distributed._functional_collectives",
           "torch._dynamo", "torch._inductor.compile_fx", "torch._inductor.codegen.cpp",
           "torch.utils.cpp_extension")
# once a rank has failed, how long its peers get to report (they usually fail at once,
# having lost it) before the world is killed
GRACE = 30.0
# once every rank has finished a function, how long the barrier after it and the reset
# before the next may take (seconds on a loaded machine) before the world is killed with
# each rank's stack
AFTER = 120.0


class WorldError(MimoFxError, AssertionError):
    """A spawned world hung, lost a rank, or a rank raised (its traceback is the message)."""


# what a rank's error says when it failed only because another rank went away (or rank
# 0, which holds the store)
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "gloo/transport/tcp", "NCCL communicator was aborted",
              "Failed to recv, got 0 bytes")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- in each process of a world -----------------------------------------------------------

def _send(conn: Connection, message: tuple) -> None:
    try:
        conn.send_bytes(pickle.dumps(message))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the parent is gone or closed the world: nobody to tell


class _Streams:
    """The parent's standard streams at a process's start, which a spawned process
    inherits and one forked from a server would not (it gets the server's, from when the
    server started): they travel as duplicated file descriptors."""

    def __reduce__(self):
        return _Streams._apply, tuple(reduction.DupFd(fd) for fd in (1, 2))

    @staticmethod
    def _apply(*streams) -> None:
        for fd, stream in enumerate(streams, start=1):
            dup = stream.detach()
            os.dup2(dup, fd)
            os.close(dup)


def _context(backend: str):
    """Processes forked from a server that has imported :data:`PRELOAD` where the
    platform has one, else spawned; spawned for NCCL (a CUDA query made while the server
    imported torch would not survive a fork)."""
    if backend == "nccl" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # (no effect once the server runs)
    return ctx


def _serve(rank: int, size: int, port: int, conn: Connection, out_dir: str, backend: str,
           threads: int, env: dict[str, str], reuse: bool, streams: None = None) -> None:
    """One process of a world: join the process group, run functions until the parent
    closes the world, a function fails or the world cannot be reused. ``env`` is the
    whole environment (the parent's at the start, and the world's); ``streams`` were
    put in place while the arguments were read (see :class:`_Streams`)."""
    os.environ.clear()
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # inductor's compile pool would start processes (each importing torch) beyond the
    # rank's threads: 8 ranks on 2 cores compiled 20% slower with it
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
    if "torch._inductor.config" in sys.modules:  # imported before: read its env already
        setattr(sys.modules["torch._inductor.config"], "compile_threads",  # noqa: B010
                int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"]))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    touched.track()
    # where this rank is, on request: the parent asks ranks that hang (see _where_stuck)
    stack = open(os.path.join(out_dir, f"{rank}.stack"), "w")  # noqa: SIM115 (process-long)
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=False)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
        baseline = _Baseline(threads) if reuse else None
        while _serve_one(rank, size, conn, baseline):
            pass
    except BaseException:  # report, don't hang the parent; then leave: peers see it gone
        _send(conn, ("error", traceback.format_exc(), time.monotonic()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve_one(rank: int, size: int, conn: Connection, baseline: _Baseline | None) -> bool:
    """Run the next function; whether this process can take another one."""
    import torch.distributed as dist

    try:
        payload = conn.recv_bytes()
    except EOFError:  # the parent closed the world (or is gone)
        return False
    fn, args = pickle.loads(payload)
    _send(conn, ("started",))
    result = fn(rank, size, *args)
    _send(conn, ("done",))
    if not dist.is_initialized():  # fn tore its world down itself
        why = "the function destroyed the default process group"
    else:
        # every rank done before any goes on: a peer still creating a group (non-members
        # return from new_group early) needs the store, and the next function its peers
        dist.barrier()
        why = "a SpawnedWorld(reuse=False) runs one function" if baseline is None else \
            baseline.restore()
    _send(conn, ("ok", result, why, touched.report(), _rules_record()))
    return not why


def _rules_record() -> list | None:
    """This process's NCCL-rules record of the function that just ran, taken (None when
    the mode is off; see :mod:`.nccl_rules`)."""
    comm = sys.modules.get("mimo_fx.compiled.comm")
    if comm is None or not comm.rules():
        return None
    record = list(comm.MESSAGES.rules)
    comm.MESSAGES.rules.clear()
    comm.MESSAGES.op_of.clear()
    return record


def _logger_states() -> dict[Any, tuple]:
    import logging

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    return {lg: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers}


class _Baseline:
    """What a function may change in its process, as it was before the first one ran,
    and :meth:`restore` to put it back."""

    def __init__(self, threads: int) -> None:
        import warnings

        import torch
        import torch._dynamo  # noqa: F401 (imports the configs below)
        import torch._functorch.config
        import torch._inductor.config

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.seed = torch.initial_seed()
        self.threads = threads
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.configs = [(m, m.get_config_copy()) for m in
                        (torch._dynamo.config, torch._inductor.config, torch._functorch.config)]
        self.loggers = _logger_states()
        self.warnings = list(warnings.filters)

    def restore(self) -> str:
        """Put everything back; why the world must end instead ("" if it need not):
        state that cannot be put back (bridges or groups still registered)."""
        import gc
        import logging
        import warnings

        import torch
        import torch._dynamo
        from torch._dynamo.utils import counters

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.manual_seed(self.seed)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(self.deterministic)
        torch._dynamo.reset()
        counters.clear()
        for module, config in self.configs:  # only what changed: no deprecation warnings
            now = module.get_config_copy()
            module.load_config({k: v for k, v in config.items() if not _same(now.get(k), v)})
        for lg in _logger_states():  # loggers made since start back to a new one's state
            level, handlers, propagate, disabled = self.loggers.get(
                lg, (logging.NOTSET, [], True, False))
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate, lg.disabled = propagate, disabled
        warnings.filters[:] = self.warnings  # type: ignore[index]
        gc.collect()
        return _registered_bridges() or _flight_recorder_full()


def _flight_recorder_full() -> str:
    """Why a world with a long Flight Recorder must end ("" if it is off or short)."""
    if int(os.environ.get(FR_ENV, "0") or 0) <= 0:
        return ""
    import torch

    dump = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined]
    entries = len(pickle.loads(dump(includeStackTraces=False)).get("entries", []))
    return (f"its Flight Recorder holds {entries} entries (more than {FR_REUSE_LIMIT}: "
            f"every later trace.mark/since would read them all)"
            if entries > FR_REUSE_LIMIT else "")


def _same(a: object, b: object) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 (a value without a plain ==: put it back)
        return False


def _registered_bridges() -> str:
    """What ``mimo_fx.compiled`` still holds: groups and prepared bridges; "" if nothing
    (or never imported)."""
    groups = sys.modules.get("mimo_fx.compiled.groups")
    live = sys.modules.get("mimo_fx.compiled.live")
    held = {"groups": len(groups.POOL.groups) if groups else 0,
            "prepared bridges": len(live.REGISTRY.kept) if live else 0}
    return ", ".join(f"{n} {what}" for what, n in held.items() if n) + \
        (" left in mimo_fx.compiled's registry" if any(held.values()) else "")


# -- in the parent --------------------------------------------------------------------------

def _where_stuck(processes: list, stuck: list[int], out_dir: str,
                 after: Sequence[int] = ()) -> str:
    """The ranks that never finished their function, and those (``after``) that finished
    it but not what follows (the barrier and the reset before the next), each with the
    innermost frames of its stack (asked for with SIGUSR1, see ``_serve``;
    ``MIMO_FX_STACK_FRAMES``, 3 by default, says how many)."""
    asked = list(stuck) + list(after)
    for rank in asked:
        if processes[rank].is_alive():
            os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(1.0)
    lines = [f"; ranks {stuck} never finished"] if stuck else []
    if after:
        lines.append(f"{'; ' if not stuck else ''}ranks {list(after)} finished the function "
                     f"but not the barrier and the reset after it")
    for rank in asked:
        try:
            with open(os.path.join(out_dir, f"{rank}.stack")) as f:
                dumps = f.read().split("Stack (most recent call first)")
            # the latest dump: a process asked before (an earlier hang) has older ones
            frames = [ln.strip() for ln in dumps[-1].splitlines()
                      if ln.strip().startswith("File")]
        except FileNotFoundError:  # not yet listening: still starting up
            frames = ["(not started: importing torch or before its process group)"]
        shown = frames[:int(os.environ.get("MIMO_FX_STACK_FRAMES", "3"))]
        lines.append(f"rank {rank} is at: " + (" <- ".join(shown) or "(no stack)"))
    return "\n  ".join(lines)


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _failure(size: int, errors: list[tuple[int, str, float]], died: dict[int, int | None],
            unfinished: list[int]) -> WorldError:
    """The error for a world where ranks raised (rank, traceback, when) or died (rank:
    exit code). A rank that fails makes its peers' collectives fail (the connection to it
    is closed or reset): the first reported is a rank that raised by itself, the earliest
    first, else a rank that died, else the earliest peer that lost one."""
    own = sorted((e for e in errors if not any(m in e[1] for m in _LOST_PEER)),
                 key=lambda e: e[2])
    lost = sorted((e for e in errors if e not in own), key=lambda e: e[2])
    notes = []
    if own or not died:
        rank, text, _ = (own or lost)[0]
        others = sorted(r for r, _, _ in errors if r != rank)
        message = (f"rank {rank} raised" + (f" (ranks {others} too)" if others else "")
                   + ":\n" + text)
        if died:
            notes.append("ranks that died: " + ", ".join(f"{r} ({_exit(c)})"
                                                         for r, c in sorted(died.items())))
    else:
        rank = min(died)
        message = (f"rank {rank} of the {size}-process world died ({_exit(died[rank])}); "
                   f"its stderr says why (a script that spawns worlds needs the "
                   f"'if __name__ == \"__main__\":' guard)")
        notes += [f"rank {r} died too ({_exit(c)})" for r, c in sorted(died.items()) if r != rank]
        if lost:
            notes.append(f"ranks {sorted(r for r, _, _ in lost)} raised after losing it, "
                         f"rank {lost[0][0]} first:\n{lost[0][1]}")
    if unfinished:
        notes.append(f"ranks {unfinished} were still running when the world was killed")
    return WorldError(message + "".join(f"\n  {n}" for n in notes))


class SpawnedWorld:
    """``size`` processes (gloo on 127.0.0.1, or NCCL with one GPU per rank) that run
    the functions given to :meth:`run` one after another; spawned on the first call and
    again after a failure.

    ``threads`` intra-op threads per process (1 by default: many ranks share few cores);
    with ``record`` every process keeps a Flight Recorder of its collectives
    (:mod:`mimo_fx.compiled.trace`); ``env`` is set in every process before its process
    group is created. With ``reuse=False`` the processes leave after one function (what
    :func:`~mimo_fx.testing.run_world` does).
    """

    def __init__(self, size: int, *, backend: str = "gloo", threads: int = 1,
                 record: bool = False, env: Mapping[str, str] | None = None,
                 reuse: bool = True, progress: float | None = None) -> None:
        if size < 1:
            raise MimoFxError(f"world={size}: need at least one process")
        self.size, self.backend, self.threads, self.reuse = size, backend, threads, reuse
        # a run that takes longer than this many seconds says on stderr how many ranks
        # have started and finished its function, and again as that changes (None: never)
        self.progress = progress
        self.env = {**(env or {}), **({FR_ENV: FR_ENTRIES} if record else {})}
        self.spawns = 0   # how many times this world was spawned
        self.runs = 0     # functions run to completion
        self.retired = ""  # why the last function ended the world ("" if it did not)
        self._rules: dict | None = None  # the last function's NCCL-rules records, by rank
        self.ends: list[str] = []  # why each earlier spawn of it ended
        self._processes: list = []
        self._conns: list[Connection] = []
        self._dir = ""
        self._started: Started | None = None
        _OPEN.add(self)

    @property
    def alive(self) -> bool:
        """Whether the world's processes are up (it spawns them on the next run if not)."""
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def __enter__(self) -> SpawnedWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list:
        """``fn(rank, size, *args)`` on every rank; the results by rank.

        ``fn`` must be importable by the processes (a module-level function) and its
        arguments and results picklable. ``timeout`` covers the spawn when the world
        has to be spawned first.
        """
        return self.start(fn, *args, timeout=timeout).result()

    def start(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Started:
        """:meth:`run`, returning at once: the world runs ``fn`` while the caller goes on
        (e.g. a function that mostly waits for timeouts, beside work that computes);
        :meth:`Started.result` waits for the results. A later :meth:`run` or
        :meth:`start` of this world takes the results first, keeping them for it."""
        if self._started is not None:
            self._started.collect()
        deadline = time.monotonic() + timeout
        payload = pickle.dumps((fn, args))  # an unpicklable call fails before any rank runs
        try:
            if not self.alive:
                self.close()
                self._spawn()
            for conn in self._conns:
                conn.send_bytes(payload)
        except BaseException as err:
            self._failed(fn, err)
            raise
        self._started = Started(self, fn, deadline, timeout)
        return self._started

    def _finish(self, started: Started) -> list:
        """The results of the function ``started`` (the world's pending one)."""
        self._started = None
        try:
            results, self.retired = self._collect(started.deadline, started.timeout)
        except BaseException as err:
            self._failed(started.fn, err)
            raise
        if self._rules is not None:
            self._check_rules(started.fn)
        self.runs += 1
        if self.retired:
            self.close()
            self._ended(started.fn)
        return results

    def _check_rules(self, fn) -> None:
        """Replay the function's NCCL-rules records of every rank (:mod:`.nccl_rules`);
        a rule broken is this function's failure."""
        from .nccl_rules import TOTALS, replay

        records, self._rules = self._rules or {}, None
        report = replay(records)
        TOTALS["functions"] += 1
        TOTALS["ops"] += report.ops
        TOTALS["groups"] += report.groups
        TOTALS["problems"] += len(report.problems)
        if report.problems:
            dump = os.environ.get("MIMO_FX_NCCL_RULES_DUMP")  # a file for every record
            if dump:
                with open(dump, "wb") as f:
                    pickle.dump(records, f)
            raise WorldError(f"{getattr(fn, '__qualname__', fn)} broke NCCL's rules on the "
                             f"{self.size}-process world: " + "; ".join(report.problems[:5])
                             + ("" if not dump else f" (every rank's record: {dump})"))

    def _failed(self, fn, err: BaseException) -> None:
        self.close(kill=True)  # a failed world may be desynchronised: never reused
        self.retired = f"the function failed: {type(err).__name__}"
        self._ended(fn)

    def _ended(self, fn) -> None:
        self.ends.append(f"{getattr(fn, '__qualname__', fn)}: {self.retired}")

    @property
    def busy(self) -> bool:
        """Whether a function started with :meth:`start` has not been collected yet."""
        return self._started is not None

    def _spawn(self) -> None:
        ctx = _context(self.backend)
        forked = ctx.get_start_method() == "forkserver"
        self._dir = tempfile.mkdtemp(prefix="mimo_fx_world_")
        port = _free_port()
        for rank in range(self.size):
            mine, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve, name=f"world{self.size}-rank{rank}",
                                  args=(rank, self.size, port, theirs, self._dir,
                                        self.backend, self.threads,
                                        {**os.environ, **self.env}, self.reuse,
                                        _Streams() if forked else None))
            process.start()
            theirs.close()
            self._processes.append(process)
            self._conns.append(mine)
        self.spawns += 1

    def _read(self, rank: int, state: dict) -> None:
        """Take what rank ``rank`` has sent; note it dead if it is gone without a word."""
        conn, process = self._conns[rank], self._processes[rank]
        while rank in state["pending"] and conn.poll():
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, ConnectionResetError):
                break
            if message[0] == "started":
                state["started"].add(rank)
            elif message[0] == "done":
                state["done"].add(rank)
            elif message[0] == "ok":
                state["results"][rank] = message[1]
                if message[4] is not None:
                    state.setdefault("rules", {})[rank] = message[4]
                for kind, names in message[3].items():
                    touched.IN_WORLDS[kind] |= names
                state["why"] = state["why"] or (f"rank {rank}: {message[2]}" if message[2] else "")
                state["pending"].discard(rank)
            else:
                state["errors"].append((rank, message[1], message[2]))
                state["pending"].discard(rank)
        if rank in state["pending"] and not process.is_alive():
            process.join()
            state["died"][rank] = process.exitcode
            state["pending"].discard(rank)

    def _collect(self, deadline: float, timeout: float) -> tuple[list, str]:
        state: dict = {"pending": set(range(self.size)), "done": set(), "errors": [],
                       "died": {}, "results": [None] * self.size, "why": "",
                       "started": set()}
        give_up = deadline
        begun = time.monotonic()
        report = begun + self.progress if self.progress is not None else float("inf")
        said, ended = "", False
        # read at least once: a started function's results may have waited in the pipes
        # past its deadline while its caller did other work (started_early's functions
        # are collected long after they finished)
        while state["pending"]:
            ranks = sorted(state["pending"])
            wait([self._conns[r] for r in ranks] + [self._processes[r].sentinel for r in ranks],
                 timeout=max(0.0, min(give_up, report) - time.monotonic()))
            for rank in ranks:
                self._read(rank, state)
            if not state["pending"] or time.monotonic() >= give_up:
                break
            if time.monotonic() >= report and state["pending"]:
                said = self._progress(state, time.monotonic() - begun, said)
                report = time.monotonic() + 1.0  # (printed again only when it changes)
            if (state["errors"] or state["died"]) and give_up == deadline:
                give_up = min(deadline, time.monotonic() + GRACE)
            if state["pending"] and state["pending"] <= state["done"] and not ended:
                # every rank finished the function: what is left (a barrier, the reset)
                # is bounded on its own, so a hang there is named with its stacks
                ended = True
                give_up = min(give_up, time.monotonic() + AFTER)
        pending = sorted(state["pending"])
        if state["errors"] or state["died"]:
            raise _failure(self.size, state["errors"], state["died"], pending)
        if pending:
            stuck = [r for r in pending if r not in state["done"]]
            after = [r for r in pending if r in state["done"]]
            what = (f"did not finish in {timeout:.0f} s (a hang?); raise timeout= if it is "
                    f"just slow" if stuck else
                    f"finished its function but not what follows within {AFTER:.0f} s (a "
                    f"hang?)")
            raise WorldError(f"the {self.size}-process world {what}"
                             + _where_stuck(self._processes, stuck, self._dir, after))
        self._rules = state.get("rules")
        return state["results"], state["why"]

    def _progress(self, state: dict, seconds: float, said: str) -> str:
        """Print to stderr how far the run is, unless it is what was ``said`` last."""
        finished = set(range(self.size)) - state["pending"] | state["done"]
        running = sorted(state["started"] - finished)
        waiting = sorted(set(range(self.size)) - state["started"] - finished)
        line = (f"{len(state['started'] | finished)}/{self.size} ranks started, "
                f"{len(finished)}/{self.size} done"
                + (f"; running: ranks {_ranks(running)}" if running else "")
                + (f"; not started: ranks {_ranks(waiting)}" if waiting else ""))
        if line != said:
            print(f"[mimo_fx] {self.size}-process world, {seconds:.0f} s: {line}",
                  file=sys.stderr, flush=True)
        return line

    def close(self, kill: bool = False) -> None:
        """End the processes (at once with ``kill``; otherwise they leave their process
        group first). The next :meth:`run` spawns the world again."""
        _close([self], kill)


class Started:
    """A function a world runs while its caller goes on (:meth:`SpawnedWorld.start`)."""

    def __init__(self, world: SpawnedWorld, fn, deadline: float, timeout: float) -> None:
        self.world, self.fn, self.deadline, self.timeout = world, fn, deadline, timeout
        self._outcome: tuple[bool, Any] | None = None

    def collect(self) -> None:
        """Wait for the results (or the failure), keeping them for :meth:`result`."""
        if self._outcome is None:
            try:
                self._outcome = (True, self.world._finish(self))
            except BaseException as err:  # noqa: BLE001 - re-raised by result()
                self._outcome = (False, err)

    def result(self) -> list:
        """The results by rank, as :meth:`SpawnedWorld.run` returns them (or its error)."""
        self.collect()
        assert self._outcome is not None
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def _close(worlds: list[SpawnedWorld], kill: bool = False) -> None:
    """Close several worlds at once: every process is told first, then each is waited for."""
    for world in worlds:
        for conn in world._conns:
            conn.close()  # the process sees EOF, leaves its process group and exits
        if kill:
            for process in world._processes:
                process.kill()
    deadline = time.monotonic() + 30.0
    for world in worlds:
        for process in world._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        if world._dir:
            shutil.rmtree(world._dir, ignore_errors=True)
        world._processes, world._conns, world._dir = [], [], ""


_OPEN: weakref.WeakSet[SpawnedWorld] = weakref.WeakSet()


@atexit.register  # before multiprocessing's own exit handler, which joins the processes
def _close_all() -> None:
    _close(list(_OPEN), kill=True)


Key = tuple[int, str, int, bool, tuple[tuple[str, str], ...]]


class SpawnedWorlds:
    """One :class:`SpawnedWorld` per (size, backend, threads, record, env), kept for reuse.

    ``env`` here is set in every world's processes, under what each call adds. At most
    ``max_processes`` processes stay alive (``MIMO_FX_WORLD_PROCESSES``, 16 by default):
    spawning a world past it closes others first, the smallest first (a world costs
    about its size to spawn again: every process imports torch and warms up its first
    compile), and of equal sizes the least recently used.
    """

    def __init__(self, max_processes: int | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        if max_processes is None:
            max_processes = int(os.environ.get("MIMO_FX_WORLD_PROCESSES", "16"))
        self.max_processes = max_processes
        self.env = dict(env or {})
        self._worlds: OrderedDict[Key, SpawnedWorld] = OrderedDict()

    def world(self, size: int, *, backend: str = "gloo", threads: int = 1,
              record: bool = False, env: Mapping[str, str] | None = None) -> SpawnedWorld:
        """The world for these options (spawned on its first run)."""
        key: Key = (size, backend, threads, record, tuple(sorted((env or {}).items())))
        if key not in self._worlds:
            self._worlds[key] = SpawnedWorld(size, backend=backend, threads=threads, record=record,
                                      env={**self.env, **(env or {})})
        self._worlds.move_to_end(key)
        return self._worlds[key]

    def run(self, size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
            backend: str = "gloo", threads: int = 1, record: bool = False,
            env: Mapping[str, str] | None = None) -> list:
        """``fn(rank, size, *args)`` on every rank of the world for these options, as
        :func:`~mimo_fx.testing.run_world` with the same arguments would, without a spawn
        when the world is already up."""
        return self.start(size, fn, *args, timeout=timeout, backend=backend,
                          threads=threads, record=record, env=env).result()

    def start(self, size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
              backend: str = "gloo", threads: int = 1, record: bool = False,
              env: Mapping[str, str] | None = None) -> Started:
        """:meth:`run`, returning at once (:meth:`SpawnedWorld.start`): a world busy with
        a started function is never closed to make room for another."""
        world = self.world(size, backend=backend, threads=threads, record=record, env=env)
        if not world.alive:
            self._make_room(world)
        return world.start(fn, *args, timeout=timeout)

    def _make_room(self, new: SpawnedWorld) -> None:
        alive = [w for w in self._worlds.values() if w.alive and w is not new]  # oldest first
        excess = sum(w.size for w in alive) + new.size - self.max_processes
        # a busy world is never closed (stable sort: oldest first within a size)
        live = sorted((w for w in alive if not w.busy), key=lambda w: w.size)
        evict = []
        for world in live:
            if excess <= 0:
                break
            evict.append(world)
            world.ends.append(f"closed to make room for {new.size} ranks "
                              f"(max_processes={self.max_processes})")
            excess -= world.size
        _close(evict, kill=True)  # idle processes: nothing to finish

    @property
    def spawns(self) -> int:
        """Worlds spawned so far (a respawn after a failure counts)."""
        return sum(w.spawns for w in self._worlds.values())

    def summary(self) -> list[str]:
        """One line per world: its options, spawns, functions run and why it ended."""
        lines = []
        for (size, backend, threads, record, env), w in self._worlds.items():
            options = [backend] + [f"threads={threads}"] * (threads != 1) \
                + ["record"] * record + [f"{k}={v}" for k, v in env]
            lines.append(f"{size} ranks ({', '.join(options)}): {w.spawns} spawned, "
                         f"{w.runs} functions run" + "".join(f"; ended by {e}" for e in w.ends))
        return lines

    def close(self, kill: bool = True) -> None:
        """End every world (at once by default: their processes are idle)."""
        _close(list(self._worlds.values()), kill)
