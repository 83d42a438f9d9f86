"""A tiny GPT whose layers split over a tensor-parallel group: the model of the tensor-parallel tests, example and
benchmark, written as a user writes one for Lightning's ``ModelParallelStrategy``.

- :class:`GPT`: token and position embeddings, pre-norm blocks (causal self-attention, a GELU MLP), a final norm
  and an output head whose weight *is* the token embedding's (tied: one parameter).
- :func:`tensor_parallel_plan`: the ``parallelize_module`` plan, Megatron's split: q/k/v and the MLP's first layer
  column-wise, the attention output and the MLP's second layer row-wise, so each block needs one all-reduce
  forward and one backward per half. The tied embedding stays replicated (``tie="replicated"``) or is split by
  vocabulary, ``Shard(0)`` for both its uses (``tie="vocab"``, as torchtitan splits its embedding and head).
- :class:`GPTModule`: the LightningModule, written for pipeline stages too (its ``forward`` tolerates missing
  modules, its loss is ``pipeline_loss``); ``configure_model`` applies the plan on
  ``self.device_mesh["tensor_parallel"]`` when there is a mesh (under ``ddp`` there is none, and the model stays
  whole), then ties the head to the embedding again (``parallelize_module`` replaces each module's parameters).
- :func:`token_dataset`: seeded token windows with structure a model can learn (a noisy repeating pattern).

Attention has no key bias: softmax ignores it, so its gradient is pure rounding, which Adam would turn into noise
that a comparison between layouts cannot tell from a bug.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

__all__ = ["GPT", "GPTModule", "tensor_parallel_plan", "token_dataset"]


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_dim  # this rank's heads: tensor parallelism splits q, k, v by columns
        q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``blocks="dict"``: the blocks in an ``nn.ModuleDict`` keyed by layer id (``"0"``, ``"1"``, ...), as
    torchtitan's models hold theirs; the parameter names are the same as with the default ``nn.ModuleList``."""

    def __init__(self, vocab: int = 32, d_model: int = 16, heads: int = 2, layers: int = 2, seq: int = 8,
                 blocks: str = "list") -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        made = [Block(d_model, heads) for _ in range(layers)]
        if blocks not in ("list", "dict"):
            raise ValueError(f"`blocks={blocks!r}`; allowed values: 'list', 'dict'")
        self.blocks = nn.ModuleList(made) if blocks == "list" else nn.ModuleDict(
            {str(i): b for i, b in enumerate(made)})
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, two uses
        # GPT-2's scale: with nn.Embedding's N(0, 1) the tied head's logits would have a standard deviation of
        # sqrt(d_model), and the first losses would be tens of nats.
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def init_weights(self) -> None:
        """Initialize every parameter in place, as the constructor does (each layer's ``reset_parameters``, then
        GPT-2's scale for the embeddings): what a model built on the meta device (``trainer.init_module(
        empty_init=True)``) is initialized with once materialized. A pipeline stage initializes what it holds."""
        for module in self.modules():
            if module is not self and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        for embedding in (self.tok, self.pos):
            if embedding is not None:
                nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        # With pipeline stages a stage holds some of the modules (the others are None) and a later stage gets the
        # activations of the one before.
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in (self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks):
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x


def tensor_parallel_plan(model: GPT, tie: str = "replicated") -> dict[str, object]:
    """The ``parallelize_module`` plan of :class:`GPT` (module names relative to the GPT)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    for i in range(len(model.blocks)):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    if tie == "vocab":
        plan["tok"] = RowwiseParallel(input_layouts=Replicate())  # weight Shard(0): split by vocabulary
        plan["head"] = ColwiseParallel(output_layouts=Replicate())  # weight Shard(0) too: the same split
    elif tie != "replicated":
        raise ValueError(f"`tie={tie!r}`; allowed values: 'replicated', 'vocab'")
    return plan


class GPTModule(L.LightningModule):
    """:class:`GPT` as a LightningModule: next-token cross-entropy, AdamW. ``retie=False`` leaves the tie as
    ``parallelize_module`` leaves it (broken), for a test that the strategy restores it."""

    def __init__(self, vocab: int = 32, d_model: int = 16, heads: int = 2, layers: int = 2, seq: int = 8,
                 tie: str = "replicated", lr: float = 1e-2, weight_decay: float = 0.1, retie: bool = True,
                 blocks: str = "list") -> None:
        super().__init__()
        self.model = GPT(vocab, d_model, heads, layers, seq, blocks)
        self.tie, self.lr, self.weight_decay, self.retie = tie, lr, weight_decay, retie

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or mesh["tensor_parallel"].size() == 1:
            return
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(self.model, mesh["tensor_parallel"], tensor_parallel_plan(self.model, self.tie))
        if self.retie:
            self.model.head.weight = self.model.tok.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.pipeline_loss(self.model(x), y)  # (with pipeline stages the strategy runs the schedule here)
        self.log("train_loss", loss)
        return loss

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        return self.model(x)  # (with pipeline stages: every stage gets the last stage's logits)

    def pipeline_loss(self, logits: Tensor, y: Tensor) -> Tensor:
        """Next-token cross-entropy of one (micro)batch."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def token_dataset(n: int, seq: int = 8, vocab: int = 32, seed: int = 0) -> TensorDataset:
    """``n`` windows ``(x, y)`` of ``seq`` tokens, ``y`` shifted by one: a repeating ramp with random starts and
    10 % of tokens replaced at random."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(n, seq + 1, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, (n, seq + 1), generator=g), tokens)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
