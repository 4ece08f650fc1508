"""The main job's packed variant: image tokens straight to their sequence positions.

Every step draws a new batch of 8 samples. A sample is text with 0-3 images at random
places, each image 1-4 tokens, so its length changes from step to step. Eight ranks,
colocated (:data:`LAYOUT`):

- the **encoder** runs on DP8: image ``k`` (in batch order) is encoded by rank ``k % 8``
  (a per-token MLP), so a rank holds whole images, of any sample, or none;
- the **LLM** runs on DP4 x CP2: dp group ``d`` packs samples ``2d`` and ``2d+1`` into one
  THD sequence (:class:`~mimo_fx.packed.Packing`), cut over cp per sequence with zigzag.
  Its layer is a token embedding, one causal attention over each packed sequence (plain
  torch: a mask from the packing's segment ids and positions) and a linear head.

Two ``redistribute`` calls to and from the packed batch's layout
(:class:`~mimo_fx.packed.PackedLayout`, one ``all_to_all`` per direction each) carry the
step, planned anew every step from the batch's metadata, which every rank knows:

- **images**: the encoder's image-token rows to the packed batch's image tokens
  (``PackedLayout.select``): each cp rank receives exactly the image embeddings whose
  tokens fall in its chunks and places them at their positions; the backward returns
  each gradient row to the encoder rank that made it;
- **keys and values**: from the packed batch to every cp rank of a group holding all of
  the group's tokens (the backward sums the cp ranks' gradients, ``grad_partial``, back
  to their owner).

The step (``loss.backward()`` of the rank's part of the loss) is compiled once: the
layouts' batches, the packing's indices and the data are graph inputs with unbacked
lengths, so every batch runs in one graph. Gradients are summed over the world (every
parameter is replicated on every rank), then SGD. Every rank also runs the undistributed
model sample by sample and compares gradients (every step) and parameters (at the end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mimo_fx import Layout, redistribute
from mimo_fx.mimo.config import MimoParallelism
from mimo_fx.mimo.config import ModuleParallelism as M
from mimo_fx.packed import PackedLayout, Packing
from mimo_fx.plan import backward_plan, plan
from mimo_fx.rows import seed_bytes

from .report import reference_step, result, sgd, step_line, step_row, summed_grads, warm_up

__all__ = ["LAYOUT", "PackedConfig", "attention_mask", "packed_batch", "train_packed"]

LAYOUT = MimoParallelism(world_size=8, colocated=True, modules={
    "enc": M(dp=8), "llm": M(cp=2, dp=4)})


@dataclass(frozen=True)
class PackedConfig:
    samples: int = 8      # per step: 2 per LLM dp group
    features: int = 6     # per image token, into the encoder
    enc_hidden: int = 8
    hidden: int = 8
    vocab: int = 16
    max_images: int = 3   # per sample
    max_image_tokens: int = 4
    max_text: int = 5     # text tokens before, between and after images (each 0..max_text)


@dataclass
class Batch:
    """One step's samples, as the data loader gives them to every rank."""

    ids: list[torch.Tensor]        # per sample (L,), text token ids (0 at image tokens)
    is_image: list[torch.Tensor]   # per sample (L,) bool
    image_tokens: list[int]        # tokens per image, in batch order
    image_sample: list[int]        # the sample of each image
    features: torch.Tensor         # (image tokens, features), images in batch order
    targets: list[torch.Tensor]    # per sample (L, hidden)


def packed_batch(cfg: PackedConfig, step: int) -> Batch:
    gen = torch.Generator().manual_seed(5000 + step)

    def rand(hi: int, lo: int = 0) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    ids, is_image, tokens, sample_of, targets = [], [], [], [], []
    for b in range(cfg.samples):
        parts: list[tuple[bool, int]] = [(False, rand(cfg.max_text))]
        for _ in range(rand(cfg.max_images)):
            n = rand(cfg.max_image_tokens, 1)
            parts += [(True, n), (False, rand(cfg.max_text))]
            tokens.append(n)
            sample_of.append(b)
        if sum(n for _, n in parts) == 0:
            parts.append((False, 1))  # no empty samples in the toy data
        mask = torch.cat([torch.full((n,), img, dtype=torch.bool) for img, n in parts])
        is_image.append(mask)
        ids.append(torch.where(mask, 0, torch.randint(1, cfg.vocab, mask.shape, generator=gen)))
        targets.append(torch.randn(len(mask), cfg.hidden, generator=gen))
    features = torch.randn(sum(tokens), cfg.features, generator=gen)
    return Batch(ids, is_image, tokens, sample_of, features, targets)


