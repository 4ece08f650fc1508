"""End-to-end oracle in the reference world: the toy MIMO model trained distributed
equals the undistributed model, parameter by parameter on every rank.

Also shows that the same check catches the two bugs the seeds' system met: encoder
gradients scaled by llm_dp/enc_dp when each module averages over its own DP, and the
CP under-count when the loss is normalised over dp only. And the jobs' per-step table row,
reduced over a 2-rank gloo world.
"""

from __future__ import annotations

import pytest
import torch

from mimo_fx.jobs.toy import ToyConfig, ToyMimo, finalize_grads
from mimo_fx.mimo import ModuleParallelism as M
from mimo_fx.reference import ReferenceWorld, shard

CFG = ToyConfig()
CONFIGS = {
    "fan_in_dst_cp2": (M(tp=2, dp=4), M(tp=2, cp=2, dp=2)),
    "fan_in": (M(tp=2, dp=4), M(tp=4, dp=2)),
    "fan_out_dst_cp2": (M(tp=4, dp=2), M(cp=2, dp=4)),
    "equal": (M(tp=2, dp=4), M(tp=2, dp=4)),
    "pipelined_disjoint": (M(tp=2, dp=2), M(tp=2, cp=2, offset=4)),
    "single_rank": (M(), M()),
}


