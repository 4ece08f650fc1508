"""The shared table of layout pairs.

Every case the design asks to cover, at world sizes 1 to 16: fan-in, fan-out, equal,
destination CP (zigzag), source CP, flattened ``(dp b s) h``, TP-sharded and partial
inputs, pipeline stages on grids with pp>1, disjoint grids with a rank offset,
overlapping grids, uneven sizes, permuted dims. The reference tests run all of them; the
compiled backend's tests run a sample. ``RAGGED`` holds the cuts by run-time counts
(a ragged dim's size is its tuple of counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mimo_fx import Grid, Layout

__all__ = ["Case", "CASES", "RAGGED", "by_name", "case_ids", "star"]


@dataclass(frozen=True)
class Case:
    name: str
    src: Layout
    dst: Layout
    sizes: dict[str, int]
    tags: tuple[str, ...] = field(default=())

    @property
    def world(self) -> int:
        return max(max(self.src.grid.ranks), max(self.dst.grid.ranks)) + 1

    @property
    def counts(self) -> dict[str, tuple[int, ...]]:
        """The ragged dims' counts (sizes given as tuples)."""
        return {d: n for d, n in self.sizes.items() if isinstance(n, tuple)}

    @property
    def totals(self) -> dict[str, int]:
        """Every dim's global size (a ragged dim's: the sum of its counts)."""
        return {d: sum(n) if isinstance(n, tuple) else n for d, n in self.sizes.items()}

    @property
    def count_free(self) -> bool:
        """Whether the plan's shape does not depend on the counts: every layout that cuts
        a ragged dim cuts it ragged (at the counts' boundaries)."""
        return all(not lay.sharding[d] or d in lay.ragged_dims
                   for d in self.counts for lay in (self.src, self.dst))

    def with_counts(self, **counts: tuple[int, ...]) -> Case:
        return Case(self.name, self.src, self.dst, {**self.sizes, **counts}, self.tags)


def L(grid: Grid, pattern: str, **kw) -> Layout:  # noqa: N802 - short table constructor
    return Layout(grid, pattern, **kw)


BSH = {"b": 8, "s": 8, "h": 6}
ENC = Grid(tp=2, dp=4)                 # encoder TP2 x DP4
LLM = Grid(tp=2, cp=2, dp=2)           # LLM TP2 x CP2 x DP2
ZZ = {"zigzag": ("cp",)}

