"""A Megatron MIMO bridge switched to mimo_fx: one import line changed.

An encoder on DP4 (ranks 0-3) feeds an LLM stage on TP2xDP2 (ranks 4-7) through
Megatron's ``BridgeCommunicator`` calls, two micro-batches in 1F1B order, and every rank
checks what it got against full-tensor math. The script is written against Megatron's
API; only the import of ``BridgeCommunicator`` differs. Two runs go beyond what
Megatron's own communicator accepts (it asserts on both): ``--dest-cp 2`` puts the LLM on
CP2xDP2 (zigzag sequence chunks), ``--variable-tokens`` gives each encoder replica its
own token count (2-D ``[T, H]`` tensors).

    torchrun --nproc-per-node 8 docs/examples/megatron_switch.py [--dest-cp 2 | --variable-tokens]

(``HyperCommGrid`` is Megatron's; tests/interop/test_megatron_interop.py runs this file as written,
with the import changed back to Megatron's, and with each flag.)
"""

import argparse
import sys

import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid

from mimo_fx.interop.megatron import BridgeCommunicator

# was: from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

B, S, H, STEPS = 8, 8, 4, 2
DIMS = ["tp", "cp", "pp", "dp"]


def _data(step: int, tokens: bool):
    """The whole micro-batch (every rank builds it alike: full-tensor math needs it):
    inputs, the LLM's loss weights, and the encoder replicas' token counts."""
    gen = torch.Generator().manual_seed(step)
    if tokens:  # 2 samples per encoder replica, 0-4 tokens each
        per_sample = torch.randint(0, 5, (4, 2), generator=gen)
        counts = per_sample.sum(1).tolist()
        x = torch.randint(-3, 4, (sum(counts), H), generator=gen).float()
        t = torch.randint(-3, 4, (sum(counts), H), generator=gen).float()
        return x, t, counts
    x = torch.randint(-3, 4, (B, S, H), generator=gen).float()
    t = torch.randint(-3, 4, (B, S, H), generator=gen).float()
    return x, t, None


def _rows(full, counts, replicas: int, i: int):
    """Replica ``i`` of ``replicas``' rows: by counts (variable tokens) or evenly."""
    if counts is None:
        return full.tensor_split(replicas)[i]
    group = len(counts) // replicas
    starts = [sum(counts[:k]) for k in range(len(counts) + 1)]
    return full[starts[i * group]:starts[(i + 1) * group]]


def _piece(full, counts, d: int, c: int, cp: int):
    """The LLM rank's piece: replica ``d``'s rows, zigzag CP chunks ``c``, ``2cp-1-c``."""
    rows = _rows(full, counts, 2, d)
    if cp == 1:
        return rows
    chunks = rows.chunk(2 * cp, dim=1)
    return torch.cat([chunks[c], chunks[2 * cp - 1 - c]], dim=1)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest-cp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--variable-tokens", action="store_true")
    args = parser.parse_args(argv)
    rank, cp = dist.get_rank(), args.dest_cp
    encoder = HyperCommGrid([1, 1, 1, 4], DIMS, rank_offset=0)
    llm = HyperCommGrid([2 // cp, cp, 1, 2], DIMS, rank_offset=4)
    extra = {"tensor_ndim": 2, "variable_tokens": True} if args.variable_tokens else {}
    comm = BridgeCommunicator(encoder, llm, comm_dtype=torch.float32, **extra)
    w = torch.arange(H * H, dtype=torch.float32).reshape(H, H).remainder(5).sub(2)
    data = [_data(step, args.variable_tokens) for step in range(STEPS)]
    problems = []

    def check(what, got, want):
        if got is None or got.shape != want.shape or not torch.equal(got.detach(), want):
            problems.append(f"rank {rank}: {what} differs from full-tensor math")

    if comm.is_current_rank_in_grid(encoder):
        weight = w.clone().requires_grad_()
        outs = [_rows(x, n, 4, rank) @ weight for x, _, n in data]
        grads = [None] * STEPS
        comm.send_forward(outs[0].detach())                 # warm-up forward
        grads[0] = comm.send_forward_recv_backward(outs[1].detach())
        grads[1] = comm.recv_backward()                     # cool-down backward
        for out, grad in zip(outs, grads):
            out.backward(grad)
        for step, (_, t, n) in enumerate(data):
            check(f"step {step}'s gradient", grads[step], _rows(t, n, 4, rank))
        want = sum(_rows(x, n, 4, rank).reshape(-1, H).T @ _rows(t, n, 4, rank).reshape(-1, H)
                   for x, t, n in data)
        check("the encoder's weight gradient", weight.grad, want)
    elif comm.is_current_rank_in_grid(llm):
        local = rank - 4
        d, c = local // 2, local % 2 if cp == 2 else 0
        pieces = [_piece(t, n, d, c, cp) for _, t, n in data]
        y = comm.recv_forward()
        y.retain_grad()  # (as Megatron's schedules do: a received tensor may be no leaf)
        y.backward(pieces[0])                               # d(sum(y * t))/dy = t
        y_next = comm.send_backward_recv_forward(y.grad)
        y_next.retain_grad()
        y_next.backward(pieces[1])
        comm.send_backward(y_next.grad)
        for step, got in enumerate((y, y_next)):
            x, _, n = data[step]
            check(f"step {step}'s activation", got, _piece(x @ w, n, d, c, cp))
    BridgeCommunicator.destroy_broadcast_pgs()  # Megatron's cleanup, on every rank
    BridgeCommunicator.destroy_bridge_pgs()
    return problems


if __name__ == "__main__":
    dist.init_process_group("gloo")
    found = main(sys.argv[1:])
    assert not found, "\n".join(found)
    print(f"rank {dist.get_rank()}: activations and gradients checked against full-tensor math")
    dist.destroy_process_group()
