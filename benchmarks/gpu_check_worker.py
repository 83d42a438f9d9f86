"""The ranks of ``benchmarks/gpu_check.py``: one launch of Lightning's launcher, fitting one case after another.

    python benchmarks/gpu_check_worker.py --spec '{"section": "parity", "out": "DIR", "accelerator": "gpu",
                                                   "devices": 2, "cases": ["ddp", "default", "int8"], "steps": 20}'

Lightning's launcher re-executes this command line once per rank (NCCL ranks on GPUs, gloo ranks on CPUs), and
every rank fits the cases of ``spec["cases"]`` in order, each with its own Trainer
(``ddp_plugin.testing.processes.run_cases``). Every rank writes ``DIR/pid-<rank>`` first. Rank 0 prints
``== case NAME`` before each fit and appends its result as a JSON line to ``DIR/result.jsonl``; the parity section
also saves the final whole parameters to ``DIR/<case>.pt``. Sections:

- ``parity``: the tiny tied-embedding GPT (``ddp_plugin.testing.gpt``), AdamW, ``steps`` steps with the same
  global batch every step (data-parallel rank r of D reads samples r, r + D, ...). Cases: ``ddp`` and
  ``ddp:16-mixed`` (Lightning's own ``DDPStrategy``, the references), and ``hierarchical_zero`` with one feature:
  ``default``, ``fp16``, ``bf16``, ``int8``, ``topk``, ``powersgd`` (``compression=``), ``zero1``-``zero3``,
  ``tp2`` (``tensor_parallel_size=2``), ``pp2`` (``pipeline_parallel_size=2``), ``16-mixed`` (the precision).
  Result: every step's loss over the global batch, whether the data-parallel replicas hold the same bits.
- ``overlap``: an MLP trained with ``accumulate_grad_batches=2``: every backward timed (CUDA events on a GPU,
  ``perf_counter`` on a CPU), the first micro-batch of each step without a gradient sync, the second with it.
  Cases ``ddp`` and ``ours``; ours also reports the strategy's ``metric_means`` (``comm/hidden_share`` ...).
- ``kill``: ``hierarchical_zero`` with ``timeout`` seconds; rank ``fault_rank`` writes ``DIR/fault`` (the time)
  and kills itself with SIGKILL at the start of step ``fault_step``; every survivor prints
  ``rank R exits after S s (at T): Error: message`` (``ddp_plugin.testing.callbacks.ExitReport``).
"""

from __future__ import annotations

import os
import time

import harness

PARITY_FLAGS: dict[str, dict] = {
    "default": {},
    "fp16": {"compression": "fp16"},
    "bf16": {"compression": "bf16"},
    "int8": {"compression": "int8"},
    "topk": {"compression": "topk"},
    "powersgd": {"compression": "powersgd"},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3, "auto_wrap_policy": ["Block"]},  # a unit per transformer block
    "zero3_offload_cpu": {"zero_stage": 3, "auto_wrap_policy": ["Block"], "offload": "cpu"},  # pinned host state
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "16-mixed": {},
}
"""``hierarchical_zero``'s flags per parity case (the ``ddp`` cases are Lightning's own strategy)."""

REFERENCE = {"16-mixed": "ddp:16-mixed"}
"""The reference each parity case is compared with (``ddp`` where not listed)."""

CLIP = 0.3  # gradient clipping by the global norm, which binds on most steps (as in tests/workers/tp_run.py)
SAMPLES_PER_RANK = 4  # a ddp rank's batch; the global batch is this times the number of ranks
GPT = {"layers": 4}  # ddp_plugin.testing.gpt.GPTModule: vocabulary 32, width 16, 2 heads, 4 blocks, 8 tokens


def main() -> None:
    spec = harness.spec_parser(__doc__)
    out = spec["out"]
    # Written before the imports (seconds): the driver can end this rank from its first moment.
    harness.write_pid(out)

    import torch

    from ddp_plugin.testing.processes import run_cases

    if spec["accelerator"] == "cpu":
        torch.set_num_threads(1)
    run = {"parity": parity, "overlap": overlap, "kill": kill}[spec["section"]]
    run_cases(spec["cases"], lambda case: run(case, spec), os.path.join(out, "result.jsonl"))


