"""Where a step's images and sequences go, by cost, as layouts the one op moves rows
between.

Every data loader (a dp index of the *loaders* grid) yields its own samples; each
:class:`Sample` is text runs and images in order. Once every rank knows every loader's
samples (one small all-gather per step, :func:`mimo_fx.mimo.share_samples`),
:func:`place` decides, the same on every rank, which encoder dp group encodes each image
and which LLM dp group packs each sample (:func:`mimo_fx.balance.assign` on their costs,
or ``balanced=False``: each loader's own). The :class:`Placement` it returns is nothing
but layouts: each bridge is a ``(src, dst)`` pair for ``redistribute(x, src, dst)``.

- :meth:`Placement.patches`: a loader's image patches (one row per image token) to the
  encoder rank that encodes the image;
- :meth:`Placement.embeddings`: the encoder's rows to the LLM cp rank holding their
  tokens in its group's packed sequence (zigzag over cp, sequence by sequence);
- :meth:`Placement.text`: a loader's text rows (token embeddings, say) to their tokens;
- :meth:`Placement.tokens`: a loader's per-token rows (targets, loss weights) to every
  token of the packed batch.

The rows keep one global order whatever the placement -- the loaders' order: loader 0's
first sample's first image token, and so on -- and each dst is a selection
(:meth:`~mimo_fx.packed.PackedLayout.select`) of where those rows now live, so the op
moves each row from its loader to its rank and every gradient back exactly; the packed
batch's storage takes a selection's rows at ``dst.positions(rank)``.

Two loaders (one sample each) on DP2, the encoder on DP2, the LLM on CP2:

>>> from mimo_fx import Grid
>>> samples = [[Sample(text=(2, 1), images=(8,))],                  # 11 tokens, 1 image
...            [Sample(text=(3, 0, 1), images=(1, 1))]]             # 6 tokens, 2 images
>>> step = place(samples, Grid(dp=2), Grid(dp=2), Grid(cp=2, offset=2))
>>> step.image_group, step.sample_group        # the large image alone on encoder 0
((0, 1, 1), (0, 0))
>>> src, dst = step.embeddings("t h")          # image rows, loader order, to their tokens
>>> {r: dst.rows(r).tolist() for r in (2, 3)}  # each cp rank's image rows (zigzag)
{2: [0, 7], 3: [1, 2, 3, 4, 5, 6, 8, 9]}
>>> dst.positions(2).tolist()                  # ... where they sit in rank 2's storage
[2, 3]
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .balance import _check_numbers, assign, image_costs, sequence_costs
from .errors import MimoFxError
from .grid import Grid
from .packed import PackedLayout

__all__ = ["Sample", "Placement", "place", "encode_samples", "decode_samples"]

Ints = tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """One sample's tokens in order: ``text[0]`` text tokens, image ``0``'s
    ``images[0]`` tokens, ``text[1]`` text tokens, ... image ``k-1``, ``text[k]``.

    ``text`` has one run more than ``images`` (runs may be 0); each image has at least
    one token (``tiles * tokens_per_tile`` for tiled images).

    >>> s = Sample(text=(3, 0, 2), images=(4, 1))
    >>> s.length, s.image_positions
    (10, (3, 4, 5, 6, 7))
    """

    text: Ints = (0,)
    images: Ints = ()

    def __post_init__(self) -> None:
        text = _ints(self.text, "Sample text", 0)
        images = _ints(self.images, "Sample images", 1)
        if len(text) != len(images) + 1:
            raise MimoFxError(f"Sample text has {len(text)} runs for {len(images)} images; "
                              f"give one text run before, between and after the images "
                              f"({len(images) + 1}, 0 where images touch)")
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "images", images)

    @property
    def length(self) -> int:
        """Every token: text and images."""
        return sum(self.text) + sum(self.images)

    @property
    def image_positions(self) -> Ints:
        """Where the image tokens sit in the sample, image after image."""
        return tuple(p for start, n in zip(self._starts[1::2], self.images)
                     for p in range(start, start + n))

    @property
    def text_positions(self) -> Ints:
        """Where the text tokens sit in the sample."""
        return tuple(p for start, n in zip(self._starts[0::2], self.text)
                     for p in range(start, start + n))

    @property
    def _starts(self) -> Ints:
        """The first token of each run: text, image, text, ..."""
        runs = [n for pair in zip(self.text, self.images) for n in pair] + [self.text[-1]]
        starts, at = [], 0
        for n in runs:
            starts.append(at)
            at += n
        return tuple(starts)


def encode_samples(samples: Sequence[Sample]) -> list[int]:
    """Samples as ints to all-gather: the count, then each one's image count, text runs, images.

    >>> encode_samples([Sample((2, 1), (8,)), Sample()])
    [2, 1, 2, 1, 8, 0, 0]
    >>> decode_samples([2, 1, 2, 1, 8, 0, 0]) == (Sample((2, 1), (8,)), Sample())
    True
    """
    out = [len(samples)]
    for s in samples:
        out += [len(s.images), *s.text, *s.images]
    return out


def decode_samples(values: Sequence[int]) -> tuple[Sample, ...]:
    """The samples :func:`encode_samples` wrote (trailing values ignored)."""
    at, out = 1, []
    for _ in range(values[0]):
        k = values[at]
        text = tuple(values[at + 1:at + k + 2])
        images = tuple(values[at + k + 2:at + 2 * k + 2])
        out.append(Sample(text, images))
        at += 2 * k + 2
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    """A step's samples and where their work runs (see the module docstring).

    ``samples[i]``: loader ``i``'s samples. Images and samples are numbered in the
    loaders' order (loader 0's first); ``image_group[k]`` is the encoder dp index that
    encodes image ``k``, ``sample_group[s]`` the LLM dp index that packs sample ``s``;
    ``image_cost`` and ``sample_cost`` are the costs they were placed by.
    """

    loaders: Grid
    encoder: Grid
    llm: Grid
    samples: tuple[tuple[Sample, ...], ...]
    image_group: Ints
    sample_group: Ints
    image_cost: tuple[float, ...] = field(repr=False)
    sample_cost: tuple[float, ...] = field(repr=False)
    zigzag: bool = True

    def __post_init__(self) -> None:
        for name in ("loaders", "encoder", "llm"):
            if not isinstance(getattr(self, name), Grid):
                raise MimoFxError(f"Placement {name} must be a Grid, got "
                                  f"{getattr(self, name)!r}")
        per_loader = _check_samples(self.samples, self.loaders)
        images = sum(len(s.images) for mine in per_loader for s in mine)
        samples = sum(len(mine) for mine in per_loader)
        for what, values, n in (("image_group", self.image_group, images),
                                ("sample_group", self.sample_group, samples),
                                ("image_cost", self.image_cost, images),
                                ("sample_cost", self.sample_cost, samples)):
            if len(values) != n:
                raise MimoFxError(f"Placement {what} has {len(values)} entries for {n} "
                                  f"{what.split('_')[0]}s; give one each, in the loaders' "
                                  f"order (place() does)")
        for what, groups, grid in (("image_group", self.image_group, self.encoder),
                                   ("sample_group", self.sample_group, self.llm)):
            bad = [g for g in groups if not 0 <= g < _groups(grid)]
            if bad:
                raise MimoFxError(f"Placement {what} names groups {bad[:8]} that {grid} "
                                  f"does not have (0..{_groups(grid) - 1})")

    # -- the step in numbers -------------------------------------------------------------
    @cached_property
    def flat(self) -> tuple[Sample, ...]:
        """Every sample, loader after loader."""
        return tuple(s for mine in self.samples for s in mine)

    @property
    def total_tokens(self) -> int:
        """The step's tokens over every loader (a loss's global normaliser)."""
        return sum(s.length for s in self.flat)

    def encoder_loads(self) -> list[float]:
        """Each encoder dp group's summed image cost."""
        return _sums(self.image_cost, self.image_group, _groups(self.encoder))

    def llm_loads(self) -> list[float]:
        """Each LLM dp group's summed sample cost."""
        return _sums(self.sample_cost, self.sample_group, _groups(self.llm))

    # -- the bridges ---------------------------------------------------------------------
    def patches(self, pattern: str = "t f") -> tuple[PackedLayout, PackedLayout]:
        """Image patch rows from each loader to its images' encoder (image order, no padding)."""
        return self._loader(pattern, lambda s: s.images), self._encoder_rows(pattern)

    def embeddings(self, pattern: str = "t h") -> tuple[PackedLayout, PackedLayout]:
        """Encoded image rows from the encoder to the LLM cp rank holding their tokens."""
        return (self._encoder_rows(pattern),
                self.packed(pattern).select(self._where(lambda s: s.image_positions)))

    def text(self, pattern: str = "t h") -> tuple[PackedLayout, PackedLayout]:
        """Text rows (a loader's text tokens, sample by sample) to their tokens."""
        return (self._loader(pattern, lambda s: [sum(s.text)]),
                self.packed(pattern).select(self._where(lambda s: s.text_positions)))

    def tokens(self, pattern: str = "t h") -> tuple[PackedLayout, PackedLayout]:
        """Per-token rows (every token of a loader's samples) to their tokens."""
        return (self._loader(pattern, lambda s: [s.length]),
                self.packed(pattern).select(self._where(lambda s: range(s.length))))

    def packed(self, pattern: str = "t h") -> PackedLayout:
        """The LLM's packed batch: dp group ``d`` packs its samples, in the loaders'
        order, cut over cp per sequence (zigzag unless ``place(zigzag=False)``)."""
        lengths = [[self.flat[s].length for s in group] for group in self._llm_samples]
        return PackedLayout(self.llm, pattern, lengths, self.zigzag)

    # -- rows and their order ------------------------------------------------------------
    def _loader(self, pattern: str, runs) -> PackedLayout:
        """Rows held by their loader, ``runs(sample)`` rows per sample (as sequences)."""
        lengths = [[n for s in mine for n in runs(s)] for mine in self.samples]
        return PackedLayout(self.loaders, pattern, lengths, zigzag=False)

    def _encoder_rows(self, pattern: str) -> PackedLayout:
        """The encoder's image rows: group ``e`` packs its images (in image order), and
        row ``j`` (loader order) is selected from where its image landed."""
        tokens = [n for s in self.flat for n in s.images]
        mine: list[list[int]] = [[] for _ in range(_groups(self.encoder))]
        for k, e in enumerate(self.image_group):
            mine[e].append(k)
        start, at = [0] * len(tokens), 0
        for images in mine:
            for k in images:
                start[k] = at
                at += tokens[k]
        rows = [start[k] + t for k, n in enumerate(tokens) for t in range(n)]
        lay = PackedLayout(self.encoder, pattern, [[tokens[k] for k in images]
                                                   for images in mine], zigzag=False)
        return lay.select(torch.tensor(rows, dtype=torch.int64))

    @cached_property
    def _llm_samples(self) -> list[list[int]]:
        groups: list[list[int]] = [[] for _ in range(_groups(self.llm))]
        for s, d in enumerate(self.sample_group):
            groups[d].append(s)
        return groups

    def _where(self, positions) -> torch.Tensor:
        """The packed batch's token of every row at ``positions(sample)`` of each
        sample, in the loaders' order."""
        start, at = [0] * len(self.flat), 0
        for group in self._llm_samples:
            for s in group:
                start[s] = at
                at += self.flat[s].length
        out: list[int] = []
        for s, sample in enumerate(self.flat):
            out += [start[s] + p for p in positions(sample)]
        return torch.tensor(out, dtype=torch.int64)


