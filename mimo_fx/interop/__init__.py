"""Interop with PyTorch's own distributed types: :mod:`.dtensor` moves DTensors between
meshes with mimo_fx plans and converts meshes and placements to layouts and back.

``import mimo_fx`` is enough: ``mimo_fx.interop.dtensor`` is imported on first use (it
imports DTensor, which ``import mimo_fx`` does not pay for).
"""

__all__ = ["dtensor"]


def __getattr__(name: str):
    """``mimo_fx.interop.dtensor``, imported on first use."""
    if name in __all__:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
