"""Balanced bins: give each item (an image, a sequence) a bin (an encoder rank, an LLM DP
group) so that the busiest bin carries little more than its share.

Every DP rank's data loader yields its own samples, and real multimodal samples differ by
orders of magnitude: no image or eight, an image of one tile or six, a caption or a long
document. Left where they were loaded, the busiest rank sets every step's time.
:func:`assign` spreads items by cost, the same way on every rank: it is a pure function
of the costs (no randomness, no communication, stable tie-breaks), so ranks that share
the costs (one small all-gather) agree on the placement without another word.

The lower bound on the busiest bin is ``max(sum(costs) / bins, max(costs))``
(:func:`lower_bound`): no assignment beats it. :func:`assign` is LPT (the costliest item
first, each to the least-loaded bin) followed by a bounded pass of moves and swaps out of
the busiest bin; on skewed costs with a few items per bin or more it lands within a few
percent of the bound (``bench/balance.py``, ``tests/core/test_balance.py``). Without a
capacity it is never worse than LPT, and LPT never worse than 4/3 of the optimum.

Costs come from the work an item makes: :func:`image_costs` (an encoder's work grows
with an image's tokens, ``tiles * tokens_per_tile``) and :func:`sequence_costs` (an LLM
layer's linear work grows with a sequence's length, its attention with the square).

>>> costs = [9, 1, 1, 1, 7, 3, 2, 8]            # 32 over 4 bins; the 9 bounds it
>>> bins = assign(costs, 4)
>>> bins
[0, 3, 3, 2, 2, 3, 3, 1]
>>> loads(costs, bins, 4), lower_bound(costs, 4)
([9.0, 8.0, 8.0, 7.0], 9.0)
"""

from __future__ import annotations

import heapq
import math
import operator
from bisect import bisect_left
from collections.abc import Sequence

import torch

from .errors import MimoFxError

__all__ = ["TOKENS_PER_TILE", "LINEAR_COST", "ATTENTION_COST", "assign", "image_costs",
           "sequence_costs", "loads", "lower_bound"]

TOKENS_PER_TILE = 576
"""Tokens an image tile becomes: a 336 x 336 tile cut into 14 x 14 patches (24 x 24), as
CLIP ViT-L/14-336 encodes each tile of LLaVA-NeXT's any-resolution images."""

LINEAR_COST = 1.0
"""A sequence's cost per token (:func:`sequence_costs`'s ``a``): the unit of cost is one
token through a layer's linear maps."""

ATTENTION_COST = 1.0 / (12 * 4096)
"""A sequence's cost per squared token (:func:`sequence_costs`'s ``b``), for a layer of
width ``h = 4096`` with a 4x MLP under a causal mask. Its linear maps (QKV ``3h^2``,
output ``h^2``, MLP ``8h^2`` multiply-adds) cost ``24 h^2`` flops per token; its attention
(``Q K^T`` and ``A V``, ``2 L^2 h`` flops each, half of them masked) ``2 L^2 h`` per
sequence. In units of one token's linear work, ``b = 2h / 24h^2 = 1 / (12h)``: the
quadratic term equals the linear one at ``L = 12h = 49,152`` tokens. Use ``1 / (12 * h)``
for another width."""

IMPROVE_ROUNDS = 64  # swaps out of the busiest bin, at most (see _Bins.improve)
PAIR_LIMIT = 32  # a bin of at most this many items also swaps pairs of them
PARTNERS = 16  # the lightest bins the busiest one tries swaps with, per round