def place(samples: Sequence[Sequence[Sample]], loaders: Grid, encoder: Grid, llm: Grid, *,
          balanced: bool = True, image_cost=None, sample_cost=None,
          encoder_capacity=None, llm_capacity=None, zigzag: bool = True) -> Placement:
    """Where every image and sample of a step goes (see the module docstring).

    Args:
        samples: per loader (the loaders grid's dp index), its samples this step.
        loaders, encoder, llm: the grids; each one's ``dp`` axis numbers its groups (no
            ``dp``: one group), every other axis replicates (the llm's ``cp`` cuts).
        balanced: place by cost (:func:`~mimo_fx.balance.assign`); False: each loader's
            own (loader ``i`` of ``L`` to encoder and LLM group ``i * G // L``).
        image_cost, sample_cost: one cost per image and per sample, in the loaders'
            order (default: an image's tokens, :func:`~mimo_fx.balance.image_costs`; a
            sample's :func:`~mimo_fx.balance.sequence_costs` of its length).
        encoder_capacity, llm_capacity: the most tokens an encoder group or an LLM
            group may take (one number or one per group; ``assign``'s capacity).
        zigzag: the LLM's cp cut (:class:`~mimo_fx.packed.Packing`).

    Every rank calling it with the same arguments gets the same placement.
    """
    for name, flag in (("balanced", balanced), ("zigzag", zigzag)):
        if not isinstance(flag, bool):
            raise MimoFxError(f"place: {name}={flag!r} must be True or False")
    per_loader = _check_samples(samples, loaders)
    flat = [s for mine in per_loader for s in mine]
    tokens = [n for s in flat for n in s.images]
    lengths = [s.length for s in flat]
    img_cost = _costs(image_cost, image_costs(tokens, tokens_per_tile=1), "image_cost",
                      "image")
    seq_cost = _costs(sample_cost, sequence_costs(lengths), "sample_cost", "sample")
    n_enc, n_llm = _groups(encoder), _groups(llm)
    if balanced:
        homes = _Homes(per_loader, loaders, encoder, llm)
        sample_group = _assign(seq_cost, n_llm, llm_capacity, lengths, "llm_capacity")
        if _uniform(llm_capacity):
            sample_group = homes.relabel(sample_group, homes.llm_weights(sample_group))
        image_group = _assign(img_cost, n_enc, encoder_capacity, tokens, "encoder_capacity")
        if _uniform(encoder_capacity):
            image_group = homes.relabel(image_group, homes.encoder_weights(image_group,
                                                                          sample_group))
    else:
        n = len(per_loader)
        image_group = [i * n_enc // n for i, mine in enumerate(per_loader)
                       for s in mine for _ in s.images]
        sample_group = [i * n_llm // n for i, mine in enumerate(per_loader) for _ in mine]
    return Placement(loaders, encoder, llm, per_loader, tuple(image_group),
                     tuple(sample_group), tuple(img_cost), tuple(seq_cost), zigzag)


# -- keeping rows home -------------------------------------------------------------------
class _Homes:
    """Where a step's rows start, to name the bins ``assign`` returns: bins are
    interchangeable (any renaming has the same loads), so each bin takes the group that
    already holds most of its rows -- a loader's rows where they were loaded, an
    encoder's rows on the LLM ranks they feed. Greedy, heaviest pair first."""

    def __init__(self, samples, loaders: Grid, encoder: Grid, llm: Grid) -> None:
        self.flat = [(i, s) for i, mine in enumerate(samples) for s in mine]
        self.loader = [set(_group_ranks(loaders, d)) for d in range(_groups(loaders))]
        self.encoder = [set(_group_ranks(encoder, e)) for e in range(_groups(encoder))]
        cp = llm.axis_size("cp") if "cp" in llm.names else 1
        self.cells = [[set(r for r in _group_ranks(llm, g)
                           if llm.coord(r).get("cp", 0) == c) for c in range(cp)]
                      for g in range(_groups(llm))]

    def _held(self, holders: set[int], g: int) -> float:
        """The share of an LLM group's rows (spread evenly over its cp cells) landing on
        a rank that ``holders`` has."""
        cells = self.cells[g]
        return sum(len(holders & cell) / len(cell) for cell in cells) / len(cells)

    def llm_weights(self, sample_group: list[int]) -> list[list[float]]:
        """``[bin][group]``: the tokens of the bin's samples already on that group."""
        out = [[0.0] * len(self.cells) for _ in self.cells]
        for (i, s), b in zip(self.flat, sample_group):
            for g in range(len(self.cells)):
                out[b][g] += s.length * self._held(self.loader[i], g)
        return out

    def encoder_weights(self, image_group: list[int], sample_group: list[int]
                        ) -> list[list[float]]:
        """``[bin][group]``: the image tokens of the bin already on that encoder group
        (loaded there), plus those whose LLM ranks are in it (no move after encoding)."""
        out = [[0.0] * len(self.encoder) for _ in self.encoder]
        images = [(i, n, g) for (i, s), g in zip(self.flat, sample_group) for n in s.images]
        for (i, n, g), b in zip(images, image_group):
            for e, ranks in enumerate(self.encoder):
                out[b][e] += n * (len(self.loader[i] & ranks) / len(ranks)
                                  + self._held(ranks, g))
        return out

    @staticmethod
    def relabel(bin_of: list[int], weights: list[list[float]]) -> list[int]:
        """``bin_of`` with each bin renamed: heaviest (bin, group) pair first, ties to
        the lower bin, then the lower group; bins left over take the groups left over."""
        n = len(weights)
        pairs = sorted(((w, b, g) for b, row in enumerate(weights) for g, w in enumerate(row)
                        if w > 0), key=lambda t: (-t[0], t[1], t[2]))
        name, taken = [-1] * n, [False] * n
        for _, b, g in pairs:
            if name[b] < 0 and not taken[g]:
                name[b], taken[g] = g, True
        free = iter(g for g in range(n) if not taken[g])
        name = [g if g >= 0 else next(free) for g in name]
        return [name[b] for b in bin_of]


def _uniform(capacity: object) -> bool:
    """Whether every bin has the same capacity (renaming bins then keeps it)."""
    if capacity is None or not isinstance(capacity, Sequence):
        return True
    return len(set(capacity)) <= 1


def _group_ranks(grid: Grid, d: int) -> list[int]:
    return [r for r in grid.ranks if grid.coord(r).get("dp", 0) == d]


# -- helpers ------------------------------------------------------------------------------
def _groups(grid: Grid) -> int:
    return grid.axis_size("dp") if "dp" in grid.names else 1


def _sums(costs: Sequence[float], group: Sequence[int], n: int) -> list[float]:
    out = [0.0] * n
    for c, g in zip(costs, group):
        out[g] += c
    return out


def _ints(values: object, what: str, least: int) -> Ints:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise MimoFxError(f"{what} must be a sequence of token counts, got {values!r}")
    out = []
    for k, v in enumerate(values):
        try:
            if isinstance(v, bool):
                raise TypeError
            n = operator.index(v)
        except TypeError:
            raise MimoFxError(f"{what}[{k}] = {v!r} must be an integer token count") from None
        if n < least:
            raise MimoFxError(f"{what}[{k}] = {n} must be >= {least}"
                              + (" (an image has at least one token)" if least else ""))
        out.append(n)
    return tuple(out)


def _check_samples(samples: object, loaders: Grid) -> tuple[tuple[Sample, ...], ...]:
    if not isinstance(loaders, Grid):
        raise MimoFxError(f"place needs the loaders' Grid, got {loaders!r}")
    n = _groups(loaders)
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence) \
            or len(samples) != n:
        raise MimoFxError(f"place needs one list of samples per loader (the loaders grid "
                          f"{loaders} has {n} dp groups), got {samples!r}")
    out = []
    for i, mine in enumerate(samples):
        if isinstance(mine, Sample) or not isinstance(mine, Sequence) \
                or not all(isinstance(s, Sample) for s in mine):
            raise MimoFxError(f"samples[{i}] must be loader {i}'s list of Sample, got "
                              f"{mine!r}")
        out.append(tuple(mine))
    return tuple(out)


def _costs(given: object, default: list[float], what: str, item: str) -> list[float]:
    if given is None:
        return default
    values = _check_numbers(given, what, "cost")
    if len(values) != len(default):
        raise MimoFxError(f"{what} has {len(values)} entries for {len(default)} {item}s; "
                          f"give one cost per {item}, in the loaders' order")
    return values


def _assign(costs, bins: int, capacity, sizes, name: str) -> list[int]:
    """:func:`assign` with ``capacity`` given to :func:`place` as ``name``: its errors
    say which argument to raise."""
    try:
        return assign(costs, bins, capacity=capacity, sizes=sizes)
    except MimoFxError as err:
        raise MimoFxError(f"place: {name}={capacity!r}: {err}") from None
