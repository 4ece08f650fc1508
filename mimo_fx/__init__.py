"""mimo_fx: one functional op to move tensors between differently-parallelised modules.

``redistribute(x, src, dst)`` moves a tensor between two :class:`Layout` s (einops-style
patterns over :class:`Grid` s of ranks); ``plan(src, dst, sizes)`` shows how.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from .errors import MimoFxError
from .grid import Grid
from .layout import Layout
from .op import redistribute
from .plan import Collective, Plan, RankPlan, backward_plan, plan, plan_for_rank

try:
    __version__ = _version("mimo-fx")
except PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "Collective", "Grid", "Layout", "MimoFxError", "Plan", "RankPlan",
           "backward_plan", "plan", "plan_for_rank", "redistribute",
           "redistribute_dtensor", "backward", "joined"]  # the last three imported on first use

_SUBPACKAGES = ("compiled", "reference", "mimo", "interop", "testing")


def __getattr__(name: str):
    """``mimo_fx.compiled``, the other backends and ``redistribute_dtensor``, imported on
    first use."""
    import importlib

    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "redistribute_dtensor":  # DTensor's entry point, imported on first use
        return importlib.import_module(f"{__name__}.interop.dtensor").redistribute_dtensor
    if name in ("backward", "joined"):  # a step's backward, source-only calls included
        return getattr(importlib.import_module(f"{__name__}.compiled"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The names above, the lazily imported ones included (for ``dir`` and completion)."""
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))
