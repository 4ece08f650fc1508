"""Call validation: a caller's mistake is an error, never a hang or garbage.

Every bridge call first inspects its tensor locally -- None or a tensor, shape, dtype,
device -- against what the bridge expects of this rank, before any collective:

- unchecked, a mistake raises :class:`MimoFxError` on the offending rank at once (its
  peers then fail in their collective when it leaves, instead of pairing wrong data);
- checked (``checked=True``), every rank all-gathers a small header -- a marker, the
  bridge's fingerprint (layouts, sizes, dtypes, options), what its inspection found, its
  tensor's dtype, device and shape -- on a process group of its own, and every rank
  raises the same error naming every offending rank. The check runs on its own group,
  with its own timeout, so a rank that calls the bridge unchecked, or calls another
  bridge, cannot pair its data with the check: the checked ranks time out with an error.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

__all__ = ["Expect", "inspect", "problem_text", "Header", "fingerprint", "MAGIC", "OK",
           "HEADER_LEN", "dtype_code", "calls_differ"]

OK, NONE_HOLDS, NOT_EMPTY, NOT_TENSOR, SHAPE, DTYPE, DEVICE = range(7)
MAGIC = 0x6D696D6F  # "mimo": a header, not data
MAX_DIMS = 8        # shape entries carried in a header (for messages)
HEADER_LEN = 6 + MAX_DIMS


@dataclass(frozen=True)
class Expect:
    """What a rank's tensor must be for one side of a bridge.

    ``shape`` is its local shape, None where it holds no piece (it passes None or an
    empty tensor); ``what`` names the side for messages (``"src (dp b) h"``).
    """

    shape: tuple[int, ...] | None
    dtype: torch.dtype
    device: torch.device
    what: str


def inspect(x, expect: Expect) -> int:
    """The first problem with ``x`` (a code), or ``OK``."""
    if x is None:
        return NONE_HOLDS if expect.shape is not None else OK
    if not isinstance(x, torch.Tensor):
        return NOT_TENSOR
    if expect.shape is None:
        if x.numel():
            return NOT_EMPTY
    elif tuple(x.shape) != expect.shape:
        return SHAPE
    if x.dtype != expect.dtype:
        return DTYPE
    if x.device.type != expect.device.type:
        return DEVICE
    return OK


def problem_text(code: int, rank: int, expect: Expect, shape=None, dtype=None,
                 device=None) -> str:
    """What went wrong on ``rank`` and how to fix it."""
    if code == NONE_HOLDS:
        return (f"rank {rank} holds a piece of {expect.what} (local shape {expect.shape}) "
                f"but passed None; pass its piece")
    if code == NOT_EMPTY:
        return (f"rank {rank} holds no piece of {expect.what} but passed a tensor of shape "
                f"{shape}; pass None (or an empty tensor, inside torch.func)")
    if code == NOT_TENSOR:
        return f"rank {rank} passed a {shape or 'non-tensor'}, not a tensor or None"
    if code == SHAPE:
        return (f"rank {rank}: local tensor has shape {shape} but {expect.what} gives it "
                f"shape {expect.shape}; check the layout and the tensor. A tensor of "
                f"other sizes needs a bridge built for those sizes")
    if code == DTYPE:
        return (f"rank {rank}: tensor dtype {dtype} but the bridge moves {expect.dtype}; "
                f"build it with dtype={dtype} or cast the tensor")
    if code == DEVICE:
        return (f"rank {rank}: tensor on {device} but the bridge moves data on "
                f"{expect.device.type}; build it with device= that device, or move the "
                f"tensor")
    raise AssertionError(code)


def fingerprint(*parts) -> int:
    """A 31-bit digest of what makes two ranks' calls one collective call."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def dtype_code(dtype) -> int:
    """A small number naming ``dtype`` (a table lookup, so it traces)."""
    return _DTYPE_CODES.get(dtype, len(_DTYPES) + 1)


def _device_code(device) -> int:
    return zlib.crc32(str(getattr(device, "type", device)).encode()) & 0x7FFFFFFF


class Header:
    """One rank's check header, and every rank's decoded back into messages."""

    @staticmethod
    def encode(x, code: int, print_: int) -> list[int]:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else ()
        dtype = dtype_code(x.dtype) if isinstance(x, torch.Tensor) else 0
        device = _device_code(x.device) if isinstance(x, torch.Tensor) else 0
        dims = list(shape[:MAX_DIMS]) + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))
        return [MAGIC, print_, code, dtype, device, len(shape), *dims]

    @staticmethod
    def problems(rows: list[list[int]], ranks: tuple[int, ...], print_: int,
                 expects: dict[int, Expect]) -> list[str]:
        """Messages for every rank whose header shows a problem (the same on every rank:
        ranks that disagree on the call itself are named in groups, not against this
        rank's own call)."""
        out = []
        dtypes = {dtype_code(d): d for d in _DTYPES}
        split = calls_differ(rows, ranks, "layouts, sizes, dtypes or options")
        if split:
            out.append(split)
        for rank, row in zip(ranks, rows):
            magic, theirs, code, dtype, device, ndim, *dims = row
            if magic != MAGIC:
                out.append(f"rank {rank} sent no check header: it called another "
                           f"collective, or this bridge with checked=False")
            elif split:
                continue  # what a rank expects depends on a call they do not share
            elif code != OK:
                expect = expects[rank]
                shape = tuple(dims[:min(ndim, MAX_DIMS)])
                out.append(problem_text(code, rank, expect, shape, dtypes.get(dtype, "?"),
                                        "another device"))
        return out


def calls_differ(rows, ranks: tuple[int, ...], what: str) -> str | None:
    """One message naming the groups of ranks whose rows carry different call
    fingerprints (column 1), the largest group first; None if they all agree."""
    groups: dict[int, list[int]] = {}
    for rank, row in zip(ranks, rows):
        if row[0] == MAGIC:
            groups.setdefault(row[1], []).append(rank)
    if len(groups) < 2:
        return None
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    names = [f"ranks {g}" if len(g) > 1 else f"rank {g[0]}" for g in ordered]
    return (f"the ranks made different calls ({what} differ): one on {names[0]}, "
            + ", ".join(f"another on {n}" for n in names[1:])
            + "; every rank must make the same call")


_DTYPES = [getattr(torch, n) for n in ("float64", "float32", "float16", "bfloat16", "int64",
                                       "int32", "int16", "int8", "uint8", "bool",
                                       "complex64", "complex128")]
_DTYPE_CODES = {d: i + 1 for i, d in enumerate(_DTYPES)}
