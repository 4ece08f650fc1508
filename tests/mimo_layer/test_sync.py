"""GradSync and TiedGrads on plain nn.Modules, on one spawned 8-rank gloo world.

Every check compares gradients with the undistributed model's, computed in the same
process from the full batch (full-tensor math, tolerance 1e-6):

- two modules on different grids -- an encoder on DP4 (ranks 0-3) and an LLM on
  CP2 x DP2 (ranks 4-7), then both on ranks 0-3 (colocated) -- each rank's loss is the
  sum over its tokens (a batch shard; on the LLM also a zigzag sequence shard) divided
  by the global token count, two micro-batches accumulated before one sync; a parameter
  used only by the rank holding sample 0, one used by nobody, a float32 one among
  float64 ones; one all-reduce per bucket (Flight Recorder), none on ranks outside;
- tied embeddings on pp=2 x dp=2: the first stage embeds, the last stage projects with
  the same weight; after GradSync (dp) and TiedGrads (stages) both copies hold the
  tied gradient; the first stage's weight broadcast to the last;
- the examples of docs/examples/sync_example.py (the README text), run and checked;
- FSDP2 (``fully_shard``, each module on its own DP mesh) gives the summed gradient
  with the loss scaled by the DP size, or with divide factor 1 and sum-only comms;
- every mistake raises the same MimoFxError on every rank (no rank left waiting).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mimo_fx import Collective, Grid, MimoFxError
from mimo_fx.mimo import (
    GradSync,
    MimoParallelism,
    ModuleParallelism,
    TiedGrads,
    data_axes,
    embedding_groups,
    is_first_stage,
)

WORLD = 8
B, S, FEAT, H = 8, 12, 5, 6      # batch, sequence, encoder features, hidden
TOL = 1e-6
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "sync_example.py"


class Encoder(nn.Module):
    def __init__(self, hidden: int = H) -> None:
        super().__init__()
        self.proj = nn.Linear(FEAT, hidden, dtype=torch.float64)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, hidden))   # float32: own bucket
        self.row0 = nn.Parameter(torch.full((hidden,), 0.1, dtype=torch.float64))
        self.unused = nn.Parameter(torch.zeros(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.proj(x)) * self.gain.double()
        if bool((rows == 0).any()):  # only the rank holding sample 0 touches row0
            y = y + (rows == 0).double()[:, None, None] * self.row0
        return y


class Llm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H, dtype=torch.float64)
        self.pos = nn.Parameter(0.1 * torch.randn(S, H, dtype=torch.float64))

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(h) + self.pos[positions])


def _data():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, FEAT, generator=gen, dtype=torch.float64)
    h = torch.randn(B, S, H, generator=gen, dtype=torch.float64)
    t_enc = torch.randn(B, S, H, generator=gen, dtype=torch.float64)
    t_llm = torch.randn(B, S, H, generator=gen, dtype=torch.float64)
    return x, h, t_enc, t_llm


def _models():
    torch.manual_seed(11)
    return Encoder(), Llm()


def _zigzag(n: int, cp: int, index: int) -> torch.Tensor:
    chunks = torch.arange(n).tensor_split(2 * cp)
    return torch.cat([chunks[index], chunks[2 * cp - 1 - index]])


def _oracle():
    """The undistributed models' gradients of the full batch's loss."""
    enc, llm = _models()
    x, h, t_enc, t_llm = _data()
    tokens = B * S
    rows, positions = torch.arange(B), torch.arange(S)
    ((enc(x, rows) - t_enc) ** 2).sum().div(tokens).backward()
    ((llm(h, positions) - t_llm) ** 2).sum().div(tokens).backward()
    return enc, llm


def _grad_problems(name: str, got: nn.Module, want: nn.Module) -> list[str]:
    out = []
    for (n, p), (_, q) in zip(got.named_parameters(), want.named_parameters()):
        expected = torch.zeros_like(q) if q.grad is None else q.grad
        if p.grad is None:
            out.append(f"{name}.{n}: no gradient")
        elif not torch.allclose(p.grad, expected, rtol=TOL, atol=TOL):
            out.append(f"{name}.{n}: off by {(p.grad - expected).abs().max().item():.3g}")
    return out


def _step(rank: int, grids: dict[str, Grid], modules: dict[str, nn.Module],
          microbatches: int = 2) -> None:
    """This rank's forward and backward of both modules, micro-batch by micro-batch."""
    x, h, t_enc, t_llm = _data()
    tokens = B * S  # the global count: the same divisor on every rank and micro-batch
    if rank in grids["enc"]:
        rows = torch.arange(B).tensor_split(grids["enc"].axis_size("dp"))[
            grids["enc"].coord(rank)["dp"]]
        for r in rows.tensor_split(microbatches):
            y = modules["enc"](x[r], r)
            ((y - t_enc[r]) ** 2).sum().div(tokens).backward()
    if rank in grids["llm"]:
        at, llm = grids["llm"].coord(rank), grids["llm"]
        rows = torch.arange(B).tensor_split(llm.axis_size("dp"))[at["dp"]]
        pos = _zigzag(S, llm.axis_size("cp"), at["cp"])
        for r in rows.tensor_split(microbatches):
            y = modules["llm"](h[r][:, pos], pos)
            ((y - t_llm[r][:, pos]) ** 2).sum().div(tokens).backward()