def _data(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(CFG.batch, CFG.seq, CFG.features, generator=gen, dtype=dtype)
    t = torch.randn(CFG.batch, CFG.seq, CFG.hidden, generator=gen, dtype=dtype)
    return x, t


def _distributed_grads(model: ToyMimo, params, x, t, loss_scale=None):
    world = ReferenceWorld()
    losses = model.loss(world, params, shard(x, model.x), shard(t, model.target))
    if loss_scale is not None:
        losses = {r: v * loss_scale for r, v in losses.items()}
    for ps in params.values():
        for p in ps.values():
            p.grad = None
    sum(losses.values()).backward()
    grads = {n: {r: p.grad for r, p in ps.items()} for n, ps in params.items()}
    return losses, finalize_grads(world, grads, model.param_layouts, CFG.sizes)


def _reference_grads(model: ToyMimo, full, x, t):
    leaves = {n: p.detach().clone().requires_grad_() for n, p in full.items()}
    loss = model.reference_loss(leaves, x, t)
    loss.backward()
    return loss, {n: p.grad for n, p in leaves.items()}


def _max_rel_error(model, grads, ref_grads, prefix=""):
    worst = 0.0
    for name, pieces in grads.items():
        if not name.startswith(prefix):
            continue
        expected = shard(ref_grads[name], model.param_layouts[name])
        assert sorted(pieces) == sorted(expected)
        for rank, g in pieces.items():
            scale = float(expected[rank].abs().max()) or 1.0
            worst = max(worst, float((g - expected[rank]).abs().max()) / scale)
    return worst


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_steps_match_undistributed_model(name):
    enc, llm = (m.grid() for m in CONFIGS[name])
    model = ToyMimo(CFG, enc, llm)
    full = model.init_params(dtype=torch.float32)
    x, t = _data(torch.float32)
    params = {n: {r: p.requires_grad_() for r, p in shard(full[n], layout).items()}
              for n, layout in model.param_layouts.items()}
    lr = 0.1
    for _ in range(3):
        losses, grads = _distributed_grads(model, params, x, t)
        ref_loss, ref_grads = _reference_grads(model, full, x, t)
        # every (dp, cp) piece's loss once: the tp == 0 ranks of the LLM
        total = sum(v for r, v in losses.items() if llm.coord(r)["tp"] == 0)
        torch.testing.assert_close(total, ref_loss, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for n in params:
                for r, p in params[n].items():
                    p -= lr * grads[n][r]
                full[n] = full[n] - lr * ref_grads[n]
    for n, pieces in params.items():
        expected = shard(full[n], model.param_layouts[n])
        for rank, p in pieces.items():
            torch.testing.assert_close(p.detach(), expected[rank], rtol=0, atol=1e-5,
                                       msg=f"{n} on rank {rank}")


def _setup(enc_cfg, llm_cfg):
    model = ToyMimo(CFG, enc_cfg.grid(), llm_cfg.grid())
    full = model.init_params()
    x, t = _data(torch.float64)
    params = {n: {r: p.requires_grad_() for r, p in shard(full[n], layout).items()}
              for n, layout in model.param_layouts.items()}
    return model, full, x, t, params


def test_oracle_catches_per_module_dp_averaging():
    """The seeds' encoder-gradient bug: local-mean loss + DP averaging per module."""
    enc_cfg, llm_cfg = M(tp=2, dp=4), M(tp=4, dp=2)
    model, full, x, t, params = _setup(enc_cfg, llm_cfg)
    _, ref = _reference_grads(model, full, x, t)
    _, good = _distributed_grads(model, params, x, t)
    assert _max_rel_error(model, good, ref) < 1e-10
    # buggy: every LLM rank's loss is a mean over its own tokens (x llm_dp), and each
    # module averages its gradients over its own DP group (/ dp)
    _, summed = _distributed_grads(model, params, x, t, loss_scale=llm_cfg.dp)
    buggy = {n: {r: g / (enc_cfg.dp if n.startswith("enc") else llm_cfg.dp)
                 for r, g in pieces.items()} for n, pieces in summed.items()}
    assert _max_rel_error(model, buggy, ref, "llm") < 1e-10   # the LLM looks right...
    enc_error = _max_rel_error(model, buggy, ref, "enc")
    assert abs(enc_error - (1 - llm_cfg.dp / enc_cfg.dp)) < 1e-6  # ...encoder off by dp ratio


def test_oracle_catches_cp_under_count():
    """The loss normalised over dp only (ignoring cp) scales every gradient by cp."""
    enc_cfg, llm_cfg = M(tp=2, dp=4), M(tp=2, cp=2, dp=2)
    model, full, x, t, params = _setup(enc_cfg, llm_cfg)
    _, ref = _reference_grads(model, full, x, t)
    _, buggy = _distributed_grads(model, params, x, t, loss_scale=llm_cfg.cp)
    assert abs(_max_rel_error(model, buggy, ref) - (llm_cfg.cp - 1)) < 1e-6


@pytest.mark.parametrize("name", ["fan_in_dst_cp2", "pipelined_disjoint", "fan_in"])
def test_text_after_images_with_lengths_changing_every_step(name):
    """Image tokens bridged to the LLM, joined with text, cut by CP: for several image and
    text lengths the gradients equal the undistributed model's."""
    enc_cfg, llm_cfg = CONFIGS[name]
    model = ToyMimo(CFG, enc_cfg.grid(), llm_cfg.grid())
    full = model.init_params()
    params = {n: {r: p.requires_grad_() for r, p in shard(full[n], layout).items()}
              for n, layout in model.param_layouts.items()}
    for images, text in ((8, 4), (2, 14), (5, 7)):
        gen = torch.Generator().manual_seed(images)
        x = torch.randn(CFG.batch, images, CFG.features, generator=gen, dtype=torch.float64)
        t = torch.randn(CFG.batch, images + text, CFG.hidden, generator=gen,
                        dtype=torch.float64)
        emb = torch.randn(CFG.batch, text, CFG.hidden, generator=gen, dtype=torch.float64)
        world = ReferenceWorld()
        losses = model.loss(world, params, shard(x, model.x), shard(t, model.target),
                            text=shard(emb, model.text), lengths=(images, text))
        for ps in params.values():
            for p in ps.values():
                p.grad = None
        sum(losses.values()).backward()
        grads = finalize_grads(world, {n: {r: p.grad for r, p in ps.items()}
                                       for n, ps in params.items()},
                               model.param_layouts, CFG.sizes)
        leaves = {n: p.detach().clone().requires_grad_() for n, p in full.items()}
        model.reference_loss(leaves, x, t, emb).backward()
        assert _max_rel_error(model, grads, {n: p.grad for n, p in leaves.items()}) < 1e-10


def _step_row(rank: int, world: int) -> dict:
    from mimo_fx.jobs.report import step_row

    return step_row(3, loss=1.5 * (rank + 1), ref_loss=4.5, grad_diff=1e-7 * (rank + 1),
                    step_bytes=100 * (rank + 1), elapsed=0.5 - 0.1 * rank)


def test_a_step_row_is_reduced_over_the_world(worlds):
    """The jobs' table row: the loss summed over the ranks, the worst gradient difference
    and time, the bytes one rank sends at most and all ranks in total."""
    rows = worlds.run(2, _step_row)
    assert rows[0] == rows[1] == {"step": 3, "loss": 4.5, "ref_loss": 4.5, "grad_diff": 2e-7,
                                  "bytes_max": 200, "bytes_total": 300, "seconds": 0.5}