# -- the assignment ----------------------------------------------------------------------
def assign(costs, bins: int, *, capacity=None, sizes=None) -> list[int]:
    """A bin for each item, ``0 <= bin < bins``, balancing the bins' summed costs.

    Args:
        costs: one cost per item (a sequence of numbers or a 1-D tensor), each ``>= 0``
            and finite; a zero-cost item goes anywhere.
        bins: how many bins (``>= 1``).
        capacity: the most a bin may hold, of ``sizes`` (say, tokens that fit in an
            encoder rank's memory): one number for every bin, or one per bin. ``None``:
            no limit.
        sizes: what ``capacity`` limits, one per item (default: the costs themselves).

    Returns the bin of each item, as a list. Deterministic: the same costs give the same
    list on every rank and every run (ties go to the lower index), so ranks that know the
    same costs need not communicate. Raises :class:`MimoFxError` naming the value and the
    fix for costs that are negative, NaN, infinite or not numbers, ``bins < 1``, sizes of
    another length, or a capacity the items cannot fit.

    >>> assign([5, 4, 3, 3, 3], 2)          # 18 over 2 bins: 9 each (LPT alone: 10)
    [0, 0, 1, 1, 1]
    >>> costs, tokens = [6, 1, 1, 1, 1, 1, 1], [1, 2, 2, 2, 2, 2, 2]
    >>> assign(costs, 2), assign(costs, 2, capacity=8, sizes=tokens)  # 12 tokens > 8
    ([0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0])
    >>> assign([1, -2], 2)
    Traceback (most recent call last):
        ...
    mimo_fx.errors.MimoFxError: costs[1] = -2: a cost must be a finite number >= 0; ...
    """
    values = _check_numbers(costs, "costs", "cost")
    n_bins = _check_bins(bins)
    if sizes is None:
        weights = values
    else:
        weights = _check_numbers(sizes, "sizes", "size")
        if len(weights) != len(values):
            raise MimoFxError(f"sizes has {len(weights)} entries but costs has {len(values)}; "
                              f"give one size per item (or leave sizes=None to limit the "
                              f"costs themselves)")
    room = None if capacity is None else _check_capacity(capacity, n_bins)
    if room is not None:
        _check_fits(weights, room)
    state = _Bins.greedy(values, weights, n_bins, room)
    state.improve(IMPROVE_ROUNDS)
    return state.bin_of


