"""Worker for the plugin tests: a short training run with plugins, reporting what the plugins saw.

    python tests/workers/plugins_run.py --mode entrypoint --out result.json   # installed codec + observer
    python tests/workers/plugins_run.py --mode two_stage --out result.json    # a codec that waits between collectives
    python tests/workers/plugins_run.py --mode state --out result.json        # plugin state through a checkpoint
    python tests/workers/plugins_run.py --mode members --out result.json      # steps gated by a plugin, its transport
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy, hookimpl
from ddp_plugin.testing.data import sine_dataset
from ddp_plugin.testing.models import TinyModule
from ddp_plugin.testing.ranks import identical_on_all_ranks


def tiny_model() -> TinyModule:
    """Six 16 x 16 blocks and a head: with a 1 KiB bucket cap, 12 buckets."""
    net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)], nn.Linear(16, 1))
    return TinyModule(net, optimizer="sgd", lr=0.05)


def loader() -> DataLoader:
    return DataLoader(sine_dataset(256, 16, seed=0), batch_size=8)


class TwoStageCodec:
    """Two dependent collectives per bucket with a wait between them and random delays, the pattern that makes
    torch's PowerSGD hook abort on gloo when ranks issue collectives in different orders."""

    def __init__(self) -> None:
        self.calls = 0
        self.rng = random.Random(int(os.environ.get("LOCAL_RANK", "0")))

    @hookimpl
    def on_cross_node_reduce(self, tensor, group):
        self.calls += 1
        time.sleep(self.rng.random() * 0.003)
        # Stage 1: the squared norm (1 element); stage 2, after waiting on it: the tensor itself (many elements).
        # Ranks that disagreed on bucket order would pair tensors of different sizes and gloo would abort.
        norm = tensor.pow(2).sum().reshape(1)
        dist.all_reduce(norm, group=group, async_op=True).wait()
        time.sleep(self.rng.random() * 0.003)
        tensor.div_(dist.get_world_size(group))
        return dist.all_reduce(tensor, group=group, async_op=True).get_future()


class StepCounter:
    """A plugin with state that must survive a checkpoint."""

    def __init__(self) -> None:
        self.steps = 0
        self.loaded = None

    @hookimpl
    def on_after_optimizer_step(self):
        self.steps += 1

    @hookimpl
    def on_save_state_dict(self):
        return {"step_counter": {"steps": self.steps}}

    @hookimpl
    def on_load_state_dict(self, state):
        self.loaded = dict(state["step_counter"])
        self.steps = self.loaded["steps"]


class EveryOtherStep:
    """The hooks of members that come and go, without torchft: every optimizer step is gated and commits on every
    other ask (the same on every rank), and the fit's collectives go through a wrapper that counts them."""

    def __init__(self) -> None:
        self.started = self.asked = self.wrapped_calls = 0

    @hookimpl
    def on_transport(self, comm):
        plugin = self

        class Counting:
            def __getattr__(self, name):
                attr = getattr(comm, name)
                if name not in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
                    return attr

                def counted(*args, **kwargs):
                    plugin.wrapped_calls += 1
                    return attr(*args, **kwargs)

                return counted

        return Counting()

    @hookimpl
    def on_step_start(self):
        self.started += 1

    @hookimpl
    def on_step_gated(self):
        return True

    @hookimpl
    def on_commit_step(self):
        self.asked += 1
        return self.asked % 2 == 0


class ParameterChanges(L.Callback):
    """Whether each training batch changed the parameters."""

    def __init__(self) -> None:
        self.changed: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.changed.append(any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters())))


def trainer_for(strategy, steps: int, **kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    result: dict = {}

    if args.mode == "entrypoint":
        import ddp_test_plugins  # the installed test package; the strategy loads it through its entry points

        strategy = HierarchicalZeroStrategy(compression="fp64_mean", bucket_size_mb=1 / 1024)
        trainer = trainer_for(strategy, 10, enable_checkpointing=False)
        model = tiny_model()
        trainer.fit(model, loader())
        result = {
            "codec_calls": ddp_test_plugins.codec.calls,
            "observed_buckets": ddp_test_plugins.observer.buckets_seen,
            "num_buckets": len(ddp_test_plugins.observer.bucket_indices),
            "identical": identical_on_all_ranks(trainer.strategy, model),
        }
    elif args.mode == "two_stage":
        codec = TwoStageCodec()
        strategy = HierarchicalZeroStrategy(plugins=[codec], bucket_size_mb=1 / 1024)
        trainer = trainer_for(strategy, 30, enable_checkpointing=False)
        model = tiny_model()
        trainer.fit(model, loader())
        result = {"codec_calls": codec.calls, "identical": identical_on_all_ranks(trainer.strategy, model)}
    elif args.mode == "state":
        path = os.path.join(os.path.dirname(args.out), "state.ckpt")
        first = StepCounter()
        trainer = trainer_for(HierarchicalZeroStrategy(plugins=[first]), 5, enable_checkpointing=False)
        trainer.fit(tiny_model(), loader())
        trainer.save_checkpoint(path)
        second = StepCounter()
        trainer = trainer_for(HierarchicalZeroStrategy(plugins=[second]), 8, enable_checkpointing=False)
        trainer.fit(tiny_model(), loader(), ckpt_path=path)
        saved = torch.load(path, weights_only=False)["ddp_plugin"]
        result = {"saved": saved, "loaded": second.loaded, "steps_after_resume": second.steps}
    elif args.mode == "members":
        members, changes = EveryOtherStep(), ParameterChanges()
        trainer = trainer_for(HierarchicalZeroStrategy(plugins=[members], hierarchical=True), -1, max_epochs=1,
                              limit_train_batches=6, enable_checkpointing=False, callbacks=[changes])
        model = tiny_model()
        trainer.fit(model, loader())
        result = {"changed": changes.changed, "started": members.started, "asked": members.asked,
                  "wrapped_calls": members.wrapped_calls, "identical": identical_on_all_ranks(trainer.strategy, model)}

    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
