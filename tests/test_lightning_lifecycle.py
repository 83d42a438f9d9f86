"""The strategy driven the way Lightning's own tests drive strategies (issue 14): Lightning's extension points
stay patchable, a strategy set up by hand leaves nothing running once its process group is gone, and a
``checkpoint_io`` of the user's own gets ordinary tensors through ``torch.save``."""

from __future__ import annotations

import json

import pytest

from tests.support import WORKERS, run_python

WORKER = WORKERS / "lifecycle_run.py"


def run(tmp_path, mode: str, *args: str) -> dict:
    run_python(WORKER, "--mode", mode, "--out", tmp_path, *args)
    return json.loads((tmp_path / f"{mode}.json").read_text())


@pytest.mark.parametrize("weighting", ["rank", "sample"])
def test_strategy_backward_wrapped_in_a_mock_trains_instead_of_recursing(tmp_path, weighting):
    # Lightning's SWA tests: mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward).
    result = run(tmp_path, "patched-backward", "--devices", "2", "--weighting", weighting)
    assert result == {"backward_calls": 4, "global_step": 4}


def test_setup_by_hand_runs_no_collective_before_setup_and_no_heartbeat_after_the_process_group(tmp_path):
    # Lightning's test_ddp_configure_ddp calls setup_environment() and setup() and never teardown().
    result = run(tmp_path, "setup-without-teardown")
    # setup_environment() only creates the process group (its init may be mocked, as in Lightning's
    # test_set_timeout); the ranks-per-node check and the mesh's groups are collectives of setup().
    assert result["collectives"] == ["setup:all_gather_object", "setup:new_group"]
    assert result["heartbeats_during"] == ["ddp_plugin-heartbeat"]
    assert result["heartbeats_after"] == []


def test_user_checkpoint_io_gets_ordinary_tensors_through_torch_save(tmp_path):
    # Stage 2: the sharder's optimizer state is deferred for our own writer; a user's TorchCheckpointIO subclass
    # gets it materialized and writes it with torch.save, as under Lightning's DDP.
    result = run(tmp_path, "user-checkpoint-io", "--devices", "2", "--stage", "2")
    assert result["saves"] == 2
    assert result["torch_save_calls"] == 2
    assert result["tensor_types"] == ["Tensor"]
    assert result["exp_avg_shapes"] == result["param_shapes"]
