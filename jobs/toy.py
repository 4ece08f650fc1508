"""A toy MIMO model: encoder (TP MLP) -> projection -> bridge -> causal LLM block.

Written once as SPMD code over ``{rank: piece}`` dicts (:mod:`mimo_fx.mimo.spmd`), so the
same step runs on the reference world and on a process world, and once as plain
full-tensor math (:meth:`ToyMimo.reference_loss`), the oracle it is checked against.

Tensor parallelism is real: weights are sharded over ``tp`` and the TP collectives are
``redistribute`` calls between layouts -- a row-parallel output is *partial* over tp
and becomes replicated (all-reduce), and a replicated activation entering a
column-parallel layer passes through ``redistribute(x, L, L, grad_partial=("tp",))``
(no communication forward, the tp ranks' gradient contributions summed backward).
Context parallelism is zigzag; attention gathers K/V over cp with
``grad_partial=("cp",)``, so each cp rank's K/V gradient contributions are summed.

Gradients are right by construction: the loss is a sum over the global batch divided
by the global element count (a constant every rank knows), each rank differentiates the
part its pieces hold, and :func:`finalize_grads` sums parameter gradients over the axes
that split the data (dp, and cp on the LLM) -- never averages, and no per-module
rescaling. TP replicas compute identical losses and identical gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mimo_fx.grid import Grid
from mimo_fx.layout import Layout
from mimo_fx.mimo.grads import finalize_grads
from mimo_fx.mimo.spmd import Pieces, World, local

__all__ = ["ToyConfig", "ToyMimo", "finalize_grads"]


@dataclass(frozen=True)
class ToyConfig:
    batch: int = 8
    seq: int = 8        # image tokens per sample (the encoder's sequence)
    features: int = 6
    enc_hidden: int = 8
    hidden: int = 8
    heads: int = 4
    ffn: int = 16
    text: int = 0       # text tokens per sample, after the image tokens in the LLM

    @property
    def sizes(self) -> dict[str, int]:
        return {"b": self.batch, "s": self.seq + self.text, "f": self.features,
                "e": self.enc_hidden, "h": self.hidden, "o": self.hidden, "g": self.ffn,
                "i": self.hidden, "v": self.seq, "t": self.text}


def _zig(grid: Grid) -> dict:
    return {"zigzag": ("cp",)} if "cp" in grid.names and grid.axis_size("cp") > 1 else {}


def _seq(grid: Grid) -> str:
    return "(cp s)" if "cp" in grid.names else "s"


class ToyMimo:
    """Layouts and math of the toy model on an encoder grid and an LLM grid."""

    def __init__(self, cfg: ToyConfig, enc: Grid, llm: Grid) -> None:
        self.cfg, self.enc, self.llm = cfg, enc, llm
        zz, seq = _zig(llm), _seq(llm)
        self.param_layouts = {
            "enc.w1": Layout(enc, "f (tp e)"),
            "enc.w2": Layout(enc, "(tp e) h"),
            "enc.proj": Layout(enc, "i h"),
            "llm.wq": Layout(llm, "h (tp o)"),
            "llm.wk": Layout(llm, "h (tp o)"),
            "llm.wv": Layout(llm, "h (tp o)"),
            "llm.wo": Layout(llm, "(tp o) h"),
            "llm.wf1": Layout(llm, "h (tp g)"),
            "llm.wf2": Layout(llm, "(tp g) h"),
        }
        self.x = Layout(enc, "(dp b) v f")          # image (visual) token features
        self.enc_partial = Layout(enc, "(dp b) v h", partial=("tp",))
        self.enc_out = Layout(enc, "(dp b) v h")
        # with text: image embeddings join the text on every LLM rank, then CP cuts the
        # joined sequence (a local slice); without, they go straight to the CP chunks
        self.text = Layout(llm, "(dp b) t h")
        self.images = Layout(llm, "(dp b) v h")
        self.joined = Layout(llm, "(dp b) s h")
        self.enc_seq = Layout(enc, "(dp b) s h")     # enc_out when the images are all of s
        self.u = Layout(llm, f"(dp b) {seq} h", **zz)
        self.q = Layout(llm, f"(dp b) {seq} (tp o)", **zz)
        self.kv = Layout(llm, "(dp b) s (tp o)")
        self.llm_partial = Layout(llm, f"(dp b) {seq} h", partial=("tp",), **zz)
        self.target = self.u

    # -- parameters ------------------------------------------------------------------
    def init_params(self, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
        """Full (undistributed) parameters."""
        c, gen = self.cfg, torch.Generator().manual_seed(seed)
        shapes = {"enc.w1": (c.features, c.enc_hidden), "enc.w2": (c.enc_hidden, c.hidden),
                  "enc.proj": (c.hidden, c.hidden), "llm.wq": (c.hidden, c.hidden),
                  "llm.wk": (c.hidden, c.hidden), "llm.wv": (c.hidden, c.hidden),
                  "llm.wo": (c.hidden, c.hidden), "llm.wf1": (c.hidden, c.ffn),
                  "llm.wf2": (c.ffn, c.hidden)}
        return {n: torch.randn(s, generator=gen, dtype=dtype) / math.sqrt(s[0])
                for n, s in shapes.items()}

    # -- the distributed step ----------------------------------------------------------
    def loss(self, world: World, params: dict[str, Pieces], x: Pieces,
             target: Pieces, tokens: int | None = None, text: Pieces | None = None,
             lengths: tuple[int, int] | None = None) -> Pieces:
        """Per-rank loss pieces: each rank's share of sum((y - t)^2) / N.

        N is ``tokens`` (default: this batch's element count); pass the global step's
        count when this batch is one micro-batch of several. ``text``: text embeddings
        ``(b, t, h)`` that follow the image tokens in the LLM's sequence; ``lengths``:
        this step's image and text tokens per sample (default: the config's; a step may
        change them, see :meth:`step_sizes`).
        """
        sizes = self.step_sizes(*(lengths or (self.cfg.seq, self.cfg.text)))
        rd = world.redistribute
        a = local(lambda xi, w: torch.nn.functional.gelu(xi @ w), x, params["enc.w1"])
        z = local(torch.matmul, a, params["enc.w2"])
        z = rd(z, self.enc_partial, self.enc_out, **_only(sizes, "bvh"))
        e = local(torch.matmul, z, params["enc.proj"])          # projection i -> h
        if text is None:
            u = rd(e, self.enc_seq, self.u, **_only(sizes, "bsh"))
        else:
            images = rd(e, self.enc_out, self.images, **_only(sizes, "bvh"))
            joined = local(lambda a, t: torch.cat([a, t], 1), images, text)
            u = rd(joined, self.joined, self.u, **_only(sizes, "bsh"))
        u = {r: t for r, t in u.items() if self.u.holds(r)}
        h = self._block(world, params, u, sizes)
        n = tokens or sizes["b"] * sizes["s"] * sizes["h"]
        return local(lambda y, t: ((y - t) ** 2).sum() / n, h, target)

    def step_sizes(self, images: int, text: int) -> dict[str, int]:
        """Every dim's size for a step with ``images`` image and ``text`` text tokens per
        sample (the LLM's sequence is both: zigzag CP needs it a multiple of 2*CP)."""
        return {**self.cfg.sizes, "v": images, "t": text, "s": images + text}

    def _f(self, world: World, t: Pieces, layout: Layout, sizes) -> Pieces:
        """Megatron's f: identity forward, tp gradient contributions summed backward."""
        return world.redistribute(t, layout, layout, grad_partial=("tp",),
                                  **_only(sizes, "bsh"))

    def _block(self, world: World, params, u: Pieces, sizes) -> Pieces:
        c, rd = self.cfg, world.redistribute
        uf = self._f(world, u, self.u, sizes)
        q = local(torch.matmul, uf, params["llm.wq"])
        k = local(torch.matmul, uf, params["llm.wk"])
        v = local(torch.matmul, uf, params["llm.wv"])
        bso = _only(sizes, "bso")
        k = rd(k, self.q, self.kv, grad_partial=self._cp(), **bso)
        v = rd(v, self.q, self.kv, grad_partial=self._cp(), **bso)
        hd = c.hidden // c.heads

        def attend(rank, qi, ki, vi):
            b, s, o = qi.shape
            length = ki.shape[1]
            pos = self._positions(rank, length)
            mask = pos[:, None] >= torch.arange(length)[None, :]
            qh = qi.view(b, s, o // hd, hd).transpose(1, 2)
            kh = ki.view(b, length, o // hd, hd).transpose(1, 2)
            vh = vi.view(b, length, o // hd, hd).transpose(1, 2)
            scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(hd)
            scores = scores.masked_fill(~mask, float("-inf"))
            return (scores.softmax(-1) @ vh).transpose(1, 2).reshape(b, s, o)

        ctx = local(attend, q, k, v, rank_arg=True)
        attn = local(torch.matmul, ctx, params["llm.wo"])
        attn = rd(attn, self.llm_partial, self.u, **_only(sizes, "bsh"))
        r = local(torch.add, u, attn)
        rf = self._f(world, r, self.u, sizes)
        m = local(lambda t, w: torch.nn.functional.gelu(t @ w), rf, params["llm.wf1"])
        m = local(torch.matmul, m, params["llm.wf2"])
        m = rd(m, self.llm_partial, self.u, **_only(sizes, "bsh"))
        return local(torch.add, r, m)

    def _cp(self) -> tuple[str, ...]:
        return ("cp",) if "cp" in self.llm.names and self.llm.axis_size("cp") > 1 else ()

    def _positions(self, rank: int, length: int) -> torch.Tensor:
        """The global positions of ``rank``'s query rows in a sequence of ``length`` (its
        zigzag chunks i and 2*CP-1-i), as tensor ops: one traced graph serves every
        length."""
        if not self._cp():
            return torch.arange(length)
        n, i = self.llm.axis_size("cp"), self.llm.coord(rank)["cp"]
        c = length // (2 * n)
        return torch.cat([torch.arange(i * c, (i + 1) * c),
                          torch.arange((2 * n - 1 - i) * c, (2 * n - i) * c)])

    # -- the oracle ------------------------------------------------------------------------
    def reference_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor,
                       target: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """The same model on full tensors, no parallelism."""
        c = self.cfg
        z = torch.nn.functional.gelu(x @ params["enc.w1"]) @ params["enc.w2"]
        u = z @ params["enc.proj"]
        if text is not None:
            u = torch.cat([u, text], 1)
        b, s, _ = u.shape
        hd = c.hidden // c.heads

        def heads(t):
            return t.view(b, s, c.heads, hd).transpose(1, 2)

        q, k, v = (heads(u @ params[f"llm.w{n}"]) for n in "qkv")
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, float("-inf"))
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, c.hidden)
        r = u + ctx @ params["llm.wo"]
        y = r + torch.nn.functional.gelu(r @ params["llm.wf1"]) @ params["llm.wf2"]
        return ((y - target) ** 2).sum() / (b * s * c.hidden)


def _only(sizes: dict[str, int], dims: str) -> dict[str, int]:
    return {d: sizes[d] for d in dims}
