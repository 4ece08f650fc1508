"""The main job's balanced variant: images and sequences placed by cost, every step.

Eight ranks, colocated (:data:`LAYOUT`), each with a data loader of its own
(:data:`LOADERS`, one per rank) that yields its own samples -- deliberately skewed: two
loaders read image-heavy documents (several images of 3-6 tiles), two interleaved
image-text, two captions (one small image), two long text and no image
(:data:`PROFILES`), with heavy-tailed counts and lengths within each. Left where they
were loaded, the document loaders' encoder ranks and their LLM dp groups would carry
most of the step.

Every step:

1. the loaders' samples (how many text and image tokens, in which order) are shared by
   one all-gather (:func:`mimo_fx.mimo.share_samples`, counted);
2. every rank computes the same :func:`mimo_fx.placement.place`: images to the encoder
   (DP8) by their tokens, samples to the LLM dp groups (DP4 x CP2) by
   ``sequence_costs`` of their lengths, each group packing its samples with zigzag over
   cp, sequence by sequence;
3. four ``redistribute`` calls between the placement's layouts carry the step: a loader's
   image patches to their encoder rank, the encoded rows to their tokens' cp rank, a
   loader's text embeddings (embedded where they were loaded) and its targets to their
   tokens; keys and values then reach every cp rank of a group as in the packed variant
   (:mod:`mimo_fx.jobs.packed`, whose model this is). Every gradient returns through the
   same calls. The loss is a sum over the step's tokens divided by their global count.

The step (``loss.backward()`` of the rank's part of the loss) is compiled once: the
placement's layouts travel as data, so one graph serves every batch and placement.
Gradients are summed over the world (every parameter is replicated), then SGD. Every
rank also runs the undistributed model on every loader's samples and compares gradients
(every step) and parameters (at the end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mimo_fx import Grid, Layout, redistribute
from mimo_fx.mimo.config import MimoParallelism
from mimo_fx.mimo.config import ModuleParallelism as M
from mimo_fx.mimo.loader import share_samples
from mimo_fx.placement import Placement, Sample, place
from mimo_fx.plan import backward_plan, plan

from .packed import (
    Batch,
    PackedConfig,
    attend,
    attention_mask,
    encode,
    init_params,
    reference_loss,
)
from .report import reference_step, result, sgd, step_line, step_row, summed_grads, warm_up

__all__ = ["LAYOUT", "LOADERS", "PROFILES", "SKEW", "BalancedConfig", "loader_batch",
           "global_batch", "step_numbers", "train_balanced"]

LAYOUT = MimoParallelism(world_size=8, colocated=True, modules={
    "enc": M(dp=8), "llm": M(cp=2, dp=4)})
LOADERS = Grid(dp=8)  # a data loader per rank
# per loader: (images per sample: least, most, geometric p), (tiles per image: least,
# most), text tokens (lognormal median, sigma, cap)
PROFILES = {
    "documents": ((1, 8, 0.3), (3, 6), (4.0, 0.6, 24)),
    "interleaved": ((0, 4, 0.5), (1, 3), (10.0, 0.8, 48)),
    "captions": ((1, 1, 1.0), (1, 1), (4.0, 0.5, 16)),
    "text": ((0, 0, 1.0), (1, 1), (28.0, 0.7, 96)),
}
SKEW = ("documents", "documents", "interleaved", "interleaved", "captions", "captions",
        "text", "text")  # loader i's profile


@dataclass(frozen=True)
class BalancedConfig:
    samples: int = 3          # per loader and step
    width: int = 64           # int64 values per loader in the sample gather
    tokens_per_tile: int = 2  # (576 in a real vision tower; small here)
    features: int = 6         # per image token (patch), into the encoder
    enc_hidden: int = 8
    hidden: int = 8
    vocab: int = 16


@dataclass
class LoaderBatch:
    """One loader's samples of a step, as only that loader has them."""

    samples: list[Sample]
    ids: list[torch.Tensor]      # per sample (L,), text token ids (0 at image tokens)
    features: torch.Tensor       # (image tokens, features), its images in order
    targets: list[torch.Tensor]  # per sample (L, hidden)


