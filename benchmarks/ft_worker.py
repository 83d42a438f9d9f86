"""Worker of ``benchmarks/fault_tolerance.py``: one node's training (one rank), on the simulated cluster.

    python benchmarks/ft_worker.py '{"out": DIR, "node": 0, "steps": 200, "sync_every": 1, ...}'

With ``"lighthouse"`` in the spec it is replica group ``node`` of a run on torchft (its own rendezvous); without,
node ``node`` of one torchrun job over every node (today's fail-fast run), which checkpoints every
``ckpt_every`` steps and, with ``"resume"``, resumes from the last one. Every optimizer step appends a JSON line to
``DIR/rec-<node><tag>.jsonl`` (the node's local rank 0): the time, the global step, the loss and the ``ft/``
metrics. ``"devices"`` ranks per node, ``"batch"``, ``"dynamic_steps"``, ``"data_split"``, ``"compression"``,
``"hierarchical"``, ``"sync_fragments"``, ``"max_staleness"``, ``"outer_optimizer"`` and ``"compression_options"``
as the strategy's flags; with ``"group_nodes": G`` (and ``"group"``, ``"groups"``, ``"node_rank"``)
replica group ``group`` spans G nodes, this one its node ``node_rank`` (one Lightning launch over them); with
``"gate"``, every rank writes ``GATE.<node>.<local rank>`` once set up and waits for ``GATE`` before its first step.
With ``"stop_file"``: once that file exists it holds a step, at which the run stops (a step every group reaches, at a
sync: the groups end together however long each was down); ``"save_params"``: at the end, the node's local rank 0
writes the parameters to ``DIR/params-<node><tag>.pt``; ``"timeout"``: the strategy's (30 s). ``"width"``, ``"lr"``, ``"seed"``: the model's.
"""

from __future__ import annotations

import json
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import harness
from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.data import sine_dataset
from ddp_plugin.testing.models import TinyModule


class Record(L.Callback):
    def __init__(self, path: str, sleep: float, gate: str | None, node: int, stop_file: str | None = None,
                 params: str | None = None) -> None:
        self.path, self.file = path, None
        self.sleep = sleep
        self.gate, self.node = gate, node
        self.stop_file, self.stop_at, self.params = stop_file, None, params

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.local_rank == 0:
            self.file = open(self.path, "a")  # noqa: SIM115 - open for the run
        if self.gate:  # every node set up before any steps (a returning node finds the gate open)
            open(f"{self.gate}.{self.node}.{trainer.local_rank}", "w").close()
            while not os.path.exists(self.gate):
                time.sleep(0.02)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.stop_file is not None:
            if self.stop_at is None and os.path.exists(self.stop_file):
                text = open(self.stop_file).read().strip()
                self.stop_at = int(text) if text else None
            if self.stop_at is not None and trainer.global_step >= self.stop_at:
                trainer.should_stop = True
        if self.file is None:  # (the node's other ranks)
            time.sleep(self.sleep)
            return
        session = trainer.strategy.fit.session
        members = session.plugin_manager.get_plugin("replica_groups") if session is not None else None
        ft = members.replicas.metrics() if members is not None else {}
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        self.file.write(json.dumps({"time": time.time(), "global_step": trainer.global_step, "loss": loss, **ft})
                        + "\n")
        self.file.flush()
        time.sleep(self.sleep)  # (the compute of a larger model, so that a step is not only communication)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.params and trainer.local_rank == 0:
            # The global copy too, once the syncs in flight are in: with `max_staleness` each group's own last inner
            # steps are in its parameters, and only the global copy is the same everywhere.
            session = trainer.strategy.fit.session
            sync = session.plugin_manager.get_plugin("outer_sync") if session is not None else None
            outer = {}
            if sync is not None:
                sync.drain()
                outer = {f"outer.{i}": p.outer.detach().clone() for i, p in enumerate(sync.pieces)}
            torch.save({"global_step": trainer.global_step, **outer,
                        **{k: v.detach().clone() for k, v in pl_module.state_dict().items()}}, self.params)


def main() -> None:
    spec = harness.spec_parser(__doc__, positional=True)
    if os.environ.get("FT_WORKER_LOG"):  # (e.g. INFO: the background heal's tries)
        import logging

        logging.basicConfig(level=os.environ["FT_WORKER_LOG"])
    torch.set_num_threads(1)
    torch.manual_seed(spec.get("seed", 0))  # every node starts from the same parameters
    model = TinyModule(harness.ft_net(spec.get("width", 128)), optimizer="adamw",
                       lr=spec.get("lr", 3e-3))
    data = DataLoader(sine_dataset(1 << 16, 8, seed=3), batch_size=spec.get("batch", 32))
    options = {"sync_every": spec["sync_every"], "timeout": spec.get("timeout", 30.0),
               "compression": spec.get("compression"),
               "hierarchical": spec.get("hierarchical"), "sync_fragments": spec.get("sync_fragments", 1),
               "max_staleness": spec.get("max_staleness", 0)}
    for key in ("outer_optimizer", "compression_options"):  # (else the strategy's defaults)
        if spec.get(key) is not None:
            options[key] = spec[key]
    tag = spec.get("tag", "")
    callbacks = [Record(os.path.join(spec["out"], f"rec-{spec['node']}{tag}.jsonl"),
                        spec.get("sleep", 0.05), spec.get("gate"), spec["node"], spec.get("stop_file"),
                        os.path.join(spec["out"], f"params-{spec['node']}{tag}.pt") if spec.get("save_params") else None)]
    ckpt_dir = os.path.join(spec["out"], "ckpt")
    if spec.get("lighthouse"):
        options["fault_tolerance"] = {"replica_group": spec.get("group", spec["node"]),
                                      "replica_groups": spec.get("groups", spec["nodes"]),
                                      # (started by ddp-plugin-group: the address it gives, a relay's with a
                                      # standby lighthouse)
                                      "lighthouse": os.environ.get("TORCHFT_LIGHTHOUSE", spec["lighthouse"]),
                                      "quorum_timeout": spec.get("quorum_timeout", 60.0),
                                      "min_replicas": spec.get("min_replicas", 1),
                                      "background_heal": spec.get("background_heal", True),
                                      "dynamic_steps": spec.get("dynamic_steps", False),
                                      "data_split": spec.get("data_split", "fixed")}
        num_nodes = spec.get("group_nodes", 1)
        os.environ["NODE_RANK"] = str(spec.get("node_rank", 0))
    else:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=spec["ckpt_every"], save_last=True,
                                         save_top_k=0))
        num_nodes = spec["nodes"]
    trainer = L.Trainer(accelerator="cpu", devices=spec.get("devices", 1), num_nodes=num_nodes,
                        strategy=HierarchicalZeroStrategy(**options), max_steps=spec["steps"], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        enable_checkpointing=not spec.get("lighthouse"))
    resume = os.path.join(ckpt_dir, "last.ckpt") if spec.get("resume") else None
    trainer.fit(model, data, ckpt_path=resume if resume and os.path.exists(resume) else None)


if __name__ == "__main__":
    main()
