"""A script that keeps its trainer in a global, as most training scripts do, and reports at the very end of
interpreter exit (the first atexit handler runs last) which gloo threads are still alive. Threads alive then are
torn down during finalization, where a process can abort after a successful run.

    python tests/workers/exit_threads.py STAGE
"""

from __future__ import annotations

import atexit
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.models import TinyModule, mlp
from ddp_plugin.testing.processes import print_line


def report() -> None:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    gloo = sorted(n for n in names if "gloo" in n or "tcpstore" in n)
    print_line(f"rank {os.environ.get('LOCAL_RANK', '0')} threads at exit: {gloo}")  # one write: ranks share the pipe


atexit.register(report)


torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HierarchicalZeroStrategy(zero_stage=int(sys.argv[1])),
                    max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(TinyModule(mlp(8, 8, 1, layers=0, activation=nn.Tanh), optimizer="adamw", lr=0.01), data)
