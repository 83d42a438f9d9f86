"""What differs between the torch versions the project runs on (the pinned one, the newest): each place that
takes one path or the other works without the other's warnings. (.ci/wheel_smoke trains on both.)"""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddp_plugin.testing.ranks import free_port
from ddp_plugin.runtime.topology import set_collective_timeout


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_setting_a_groups_collective_timeout_warns_of_no_deprecated_call(world_of_one):
    # torch 2.15 deprecated distributed_c10d._set_pg_timeout for dist.set_timeout (FutureWarning on every group).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_collective_timeout(world_of_one, timedelta(seconds=42))
    dist.all_reduce(torch.ones(1))  # the group still works