def _two_modules(rank: int, grids: dict[str, Grid], config: MimoParallelism | None = None,
                 **options) -> str | None:
    """Both modules stepped and synchronised; problems against the oracle, or None."""
    from mimo_fx.compiled import trace

    enc, llm = _models()
    modules = {"enc": enc, "llm": llm}  # given on every rank: ignored outside the grid
    if config is None:
        sync = GradSync({n: (m, grids[n]) for n, m in modules.items()}, **options)
    else:
        grids = config.grids()
        sync = GradSync.from_config(config, {n: m for n, m in modules.items()
                                             if rank in grids[n]}, **options)
    _step(rank, grids, modules)
    start = trace.mark()
    sync.sync()
    calls = [c for c in trace.since(start)]
    sync.destroy()
    problems = []
    want = [(Collective.ALL_REDUCE, b.ranks, b.numel) for b in sync.buckets]
    if [(c.kind, c.ranks, c.numel_in) for c in calls] != want:
        problems.append(f"collectives {calls}, expected one per bucket {want}")
    oracle = dict(zip(("enc", "llm"), _oracle()))
    for name, grid in grids.items():
        if rank in grid:
            problems += _grad_problems(name, modules[name], oracle[name])
        elif any(p.grad is not None for p in modules[name].parameters()):
            problems.append(f"{name}: a rank outside its grid got gradients")
    return "; ".join(problems) or None


DISJOINT = {"enc": Grid(dp=4), "llm": Grid(cp=2, dp=2, offset=4)}
COLOCATED = {"enc": Grid(dp=4), "llm": Grid(cp=2, dp=2)}
CONFIG = MimoParallelism(world_size=WORLD, modules={
    "enc": ModuleParallelism(dp=4), "llm": ModuleParallelism(cp=2, dp=2, offset=4)})


# -- tied embeddings ------------------------------------------------------------------
V, T, TB = 10, 5, 4               # vocabulary, tokens per sample, batch
TIED_GRID = Grid(pp=2, dp=2)      # ranks 0-3: rank = pp + 2 * dp


