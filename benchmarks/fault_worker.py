"""One training run of the fault matrix (``benchmarks/faults.py``), with one fault injected.

    python benchmarks/fault_worker.py --spec '{"strategy": "ours", "flags": {"zero_stage": 2}, "out": "DIR", ...}'

Lightning's launcher re-executes this command line once per rank. Every rank writes ``DIR/pid-<rank>``; the rank
that injects a fault writes ``DIR/fault`` (the time, then what it did) just before; rank 0 writes
``DIR/result.json`` when the run ends normally. Spec keys (all optional but ``out``):

- ``strategy``: ``"ours"`` (``HierarchicalZeroStrategy(**flags)``) or ``"ddp"`` (Lightning's ``DDPStrategy``)
- ``flags``: keyword arguments of the strategy (``timeout`` in seconds)
- ``devices`` (4), ``steps`` (12), ``model`` (``"mlp"``; ``"blocks"``: GPT-2's layout, blocks in an
  ``nn.ModuleList``, tied embedding and head; ``"gpt"``: ``ddp_plugin.testing.gpt``'s tied GPT, which splits for
  ``tensor_parallel_size`` in ``configure_model`` and computes its loss with ``pipeline_loss`` for pipeline
  stages), ``width`` (32), ``optimizer`` (``"adamw"`` or ``"lars"``: a per-tensor trust ratio in a subclass of
  ``SGD``)
- ``fault``: ``{"kind": "sigstop" | "sigkill" | "raise" | "nan" | "sigkill_in_save", "rank": r, "step": s}``;
  ``sigkill_in_save``: the rank kills itself as the checkpoint save after step ``s`` starts writing its part of a
  sharded checkpoint (``torch.distributed.checkpoint.save``, the others inside it); needs ``save_every``
- ``save_every``: ``trainer.save_checkpoint(ckpt)`` after every this many steps; ``stall_save``: rank 0 stops
  writing the second of them half way and waits to be killed (``DIR/fault`` written then)
- ``ckpt``: checkpoint path for ``save_every`` and ``save_after_fit``; ``resume``: ``ckpt_path`` for ``fit``
"""

from __future__ import annotations

import json
import os
import time

import harness


def _mark_fault(out: str, what: str) -> None:
    with open(os.path.join(out, "fault"), "w") as f:
        f.write(f"{time.time()}\n{what}\n")


