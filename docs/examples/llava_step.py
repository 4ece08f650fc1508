"""A tiny Hugging Face LLaVA trained on PyTorch's own parallelism, 4 gloo processes: the
vision tower and projector on ranks 0-1 (FSDP2), the language model on ranks 2-3 (DTensor
tensor parallel from the model's own ``tp_plan``), the image-token rows moved between
them by mimo_fx. The number of images per sample changes every step, zero included.

    python docs/examples/llava_step.py [aot_eager|inductor|eager]

Needs transformers (``pip install -e ".[hf]"``). docs/llava.md shows lines between the
``# --`` markers verbatim; tests/mimo_layer/test_llava.py runs ``train`` through the main
job's llava variant (``python -m mimo_fx.jobs --variant llava``, jobs/llava.py), which
checks every gradient and the parameters against the same model trained on one process.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutputWithPooling

import mimo_fx
from mimo_fx import Layout
from mimo_fx.compiled import Redistributor
from mimo_fx.mimo import fsdp_sums
from mimo_fx.reference import shard

IMAGE = 127          # the image placeholder token (the vocabulary's last id)
PX, PATCH = 16, 8    # 16 px images, 8 px patches: 4 image tokens per image (CLS dropped)
TOKENS = (PX // PATCH) ** 2
H = 64               # the language model's hidden size: the width of the rows moved
B, S = 4, 20         # samples per batch, tokens per sample
# images per sample, one row per step: on step 1 encoder rank 0 (samples 0-1) has none,
# on step 2 no rank has any
IMAGES = [(1, 2, 0, 1), (0, 0, 1, 0), (0, 0, 0, 0), (2, 0, 1, 2), (2, 2, 2, 2), (0, 1, 0, 0)]
LR = 0.05


# -- the model
def tiny_llava() -> LlavaForConditionalGeneration:
    """CLIP vision (hidden 32) + projector + Llama (hidden 64, 4 heads, 2 KV heads)."""
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, image_size=PX, patch_size=PATCH)
    text = LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                       max_position_embeddings=64, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)                          # the same weights on every rank
    return LlavaForConditionalGeneration(config).float()


class Encoder(nn.Module):
    """The vision tower and the projector: HF's ``get_image_features`` (last layer, CLS
    dropped), one row per image token, for any number of images, 0 included."""

    def __init__(self, llava: LlavaForConditionalGeneration) -> None:
        super().__init__()
        self.vision_tower = llava.model.vision_tower
        self.multi_modal_projector = llava.model.multi_modal_projector

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.features(pixels)  # FSDP2's hooks around it; features() is compiled

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        n = pixels.shape[0]  # CLIP fails on 0 images: one blank image more, its rows dropped
        padded = torch.cat([pixels, pixels.new_zeros(1, *pixels.shape[1:])])
        hidden = self.vision_tower(padded).last_hidden_state[:n, 1:].flatten(0, 1)
        return self.multi_modal_projector(hidden)  # (images x TOKENS, H)


def tp_plan(model: nn.Module) -> dict:
    """The model's own tensor-parallel plan (``model.tp_plan``) as torch's styles."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    return {name: styles[style]() for name, style in model.tp_plan.items()}
# --


def batch(step: int):
    """A step's batch, the same on every rank: token ids with ``TOKENS`` placeholders per
    image, labels (-100 at the placeholders), the images in sample order, and the number
    of images per sample."""
    gen = torch.Generator().manual_seed(1000 + step)
    counts = IMAGES[step % len(IMAGES)]
    ids = torch.randint(2, IMAGE, (B, S), generator=gen)
    for i, n in enumerate(counts):
        for k in range(n):  # a text token, then the image's tokens
            start = 2 + k * (1 + TOKENS)
            ids[i, start:start + TOKENS] = IMAGE
    labels = ids.masked_fill(ids == IMAGE, -100)
    pixels = torch.randn(sum(counts), 3, PX, PX, generator=gen)
    return ids, labels, pixels, counts


