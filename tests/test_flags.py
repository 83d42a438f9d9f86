"""C6: a bad flag fails at construction with a message naming the flag and the allowed values; the string names
are registered with Lightning."""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest

import ddp_plugin
from ddp_plugin import HierarchicalZeroStrategy


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"zero_stage": 4}, r"`zero_stage=4`.*allowed values: 0, 1, 2, 3"),
        ({"zero_stage": "2"}, r"`zero_stage='2'`.*allowed values: 0, 1, 2, 3"),
        ({"zero_stage": True}, r"`zero_stage=True`"),
        ({"devices_per_node": 0}, r"`devices_per_node=0`.*positive integer"),
        ({"devices_per_node": 1.5}, r"`devices_per_node=1.5`"),
        ({"compression": "zstd"}, r"`compression='zstd'`.*allowed values: None"),
        ({"compression_options": [1]}, r"`compression_options` must be a dict"),
        ({"bucket_size_mb": 0}, r"`bucket_size_mb=0` must be a positive number"),
        ({"bucket_size_mb": "25"}, r"`bucket_size_mb='25'`"),
        ({"process_group_backend": "tcp"}, r"`process_group_backend='tcp'`.*'gloo', 'nccl', 'mpi'"),
        ({"timeout": -1}, r"`timeout=-1`.*positive number of seconds"),
        ({"start_method": "thread"}, r"`start_method='thread'`.*'popen', 'spawn', 'fork', 'forkserver'"),
        ({"shard_scope": "rack"}, r"`shard_scope='rack'`.*allowed values: 'global', 'node'"),
        ({"zero_stage": 3, "auto_wrap_policy": 0}, r"`auto_wrap_policy=0` must be a positive parameter count"),
        ({"zero_stage": 3, "auto_wrap_policy": [3.5]}, r"`auto_wrap_policy=\[3.5\]`.*allowed values: None"),
        ({"gradient_clip_norm": -1.0}, r"`gradient_clip_norm=-1.0` must be a positive number"),
        ({"checkpoint": "dcp"}, r"`checkpoint='dcp'`.*allowed values: 'master', 'sharded'"),
        ({"release_cpu_memory": 1}, r"`release_cpu_memory=1`.*allowed values: None, True, False"),
    ],
)
def test_bad_flag_fails_at_construction_naming_flag_and_allowed_values(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HierarchicalZeroStrategy(**kwargs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_names_select_the_sharder(stage):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=f"hierarchical_zero_stage_{stage}", logger=False)
    assert trainer.strategy.zero_stage == stage
    assert trainer.strategy.shard_scope == "global"


def test_mpi_backend_without_torch_mpi_support_is_refused(monkeypatch):
    monkeypatch.setattr("torch.distributed.is_mpi_available", lambda: False)
    with pytest.raises(ValueError, match=r"`process_group_backend='mpi'` needs a torch build with MPI"):
        HierarchicalZeroStrategy(process_group_backend="mpi")


def test_timeout_accepts_seconds():
    assert HierarchicalZeroStrategy(timeout=90)._timeout == timedelta(seconds=90)


def test_string_name_selects_the_strategy():
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="hierarchical_zero", logger=False)
    assert isinstance(trainer.strategy, HierarchicalZeroStrategy)
    assert trainer.strategy.zero_stage == 0
    assert trainer.strategy.num_processes == 4
    spawn = L.Trainer(accelerator="cpu", devices=2, strategy="hierarchical_zero_spawn", logger=False)
    assert spawn.strategy._start_method == "spawn"


def test_plugin_authors_import_the_marker_from_the_package():
    from ddp_plugin.hookspecs import hookimpl

    assert ddp_plugin.hookimpl is hookimpl


def test_devices_per_node_that_does_not_divide_the_world_fails_before_launch():
    with pytest.raises(ValueError, match=r"`devices_per_node=3` does not divide the world size 4.*1, 2, 4"):
        L.Trainer(accelerator="cpu", devices=4, strategy=HierarchicalZeroStrategy(devices_per_node=3), logger=False)
