"""Where the tensors a bridge makes live, without a GPU.

Every rank's lowered program runs at once in threads (``threads.py``) with the data on
``meta`` (shapes, no values) under :class:`mimo_fx.testing.devices.Devices`: no op may
mix the data's device with another (a CPU index for CUDA data fails on a GPU) and no
buffer may be made elsewhere. The shared table's box plans, forward and backward, and
a row bridge's route (its index vectors on the data's device, its counts on the host).
Then the two questions a bridge asks of a backend object, each driven both ways with
stand-in process groups: whether a backend serves CUDA tensors on its own (where data
then moves by default), and whether it coalesces a grouped call.
"""

from __future__ import annotations

import pytest
import torch
from cases import CASES, case_ids, star
from threads import run_programs

from mimo_fx import Grid, Layout, plan
from mimo_fx.compiled import comm, groups, lowering
from mimo_fx.compiled.row_sizing import RowSizing, sizing_for
from mimo_fx.packed import PackedLayout, Packing, pack_shard
from mimo_fx.plan import backward_plan
from mimo_fx.reference import shard
from mimo_fx.testing.devices import Devices

META = torch.device("meta")


def _shapes(layout, sizes) -> dict:
    """Each holder's local shape, as the oracle cuts a full tensor."""
    full = torch.zeros(tuple(sizes[d] for d in layout.dims))
    return {r: tuple(t.shape) for r, t in shard(full, layout).items()}


def _run_on_meta(p, layout_in, layout_out, sizes):
    """Every rank's program of plan ``p`` on meta pieces; each rank's problems and its
    output's device and shape against the layout's."""
    ranks = sorted(set(p.src.grid.ranks) | set(p.dst.grid.ranks))
    programs = {r: lowering.lower(p, r) for r in ranks}
    inputs = {r: torch.empty(shape, dtype=torch.float64, device=META)
              for r, shape in _shapes(layout_in, sizes).items()}
    want = _shapes(layout_out, sizes)
    seen = {r: Devices(META) for r in ranks}
    outs = run_programs(programs, inputs, len(layout_in.local_dims), device=META,
                        inside=seen.get)
    for r in ranks:
        assert not seen[r].problems, f"rank {r}: {seen[r].problems}"
        assert seen[r].ops > 0 or not programs[r].ops
        assert outs[r].device == META, f"rank {r}: output on {outs[r].device}"
        if r in want:
            assert tuple(outs[r].shape) == want[r], f"rank {r}"


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_box_programs_keep_every_tensor_on_the_data_device(case):
    sizes = case.totals if not case.counts else case.sizes
    if case.counts:
        pytest.skip("ragged cases: their local shapes come from counts (see the row case)")
    _run_on_meta(plan(case.src, case.dst, sizes, torch.float64), case.src, case.dst, sizes)
    _run_on_meta(backward_plan(case.src, case.dst, sizes, torch.float64), star(case.dst),
                 case.src, sizes)


def _row_sizing(rank: int, device) -> RowSizing:
    src = Layout(Grid(dp=2), "(dp t) h")
    dst = PackedLayout(Grid(cp=2), "t h", [[3, 5]])
    sizing = sizing_for(src, dst, {"h": 6}, torch.float32, (), rank, "", device)
    assert isinstance(sizing, RowSizing)
    return sizing


def test_a_row_route_indexes_on_the_data_device_and_counts_on_the_host():
    full = {"t": 8, "h": 6}
    for rank in (0, 1):
        sizing = _row_sizing(rank, META)
        fwd, bwd, values, index, _ = sizing.programs(full, frozenset())
        assert index and all(t.device == META for t in index), [t.device for t in index]
        assert all(isinstance(v, int) for v in values)  # (host ints: nothing to read)
        route, _ = sizing.route(sizing.src, sizing.dst, full)
        assert all(isinstance(n, int) for n in route.counts)
    # the default, where no device is given: the CPU
    assert all(t.device.type == "cpu" for t in _row_sizing(0, None).programs(
        full, frozenset())[3])