# ---------------------------------------------------------------------------------------------- shared


def _precision(case: str, accelerator: str) -> tuple[str | None, list]:
    """``Trainer(precision=..., plugins=...)`` for a case: fp16 with a loss scaler for the ``16-mixed`` cases (on a
    CPU Lightning's ``MixedPrecision`` with torch's CPU ``GradScaler``, the same path as CUDA's scaler)."""
    if not case.endswith("16-mixed"):
        return "32-true", []
    if accelerator != "cpu":
        return "16-mixed", []
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    return None, [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]


def _trainer(spec: dict, strategy, steps: int, callbacks: list, case: str = "", **kwargs):
    import lightning as L

    precision, plugins = _precision(case, spec["accelerator"])
    return L.Trainer(
        accelerator=spec["accelerator"], devices=spec["devices"], strategy=strategy, max_steps=steps,
        max_epochs=-1, callbacks=callbacks, plugins=plugins, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False, **({"precision": precision} if precision else {}), **kwargs,
    )


def _gpt_data(trainer, devices: int, steps: int):
    """One global batch of ``SAMPLES_PER_RANK`` x ``devices`` token windows, trained on at each of ``steps`` steps
    (so the loss falls fast and smoothly, and loss curves can be compared step by step), data-parallel rank r of D
    reading samples r, r + D, ... of it: every layout sees the same global batch."""
    import lightning as L
    from torch.utils.data import TensorDataset

    from ddp_plugin.testing.data import rank_loader
    from ddp_plugin.testing.gpt import token_dataset

    global_batch = SAMPLES_PER_RANK * devices

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            kwargs = trainer.strategy.distributed_sampler_kwargs  # data-parallel ranks (D = world / (T x P))
            x, y = token_dataset(global_batch, seed=0).tensors
            data = TensorDataset(x.repeat(steps, 1), y.repeat(steps, 1))  # the same global batch at every step
            return rank_loader(data, global_batch, kwargs["num_replicas"], kwargs["rank"])

    return Data()


def _is_ours(strategy) -> bool:
    from ddp_plugin import HierarchicalZeroStrategy

    return isinstance(strategy, HierarchicalZeroStrategy)


# ---------------------------------------------------------------------------------------------- parity


