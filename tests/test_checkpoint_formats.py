"""Checkpoints written by earlier versions of this library still load.

``tests/data/sharded_v1`` holds two ``checkpoint="sharded"`` checkpoints written by the 0.1.0 layout (tensor-
parallel blocks under keys of this library's own, ``<name>@<dim>:<offset>``; ZeRO pieces of them
``...#<start>``), by ``tests/workers/tp_run.py`` at step 10 of the tiny GPT split over TP 2 x DP 2 (stage 0 and
stage 3, tie ``vocab``), beside the parameters that same run had at step 20 (``<variant>-step20.pt``). Resumed
from them, the run ends where the uninterrupted run that wrote them ended.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ddp_plugin.testing.processes import runs_argument
from tests.support import WORKERS, relative_difference, run_python

V1 = Path(__file__).parent / "data" / "sharded_v1"
RTOL = 3e-4  # as in test_tensor_parallel: rounding inside the split layers over 10 Adam steps


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("from-v1")
    for name in ("0-vocab-sharded-step10.ckpt", "3-vocab-sharded-step10.ckpt"):
        shutil.copytree(V1 / name, out / name)  # (read only, but a copy keeps the repository's untouched)
    tp2 = ["--out", out, "--devices", "4", "--devices-per-node", "2", "--tp", "2"]
    run_python(WORKERS / "tp_run.py", *runs_argument([
        # the same layout and stage, and the stage-3 checkpoint into stage 2
        [*tp2, "--variants", "0:vocab", "--resume", out / "0-vocab-sharded-step10.ckpt", "--tag=-v1"],
        [*tp2, "--variants", "2:vocab", '--flags={"checkpoint": "sharded"}',
         "--resume", out / "3-vocab-sharded-step10.ckpt", "--tag=-v1"],
    ]), timeout=600)
    # and into the unsplit model on plain data parallelism (every block read and put together)
    run_python(WORKERS / "tp_run.py", "--out", out, "--devices", "2", "--tp", "1", "--variants", "0:vocab",
               "--resume", out / "3-vocab-sharded-step10.ckpt", "--tag=-tp1-v1")
    return {tag: torch.load(out / f"{tag}.pt") for tag in ("0-vocab-v1", "2-vocab-v1", "0-vocab-tp1-v1")}


@pytest.mark.parametrize(("tag", "written_by"), [
    ("0-vocab-v1", "0-vocab"), ("2-vocab-v1", "3-vocab"), ("0-vocab-tp1-v1", "3-vocab")])
def test_a_sharded_tensor_parallel_checkpoint_of_the_first_layout_resumes(resumed, tag, written_by):
    uninterrupted = torch.load(V1 / f"{written_by}-step20.pt")["params"]
    assert relative_difference(resumed[tag]["params"], uninterrupted) <= RTOL
    assert resumed[tag]["max_replica_diff"] == 0.0


@pytest.mark.parametrize("variant", ["0-vocab", "3-vocab"])
def test_a_sharded_checkpoint_of_the_first_layout_consolidates_into_the_unsplit_model(variant, tmp_path):
    from ddp_plugin.sharded_checkpoint import consolidate
    from ddp_plugin.testing.gpt import GPTModule

    consolidate(V1 / f"{variant}-sharded-step10.ckpt", tmp_path / "whole.ckpt")
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=False)
    GPTModule(tie="vocab").load_state_dict(whole["state_dict"], strict=True)
    shapes = {name: tuple(p.shape) for name, p in GPTModule(tie="vocab").named_parameters()}
    state = whole["optimizer_states"][0]["state"]
    assert len(state) == len(shapes)
    assert all(tuple(entries["exp_avg"].shape) in shapes.values() for entries in state.values())