class Tied(nn.Module):
    """The undistributed LLM: the embedding is also the output projection."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.weight = nn.Parameter(torch.randn(V, H, dtype=torch.float64))
        self.first = nn.Linear(H, H, dtype=torch.float64)
        self.last = nn.Linear(H, H, dtype=torch.float64)

    def stage0(self, tokens):
        return torch.tanh(self.first(F.embedding(tokens, self.weight)))

    def stage1(self, h, targets):
        logits = self.last(h) @ self.weight.T
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="sum")


def _tied_data():
    gen = torch.Generator().manual_seed(9)
    return torch.randint(V, (TB, T), generator=gen), torch.randint(V, (TB, T), generator=gen)


def _tied(rank: int) -> str | None:
    """pp=2 x dp=2: activations sent forward, their gradients back (send/recv)."""
    full = Tied()
    tokens, targets = _tied_data()
    full.stage1(full.stage0(tokens), targets).div(TB * T).backward()
    grid, stage = TIED_GRID, None
    if rank in grid:
        stage = nn.Module()
        first = is_first_stage(grid, rank)
        stage.lin = nn.Linear(H, H, dtype=torch.float64)
        stage.lin.load_state_dict((full.first if first else full.last).state_dict())
        # the last stage's copy starts wrong on purpose: the broadcast must fix it
        stage.weight = nn.Parameter(full.weight.detach().clone() if first
                                    else torch.zeros(V, H, dtype=torch.float64))
    grads = GradSync({"llm": (stage, grid)})
    tied = TiedGrads(grid, None if stage is None else stage.weight)
    tied.broadcast_from_first_stage()
    problems = []
    if stage is not None:
        if not torch.equal(stage.weight.detach(), full.weight.detach()):
            problems.append("the broadcast did not tie the last stage's weight")
        rows = torch.arange(TB).tensor_split(2)[grid.coord(rank)["dp"]]
        _tied_step(rank, stage, first, tokens[rows], targets[rows])
    grads.sync()
    tied.sync()
    if stage is not None:
        lin = full.first if first else full.last
        want = {"weight": full.weight.grad, "lin.weight": lin.weight.grad,
                "lin.bias": lin.bias.grad}
        for name, g in want.items():
            got = stage.get_parameter(name).grad
            if got is None or not torch.allclose(got, g, rtol=TOL, atol=TOL):
                problems.append(f"stage {grid.coord(rank)['pp']} {name}: wrong gradient")
    if tied.groups != ((0, 1), (2, 3)) or len(tied.buckets) != (1 if stage else 0):
        problems.append(f"groups {tied.groups}, buckets {tied.buckets}")
    grads.destroy()
    tied.destroy()
    return "; ".join(problems) or None


def _tied_step(rank, stage, first, tokens, targets) -> None:
    import torch.distributed as dist

    if first:
        h = torch.tanh(stage.lin(F.embedding(tokens, stage.weight)))
        dist.send(h.detach().contiguous(), rank + 1)
        grad = torch.empty_like(h)
        dist.recv(grad, rank + 1)
        h.backward(grad)
    else:
        h = torch.empty(tokens.shape + (H,), dtype=torch.float64)
        dist.recv(h, rank - 1)
        h.requires_grad_()
        logits = stage.lin(h) @ stage.weight.T
        F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1),
                        reduction="sum").div(TB * T).backward()
        dist.send(h.grad, rank - 1)


# -- mistakes: each raises on every rank ---------------------------------------------
def _mistakes(rank: int) -> dict[str, str]:
    enc, llm = Encoder(), Llm()
    other = Encoder(hidden=H + 1) if rank == 3 else Encoder()
    weight = nn.Parameter(torch.zeros(V, H))
    cases = {
        "module_none": lambda: GradSync({"enc": (None if rank == 2 else enc, Grid(dp=4))}),
        "unknown_axis": lambda: GradSync({"enc": (enc, Grid(dp=4))}, axes=("dq",)),
        "pp_axis": lambda: GradSync({"enc": (enc, Grid(dp=4))}, axes=("dp", "pp")),
        "axes_string": lambda: GradSync({"enc": (enc, Grid(dp=4))}, axes="dp"),
        "not_a_pair": lambda: GradSync({"enc": enc}),  # type: ignore[dict-item]
        "too_big": lambda: GradSync({"enc": (enc, Grid(dp=16))}),
        "replicas_differ": lambda: GradSync({"enc": (other, Grid(dp=4))}),
        "ranks_disagree": lambda: GradSync({"enc": (enc, Grid(dp=4))},
                                           axes=("dp",) if rank == 5 else ("dp", "cp")),
        "shared_param": lambda: GradSync({"a": (enc, Grid(dp=4)), "b": (enc, Grid(dp=4))}),
        "bucket_numel": lambda: GradSync({"enc": (enc, Grid(dp=4))}, bucket_numel=0),
        "not_in_config": lambda: GradSync.from_config(CONFIG, {"enc": enc} if rank < 4 else
                                                      {"llm": llm, "vision": enc} if rank == 6
                                                      else {"llm": llm}),
        "tied_missing": lambda: TiedGrads(TIED_GRID, weight if rank in (0, 2, 3) else None),
        "tied_middle": lambda: TiedGrads(Grid(pp=3), weight if rank < 3 else None),
        "tied_off_grid": lambda: TiedGrads(TIED_GRID, weight),
        "tied_differ": lambda: TiedGrads(TIED_GRID, None if rank > 3 else nn.Parameter(
            torch.zeros(V + (rank == 1), H))),
    }
    out = {}
    for name, build in cases.items():
        try:
            build().destroy()
            out[name] = "no error"
        except MimoFxError as err:
            out[name] = str(err)
    return out


MISTAKES = {
    "module_none": r"GradSync on rank 2: modules\['enc'\]: rank 2 is in its grid "
                   r"Grid\(dp=4\) but the module is None; pass this rank's nn.Module",
    "unknown_axis": r"GradSync on rank 0: unknown axis 'dq': the grids have axes \['dp'\]",
    "pp_axis": r"axis 'pp' cannot be summed over: pipeline stages hold different "
               r"parameters.*TiedGrads",
    "axes_string": r"axes='dp' must be a sequence of axis names",
    "not_a_pair": r"modules\['enc'\] must be a pair \(nn.Module or None, Grid\)",
    "too_big": r"needs ranks 0..15 but the world has 8",
    "replicas_differ": r"GradSync: the replicas of module 'enc' over \('dp',\) are summed, "
                       r"but ranks \(0, 1, 2, 3\) differ \(ranks \[0, 1, 2\]: 5 parameters, "
                       r"6 elements of torch.float32, 45 elements of torch.float64; ranks "
                       r"\[3\]: 5 parameters, 7 elements of torch.float32, 52 elements",
    "ranks_disagree": r"rank 5 was built with .*but rank 0 with .*every rank must build "
                      r"the same GradSync",
    "shared_param": r"parameter b.gain is also a.gain: one parameter in two modules",
    "bucket_numel": r"bucket_numel=0 must be a positive integer",
    "not_in_config": r"GradSync on rank 6: modules \['vision'\] are not in the config, whose "
                     r"modules are \['enc', 'llm'\]",
    "tied_missing": r"TiedGrads on rank 1: rank 1 is the first or last stage of "
                    r"Grid\(pp=2, dp=2\), so it must pass its tied weights",
    "tied_middle": r"TiedGrads on rank 1: rank 1 is stage 1 of 3, neither first nor last",
    "tied_off_grid": r"TiedGrads on rank 4: rank 4 is not in Grid\(pp=2, dp=2\)",
    "tied_differ": r"ranks \(0, 1\) differ \(ranks \[0\]: 1 parameter, 60 elements of "
                   r"torch.float32; ranks \[1\]: 1 parameter, 66 elements",
}


# -- the README's examples ------------------------------------------------------------
def _example(rank: int, world: int) -> str | None:
    spec = importlib.util.spec_from_file_location("sync_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    problems = []
    encoder, llm, x = ex.encoder_and_llm_step(rank, world)
    torch.manual_seed(0)
    full_enc, full_llm = nn.Linear(16, 16), nn.Linear(16, 16)
    tokens = x.shape[0] * x.shape[1]
    (full_enc(x).square().sum() / tokens + full_llm(x).square().sum() / tokens).backward()
    mine = [(encoder, full_enc)] if rank < 4 else [(llm, full_llm)]
    for got, want in mine:
        for p, q in zip(got.parameters(), want.parameters()):
            if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
                problems.append(f"GradSync example: off by {(p.grad - q.grad).abs().max()}")
    stage, tokens = ex.tied_embedding_step(rank, world)
    if stage is not None:
        problems += _tied_example_problems(rank, stage, tokens)
    return "; ".join(problems) or None


def _tied_example_problems(rank, stage, tokens) -> list[str]:
    """The example's tied gradient against one weight that embeds and projects."""
    full = nn.Parameter(stage.weight.detach().clone())  # tied: equal on both stages
    logits = F.embedding(tokens, full)[:, :-1] @ full.T
    count = tokens.shape[0] * (tokens.shape[1] - 1)
    F.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1),
                    reduction="sum").div(count).backward()
    if not torch.allclose(stage.weight.grad, full.grad, rtol=1e-5, atol=1e-6):
        return [f"TiedGrads example on rank {rank}: off by "
                f"{(stage.weight.grad - full.grad).abs().max()}"]
    return []