def main() -> None:
    spec = harness.spec_parser(__doc__)
    out = spec["out"]
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    # Written before any import of Lightning (ddp_plugin.testing.processes.write_pid_file would import it): the
    # driver can kill this rank from its first second.
    harness.write_pid(out)

    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.data import sine_dataset
    from ddp_plugin.testing.gpt import GPTModule, token_dataset
    from ddp_plugin.testing.models import LARS, mlp
    from ddp_plugin.testing.processes import inject_fault

    torch.set_num_threads(1)
    width = int(spec.get("width", 32))
    fault = spec.get("fault") or {}

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

        def forward(self, x):
            return x + torch.tanh(self.fc(self.ln(x)))

    class Model(L.LightningModule):
        """An MLP or GPT-2's layout (``spec["model"] == "blocks"``, the module tree a stage 3 policy groups), and a
        fault injected inside ``training_step`` on one rank at one step: not a ``ddp_plugin.testing`` TinyModule,
        whose modules all sit under ``net`` and which has no faults."""

        def __init__(self) -> None:
            super().__init__()
            if spec.get("model") == "blocks":
                self.wte = nn.Embedding(64, width)
                self.h = nn.ModuleList(Block() for _ in range(4))  # never called itself, like GPT-2's
                self.head = nn.Linear(width, 64, bias=False)
                self.head.weight = self.wte.weight
            else:
                self.net = mlp(8, width, 1, layers=1, activation=nn.Tanh)

        def forward(self, x):
            if spec.get("model") == "blocks":
                h = self.wte(x)
                for block in self.h:
                    h = block(h)
                return self.head(h)
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if fault and self.global_rank == fault.get("rank") and self.global_step == fault.get("step", 5):
                kind = fault["kind"]
                if kind == "nan":
                    x = x.clone().float() if spec.get("model") != "blocks" else x
                    _mark_fault(out, "nan")
                    loss = self._loss(x, y) * float("nan")
                    return loss
                _mark_fault(out, kind)
                inject_fault(kind)
            loss = self._loss(x, y)
            self.log("loss", loss)
            return loss

        def _loss(self, x, y):
            if spec.get("model") == "blocks":
                return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            if spec.get("optimizer") == "lars":
                return LARS(self.parameters(), lr=0.05, momentum=0.9, eps=1e-8)
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            n = 16 * spec.get("steps", 12)
            if spec.get("model") == "blocks":
                x = torch.randint(0, 64, (n, 8), generator=g)
                data = TensorDataset(x, x.roll(1, dims=1))
            else:
                data = sine_dataset(n, 8, seed=0)
            return DataLoader(data, batch_size=16 // spec.get("devices", 4))

    class GPTModel(GPTModule):
        """The tied GPT of the 3-D mesh (``model == "gpt"``), with the same faults in ``training_step``."""

        def __init__(self) -> None:
            super().__init__(vocab=32, d_model=width, heads=2, layers=2, seq=8)

        def training_step(self, batch, batch_idx):
            if fault and self.global_rank == fault.get("rank") and self.global_step == fault.get("step", 5) \
                    and fault["kind"] != "sigkill_in_save":
                _mark_fault(out, fault["kind"])
                inject_fault(fault["kind"])
            return super().training_step(batch, batch_idx)

        def train_dataloader(self):
            return DataLoader(token_dataset(8 * spec.get("devices", 4) * spec.get("steps", 12), seq=8, vocab=32),
                              batch_size=8)

    class SaveEvery(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if fault.get("kind") == "sigkill_in_save" and trainer.global_step == fault.get("step", 5) \
                    and rank == fault.get("rank"):
                import torch.distributed.checkpoint as dcp

                def killed_while_saving(*args, **kwargs):
                    _mark_fault(out, "sigkill_in_save")
                    inject_fault("sigkill")

                dcp.save = killed_while_saving
            if trainer.global_step % spec["save_every"] == 0:
                if spec.get("stall_save") and trainer.global_step == 2 * spec["save_every"] and rank == 0:
                    _stall_writes(out)
                trainer.save_checkpoint(spec["ckpt"])

    flags = dict(spec.get("flags", {}))
    if spec.get("strategy") == "ddp":
        timeout = flags.pop("timeout", None)
        if isinstance(timeout, (int, float)) and timeout == timeout and abs(timeout) != float("inf"):
            timeout = _timedelta(timeout)  # DDPStrategy takes a timedelta; odd values go through as they are
        strategy = DDPStrategy(**({"timeout": timeout} if timeout is not None else {}), **flags)
    else:
        strategy = HierarchicalZeroStrategy(**flags)
    L.seed_everything(0, verbose=False)
    model = GPTModel() if spec.get("model") == "gpt" else Model()
    trainer = L.Trainer(
        accelerator="cpu", devices=spec.get("devices", 4), strategy=strategy, max_steps=spec.get("steps", 12),
        callbacks=[SaveEvery()] if spec.get("save_every") else [], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        # (the pipeline stages and tensor-parallel peers of the mesh read the same batch: the strategy's sampler)
        use_distributed_sampler=spec.get("model") == "gpt",
    )
    trainer.fit(model, ckpt_path=spec.get("resume"))
    if spec.get("save_after_fit"):
        trainer.save_checkpoint(spec["ckpt"])
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    if trainer.is_global_zero:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"param_sum": total, "global_step": trainer.global_step,
                       "zero_stage": getattr(strategy, "zero_stage", None)}, f)


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _stall_writes(out: str) -> None:
    """Make rank 0's next checkpoint write stop after 4 kB, mark the fault, and wait to be killed."""
    import lightning.fabric.plugins.io.torch_io as torch_io

    import ddp_plugin.checkpoints.checkpoint_io

    class Stalling:
        def __init__(self, f) -> None:
            self.f, self.written = f, 0

        def write(self, data) -> int:
            n = self.f.write(data[: max(0, 4096 - self.written)] if self.written < 4096 else b"")
            self.written += len(data)
            if self.written >= 4096:
                self.f.flush()
                _mark_fault(out, "sigkill")
                time.sleep(3600)
            return n

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_stream_save = ddp_plugin.checkpoints.checkpoint_io.stream_save
    ddp_plugin.checkpoints.checkpoint_io.stream_save = lambda obj, f: real_stream_save(obj, Stalling(f))  # ours

    def stalling_atomic_save(checkpoint, filepath) -> None:  # Lightning's TorchCheckpointIO (ddp)
        import io

        import torch

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        with open(f"{filepath}.partial", "wb") as f:
            Stalling(f).write(buffer.getvalue())

    torch_io._atomic_save = stalling_atomic_save


if __name__ == "__main__":
    main()