def test_row_programs_run_on_the_data_device():
    full = {"t": 8, "h": 6}
    sizings = {r: _row_sizing(r, META) for r in (0, 1)}
    got = {r: s.programs(full, frozenset()) for r, s in sizings.items()}
    env = {r: dict(zip(sizings[r].variables, got[r][2])) for r in sizings}
    seen = {r: Devices(META) for r in sizings}
    x = {r: torch.empty(4, 6, device=META) for r in sizings}
    outs = _run_rows({r: got[r][0] for r in sizings}, x, env,
                     {r: got[r][3] for r in sizings}, seen)
    for r in sizings:
        assert not seen[r].problems, f"rank {r}: {seen[r].problems}"
        assert outs[r].device == META
    # each cp rank's packed storage, as the packed oracle cuts 3 + 5 tokens (zigzag, padded)
    want = pack_shard(torch.zeros(8, 6), Packing([3, 5], cp=2))
    assert {r: tuple(outs[r].shape) for r in sizings} == {r: tuple(want[r].shape)
                                                          for r in sizings}


def _run_rows(programs, inputs, env, index, seen):
    """Row programs with per-rank numbers: ``run_programs`` takes one ``env``, so each
    rank's program is run with its own, all at once."""
    import threading

    from threads import EXECUTORS, ThreadComm, _Rendezvous

    world, outs, errors = _Rendezvous(), {}, []

    def one(rank):
        try:
            ex = EXECUTORS["interpreted"](ThreadComm(world, rank))
            with seen[rank]:
                (outs[rank],) = ex.run(programs[rank], (inputs[rank],), env[rank],
                                       index[rank])
        except BaseException as err:  # reported below
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, "\n".join(errors)
    return outs


# -- capabilities asked of the backend object, both ways -------------------------------------
class _Backend:
    def __init__(self, coalescing: bool) -> None:
        self.supports_coalescing = coalescing


class _Group:
    """A stand-in process group: a backend per device type, as torch's ``_get_backend``
    gives them (raising for a device type it has no backend for)."""

    def __init__(self, name: str, backends: dict[str, _Backend]) -> None:
        self.group_name, self._backends = name, backends
        self._device_types = [torch.device(t) for t in backends]

    def _get_backend(self, device: torch.device):
        try:
            return self._backends[device.type]
        except KeyError:
            raise RuntimeError(f"no backend for {device.type}") from None


GLOO, NCCL = _Backend(False), _Backend(True)


@pytest.mark.parametrize("backends, own", [
    ({"cuda": NCCL}, True),                       # "nccl"
    ({"cpu": GLOO, "cuda": NCCL}, True),          # "cpu:gloo,cuda:nccl"
    ({"cpu": GLOO, "cuda": GLOO}, False),         # gloo serving CUDA tensors too
    ({"cpu": GLOO}, False),                       # gloo alone
], ids=["nccl", "cpu_gloo_cuda_nccl", "gloo_both", "gloo"])
def test_a_backend_of_its_own_for_cuda_is_asked_of_the_group(backends, own):
    assert groups._own_backend(_Group("g", backends), "cuda") is own


@pytest.mark.parametrize("backends, device, coalescing", [
    ({"cuda": NCCL}, "cuda", True),
    ({"cpu": GLOO, "cuda": NCCL}, "cuda", True),
    ({"cpu": GLOO, "cuda": NCCL}, "cpu", False),
    ({"cpu": GLOO}, "cpu", False),
    ({"cpu": GLOO}, "cuda", False),
], ids=["nccl", "mixed_cuda", "mixed_cpu", "gloo", "gloo_no_cuda"])
def test_whether_a_grouped_call_coalesces_is_asked_of_the_backend(backends, device,
                                                                   coalescing):
    name = f"devices-test-{sorted(backends)}-{device}"
    assert comm.coalesces(_Group(name, backends), torch.device(device)) is coalescing