def loader_batch(cfg: BalancedConfig, step: int, loader: int) -> LoaderBatch:
    """Loader ``loader``'s samples at ``step``, drawn from its profile (:data:`SKEW`)."""
    gen = torch.Generator().manual_seed(20_000 + 100 * step + loader)
    (lo, hi, p), (t_lo, t_hi), (median, sigma, cap) = PROFILES[SKEW[loader]]
    samples, ids, targets, rows = [], [], [], 0
    for _ in range(cfg.samples):
        images = min(hi, lo + _geometric(p, gen)) if hi else 0
        tiles = torch.randint(t_lo, t_hi + 1, (images,), generator=gen).tolist()
        text = min(cap, int(median * float(torch.exp(torch.randn((), generator=gen) * sigma))))
        cuts = sorted(torch.randint(0, text + 1, (images,), generator=gen).tolist())
        runs = [b - a for a, b in zip([0, *cuts], [*cuts, text])]
        runs[-1] += max(0, 2 - text - sum(tiles))  # at least 2 tokens per sample
        sample = Sample(tuple(runs), tuple(n * cfg.tokens_per_tile for n in tiles))
        mask = torch.zeros(sample.length, dtype=torch.bool)
        mask[list(sample.image_positions)] = True
        samples.append(sample)
        ids.append(torch.where(mask, 0, torch.randint(1, cfg.vocab, mask.shape,
                                                      generator=gen)))
        targets.append(torch.randn(sample.length, cfg.hidden, generator=gen))
        rows += sum(sample.images)
    features = torch.randn(rows, cfg.features, generator=gen)
    return LoaderBatch(samples, ids, features, targets)


def _geometric(p: float, gen: torch.Generator) -> int:
    """Failures before the first success, each try succeeding with ``p``."""
    n = 0
    while float(torch.rand((), generator=gen)) >= p:
        n += 1
    return n


def global_batch(cfg: BalancedConfig, step: int) -> Batch:
    """Every loader's samples, loader after loader: the undistributed model's batch."""
    parts = [loader_batch(cfg, step, i) for i in range(LOADERS.size)]
    samples = [s for b in parts for s in b.samples]
    is_image = []
    for s in samples:
        is_image.append(torch.zeros(s.length, dtype=torch.bool))
        is_image[-1][list(s.image_positions)] = True
    tokens = [n for s in samples for n in s.images]
    sample_of = [k for k, s in enumerate(samples) for _ in s.images]
    return Batch([t for b in parts for t in b.ids], is_image, tokens, sample_of,
                 torch.cat([b.features for b in parts]), [t for b in parts for t in b.targets])


# -- one rank's step ---------------------------------------------------------------------
@dataclass
class RankStep:
    """One rank's inputs for a step (what its compiled step takes) and the bytes it
    sends through the step's bridges, forward and backward."""

    inputs: dict
    sent: int


def layouts(cfg: BalancedConfig, step: Placement) -> dict:
    """The step's layouts, the same on every rank: the placement's bridges and the keys
    (every token of a group on each of its cp ranks)."""
    patches, embeddings = step.patches("t f"), step.embeddings("t h")
    text, tokens = step.text("t h"), step.tokens("t h")
    return {"patch_src": patches[0], "patch_dst": patches[1], "emb_src": embeddings[0],
            "emb_dst": embeddings[1], "text_src": text[0], "text_dst": text[1],
            "tok_src": tokens[0], "tok_dst": tokens[1], "packed": step.packed("t h"),
            "keys": Layout(step.llm, "(dp t) h", ragged="dp")}


def _plans(cfg: BalancedConfig, lay: dict) -> list:
    """Each bridge of a step's forward and backward plans (for their bytes)."""
    totals = tuple(p.total for p in lay["packed"].packings)
    h, f = {"h": cfg.hidden}, {"f": cfg.features}
    pairs: list[tuple[str, str, dict, tuple[str, ...]]] = [
        ("patch_src", "patch_dst", f, ()), ("emb_src", "emb_dst", h, ()),
        ("text_src", "text_dst", h, ()), ("tok_src", "tok_dst", h, ()),
        ("packed", "keys", {"t": totals, "h": 2 * cfg.hidden}, ("cp",))]
    return [(plan(lay[a], lay[b], sizes), backward_plan(lay[a], lay[b], sizes, None, partial))
            for a, b, sizes, partial in pairs]