# -- FSDP2: averaging vs the global-token convention ---------------------------------
FSDP_FIXES = ("loss_times_dp", "divide_factor_1_sum_only", "divide_factor_1_alone",
              "default")


def _fsdp(rank: int) -> dict[str, str | None]:
    """Each module fully_shard-ed on its own DP mesh (ranks 0-3 and 4-7), float32."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    meshes = [DeviceMesh("cpu", torch.arange(4)), DeviceMesh("cpu", torch.arange(4, 8))]
    mesh = meshes[rank // 4]  # every rank built both meshes, in the same order
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(1))   # 24 tokens
    tokens = x.shape[0]
    out: dict[str, str | None] = {}
    for fix in FSDP_FIXES:
        torch.manual_seed(2)
        model, full = nn.Linear(4, 3), nn.Linear(4, 3)
        full.load_state_dict(model.state_dict())
        fully_shard(model, mesh=mesh)
        scale = 1.0
        if fix == "loss_times_dp":
            scale = float(mesh.size())  # FSDP divides by it again
        elif fix != "default":
            model.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        if fix == "divide_factor_1_sum_only":
            model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        mine = x.tensor_split(mesh.size())[mesh.get_local_rank()]
        try:
            (model(mine).square().sum() / tokens * scale).backward()
        except RuntimeError as err:  # the last fix: raises on every rank, before any call
            out[fix] = str(err)
            continue
        average = mesh.size() if fix == "default" else 1  # FSDP2's default: an average
        full(x).square().sum().div(tokens * average).backward()
        diff = max((p.grad.full_tensor() - q.grad).abs().max().item()
                   for p, q in zip(model.parameters(), full.parameters()))
        out[fix] = None if diff <= TOL else f"off by {diff:.3g}"
    try:  # an FSDP module's gradients are reduced on its own mesh
        GradSync({"m": (model, Grid(dp=4, offset=4 * (rank // 4)))}).destroy()
        out["gradsync_refuses_dtensor"] = "no error"
    except MimoFxError as err:
        out["gradsync_refuses_dtensor"] = str(err)
    return out


def _world(rank: int, world: int) -> dict:
    import time

    from mimo_fx.compiled import live_groups

    checks = {
        "mistakes": lambda: _mistakes(rank),  # first: a mistake must not wedge the world
        "disjoint": lambda: _two_modules(rank, DISJOINT),
        "from_config": lambda: _two_modules(rank, DISJOINT, config=CONFIG),
        "colocated": lambda: _two_modules(rank, COLOCATED),
        "small_buckets": lambda: _two_modules(rank, DISJOINT, bucket_numel=40),
        "dp_only": lambda: _two_modules(rank, {"enc": Grid(dp=4), "llm": Grid(cp=1, dp=4)},
                                        axes=("dp",)),
        "tied": lambda: _tied(rank),
        "example": lambda: _example(rank, world),
        "groups_left": live_groups,
        "fsdp": lambda: _fsdp(rank),
    }
    out: dict = {"seconds": {}}
    for name, check in checks.items():
        start = time.perf_counter()
        out[name] = check()
        out["seconds"][name] = round(time.perf_counter() - start, 2)
    return out


@pytest.fixture(scope="module")
def results(worlds):
    return worlds.run(WORLD, _world, timeout=300, record=True)


@pytest.mark.slow
@pytest.mark.parametrize("check", ["disjoint", "from_config", "colocated", "small_buckets",
                                   "dp_only", "tied", "example"])
def test_gradients_equal_the_undistributed_model(results, check):
    problems = {rank: r[check] for rank, r in enumerate(results) if r[check] is not None}
    assert not problems, problems


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_every_rank_raises_the_same_clear_error(results, name):
    messages = [r["mistakes"][name] for r in results]
    assert len(set(messages)) == 1, messages  # the same on every rank: nobody waits
    assert re.search(MISTAKES[name], messages[0]), messages[0]


@pytest.mark.slow
def test_no_process_group_left_behind(results):
    assert [r["groups_left"] for r in results] == [0] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("fix", FSDP_FIXES[:2] + ("default",))
def test_fsdp2_gives_the_summed_gradient(results, fix):
    """With either fix; by default a 1/DP share of it (FSDP2 averages)."""
    problems = {rank: r["fsdp"][fix] for rank, r in enumerate(results)
                if r["fsdp"][fix] is not None}
    assert not problems, problems


@pytest.mark.slow
def test_fsdp2_divide_factor_alone_fails_on_gloo(results):
    """What the README says: float32 with divide factor 1 asks gloo for PREMUL_SUM."""
    for r in results:
        assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in (r["fsdp"][FSDP_FIXES[2]] or "")


@pytest.mark.slow
def test_gradsync_refuses_an_fsdp_module(results):
    for r in results:
        assert re.search(r"m.weight is a DTensor \(FSDP2 or tensor parallel\)",
                         r["fsdp"]["gradsync_refuses_dtensor"])


def test_needs_an_initialised_world():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already has a world")
    with pytest.raises(MimoFxError, match="needs torch.distributed initialised"):
        GradSync({"enc": (Encoder(), Grid(dp=1))})
    with pytest.raises(MimoFxError, match="needs torch.distributed initialised"):
        TiedGrads(TIED_GRID, None)


def test_pure_helpers():
    assert data_axes(Grid(tp=2, cp=1, dp=4)) == ("dp",)
    assert data_axes(Grid(tp=2, cp=2, dp=1)) == ("cp",)
    assert embedding_groups(Grid(tp=2, pp=3, dp=2)) == ((0, 4), (1, 5), (6, 10), (7, 11))
    assert embedding_groups(Grid(dp=2)) == ((0,), (1,))