CASES: list[Case] = [
    # -- world 1 and small odd worlds ------------------------------------------------------
    Case("world1_identity", L(Grid(dp=1), "b s h"), L(Grid(dp=1), "b s h"), BSH, ("local",)),
    Case("world3_tp_to_dp", L(Grid(tp=3), "b (tp h)"), L(Grid(dp=3), "(dp b) h"),
         {"b": 6, "h": 9}),
    Case("world5_uneven", L(Grid(dp=5), "(dp b) h"), L(Grid(tp=5), "b (tp h)"),
         {"b": 7, "h": 3}, ("uneven",)),
    Case("world6_overlap", L(Grid(dp=4), "(dp b) h"), L(Grid(tp=2, dp=2, offset=2), "(dp b) h"),
         {"b": 8, "h": 4}, ("overlap",)),
    # -- colocated fan-in / fan-out / equal ------------------------------------------------
    Case("fan_in", L(ENC, "(dp b) s h"), L(LLM, "(dp b) s h"), BSH, ("fan_in", "gather")),
    Case("fan_in_cp_zigzag", L(ENC, "(dp b) s h"), L(LLM, "(dp b) (cp s) h", **ZZ), BSH,
         ("fan_in", "cp")),
    Case("fan_out", L(Grid(tp=4, dp=2), "(dp b) s h"), L(Grid(dp=8), "(dp b) s h"), BSH,
         ("fan_out", "local")),
    Case("fan_out_cp_zigzag", L(Grid(tp=4, dp=2), "(dp b) s h"),
         L(Grid(cp=2, dp=4), "(dp b) (cp s) h", **ZZ), BSH, ("fan_out", "cp", "local")),
    Case("equal_tp2dp4_to_tp4dp2", L(ENC, "(dp b) s h"), L(Grid(tp=4, dp=2), "(dp b) s h"),
         BSH, ("equal", "gather")),
    Case("equal_tp4dp2_to_tp2dp4", L(Grid(tp=4, dp=2), "(dp b) s h"), L(ENC, "(dp b) s h"),
         BSH, ("equal", "local")),
    Case("equal_same_grid", L(ENC, "(dp b) s h"), L(ENC, "(dp b) s h"), BSH,
         ("equal", "local")),
    Case("equal_tp_sharded_both", L(ENC, "(dp b) s (tp h)"),
         L(Grid(tp=4, dp=2), "(dp b) s (tp h)"), {"b": 8, "s": 4, "h": 8}, ("equal",)),
    # -- context parallelism ---------------------------------------------------------------
    Case("src_cp_zigzag_to_dp", L(LLM, "(dp b) (cp s) h", **ZZ), L(ENC, "(dp b) s h"), BSH,
         ("cp",)),
    Case("cp_contiguous_to_zigzag", L(LLM, "(dp b) (cp s) h"), L(LLM, "(dp b) (cp s) h", **ZZ),
         BSH, ("cp",)),
    Case("dp_cp_multi_axis", L(ENC, "(dp b) s h"), L(LLM, "(dp cp b) s h"), BSH, ("cp",)),
    # -- flattened and permuted dims -------------------------------------------------------
    Case("flattened_dp_b_s", L(ENC, "(dp b s) h"), L(LLM, "(dp b) (cp s) h", **ZZ), BSH,
         ("flattened", "cp")),
    Case("flattened_s_outer", L(ENC, "(s dp b) h"), L(LLM, "(dp b) s h"), BSH,
         ("flattened",)),
    Case("permuted_dims", L(ENC, "(dp b) s h"), L(LLM, "s (dp b) (tp h)"), BSH, ("permuted",)),
    # -- TP-sharded and partial inputs -----------------------------------------------------
    Case("tp_sharded_in", L(ENC, "(dp b) s (tp h)"), L(LLM, "(dp b) (cp s) h", **ZZ), BSH,
         ("tp",)),
    Case("partial_to_replicated", L(ENC, "(dp b) s h", partial="tp"), L(ENC, "(dp b) s h"),
         BSH, ("partial", "all_reduce")),
    Case("partial_to_tp_sharded", L(ENC, "(dp b) s h", partial="tp"),
         L(ENC, "(dp b) s (tp h)"), BSH, ("partial", "reduce_scatter")),
    Case("partial_to_llm_cp", L(ENC, "(dp b) s h", partial="tp"),
         L(LLM, "(dp b) (cp s) h", **ZZ), BSH, ("partial",)),
    Case("partial_two_axes", L(Grid(tp=2, cp=2), "s h", partial=("tp", "cp")),
         L(Grid(tp=2, cp=2), "(cp s) h"), {"s": 8, "h": 5}, ("partial",)),
    Case("partial_kept", L(Grid(tp=2, dp=2), "(dp b) h", partial="tp"),
         L(Grid(tp=2, dp=2), "b (dp h)", partial="tp"), {"b": 4, "h": 6}, ("partial_kept",)),
    # -- pipeline stages and disjoint grids ------------------------------------------------
    Case("pp_stage_to_stage", L(Grid(tp=2, pp=2, dp=2), "(dp b) s h", at={"pp": -1}),
         L(Grid(tp=2, pp=2, dp=2), "(dp b) s h", at={"pp": 0}), BSH, ("pp",)),
    Case("pp_disjoint", L(Grid(tp=2, pp=2, dp=2), "(dp b) s h", at={"pp": -1}),
         L(Grid(tp=2, pp=2, dp=2, offset=8), "(dp b) s h", at={"pp": 0}), BSH,
         ("pp", "disjoint")),
    Case("pp_disjoint_to_cp", L(Grid(tp=2, pp=2, dp=2), "(dp b) s h", at={"pp": -1}),
         L(Grid(tp=2, cp=2, dp=2, offset=8), "(dp b) (cp s) h", **ZZ), BSH,
         ("pp", "disjoint", "cp")),
    Case("pp_disjoint_world8", L(Grid(tp=2, pp=2), "b s (tp h)", at={"pp": -1}),
         L(Grid(tp=2, pp=2, offset=4), "(tp b) s h", at={"pp": 0}), BSH, ("pp", "disjoint")),
    Case("disjoint_fan_out", L(Grid(tp=2, dp=2), "(dp b) s h"),
         L(Grid(dp=4, offset=4), "(dp b) s h"), BSH, ("disjoint",)),
    Case("disjoint_fan_in_tp4", L(Grid(dp=4), "(dp b) s h"),
         L(Grid(tp=4, offset=4), "b s h"), BSH, ("disjoint",)),
    Case("disjoint_tp_sharded_dst", L(Grid(tp=2, dp=2), "(dp b) s (tp h)"),
         L(Grid(tp=2, dp=2, offset=4), "(dp b) (tp s) h"), BSH, ("disjoint",)),
    # -- uneven sizes ----------------------------------------------------------------------
    Case("uneven_fan_in", L(ENC, "(dp b) s h"), L(LLM, "(dp b) (cp s) h"),
         {"b": 7, "s": 5, "h": 3}, ("uneven",)),
    Case("uneven_empty_shards", L(Grid(dp=4), "(dp b) h"), L(Grid(tp=2, dp=2), "(dp b) (tp h)"),
         {"b": 3, "h": 3}, ("uneven",)),
    Case("uneven_disjoint", L(Grid(tp=2, dp=3), "(dp b) s (tp h)"),
         L(Grid(tp=3, dp=2, offset=6), "(dp b) s h"), {"b": 5, "s": 2, "h": 7},
         ("uneven", "disjoint")),
    # -- DTensor's chunk split (trailing shards may be empty) ------------------------------
    Case("chunk_empty_shard", L(Grid(dp=4), "(dp b) h", split="chunk"),
         L(Grid(tp=2, dp=2), "(dp b) (tp h)"), {"b": 5, "h": 3}, ("uneven", "chunk")),
    Case("chunk_partial_nested", L(Grid(tp=2, dp=3), "(dp b) h", partial="tp", split="chunk"),
         L(Grid(tp=2, dp=3), "b (tp dp h)", split="chunk"), {"b": 4, "h": 5},
         ("uneven", "chunk", "partial")),
    Case("chunk_disjoint", L(Grid(tp=2, dp=2), "(dp b) s (tp h)", split="chunk"),
         L(Grid(tp=2, dp=2, offset=4), "(dp b) (tp s) h", split="chunk"),
         {"b": 3, "s": 3, "h": 5}, ("uneven", "chunk", "disjoint")),
    # -- world 16 --------------------------------------------------------------------------
    Case("world16_fan_in_cp", L(Grid(tp=2, dp=8), "(dp b) s h"),
         L(Grid(tp=4, cp=2, dp=2), "(dp b) (cp s) (tp h)", **ZZ), {"b": 8, "s": 8, "h": 8},
         ("cp",)),
    Case("world16_disjoint_pp", L(Grid(tp=2, pp=2, dp=2), "(dp b) s (tp h)", at={"pp": 1}),
         L(Grid(tp=4, dp=2, offset=8), "(dp b) (tp s) h"), {"b": 4, "s": 8, "h": 4},
         ("pp", "disjoint")),
]