def init_params(cfg: PackedConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shapes = {"enc.w1": (cfg.features, cfg.enc_hidden), "enc.w2": (cfg.enc_hidden, cfg.hidden),
              "llm.emb": (cfg.vocab, cfg.hidden), "llm.wq": (cfg.hidden, cfg.hidden),
              "llm.wk": (cfg.hidden, cfg.hidden), "llm.wv": (cfg.hidden, cfg.hidden),
              "llm.wo": (cfg.hidden, cfg.hidden), "llm.head": (cfg.hidden, cfg.hidden)}
    return {n: torch.randn(*s, generator=gen) / s[0] ** 0.5 for n, s in shapes.items()}


def encode(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["enc.w1"]) @ p["enc.w2"]


def attend(p: dict, h: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of the queries ``h`` over keys and values ``kv`` = cat(k, v) rows."""
    k, v = kv.chunk(2, dim=1)
    scores = (h @ p["llm.wq"]) @ k.T / h.shape[1] ** 0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=1)
    return (h + (weights @ v) @ p["llm.wo"]) @ p["llm.head"]


def reference_loss(p: dict, batch: Batch) -> torch.Tensor:
    """The undistributed model, sample by sample, on plain tensors."""
    embedded = encode(p, batch.features)
    starts = [0]
    for n in batch.image_tokens:
        starts.append(starts[-1] + n)
    loss, count = embedded.new_zeros(()), 0
    for b, (ids, mask, target) in enumerate(zip(batch.ids, batch.is_image, batch.targets)):
        rows = [embedded[starts[k]:starts[k + 1]] for k, s in enumerate(batch.image_sample)
                if s == b]
        h = p["llm.emb"][ids]
        if rows:
            h = h.index_copy(0, torch.nonzero(mask).flatten(), torch.cat(rows))
        kv = torch.cat([h @ p["llm.wk"], h @ p["llm.wv"]], dim=1)
        causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        loss = loss + ((attend(p, h, kv, causal) - target) ** 2).sum()
        count += target.numel()
    return loss / count


@dataclass
class RankStep:
    """One rank's inputs for a step: what its compiled step takes, and the plans' bytes."""

    inputs: dict
    sent: int          # bytes this rank sends through both bridges (forward + backward)
    image_bytes: int   # the image bridge's bytes, all ranks, forward + backward
    seed_image_bytes: int  # the same for the seeds' replicate-and-all-reduce scheme
    count: int         # the loss's global element count


def layouts(cfg: PackedConfig, batch: Batch):
    """The step's layouts, the same on every rank: the encoder's image-token rows (rank
    ``r`` holds the tokens of images ``r, r + 8, ...``, ragged over dp), the packed batch
    (dp group ``d`` packs samples ``2d, 2d + 1``, zigzag over cp), its image tokens (row
    ``j``: the ``j``-th image-token row of the encoder's layout) and every group's tokens
    on each of its cp ranks (the keys and values a rank attends over)."""
    grids = LAYOUT.grids()
    enc, llm = grids["enc"], grids["llm"]
    dp = llm.axis_size("dp")
    groups = [list(_samples(cfg, llm, d)) for d in range(dp)]
    tokens = PackedLayout(llm, "t h", [[len(batch.ids[b]) for b in g] for g in groups])
    start, at = {}, 0  # each sample's first token in the packed batch
    for g in groups:
        for b in g:
            start[b] = at
            at += len(batch.ids[b])
    image_at, k = [], {b: 0 for b in range(cfg.samples)}  # each image's first token
    for n, b in zip(batch.image_tokens, batch.image_sample):
        where = torch.nonzero(batch.is_image[b]).flatten().tolist()
        image_at.append([start[b] + i for i in where[k[b]:k[b] + n]])
        k[b] += n
    enc_images = [list(range(r, len(image_at), enc.size)) for r in enc.ranks]
    positions = [t for mine in enc_images for i in mine for t in image_at[i]]
    counts = tuple(sum(batch.image_tokens[i] for i in mine) for mine in enc_images)
    totals = tuple(p.total for p in tokens.packings)
    return (Layout(enc, "(dp t) h", ragged="dp"), tokens, tokens.select(positions),
            Layout(llm, "(dp t) h", ragged="dp"), enc_images, counts, totals)


def rank_step(cfg: PackedConfig, batch: Batch, rank: int) -> RankStep:
    """``rank``'s inputs for ``batch`` (outside the compiled step), and the bytes the
    step's plans move."""
    enc, tokens, images, keys, enc_images, counts, totals = layouts(cfg, batch)
    llm = tokens.grid
    d, c = llm.coord(rank)["dp"], llm.coord(rank)["cp"]
    inputs = _inputs(batch, _samples(cfg, llm, d), tokens.packings[d], c)
    starts = [0]
    for n in batch.image_tokens:
        starts.append(starts[-1] + n)
    mine = [t for i in enc_images[rank] for t in range(starts[i], starts[i + 1])]
    inputs["features"] = batch.features[mine]
    inputs["image_rows"] = images.positions(rank)
    inputs["totals"] = torch.tensor(totals)
    # one graph for every batch: a rank's image tokens may be 0 or 1 (unbacked: no
    # specialisation), its tokens and its group's tokens never are (>= 2 per sequence:
    # backed, so the attention's shapes stay ones the compiler can reason on)
    for name in ("features", "image_rows"):
        torch._dynamo.decorators.mark_unbacked(inputs[name], 0)
    for name in ("ids", "target", "real", "mask"):
        torch._dynamo.mark_dynamic(inputs[name], 0)
    torch._dynamo.mark_dynamic(inputs["mask"], 1)
    img_sizes, kv_sizes = {"t": counts, "h": cfg.hidden}, {"t": totals, "h": 2 * cfg.hidden}
    img = (plan(enc, images, img_sizes), backward_plan(enc, images, img_sizes))
    kv = (plan(tokens, keys, kv_sizes), backward_plan(tokens, keys, kv_sizes, None, ("cp",)))
    sent = sum(p.bytes_sent.get(rank, 0) for p in (*img, *kv))
    ours = sum(n for p in img for n in p.bytes_sent.values())
    seed = 0
    for group in llm.groups("cp"):  # every cp rank of a group gets all its rows
        needed = {g for r in group for g in images.rows(r).tolist()}
        held = {r: sum(len(needed & set(range(a, b))) for (a, b), in img[0].hold.boxes(r))
                for r in group}
        seed += sum(seed_bytes(len(needed), group, 4 * cfg.hidden, held).values())
    count = sum(t.numel() for t in batch.targets)
    return RankStep(inputs, sent, ours, seed, count)


def _samples(cfg: PackedConfig, llm, d: int) -> range:
    """The samples dp group ``d`` packs: a contiguous block of the batch."""
    dp = llm.axis_size("dp")
    return range(d * cfg.samples // dp, (d + 1) * cfg.samples // dp)


def _inputs(batch: Batch, samples: range, packing: Packing, c: int) -> dict:
    """The LLM inputs of cp rank ``c`` of the dp group packing ``samples``: token ids,
    targets, which tokens are real, and the attention mask over the group's tokens."""
    token = packing.token_index(c)
    real = token >= 0
    take = torch.where(real, token, 0)
    ids = torch.cat([batch.ids[b] for b in samples])[take]
    target = torch.cat([batch.targets[b] for b in samples])[take]
    return {"ids": ids, "mask": attention_mask(packing, c), "target": target,
            "real": real[:, None].to(target.dtype)}


def attention_mask(packing: Packing, c: int) -> torch.Tensor:
    """Which of its dp group's tokens (the keys, unpadded, in packing order) each token
    of cp rank ``c``'s storage attends to, from the packing's segment ids and positions:
    a real query sees its own sequence's keys up to itself; a padding query sees every
    key (no empty softmax row) and weighs nothing in the loss."""
    seg, pos = packing.segment_ids(c), packing.position_in_sequence(c)
    key_seg = torch.cat([torch.full((n,), s) for s, n in enumerate(packing.lengths)]
                        + [torch.zeros(0, dtype=torch.int64)])
    key_pos = torch.cat([torch.arange(n) for n in packing.lengths]
                        + [torch.zeros(0, dtype=torch.int64)])
    return ((key_seg[None, :] == seg[:, None]) & (key_pos[None, :] <= pos[:, None])) \
        | (seg[:, None] < 0)


def train_packed(rank: int, steps: int, backend: str, lr: float, say=None) -> dict:
    """Train the packed variant on this rank (all 8 ranks call it); the e2e result dict.

    Long because it reads as the training script a user writes: the bridges and the
    compiled step, the warm-up, then the loop checked against the undistributed model."""
    import torch.distributed as dist

    from mimo_fx.compiled import prepare

    say = say or (lambda *a, **k: None)
    cfg = PackedConfig()
    world = dist.get_world_size()
    full = init_params(cfg)
    mine = {n: v.clone().requires_grad_() for n, v in full.items()}
    enc, tokens, images, keys = layouts(cfg, packed_batch(cfg, 0))[:4]
    prepare(enc, images, {"h": cfg.hidden})  # process groups, eagerly, on every rank
    prepare(tokens, keys, {"h": 2 * cfg.hidden}, grad_partial=("cp",))

    def loss_fn(p, features, ids, image_rows, mask, target, real, images, tokens, totals,
                count):
        rows = redistribute(encode(p, features), enc, images, h=cfg.hidden)
        h = p["llm.emb"][ids].index_copy(0, image_rows, rows)
        kv = redistribute(torch.cat([h @ p["llm.wk"], h @ p["llm.wv"]], dim=1), tokens,
                          keys, t=tuple(totals.tolist()), h=2 * cfg.hidden,
                          grad_partial=("cp",))
        return (((attend(p, h, kv, mask) - target) * real) ** 2).sum() / count

    step_fn = loss_fn if backend == "eager" else torch.compile(loss_fn, backend=backend,
                                                                fullgraph=True)

    def run_step(k: int):
        batch = packed_batch(cfg, k)
        r = rank_step(cfg, batch, rank)
        _, step_tokens, step_images = layouts(cfg, batch)[:3]
        for v in mine.values():
            v.grad = None
        # (the count as a tensor: a Python int would be a constant of the graph)
        loss = step_fn(mine, **r.inputs, images=step_images, tokens=step_tokens,
                       count=torch.tensor(float(r.count)))
        loss.backward()
        grads, numel = summed_grads(mine)  # every parameter is replicated on every rank
        return batch, r, loss, grads, numel

    compile_s = warm_up("packed", backend, run_step, say)
    rows = []
    for step in range(1, steps + 1):
        dist.barrier()
        start = time.perf_counter()
        batch, r, loss, grads, numel = run_step(step)
        sgd(mine, grads, lr)
        elapsed = time.perf_counter() - start
        ref, grad_diff, full = reference_step(full, reference_loss, batch, grads, lr)
        sync = 2 * (world - 1) * numel * 4 // world  # ring all-reduce of the gradients
        rows.append(step_row(step, float(loss.detach()), float(ref.detach()), grad_diff,
                             r.sent + sync, elapsed))
        rows[-1]["image_bytes"], rows[-1]["seed_image_bytes"] = r.image_bytes, \
            r.seed_image_bytes
        say(step_line("packed", rows[-1], steps), flush=True)
    return result("packed", backend, rows, mine, full, compile_s)