def _sent(plans: list, rank: int | None = None) -> int:
    """Bytes ``rank`` (or every rank) sends through ``plans``, forward and backward (the
    targets' plan, ``plans[3]``, has no backward)."""
    out = 0
    for k, (fwd, bwd) in enumerate(plans):
        for p in (fwd, bwd) if k != 3 else (fwd,):
            out += sum(n for r, n in p.bytes_sent.items() if rank is None or r == rank)
    return out


def rank_step(cfg: BalancedConfig, mine: LoaderBatch, step: Placement, rank: int) -> RankStep:
    """``rank``'s inputs for the step placed by ``step`` (outside the compiled step)."""
    lay = layouts(cfg, step)
    llm = step.llm
    c = llm.coord(rank)["cp"]
    text_ids = torch.cat([ids[list(s.text_positions)] for s, ids in zip(mine.samples,
                                                                         mine.ids)])
    inputs = {"patches": mine.features, "text_ids": text_ids,
              "targets": torch.cat(mine.targets),
              "img_pos": lay["emb_dst"].positions(rank),
              "text_pos": lay["text_dst"].positions(rank),
              "tok_pos": lay["tok_dst"].positions(rank),
              "mask": attention_mask(lay["packed"].packing(rank), c)}
    # one graph for every batch: what a rank holds may be 0 or 1 rows (unbacked), its
    # packed tokens and its group's never are (>= 2 per sequence: backed)
    for name in ("patches", "text_ids", "targets", "img_pos", "text_pos", "tok_pos"):
        torch._dynamo.decorators.mark_unbacked(inputs[name], 0)
    torch._dynamo.mark_dynamic(inputs["mask"], 0)
    torch._dynamo.mark_dynamic(inputs["mask"], 1)
    return RankStep({**inputs, **lay}, _sent(_plans(cfg, lay), rank))


def step_numbers(cfg: BalancedConfig, step: Placement) -> dict:
    """The step against the naive placement (each loader's samples on its own ranks):
    bytes every rank sends through the bridges (both ways), and each module's busiest
    group's cost over the mean."""
    naive = place(step.samples, step.loaders, step.encoder, step.llm, balanced=False)
    out: dict = {}
    for which, p in (("balanced", step), ("naive", naive)):
        out[f"bytes {which}"] = _sent(_plans(cfg, layouts(cfg, p)))
        for module, loads in (("enc", p.encoder_loads()), ("llm", p.llm_loads())):
            out[f"{module} {which}"] = max(loads) / (sum(loads) / len(loads))
    return out


def loss_fn(cfg: BalancedConfig, p: dict, patches, text_ids, targets, img_pos, text_pos,
            tok_pos, mask, count, patch_src, patch_dst, emb_src, emb_dst, text_src,
            text_dst, tok_src, tok_dst, packed, keys, totals):
    """This rank's part of the step's loss: every bridge of the placement, the encoder on
    the rows it receives, the LLM layer on its packed tokens."""
    h_dim = cfg.hidden
    rows = redistribute(patches, patch_src, patch_dst, f=cfg.features)  # to the encoder
    images = redistribute(encode(p, rows), emb_src, emb_dst, h=h_dim)    # to their tokens
    text = redistribute(p["llm.emb"][text_ids], text_src, text_dst, h=h_dim)
    target_rows = redistribute(targets, tok_src, tok_dst, h=h_dim)
    n = mask.shape[0]
    h = patches.new_zeros(n, h_dim).index_copy(0, text_pos, text).index_copy(0, img_pos,
                                                                              images)
    target = patches.new_zeros(n, h_dim).index_copy(0, tok_pos, target_rows)
    real = patches.new_zeros(n, 1).index_fill(0, tok_pos, 1.0)
    kv = redistribute(torch.cat([h @ p["llm.wk"], h @ p["llm.wv"]], dim=1), packed, keys,
                      t=tuple(totals.tolist()), h=2 * h_dim, grad_partial=("cp",))
    return (((attend(p, h, kv, mask) - target) * real) ** 2).sum() / count