def train(rank: int, world: int, steps: int = 3, backend: str = "aot_eager", lr: float = LR):
    """Train ``steps`` SGD steps on this rank (ranks 0-3; ranks 4 and up of a larger world
    only take part in making the device meshes). A generator: after each step's
    backward it yields ``(step, loss or None, this rank's parameters by name)``, before
    the optimizer's step."""
    if backend == "inductor":  # its channels-last conv layout and an unbacked image count
        torch._inductor.config.layout_optimization = False  # fail: "expected size 32==32"
    compiled = (lambda f: f) if backend == "eager" else torch.compile(backend=backend,
                                                                      fullgraph=True)
    # -- meshes and models
    enc = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))  # vision: FSDP2 on ranks 0-1
    lm = DeviceMesh("cpu", [2, 3], mesh_dim_names=("tp",))   # language model: TP on 2-3
    model = tiny_llava()
    if rank in (0, 1):
        encoder = fsdp_sums(fully_shard(Encoder(model), mesh=enc))  # gradients summed
        encoder.features = compiled(encoder.features)    # FSDP2's hooks stay eager
        params = dict(encoder.named_parameters(prefix="model"))
    elif rank in (2, 3):
        parallelize_module(model, lm, tp_plan(model))
        params = {n: p for n, p in model.named_parameters()
                  if n.startswith(("model.language_model", "lm_head"))}
    # --
    if rank >= 4:  # a larger world's other ranks: they took part in making the meshes
        return     # (torch's rule); a bridge is built by its grids' ranks only
    # -- glue
    bridge = Redistributor(Layout(enc, "(dp t) h", ragged="dp"), Layout(lm, "t h"), {"h": H})

    @compiled
    def lm_loss(ids, labels):
        image = BaseModelOutputWithPooling(pooler_output=[bridge(None)])  # every image row
        return model(input_ids=ids, labels=labels, mm_encoder_outputs={"image": image}).loss
    # --
    # -- loop
    opt = torch.optim.SGD(params.values(), lr=lr)
    for k in range(steps):
        ids, labels, pixels, counts = batch(k)
        if rank in (0, 1):                                   # this rank's images, as rows
            mine = shard(pixels, Layout(enc, "(dp i) c y x", ragged="dp"), rank=rank, i=counts)
            torch._dynamo.decorators.mark_unbacked(mine, 0)  # 0, 1, 2, ... images: one graph
            bridge(encoder(mine))                            # ... to ranks 2-3
        loss = lm_loss(ids, labels) if rank in (2, 3) else None
        mimo_fx.backward(loss)       # every rank; on 0-1 the bridge's backward, into FSDP2
        yield k, loss, params        # (the main job compares the gradients here)
        opt.step()
        opt.zero_grad()
    # --
    bridge.destroy()


def _run(rank: int, world: int, backend: str) -> list:
    return [None if loss is None else loss.item() for _, loss, _ in
            train(rank, world, backend=backend)]


def check(results: list, lr: float = LR) -> None:
    """The LM ranks' losses against the same model trained on one process on the whole
    batch, HF's own forward (raises if not); the encoder ranks have none."""
    model = tiny_llava()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for k in range(len(results[2])):
        ids, labels, pixels, _ = batch(k)
        loss = model(input_ids=ids, labels=labels,
                     pixel_values=pixels if len(pixels) else None).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        for rank in (2, 3):
            assert abs(results[rank][k] - loss.item()) <= 1e-4 * abs(loss.item()), \
                (k, rank, results[rank][k], loss.item())
        assert results[0][k] is None and results[1][k] is None


if __name__ == "__main__":
    import sys

    from mimo_fx.testing import run_world

    results = run_world(4, _run, sys.argv[1] if len(sys.argv) > 1 else "aot_eager",
                        timeout=900)
    print(results)
    check(results)
    print("checked against the model on one process: every step's loss, OK")
