"""Layout parsing, printing, value semantics, pinning and every user-facing error."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from mimo_fx import Grid, Layout, MimoFxError
from mimo_fx.layout import Factor
from mimo_fx.plan import plan
from mimo_fx.reference import redistribute, shard

G = Grid(tp=2, cp=2, dp=2)
GP = Grid(tp=2, pp=3, offset=10)


# -- parsing -------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern,dims,sharding,replicated,groups", [
    ("(dp b) s h", ("b", "s", "h"), {"b": ("dp",), "s": (), "h": ()}, ("tp", "cp"),
     ((Factor("b", ("dp",)),), (Factor("s", ()),), (Factor("h", ()),))),
    ("(dp b) (cp s) (tp h)", ("b", "s", "h"), {"b": ("dp",), "s": ("cp",), "h": ("tp",)}, (),
     ((Factor("b", ("dp",)),), (Factor("s", ("cp",)),), (Factor("h", ("tp",)),))),
    ("(dp cp b) s", ("b", "s"), {"b": ("dp", "cp"), "s": ()}, ("tp",),
     ((Factor("b", ("dp", "cp")),), (Factor("s", ()),))),
    ("(dp b s) h", ("b", "s", "h"), {"b": ("dp",), "s": (), "h": ()}, ("tp", "cp"),
     ((Factor("b", ("dp",)), Factor("s", ())), (Factor("h", ()),))),
    ("(s dp b) (tp h)", ("s", "b", "h"), {"s": (), "b": ("dp",), "h": ("tp",)}, ("cp",),
     ((Factor("s", ()), Factor("b", ("dp",))), (Factor("h", ("tp",)),))),
    ("(cp s tp h)", ("s", "h"), {"s": ("cp",), "h": ("tp",)}, ("dp",),
     ((Factor("s", ("cp",)), Factor("h", ("tp",))),)),
    ("x", ("x",), {"x": ()}, ("tp", "cp", "dp"), ((Factor("x", ()),),)),
])
def test_parse(pattern, dims, sharding, replicated, groups):
    layout = Layout(G, pattern)
    assert layout.dims == dims
    assert layout.sharding == sharding
    assert layout.replicated == replicated
    assert layout.local_dims == groups
    assert layout.sharded_axes == tuple(a for d in dims for a in sharding[d])
    assert str(layout) == pattern


def test_replicated_excludes_partial_and_pinned():
    g = Grid(tp=2, cp=2, pp=2, dp=2)
    layout = Layout(g, "(dp b) s", partial="tp", at={"pp": 0})
    assert layout.replicated == ("cp",)
    assert layout.partial == ("tp",)
    assert layout.at == (("pp", 0),)


@pytest.mark.parametrize("raw,printed", [
    ("( dp  b ) s", "(dp b) s"),
    ("  (dp b)s\t\n h ", "(dp b) s h"),
    ("(b) s", "b s"),
    ("(dp    cp b)(tp h)", "(dp cp b) (tp h)"),
])
def test_whitespace_normalised(raw, printed):
    layout = Layout(G, raw)
    assert str(layout) == printed
    assert layout.pattern == printed
    assert layout == Layout(G, printed)


# -- printing and value semantics ----------------------------------------------------------
G4 = Grid(tp=2, cp=2, pp=2, dp=2)
REPR_CASES = [
    Layout(G4, "(dp b) s h"),
    Layout(G4, "(dp b) (cp s) h", zigzag="cp"),
    Layout(G4, "(dp b) s h", partial=("tp", "cp")),
    Layout(G4, "(dp b) (cp s) h", partial="tp", at={"pp": -1}, zigzag=("cp",)),
    Layout(Grid(tp=2, pp=3, offset=6), "b (tp h)", at={"pp": 1}),
    Layout(G4, "(dp cp b) (tp h)", partial="pp", split="chunk"),
]


@pytest.mark.parametrize("layout", REPR_CASES, ids=lambda lay: lay.describe())
def test_repr_eval_round_trip(layout):
    again = eval(repr(layout), {"Grid": Grid, "Layout": Layout})
    assert again == layout
    assert hash(again) == hash(layout)
    assert pickle.loads(pickle.dumps(layout)) == layout


def test_repr_and_describe_text():
    layout = Layout(G4, "(dp b) (cp  s) h", partial="tp", at={"pp": -1}, zigzag="cp")
    assert repr(layout) == ("Layout(Grid(tp=2, cp=2, pp=2, dp=2), '(dp b) (cp s) h', "
                            "partial=('tp',), at={'pp': 1}, zigzag=('cp',))")
    assert layout.describe() == "(dp b) (cp s) h [partial tp; zigzag cp; at pp=1]"


def test_equality_and_hash():
    a = Layout(G4, "(dp b) s", at={"pp": -1})
    b = Layout(G4, "( dp b )  s", at={"pp": 1})  # -1 normalised to 1 on pp=2
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert Layout(G, "b", partial="tp") == Layout(G, "b", partial=("tp",))
    assert Layout(G, "(cp s)", zigzag="cp") == Layout(G, "(cp s)", zigzag=["cp"])
    assert a != Layout(G4, "(dp b) s", at={"pp": 0})
    assert a != Layout(G4, "(dp b) s")
    assert Layout(G, "b s") != Layout(G, "s b")
    assert Layout(G, "b s") != Layout(Grid(tp=2, cp=2, dp=2, offset=8), "b s")
    assert Layout(G, "(cp s)") != Layout(G, "(cp s)", zigzag="cp")
    assert Layout(G, "b") != Layout(G, "b", partial="tp")
    assert Layout(G, "(dp b)") == Layout(G, "(dp b)", split="tensor_split")
    assert Layout(G, "(dp b)") != Layout(G, "(dp b)", split="chunk")


def test_split_repr_describe_and_pickle():
    layout = Layout(G4, "(dp b) s", at={"pp": 0}, split="chunk")
    assert repr(layout) == ("Layout(Grid(tp=2, cp=2, pp=2, dp=2), '(dp b) s', at={'pp': 0}, "
                            "split='chunk')")
    assert layout.describe() == "(dp b) s [at pp=0; split chunk]"
    assert pickle.loads(pickle.dumps(layout)).split == "chunk"
    assert "split" not in repr(Layout(G4, "(dp b) s"))


def test_split_changes_the_plan_and_gradient_layout():
    """Plans key on the split; the adjoint keeps it (src* and the dst cotangent layout)."""
    from mimo_fx.plan import backward_plan

    src = Layout(Grid(dp=4), "(dp b) h", partial=(), split="chunk")
    dst = Layout(Grid(tp=4), "b (tp h)", split="chunk")
    sizes = {"b": 5, "h": 6}
    p = plan(src, dst, sizes)
    assert p is not plan(Layout(Grid(dp=4), "(dp b) h"), dst, sizes)
    bwd = backward_plan(src, dst, sizes)
    assert bwd.src.split == "chunk" and bwd.dst.split == "chunk"
    assert p.hold.segments(3) == ((), ((0, 6),))  # 5 by 4 in chunks: 2, 2, 1, empty


# -- holds / holders -----------------------------------------------------------------------
@pytest.mark.parametrize("index,stage", [(-1, 2), (2, 2), (0, 0), (-3, 0), (1, 1), (-2, 1)])
def test_holders_pinned(index, stage):
    layout = Layout(GP, "b (tp h)", at={"pp": index})
    assert layout.at == (("pp", stage),)
    # GP = Grid(tp=2, pp=3, offset=10): rank = 10 + tp + 2*pp
    want = tuple(10 + tp + 2 * stage for tp in range(2))
    assert layout.holders == want
    for r in range(0, 30):
        assert layout.holds(r) == (r in want)


def test_holders_unpinned_is_whole_grid():
    layout = Layout(GP, "b h")
    assert layout.holders == tuple(range(10, 16))
    assert not layout.holds(9) and not layout.holds(16)


# -- errors --------------------------------------------------------------------------------
def esc(s: str) -> str:
    return re.escape(s)


@pytest.mark.parametrize("grid,pattern,kwargs,match", [
    # unknown axes in keyword arguments
    (G, "(dp b) s", {"partial": "ep"}, r"partial= names unknown axis 'ep'.*\('tp', 'cp', 'dp'\)"),
    (G, "(dp b) s", {"zigzag": "pp"}, r"zigzag= names unknown axis 'pp'"),
    (G, "(dp b) s", {"at": {"pp": 0}}, r"at= names unknown axis 'pp'.*has axes"),
    (G, "(dp b) s", {"partial": ("tp", "tp")}, r"partial=\('tp', 'tp'\) names an axis twice"),
    (G, "(dp b) s", {"at": [("tp", 0)]}, r"at= must be a dict like"),
    # axis-like names on a grid without them
    (Grid(tp=2, dp=2), "(cp s) h", {}, r"'cp' looks like a grid axis.*add it to the Grid"),
    (Grid(tp=2, dp=2), "b (ep e)", {}, r"'ep' looks like a grid axis"),
    (Grid(tp=2, dp=2), "pp b", {}, r"'pp' looks like a grid axis"),
    (Grid(tp=2, cp=2), "(dp b) s", {}, r"'dp' looks like a grid axis.*\('tp', 'cp'\)"),
    # structure of the pattern
    (G, "(dp b) (dp s)", {}, r"axis 'dp' is used twice"),
    (G, "(dp b s", {}, r"unbalanced '\(': a group is not closed; add '\)'"),
    (G, "b) s", {}, r"unbalanced '\)': no group is open"),
    (G, "((dp b) s)", {}, r"nested parentheses"),
    (G, "(dp (b s))", {}, r"nested parentheses"),
    (G, "() b", {}, r"empty group '\(\)'"),
    (G, "b (tp b)", {}, r"dim 'b' is named twice"),
    (G, "dp b", {}, r"axis 'dp' stands alone and shards nothing.*'\(dp h\)'"),
    (G, "(tp) b", {}, r"axis 'tp' stands alone"),
    (G, "(b dp) s", {}, r"axis 'dp' ends group '\(b dp\)'.*'\(dp b\)'"),
    (G, "(b s cp)", {}, r"axis 'cp' ends group"),
    (G, "(dp b tp) s", {}, r"axis 'tp' ends group.*e\.g\. '\(tp dp b\)'"),
    (G, "(dp tp) s", {}, r"group '\(dp tp\)' names axes but no dim.*'\(dp tp b\)'"),
    (G, "(dp b) s", {"partial": 3}, r"partial=3 must name grid axes: one name or a tuple"),
    (G, "(dp b) s", {"zigzag": b"cp"}, r"zigzag=b'cp' must name grid axes"),
    (G, "(dp b) s", {"ragged": ("dp", 1)}, r"ragged=\('dp', 1\) must name grid axes"),
    (G, "b, s", {}, r"unexpected character ','"),
    (G, "b*s", {}, r"unexpected character '\*'"),
    (G, "b 2s", {}, r"unexpected character '2'"),
    (G, "", {}, r"names no dims"),
    (G, "   ", {}, r"names no dims"),
    # axis roles that conflict
    (G, "b (tp h)", {"partial": "tp"}, r"axis 'tp' both shards a dim and is partial"),
    (G4, "b h", {"partial": "pp", "at": {"pp": 0}},
     r"axis 'pp' is both pinned \(at=\) and partial"),
    (G4, "(pp b) h", {"at": {"pp": 0}}, r"axis 'pp' is pinned with at= but also shards a dim"),
    (GP, "b h", {"at": {"pp": 3}},
     r"at=\{'pp': 3\} is out of range; valid indices are the ints -3\.\.2"),
    (GP, "b h", {"at": {"pp": -4}}, r"at=\{'pp': -4\} is out of range"),
    (GP, "b h", {"at": {"pp": True}}, r"at=\{'pp': True\} is not an int; valid indices"),
    (GP, "b h", {"at": {"pp": 1.0}}, r"at=\{'pp': 1\.0\} is not an int"),
    (G, "(dp b) s", {"zigzag": "cp"}, r"zigzag axis 'cp' does not shard any dim.*'\(cp s\)'"),
    (G, "(dp cp s) h", {"zigzag": "cp"},
     r"zigzag axis 'cp' must be the only axis sharding 's', found \('dp', 'cp'\)"),
    (G, "(cp dp s) h", {"zigzag": "cp"}, r"zigzag axis 'cp' must be the only axis sharding 's'"),
    (G, "(dp b) h", {"split": "even"},
     r"split='even' is not a known rule; use one of \('tensor_split', 'chunk'\)"),
    (G, "(dp b) h", {"split": None}, r"split=None is not a known rule"),
])
def test_layout_errors(grid, pattern, kwargs, match):
    with pytest.raises(MimoFxError, match=match):
        Layout(grid, pattern, **kwargs)


def test_unicode_dim_names_and_none_for_no_axes():
    """A dim's name is any identifier (one dim, not one per character class), and None
    for partial/zigzag/ragged means none, as () does."""
    layout = Layout(Grid(dp=2), "(dp bé) h", partial=None, zigzag=None, ragged=None)
    assert layout.dims == ("bé", "h") and layout.partial == layout.zigzag == ()
    x = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(shard(x, layout)[1], x[2:])


def test_zigzag_over_one_rank_is_the_identity():
    """A zigzag axis of size 1 hands its rank both chunks in order: the layout is the one
    without it (equal, so it plans the same: a partial-to-sharded pair fuses into one
    all-reduce either way), and any length works."""
    from mimo_fx import plan

    one = Grid(tp=2, pp=1, cp=2)
    src = Layout(one, "(pp b) s h", partial="cp", zigzag="pp")
    assert src == Layout(one, "(pp b) s h", partial="cp") and src.zigzag == ()
    dst = Layout(Grid(tp=2, cp=1, pp=2), "(cp b) s h")
    assert [type(s).__name__ for s in plan(src, dst, {"b": 2, "s": 1, "h": 3}).steps] \
        == ["AllReduce"]
    x = torch.arange(10.0).reshape(2, 5)
    odd = Layout(Grid(cp=1, dp=2), "(dp b) (cp s)", zigzag="cp")
    assert torch.equal(shard(x, odd)[1], x[1:])


def test_non_grid_and_non_string():
    with pytest.raises(MimoFxError, match=r"needs a Grid \(or a DeviceMesh with named dims\) "
                                          r"as first argument, got 'tp'"):
        Layout("tp", "b")  # type: ignore[arg-type]
    with pytest.raises(MimoFxError, match=r"pattern must be a string, got \['b'\]"):
        Layout(G, ["b"])  # type: ignore[arg-type]


# -- errors raised when sizes are known ----------------------------------------------------
ZIG = Layout(G, "(cp s) h", zigzag="cp")  # CP=2: s must be a multiple of 4
FLAT = Layout(G, "s h")


@pytest.mark.parametrize("src,dst", [(ZIG, FLAT), (FLAT, ZIG)], ids=["src-zig", "dst-zig"])
@pytest.mark.parametrize("s", [6, 2, 5])
def test_plan_zigzag_not_divisible(src, dst, s):
    with pytest.raises(MimoFxError, match=rf"zigzag.*s={s} is not divisible by 4; pad 's'"):
        plan(src, dst, {"s": s, "h": 2})


@pytest.mark.parametrize("s", [6, 2, 5])
def test_shard_zigzag_not_divisible(s):
    with pytest.raises(MimoFxError, match=rf"zigzag needs s={s} divisible by 2\*2; pad 's'"):
        shard(torch.zeros(s, 2), ZIG)


def test_plan_zigzag_divisible_is_fine():
    assert plan(ZIG, FLAT, {"s": 8, "h": 2}).dims == ("s", "h")


SRC = Layout(G, "(dp b) s")


@pytest.mark.parametrize("dst,sizes,match", [
    (Layout(G, "b h"), {"b": 4, "s": 3},
     r"must name the same dims; only in src: \['s'\], only in dst: \['h'\]"),
    (Layout(G, "b"), {"b": 4, "s": 3}, r"only in src: \['s'\], only in dst: \[\]"),
    (Layout(G, "b s"), {"b": 4}, r"sizes miss dims \['s'\].*e\.g\. s=\.\.\."),
    (Layout(G, "b s"), {}, r"sizes miss dims \['b', 's'\]"),
    (Layout(G, "b s"), {"b": 4, "s": 3, "x": 2}, r"sizes name dims \['x'\].*\('b', 's'\)"),
    (Layout(G, "b s"), {"b": 0, "s": 3}, r"size b=0 must be a positive integer"),
    (Layout(G, "b s"), {"b": 4, "s": -3}, r"size s=-3 must be a positive integer"),
    (Layout(G, "b s"), {"b": 4.0, "s": 3}, r"size b=4\.0 must be a positive integer"),
    (Layout(G, "b s"), {"b": True, "s": 3}, r"size b=True must be a positive integer"),
    (Layout(G, "b s", partial="tp"), {"b": 4, "s": 3},
     r"partial over \('tp',\).*only keep partial axes that src.*Make dst replicated"),
])
def test_plan_errors(dst, sizes, match):
    with pytest.raises(MimoFxError, match=match):
        plan(SRC, dst, sizes)


def test_plan_dst_partial_on_other_grid():
    src = Layout(G, "b s", partial="tp")
    dst = Layout(Grid(tp=2, cp=2, dp=2, offset=8), "b s", partial="tp")
    with pytest.raises(MimoFxError, match=r"only keep partial axes.*on the same grid"):
        plan(src, dst, {"b": 2, "s": 2})


def test_plan_needs_layouts():
    with pytest.raises(MimoFxError, match=r"plan needs two layouts.*Layout\(Grid"):
        plan("(dp b) s", SRC, {"b": 2, "s": 2})  # type: ignore[arg-type]


# -- errors of the reference redistribute --------------------------------------------------
R_SRC = Layout(Grid(tp=2), "b s")
R_DST = Layout(Grid(tp=2), "(tp b) s")


@pytest.mark.parametrize("sizes", [{}, {"b": 2, "s": 3}], ids=["inferred", "given"])
@pytest.mark.parametrize("shape", [(2, 3, 1), (6,)])
def test_redistribute_wrong_ndim(sizes, shape):
    pieces = {0: torch.zeros(shape), 1: torch.zeros(shape)}
    with pytest.raises(MimoFxError, match=rf"local tensor has {len(shape)} dims.*{esc(repr('b s'))}"
                       rf".* 2"):
        redistribute(pieces, R_SRC, R_DST, **sizes)


def test_redistribute_missing_holder():
    with pytest.raises(MimoFxError, match=r"held by ranks \[0, 1\]; pieces miss \[1\]"):
        redistribute({0: torch.zeros(2, 3)}, R_SRC, R_DST)


def test_redistribute_extra_rank():
    pieces = {0: torch.zeros(2, 3), 1: torch.zeros(2, 3), 5: torch.zeros(2, 3)}
    with pytest.raises(MimoFxError, match=r"pieces miss \[\] and have extra \[5\]"):
        redistribute(pieces, R_SRC, R_DST)


def test_redistribute_missing_pinned_holder():
    src = Layout(GP, "b h", at={"pp": -1})  # holders 14, 15
    with pytest.raises(MimoFxError, match=r"held by ranks \[14, 15\]; pieces miss \[15\]"):
        redistribute({14: torch.zeros(2, 2)}, src, Layout(GP, "b h", at={"pp": 0}))


def test_with_partial_replaces_partial_only():
    layout = Layout(G4, "(dp b) (cp s)", partial="tp", at={"pp": 1}, zigzag="cp", split="chunk")
    assert layout.with_partial() == Layout(G4, "(dp b) (cp s)", at={"pp": 1}, zigzag="cp",
                                           split="chunk")
    assert layout.with_partial().with_partial("tp") == layout
