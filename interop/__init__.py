"""Interop with other libraries' distributed types: :mod:`.dtensor` moves DTensors between
meshes with mimo_fx plans and converts meshes and placements to layouts and back;
:mod:`.megatron` offers Megatron-Core's bridge communicators (one import changed).

``import mimo_fx`` is enough: each is imported on first use (``dtensor`` imports DTensor,
which ``import mimo_fx`` does not pay for).
"""

__all__ = ["dtensor", "megatron"]


def __getattr__(name: str):
    """``mimo_fx.interop.dtensor`` / ``.megatron``, imported on first use."""
    if name in __all__:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