def parity(case: str, spec: dict) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.gpt import GPTModule
    from ddp_plugin.testing.ranks import identical_on_all_ranks, replicas_identical

    steps = spec["steps"]
    class Record(L.Callback):
        """Every step's loss; at the end of training (collectives, on every rank, with the model still on its
        device): the loss over the global batch per step, whether the data-parallel replicas are identical, and
        the whole parameters (``strategy.lightning_module_state_dict()``: gathered over tensor-parallel ranks,
        pipeline stages and ZeRO shards)."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.result: dict = {}
            self.state: dict = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, pl_module) -> None:
            strategy = trainer.strategy
            # Each rank's loss is its data-parallel rank's batch's (every tensor-parallel rank and pipeline stage of
            # it reports the same): the mean over all ranks is the loss over the global batch.
            losses = torch.tensor(self.losses, dtype=torch.float64, device=pl_module.device)
            dist.all_reduce(losses)
            losses /= dist.get_world_size()
            identical = (replicas_identical(strategy, pl_module) if _is_ours(strategy)
                         else identical_on_all_ranks(strategy, pl_module))
            state = strategy.lightning_module_state_dict()
            self.state = {k: v.detach().float().cpu().clone() for k, v in state.items() if torch.is_tensor(v)}
            self.result = {"losses": losses.tolist(), "replicas_identical": bool(identical)}

    L.seed_everything(1234, verbose=False)
    model = GPTModule(**GPT)
    if case.startswith("ddp"):
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy()
    else:
        # Small buckets: several buckets per step, launched in order while backward runs.
        strategy = HierarchicalZeroStrategy(bucket_size_mb=1 / 256, **PARITY_FLAGS[case])
    record = Record()
    trainer = _trainer(spec, strategy, steps, [record], case, gradient_clip_val=CLIP)
    started = time.perf_counter()
    trainer.fit(model, datamodule=_gpt_data(trainer, spec["devices"], steps))
    seconds = time.perf_counter() - started
    result = {"case": case, "seconds": seconds, "steps": trainer.global_step, **record.result,
              "backend": dist.get_backend() if dist.is_initialized() else None,
              "device": str(trainer.strategy.root_device)}
    if trainer.is_global_zero:
        torch.save(record.state, os.path.join(spec["out"], f"{case}.pt"))
    return result


# ---------------------------------------------------------------------------------------------- overlap


def overlap(case: str, spec: dict) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.models import TinyModule, mlp

    accumulate, warmup, steps = 2, spec["warmup"], spec["steps"]
    gpu = spec["accelerator"] != "cpu"

    class BackwardTimer(L.Callback):
        """Every backward's time: from ``on_before_backward`` to ``on_after_backward`` (the strategy's gradient
        sync, where the micro-batch synchronizes, ends inside it). CUDA events on a GPU, read once the batch is
        done; ``perf_counter`` on a CPU."""

        def __init__(self) -> None:
            self.synced: list[float] = []
            self.unsynced: list[float] = []
            self._start = self._end = None

        def _now(self):
            if gpu:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                return event
            return time.perf_counter()

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._start = self._now()

        def on_after_backward(self, trainer, pl_module) -> None:
            self._end = self._now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if gpu:
                torch.cuda.synchronize()
                seconds = self._start.elapsed_time(self._end) / 1e3
            else:
                seconds = self._end - self._start
            if batch_idx >= warmup * accumulate:
                (self.synced if batch_idx % accumulate == accumulate - 1 else self.unsynced).append(seconds)

    hidden, layers = spec["hidden"], spec["layers"]
    L.seed_everything(0, verbose=False)
    model = TinyModule(mlp(64, hidden, 10, layers=layers), loss="cross_entropy", optimizer="sgd", lr=1e-3)
    n = (warmup + steps) * accumulate * 16
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)),
                        batch_size=16)
    strategy = DDPStrategy() if case == "ddp" else HierarchicalZeroStrategy()
    timer = BackwardTimer()
    trainer = _trainer(spec, strategy, warmup + steps, [timer], accumulate_grad_batches=accumulate)
    trainer.fit(model, loader)
    params = sum(p.numel() for p in model.parameters())
    return {"case": case, "synced_s": timer.synced, "unsynced_s": timer.unsynced, "params": params,
            "grad_MB": params * 4 / 1e6, "metrics": dict(getattr(trainer.strategy, "metric_means", {}) or {}),
            "backend": dist.get_backend() if dist.is_initialized() else None}


# ---------------------------------------------------------------------------------------------- kill


def kill(case: str, spec: dict) -> dict:
    import lightning as L
    import torch.distributed as dist

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.callbacks import ExitReport
    from ddp_plugin.testing.gpt import GPTModule
    from ddp_plugin.testing.processes import inject_fault

    out, fault_rank, fault_step = spec["out"], spec["fault_rank"], spec["fault_step"]
    steps = fault_step + 20

    class KillAt(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_rank == fault_rank and trainer.global_step == fault_step:
                with open(os.path.join(out, "fault"), "w") as f:
                    f.write(f"{time.time()}\nsigkill rank {fault_rank} at step {fault_step}\n")
                inject_fault("sigkill")

    L.seed_everything(1234, verbose=False)
    model = GPTModule(**GPT)
    report = ExitReport()
    trainer = _trainer(spec, HierarchicalZeroStrategy(timeout=spec["timeout"]), steps, [KillAt(), report])
    try:
        trainer.fit(model, datamodule=_gpt_data(trainer, spec["devices"], steps))
    except BaseException as err:
        report.report(trainer.global_rank, err)  # (a failure outside the Trainer's own handling)
        raise
    return {"case": case, "finished": True, "steps": trainer.global_step,
            "backend": dist.get_backend() if dist.is_initialized() else None}


if __name__ == "__main__":
    main()