# -- ragged cuts: a different token count per DP replica (or per sample) ----------------
RG = {"ragged": ("dp",)}
RAGGED: list[Case] = [
    Case("ragged_fan_in_nested", L(ENC, "(dp t) h", **RG), L(LLM, "(dp t) h", **RG),
         {"t": (3, 0, 5, 2), "h": 4}, ("ragged", "fan_in")),
    Case("ragged_fan_in_replicated", L(ENC, "(dp t) h", **RG), L(LLM, "t (tp h)"),
         {"t": (3, 0, 5, 2), "h": 4}, ("ragged", "fan_in")),
    Case("ragged_fan_out_per_sample", L(Grid(tp=4, dp=2), "(dp t) h", **RG),
         L(Grid(dp=8), "(dp t) h", **RG), {"t": (2, 1, 0, 3, 4, 0, 1, 2), "h": 3},
         ("ragged", "fan_out")),
    Case("ragged_equal_tp_sharded", L(ENC, "(dp t) (tp h)", **RG),
         L(Grid(tp=4, dp=2), "(dp t) h", **RG), {"t": (1, 4, 2, 0), "h": 6},
         ("ragged", "equal")),
    Case("ragged_with_seq_zigzag", L(ENC, "(dp t) s h", **RG),
         L(LLM, "(dp t) (cp s) h", zigzag=("cp",), **RG), {"t": (2, 1, 0, 3), "s": 8, "h": 2},
         ("ragged", "cp")),
    Case("ragged_partial_in", L(Grid(tp=2, dp=2), "(dp t) h", partial="tp", **RG),
         L(Grid(tp=2, dp=2), "(dp t) h", **RG), {"t": (3, 2), "h": 4},
         ("ragged", "partial")),
    Case("ragged_disjoint_nested", L(Grid(dp=4), "(dp t) h", **RG),
         L(Grid(tp=2, dp=2, offset=4), "(dp t) h", **RG), {"t": (2, 0, 3, 1), "h": 4},
         ("ragged", "disjoint")),
    Case("ragged_disjoint_replicated", L(Grid(tp=2, dp=2), "(dp t) h", **RG),
         L(Grid(tp=2, offset=4), "t (tp h)"), {"t": (4, 1), "h": 4},
         ("ragged", "disjoint")),
    # counts that an even cut splits: the plan's shape follows the counts
    Case("ragged_to_cp", L(ENC, "(dp t) h", **RG), L(LLM, "(cp t) h"),
         {"t": (3, 0, 5, 2), "h": 4}, ("ragged", "cp", "count_dependent")),
    Case("ragged_to_zigzag", L(ENC, "(dp t) h", **RG), L(LLM, "(cp t) h", zigzag=("cp",)),
         {"t": (5, 0, 4, 3), "h": 2}, ("ragged", "cp", "count_dependent")),
    Case("even_to_ragged", L(Grid(dp=4), "(dp t) h"), L(Grid(tp=2, dp=2), "(dp t) h", **RG),
         {"t": (1, 6), "h": 3}, ("ragged", "count_dependent")),
    Case("ragged_disjoint_to_cp", L(Grid(dp=2), "(dp t) h", **RG),
         L(Grid(cp=2, offset=2), "(cp t) h"), {"t": (5, 2), "h": 3},
         ("ragged", "disjoint", "count_dependent")),
]


def by_name(name: str) -> Case:
    """The table's case called ``name``."""
    found = [c for c in CASES + RAGGED if c.name == name]
    if not found:
        raise KeyError(f"no case {name!r}; cases: {', '.join(case_ids())}")
    return found[0]


def case_ids(cases=CASES) -> list[str]:
    return [c.name for c in cases]


def star(layout: Layout) -> Layout:
    """The layout with partial axes replicated: what gradients w.r.t. it look like."""
    return layout.with_partial()
