"""Numbers as messages and tables print them.

>>> format_bytes(3 * 1024 ** 2)
'3.0 MiB'
"""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float, digits: int = 1) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError
