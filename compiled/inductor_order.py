"""Keep inductor's scheduler from reordering mimo_fx's ordered collectives.

Every collective mimo_fx issues is an op with an ORDERED effect (see :mod:`.comm`), so
each rank runs them in program order. Inductor (torch <= 2.13) lowers such an op with an
ordering edge to the previous one, but files the edge under the new op's *buffer* name
while its scheduler looks edges up by *operation* name: the edge is lost, and the
peak-memory reordering pass (on by default) may then move collectives past each other --
differently on each rank, since each rank's graph is different -- and the ranks deadlock
or pair the wrong collectives. (Upstream fix: pytorch/pytorch#188301.)

:func:`install` re-files those edges under operation names just before the scheduler
reads them. It is idempotent and harmless where torch already files them right. It
patches ``torch._inductor.scheduler`` when that module is first imported, so code that
never compiles does not pay for importing inductor.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

__all__ = ["install", "refile_effect_edges"]

_TARGET = "torch._inductor.scheduler"


def refile_effect_edges(graph) -> None:
    """Move ordering edges keyed by a buffer name to the name of its operation."""
    deps = getattr(graph, "additional_star_deps", None)
    buffers = getattr(graph, "name_to_buffer", {})
    if not deps:
        return
    for key in [k for k in deps if k in buffers]:
        op = buffers[key].get_operation_name()
        if op != key:
            deps[op] |= deps.pop(key)


def _patch(module) -> None:
    scheduler = module.Scheduler
    if getattr(scheduler.__init__, "_mimo_fx", False):
        return
    original = scheduler.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):  # noqa: N807 (the patched method's own name)
        from torch._inductor.virtualized import V

        refile_effect_edges(V.graph)
        original(self, *args, **kwargs)

    __init__._mimo_fx = True  # type: ignore[attr-defined]
    scheduler.__init__ = __init__


class _OnImport(importlib.abc.MetaPathFinder):
    """Patches the scheduler module right after Python first executes it."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch the scheduler now if it is imported, else when it is."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _OnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport())
