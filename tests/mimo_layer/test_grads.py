"""Multi-module gradients: no_sync over all modules, one sync per step, zero_grad.

Two micro-batches accumulated under ``no_sync`` then synchronised give, on every rank
and for both modules (encoder DP4, LLM CP2 x DP2), the full batch's gradient of the
undistributed model -- because each micro-batch loss is normalised by the step's global
token count.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mimo_fx import MimoFxError
from mimo_fx.jobs.toy import ToyConfig, ToyMimo
from mimo_fx.mimo import ModuleParallelism as M
from mimo_fx.mimo.grads import ModuleGrads
from mimo_fx.reference import ReferenceWorld, shard

CFG = ToyConfig()


def _micro_grads(model, params, x, t, tokens):
    world = ReferenceWorld()
    for ps in params.values():
        for p in ps.values():
            p.grad = None
    losses = model.loss(world, params, shard(x, model.x), shard(t, model.target), tokens)
    sum(losses.values()).backward()
    return {n: {r: p.grad for r, p in ps.items()} for n, ps in params.items()}


def test_two_micro_batches_under_no_sync_equal_the_full_batch_gradient():
    enc, llm = M(tp=2, dp=4).grid(), M(tp=2, cp=2, dp=2).grid()
    full_model = ToyMimo(CFG, enc, llm)
    micro = ToyMimo(dataclasses.replace(CFG, batch=CFG.batch // 2), enc, llm)
    full = full_model.init_params()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(CFG.batch, CFG.seq, CFG.features, generator=gen, dtype=torch.float64)
    t = torch.randn(CFG.batch, CFG.seq, CFG.hidden, generator=gen, dtype=torch.float64)
    leaves = {n: p.clone().requires_grad_() for n, p in full.items()}
    full_model.reference_loss(leaves, x, t).backward()

    params = {n: {r: p.requires_grad_() for r, p in shard(full[n], layout).items()}
              for n, layout in micro.param_layouts.items()}
    grads = ModuleGrads(ReferenceWorld(), micro.param_layouts, CFG.sizes)
    assert grads.modules == ("enc", "llm")
    tokens = CFG.batch * CFG.seq * CFG.hidden
    half = CFG.batch // 2
    with grads.no_sync():
        grads.accumulate(_micro_grads(micro, params, x[:half], t[:half], tokens))
    assert not grads.synced
    grads.accumulate(_micro_grads(micro, params, x[half:], t[half:], tokens))
    assert grads.synced
    for name, pieces in grads.grads.items():
        expected = shard(leaves[name].grad, micro.param_layouts[name])
        for rank, g in pieces.items():
            torch.testing.assert_close(g, expected[rank], rtol=1e-9, atol=1e-12,
                                       msg=f"{name} on rank {rank}")

    with pytest.raises(MimoFxError, match="already synchronised.*zero_grad"):
        grads.accumulate(_micro_grads(micro, params, x[:half], t[:half], tokens))
    grads.zero_grad()
    assert grads.grads == {} and not grads.synced


def test_grads_errors_name_the_problem():
    enc, llm = M(dp=2).grid(), M(dp=2).grid()
    model = ToyMimo(CFG, enc, llm)
    grads = ModuleGrads(ReferenceWorld(), model.param_layouts, CFG.sizes)
    with pytest.raises(MimoFxError, match=r"unknown parameters \['enc.nope'\]"):
        grads.accumulate({"enc.nope": {0: torch.zeros(1)}})
    with grads.no_sync():
        grads.accumulate({"enc.w1": {0: torch.zeros(6, 8), 1: torch.zeros(6, 8)}})
    with pytest.raises(MimoFxError, match=r"no gradient accumulated for \['enc.proj'"):
        grads.sync()


def test_sync_keeps_the_parameter_layout_split():
    """A parameter cut with DTensor's chunk rule (h=5 over tp=4: 2, 2, 1, 0) is summed
    over dp in that same layout, not re-cut with tensor_split (2, 1, 1, 1)."""
    from mimo_fx import Grid, Layout
    from mimo_fx.mimo.grads import finalize_grads

    layout = Layout(Grid(tp=4, dp=2), "(tp h)", split="chunk")
    per_replica = [torch.arange(5.0) * (d + 1) for d in range(2)]  # each dp replica's grad
    grads = {"w": {r: shard(per_replica[layout.grid.coord(r)["dp"]], layout)[r]
                   for r in layout.grid.ranks}}
    out = finalize_grads(ReferenceWorld(), grads, {"w": layout}, {"h": 5})
    expected = shard(per_replica[0] + per_replica[1], layout)
    assert all(torch.equal(out["w"][r], expected[r]) for r in layout.grid.ranks)