def _placement(cfg: BalancedConfig, step: int, rank: int, counts: dict
               ) -> tuple[LoaderBatch, Placement]:
    """This rank's loader batch and the step's placement, after the one sample gather."""
    mine = loader_batch(cfg, step, LOADERS.coord(rank)["dp"])
    shared = share_samples(mine.samples, LOADERS, width=cfg.width)  # one all-gather
    counts["gathers"] += 1
    grids = LAYOUT.grids()
    return mine, place(shared, LOADERS, grids["enc"], grids["llm"])


def train_balanced(rank: int, steps: int, backend: str, lr: float, say=None) -> dict:
    """Train the balanced variant on this rank (all 8 ranks call it); the e2e result
    dict.

    Long because it reads as the training script a user writes: the bridges and the
    compiled step, the warm-up, then the loop checked against the undistributed model."""
    import torch.distributed as dist

    from mimo_fx.compiled import prepare
    say = say or (lambda *a, **k: None)
    cfg = BalancedConfig()
    world = dist.get_world_size()
    full = init_params(PackedConfig(features=cfg.features, enc_hidden=cfg.enc_hidden,
                                    hidden=cfg.hidden, vocab=cfg.vocab))
    mine = {n: v.clone().requires_grad_() for n, v in full.items()}
    counts = {"gathers": 0}
    lay = layouts(cfg, _placement(cfg, 0, rank, counts)[1])
    prepare(lay["patch_src"], lay["patch_dst"], {"f": cfg.features})  # every rank, eagerly
    prepare(lay["emb_src"], lay["emb_dst"], {"h": cfg.hidden})
    prepare(lay["text_src"], lay["text_dst"], {"h": cfg.hidden})  # (the targets' too)
    prepare(lay["packed"], lay["keys"], {"h": 2 * cfg.hidden}, grad_partial=("cp",))
    def fn(p, **inputs):
        return loss_fn(cfg, p, **inputs)

    step_fn = fn if backend == "eager" else torch.compile(fn, backend=backend, fullgraph=True)

    def run_step(k: int):
        batch, step = _placement(cfg, k, rank, counts)
        r = rank_step(cfg, batch, step, rank)
        for v in mine.values():
            v.grad = None
        # (the count and the totals as tensors: Python ints would be constants)
        count = torch.tensor(float(step.total_tokens * cfg.hidden))
        totals = torch.tensor([p.total for p in r.inputs["packed"].packings])
        loss = step_fn(mine, **r.inputs, count=count, totals=totals)
        loss.backward()
        grads, numel = summed_grads(mine)  # every parameter is replicated on every rank
        return step, r, loss, grads, numel

    compile_s = warm_up("balanced", backend, run_step, say)
    rows = []
    for step in range(1, steps + 1):
        dist.barrier()
        before = counts["gathers"]
        start = time.perf_counter()
        placed, r, loss, grads, numel = run_step(step)
        sgd(mine, grads, lr)
        elapsed = time.perf_counter() - start
        ref, grad_diff, full = reference_step(full, reference_loss, global_batch(cfg, step),
                                              grads, lr)
        sync = 2 * (world - 1) * numel * 4 // world  # ring all-reduce of the gradients
        gather = (world - 1) * cfg.width * 8  # the sample gather (a ring all-gather)
        rows.append(step_row(step, float(loss.detach()), float(ref.detach()), grad_diff,
                             r.sent + sync + gather, elapsed))
        rows[-1].update(gathers=counts["gathers"] - before, gather_bytes=gather,
                        **step_numbers(cfg, placed))
        say(step_line("balanced", rows[-1], steps), flush=True)
    return result("balanced", backend, rows, mine, full, compile_s)
