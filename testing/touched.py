"""Which library modules a test run touched, in its own process and in its worlds.

The library is every module under the directories of ``mimo_fx``, ``mimo_fx.compiled``
and ``mimo_fx.reference``, named by path (``compiled/bridge.py``). A module counts as
*imported* when it is in ``sys.modules``; every process of a :class:`~.SpawnedWorld` reports its
imported modules with each result, and the parent keeps their union (:data:`IN_WORLDS`).

With ``MIMO_FX_TRACK_CALLS=1`` in the environment, :func:`track` also records the modules
one of whose functions ran (``sys.settrace``, in every thread; it slows pure-Python code
by about half, so it is opt-in): a module counts as *called* when a function of it ran
(a module that defines none, when it is imported).
"""

from __future__ import annotations

import ast
import os
import sys
import threading
from functools import cache
from pathlib import Path

__all__ = ["ENV", "IN_WORLDS", "called", "imported", "library", "library_name", "report", "track",
           "tracking"]

ENV = "MIMO_FX_TRACK_CALLS"
# what the processes of every world this process spawned reported: {"imported": {...},
# "called": {...}}
# the library's packages, each in a folder of its own (pyproject.toml's package-dir)
PACKAGES = ("mimo_fx", "mimo_fx.compiled", "mimo_fx.reference", "mimo_fx.mimo",
            "mimo_fx.interop", "mimo_fx.jobs", "mimo_fx.testing")
IN_WORLDS: dict[str, set[str]] = {"imported": set(), "called": set()}
_CALLED: set[str] = set()


@cache
def _roots() -> dict[str, str]:
    """Each library directory (resolved) -> its name in a module's path."""
    import importlib

    packages = [importlib.import_module(name) for name in PACKAGES]
    return {os.path.realpath(p): Path(p).name for m in packages for p in m.__path__}


@cache
def library_name(filename: str | None) -> str | None:
    """``compiled/bridge.py`` for a file of the library, else None."""
    if not filename:
        return None
    path = os.path.realpath(filename)
    for root, name in _roots().items():
        if path.startswith(root + os.sep):
            return f"{name}/{os.path.relpath(path, root)}"
    return None


@cache
def library() -> dict[str, bool]:
    """Every library module by path, and whether it defines a function."""
    out = {}
    for root, name in _roots().items():
        for path in sorted(Path(root).rglob("*.py")):
            tree = ast.parse(path.read_text())
            out[f"{name}/{path.relative_to(root)}"] = any(
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree))
    return out


def imported() -> set[str]:
    """The library modules in this process's ``sys.modules``."""
    names = (library_name(getattr(m, "__file__", None)) for m in list(sys.modules.values()))
    return {n for n in names if n}


def tracking() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


def _tracer(frame, event, arg):
    seen = _CALLED
    if seen is not None and frame.f_code.co_name != "<module>":  # None: shutting down
        seen.add(frame.f_code.co_filename)
    return None


def track() -> None:
    """Record the library modules whose functions run in this process, from now on (only
    with ``MIMO_FX_TRACK_CALLS=1``)."""
    if tracking():
        library()  # before the tracer needs it
        threading.settrace(_tracer)
        sys.settrace(_tracer)


def called() -> set[str]:
    """The library modules a function of which ran since :func:`track`."""
    names = (library_name(f) for f in list(_CALLED))
    return {n for n in names if n}


def report() -> dict[str, set[str]]:
    """What a world's process sends back with each result."""
    return {"imported": imported(), "called": called()}