class _Bins:
    """Items in bins, with each bin's cost and size and its items sorted by cost: the
    state the greedy pass builds and the improvement pass changes."""

    def __init__(self, costs: list[float], sizes: list[float], bins: int,
                 room: list[float] | None) -> None:
        self.costs, self.sizes, self.room = costs, sizes, room
        self.bin_of = [0] * len(costs)
        self.load = [0.0] * bins
        self.used = [0.0] * bins
        self.items: list[list[tuple[float, int]]] = [[] for _ in range(bins)]

    @classmethod
    def greedy(cls, costs: list[float], sizes: list[float], bins: int,
               room: list[float] | None) -> _Bins:
        """LPT: the costliest item first, each to the least-loaded bin it fits in. Under
        a capacity that order cannot meet, the largest item first instead (to the
        least-loaded bin with room, then, failing that too, to the fullest bin with room:
        best-fit decreasing, a bin-packing order)."""
        by_cost = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
        state = cls(costs, sizes, bins, room)
        if state._place_all(by_cost, tightest=False):
            return state
        assert room is not None  # without a capacity every item fits
        by_size = sorted(range(len(costs)), key=lambda i: (-sizes[i], -costs[i], i))
        for tightest in (False, True):
            state = cls(costs, sizes, bins, room)
            if state._place_all(by_size, tightest):
                return state
        enough = sum(sizes) / bins + max(sizes)
        raise MimoFxError(
            f"capacity {_show(room)} leaves no room for every item: the sizes sum to "
            f"{_num(sum(sizes))} against {_num(sum(room))} of capacity, the largest is "
            f"{_num(max(sizes))}, and neither cost-first nor largest-first packing found "
            f"room; raise capacity (every bin at {_num(enough)}, the mean plus the largest "
            f"size, always fits) or use more bins")

    def _place_all(self, order: list[int], tightest: bool) -> bool:
        """Place ``order``'s items one by one on the least-loaded bin with room (ties: the
        one with fewer items, then the lower bin), or the fullest with room
        (``tightest``); whether every item found one."""
        if tightest:
            for i in order:
                fit = [b for b in range(len(self.load)) if self._fits(b, self.sizes[i])]
                if not fit:
                    return False
                self._add(i, max(fit, key=lambda b: (self.used[b], -b)))
        else:
            heap = [(0.0, 0, b) for b in range(len(self.load))]
            for i in order:
                popped = []
                while heap and not self._fits(heap[0][2], self.sizes[i]):
                    popped.append(heapq.heappop(heap))
                if not heap:
                    return False
                _, _, b = heapq.heappop(heap)
                self._add(i, b)
                heapq.heappush(heap, (self.load[b], len(self.items[b]), b))
                for entry in popped:
                    heapq.heappush(heap, entry)
        for items in self.items:
            items.sort()
        return True

    def _fits(self, b: int, size: float) -> bool:
        return self.room is None or self.used[b] + size <= self.room[b]

    def _add(self, i: int, b: int) -> None:
        self.bin_of[i] = b
        self.load[b] += self.costs[i]
        self.used[b] += self.sizes[i]
        self.items[b].append((self.costs[i], i))

    def _remove(self, i: int, b: int) -> None:
        self.load[b] -= self.costs[i]
        self.used[b] -= self.sizes[i]
        items = self.items[b]
        del items[bisect_left(items, (self.costs[i], i))]

    def _insert(self, i: int, b: int) -> None:
        self.bin_of[i] = b
        self.load[b] += self.costs[i]
        self.used[b] += self.sizes[i]
        items = self.items[b]
        items.insert(bisect_left(items, (self.costs[i], i)), (self.costs[i], i))

    # -- improvement ---------------------------------------------------------------------
    def improve(self, rounds: int) -> None:
        """Up to ``rounds`` times, lower the busiest bin (the lowest of equals) by moving
        one or two of its items to a lighter bin, or swapping them for cheaper ones there
        (:meth:`_groups`): the swap that leaves the pair's larger load smallest, tried
        against the :data:`PARTNERS` lightest bins from the lightest up. Every change
        lowers the sorted loads lexicographically, so the pass ends; it stops early when
        no change helps or the busiest bin is at the lower bound."""
        bound = max(sum(self.costs) / len(self.load), max(self.costs, default=0.0))
        for _ in range(rounds):
            top = max(range(len(self.load)), key=lambda b: (self.load[b], -b))
            if self.load[top] <= bound * (1 + 1e-12):
                return
            if not self._improve_bin(top):
                return

    def _improve_bin(self, top: int) -> bool:
        """One swap lowering bin ``top``; whether one was found."""
        others = heapq.nsmallest(PARTNERS, (b for b in range(len(self.load)) if b != top),
                                 key=lambda b: (self.load[b], b))
        mine = self._groups(top, empty=False)
        for b in others:
            gap = self.load[top] - self.load[b]
            if gap <= 0:
                return False
            best = self._best_change(mine, b, gap, top)
            if best is not None:
                out, back = best
                for i in out:
                    self._remove(i, top)
                for j in back:
                    self._remove(j, b)
                    self._insert(j, top)
                for i in out:
                    self._insert(i, b)
                return True
        return False

    def _groups(self, b: int, empty: bool) -> list[tuple[float, tuple[int, ...]]]:
        """What bin ``b`` may give in a swap, by cost: each item, each pair of
        items while the bin holds at most :data:`PAIR_LIMIT`, and nothing (``empty``)."""
        items = self.items[b]
        out: list[tuple[float, tuple[int, ...]]] = [(0.0, ())] if empty else []
        out += [(c, (i,)) for c, i in items]
        if len(items) <= PAIR_LIMIT:
            out += [(c + d, (i, j)) for k, (c, i) in enumerate(items)
                    for d, j in items[k + 1:]]
        out.sort()
        return out

    def _best_change(self, mine: list, b: int, gap: float, top: int
                     ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Of ``mine`` (bin ``top``'s groups) and of bin ``b``'s (or nothing), the two
        whose swap shifts ``d`` of cost, ``0 < d < gap`` and closest to ``gap / 2``
        (both bins then below ``top``'s load), within capacity."""
        theirs = self._groups(b, empty=True)
        keys = [c for c, _ in theirs]
        best, best_miss = None, gap / 2
        for cost_out, out in mine:
            k = bisect_left(keys, cost_out - gap / 2)
            for cost_back, back in theirs[max(k - 1, 0):k + 1]:
                d = cost_out - cost_back
                miss = abs(d - gap / 2)
                if 0 < d < gap and miss < best_miss and self._swap_fits(out, back, top, b):
                    best, best_miss = (out, back), miss
        return best

    def _swap_fits(self, out: tuple[int, ...], back: tuple[int, ...], top: int,
                   b: int) -> bool:
        if self.room is None:
            return True
        moved = sum(self.sizes[i] for i in out) - sum(self.sizes[j] for j in back)
        return self.used[b] + moved <= self.room[b] and self.used[top] - moved <= self.room[top]


# -- costs -------------------------------------------------------------------------------
def image_costs(tiles, *, tokens_per_tile: int = TOKENS_PER_TILE) -> list[float]:
    """The encoder's cost of each image: its tokens, ``tiles * tokens_per_tile``.

    A vision transformer on any-resolution tiles attends within a tile, so its work is
    linear in the tiles (and in the tokens: pass ``tokens_per_tile=1`` and token counts
    when images come as tokens). ``tiles``: one count per image.

    >>> image_costs([1, 5, 0])
    [576.0, 2880.0, 0.0]
    >>> image_costs([3], tokens_per_tile=2)
    [6.0]
    """
    per_tile = _check_positive(tokens_per_tile, "tokens_per_tile", "e.g. 576")
    return [n * per_tile for n in _check_numbers(tiles, "tiles", "tile count")]


def sequence_costs(lengths, *, a: float = LINEAR_COST, b: float = ATTENTION_COST
                   ) -> list[float]:
    """An LLM's cost of each sequence, ``a * length + b * length ** 2``: its linear maps
    grow with its tokens, its attention with their square.

    The defaults are one layer of width 4096 with a 4x MLP under a causal mask, in units
    of one token's linear work (:data:`ATTENTION_COST` says where ``b`` comes from); for
    width ``h``, ``b = 1 / (12 * h)``.

    >>> sequence_costs([0, 4096, 49152])       # the quadratic term catches up at 12h
    [0.0, 4437.333333333333, 98304.0]
    >>> sequence_costs([10], a=0.0, b=1.0)
    [100.0]
    """
    lin = _check_nonnegative(a, "a", "e.g. a=1.0")
    quad = _check_nonnegative(b, "b", "e.g. b=1/(12*4096)")
    return [lin * n + quad * n * n for n in _check_numbers(lengths, "lengths", "length")]


def loads(costs, bin_of: Sequence[int], bins: int) -> list[float]:
    """Each bin's summed cost under ``bin_of`` (one bin per item, as :func:`assign`
    returns).

    >>> loads([3, 1, 2], [1, 0, 1], 2)
    [1.0, 5.0]
    """
    values = _check_numbers(costs, "costs", "cost")
    n_bins = _check_bins(bins)
    if len(bin_of) != len(values):
        raise MimoFxError(f"bin_of has {len(bin_of)} entries but costs has {len(values)}; "
                          f"give one bin per item")
    out = [0.0] * n_bins
    for k, (cost, b) in enumerate(zip(values, bin_of)):
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n_bins:
            raise MimoFxError(f"bin_of[{k}] = {b!r} is not a bin; bins are 0..{n_bins - 1}")
        out[b] += cost
    return out


def lower_bound(costs, bins: int) -> float:
    """No assignment's busiest bin is below ``max(sum(costs) / bins, max(costs))``.

    >>> lower_bound([4, 1, 1], 2), lower_bound([2, 2, 2], 2)
    (4.0, 3.0)
    """
    values = _check_numbers(costs, "costs", "cost")
    return max(sum(values) / _check_bins(bins), max(values, default=0.0))


# -- validation --------------------------------------------------------------------------
def _check_numbers(values: object, what: str, noun: str) -> list[float]:
    """``values`` (one ``noun`` per item) as a list of floats, each finite and ``>= 0``."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_complex() or values.dtype == torch.bool:
            raise MimoFxError(f"{what} must be a 1-D real tensor (one number per item), got "
                              f"dtype {values.dtype} and shape {tuple(values.shape)}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise MimoFxError(f"{what} must be a sequence of numbers, one per item, e.g. "
                          f"[3, 0, 5.5]; got {values!r}")
    out = []
    for k, v in enumerate(values):
        if isinstance(v, (bool, str, bytes)) or not hasattr(v, "__float__"):
            raise MimoFxError(f"{what}[{k}] = {v!r} is not a number; give each item's "
                              f"{noun} as an int or float")
        x = float(v)
        if not math.isfinite(x) or x < 0:
            raise MimoFxError(f"{what}[{k}] = {v!r}: a {noun} must be a finite number "
                              f">= 0; give 0 for an item that has none")
        out.append(x)
    return out


def _check_bins(bins: object) -> int:
    try:
        if isinstance(bins, bool):
            raise TypeError
        n = operator.index(bins)  # type: ignore[arg-type]
    except TypeError:
        raise MimoFxError(f"bins = {bins!r} must be an integer >= 1 (the ranks or groups "
                          f"to spread over)") from None
    if n < 1:
        raise MimoFxError(f"bins = {n} must be >= 1 (the ranks or groups to spread over)")
    return n


def _check_capacity(capacity: object, bins: int) -> list[float]:
    """One capacity per bin, each > 0 and not NaN (``inf``: no limit)."""
    if isinstance(capacity, (int, float, torch.Tensor)) and not isinstance(capacity, bool) \
            and (not isinstance(capacity, torch.Tensor) or capacity.dim() == 0):
        per = [capacity] * bins
    else:
        per = capacity  # type: ignore[assignment]
        if isinstance(per, torch.Tensor):
            per = per.tolist()
        if isinstance(per, (str, bytes)) or not isinstance(per, Sequence) \
                or len(per) != bins:
            raise MimoFxError(f"capacity = {capacity!r} must be one number for every bin or "
                              f"a sequence of {bins} (one per bin)")
    out = []
    for k, c in enumerate(per):
        x = float(c) if isinstance(c, (int, float, torch.Tensor)) \
            and not isinstance(c, bool) else math.nan
        if not x > 0:
            raise MimoFxError(f"capacity {c!r} (bin {k}) must be a number > 0, the most a "
                              f"bin may hold; leave capacity=None for no limit")
        out.append(x)
    return out


def _check_fits(sizes: list[float], room: list[float]) -> None:
    """What no assignment can meet: an item larger than every bin, or more in all than
    the bins hold."""
    widest = max(room)
    for k, s in enumerate(sizes):
        if s > widest:
            raise MimoFxError(f"item {k} has size {_num(s)}, more than any bin's capacity "
                              f"({_show(room)}); raise capacity to at least {_num(s)} or "
                              f"split the item")
    if sum(sizes) > sum(room):
        raise MimoFxError(f"the sizes sum to {_num(sum(sizes))}, more than the bins hold "
                          f"({_show(room)}, {_num(sum(room))} in all); raise capacity to "
                          f"at least {_num(sum(sizes) / len(room))} per bin or use more "
                          f"bins")


def _check_positive(value: object, what: str, example: str) -> float:
    x = _check_nonnegative(value, what, example)
    if x == 0:
        raise MimoFxError(f"{what} = {value!r} must be > 0; {example}")
    return x


def _check_nonnegative(value: object, what: str, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise MimoFxError(f"{what} = {value!r} must be a finite number >= 0; {example}")
    return float(value)


def _num(x: float) -> str:
    return f"{x:g}"


def _show(room: list[float]) -> str:
    return _num(room[0]) + " per bin" if len(set(room)) == 1 else str([_num(r) for r in room])
