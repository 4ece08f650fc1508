"""Megatron-Core's own bridge communicators, loaded for side-by-side runs (tests, benches).

Megatron-Core is never a dependency of mimo_fx. Its ``hyper_comm_grid``,
``pipeline_parallel.bridge_communicator`` and ``models.mimo.comm.colocated_communicator``
modules need only torch, so they are imported from a wheel (or a source tree) without the
package's ``__init__`` (which imports far more). :func:`megatron_root` finds the wheel in
a cache directory or pip-downloads it there once; :func:`load` imports the three modules;
:func:`on_cpu` lets them run on a gloo world (their groups ask for ``nccl`` and their
buffers for the current CUDA device).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile

__all__ = ["VERSION", "CACHE", "MODULES", "megatron_root", "load", "version", "on_cpu"]

VERSION = "0.19.2"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "mimo_fx", "megatron")
MODULES = ("megatron.core.hyper_comm_grid",
           "megatron.core.pipeline_parallel.bridge_communicator",
           "megatron.core.models.mimo.comm.colocated_communicator")
_FILES = ("hyper_comm_grid.py", "bridge_communicator.py", "colocated_communicator.py",
          "package_info.py")


class NotFound(RuntimeError):
    """Megatron-Core could not be found or fetched (the message says why)."""


def _wheels() -> list[str]:
    if not os.path.isdir(CACHE):
        return []
    return sorted(f for f in os.listdir(CACHE)
                  if f.endswith(".whl") and f"-{VERSION}-" in f)


def fetch() -> str:
    """pip-download megatron-core's wheel (no dependencies) into :data:`CACHE`; its path."""
    os.makedirs(CACHE, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                           f"megatron-core=={VERSION}", "--python-version", "3.12",
                           "--only-binary=:all:", "-d", CACHE],
                          capture_output=True, text=True, timeout=600)
    wheels = _wheels()
    if done.returncode or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise NotFound(f"pip could not download megatron-core=={VERSION}: {tail[0]}")
    return os.path.join(CACHE, wheels[-1])


def megatron_root(path: str | None = None, fetch_missing: bool = False) -> str:
    """A directory holding ``megatron/core/...``: ``path`` (a tree, or a wheel unpacked
    into a temporary directory), else the cached wheel, else (``fetch_missing``) one
    downloaded now. Raises :class:`NotFound` saying why not."""
    if path is None:
        wheels = _wheels()
        if wheels:
            path = os.path.join(CACHE, wheels[-1])
        elif fetch_missing:
            path = fetch()
        else:
            raise NotFound(f"Megatron-Core {VERSION} not found: pass a megatron_core wheel "
                           f"or a tree holding megatron/core, or fetch it (pip-downloads "
                           f"megatron-core=={VERSION} into the user cache)")
    if path.endswith(".whl"):
        out = tempfile.mkdtemp(prefix="megatron_core_")
        with zipfile.ZipFile(path) as z:
            z.extractall(out, [n for n in z.namelist() if n.startswith("megatron/core/")
                               and n.endswith(_FILES)])
        return out
    if not os.path.isdir(os.path.join(path, "megatron", "core")):
        raise NotFound(f"{path}: no megatron/core in it")
    return path


def load(root: str) -> dict:
    """Megatron's three modules imported from ``root``, by their last name
    (``hyper_comm_grid``, ``bridge_communicator``, ``colocated_communicator``), with empty
    parent packages."""
    for name in MODULES:
        parts = name.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            pkg = ".".join(parts[:i])
            if pkg not in sys.modules:
                mod = types.ModuleType(pkg)
                mod.__path__ = [os.path.join(root, *parts[:i])]
                sys.modules[pkg] = mod
    import warnings

    # Megatron's own notices, once per rank and case, would bury progress lines
    warnings.filterwarnings("ignore", message="absl.logging is not installed")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated")
    return {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in MODULES}


def version(root: str) -> str:
    """MAJOR.MINOR.PATCH as ``package_info.py`` states them (read, not executed)."""
    info = os.path.join(root, "megatron", "core", "package_info.py")
    text = open(info).read() if os.path.exists(info) else ""
    found = {k: re.search(rf"^{k} = (\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
    return ".".join(m.group(1) if m else "?" for m in found.values())


@contextlib.contextmanager
def on_cpu():
    """Within it, Megatron's groups asking for ``nccl`` get gloo and its buffers the CPU
    (``torch.cuda.current_device()`` answers ``"cpu"``); both restored on leaving."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    new_group, current = c10d.new_group, torch.cuda.current_device

    def gloo_group(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return new_group(*args, **kwargs)

    c10d.new_group = dist.new_group = gloo_group
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        c10d.new_group = dist.new_group = new_group
        torch.cuda.current_device = current  # type: ignore[assignment]
