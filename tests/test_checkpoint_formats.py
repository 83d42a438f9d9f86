"""Checkpoints written by earlier versions of this library still load.

``tests/data/sharded_v1`` holds two ``checkpoint="sharded"`` checkpoints written in layout 1 (before the layout
had a version: tensor-parallel blocks under keys of this library's own, ``<name>@<dim>:<offset>``; ZeRO pieces of
them ``...#<start>``), by ``tests/workers/tp_run.py`` at step 10 of the tiny GPT split over TP 2 x DP 2 (stage 0 and
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
    # (the schedule the checkpoints were written with: 20 steps in epochs of 5, not tp_run's default)
    schedule = ["--steps", "20", "--epoch", "5"]
    tp2 = ["--out", out, "--devices", "4", "--devices-per-node", "2", "--tp", "2", *schedule]
    run_python(WORKERS / "tp_run.py", *runs_argument([
        # the same layout and stage, and the stage-3 checkpoint into stage 2
        # (saving at step 15 in today's layout)
        [*tp2, "--variants", "0:vocab", '--flags={"checkpoint": "sharded"}', "--save-at", "15",
         "--resume", out / "0-vocab-sharded-step10.ckpt", "--tag=-v1"],
        [*tp2, "--variants", "2:vocab", '--flags={"checkpoint": "sharded"}',
         "--resume", out / "3-vocab-sharded-step10.ckpt", "--tag=-v1"],
    ]), timeout=600)
    # and into the unsplit model on plain data parallelism (every block read and put together)
    run_python(WORKERS / "tp_run.py", "--out", out, "--devices", "2", "--tp", "1", "--variants", "0:vocab",
               "--resume", out / "3-vocab-sharded-step10.ckpt", "--tag=-tp1-v1", *schedule)
    found = {tag: torch.load(out / f"{tag}.pt") for tag in ("0-vocab-v1", "2-vocab-v1", "0-vocab-tp1-v1")}
    return {**found, "v2": out / "0-vocab-v1-step15.ckpt"}


@pytest.mark.parametrize(("tag", "written_by"), [
    ("0-vocab-v1", "0-vocab"), ("2-vocab-v1", "3-vocab"), ("0-vocab-tp1-v1", "3-vocab")])
def test_a_sharded_tensor_parallel_checkpoint_of_the_first_layout_resumes(resumed, tag, written_by):
    uninterrupted = torch.load(V1 / f"{written_by}-step20.pt")["params"]
    assert relative_difference(resumed[tag]["params"], uninterrupted) <= RTOL
    assert resumed[tag]["max_replica_diff"] == 0.0


@pytest.mark.parametrize("variant", ["0-vocab", "3-vocab"])
def test_a_sharded_checkpoint_of_the_first_layout_consolidates_into_the_unsplit_model(variant, tmp_path):
    from ddp_plugin.checkpoints.sharded_checkpoint import consolidate
    from ddp_plugin.testing.gpt import GPTModule

    consolidate(V1 / f"{variant}-sharded-step10.ckpt", tmp_path / "whole.ckpt")
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=False)
    GPTModule(tie="vocab").load_state_dict(whole["state_dict"], strict=True)
    shapes = {name: tuple(p.shape) for name, p in GPTModule(tie="vocab").named_parameters()}
    state = whole["optimizer_states"][0]["state"]
    assert len(state) == len(shapes)
    assert all(tuple(entries["exp_avg"].shape) in shapes.values() for entries in state.values())


def test_todays_layout_stores_tensor_parallel_shards_as_dcp_stores_dtensors(resumed, tmp_path):
    """Layout 2: no key of this library's own for a DTensor; DCP's metadata holds each split tensor's two shards
    (T 2) with the whole shape, and DCP alone reads the whole tensor, equal to what consolidating gives."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ddp_plugin.checkpoints.sharded_checkpoint import FORMAT, FORMAT_KEY, consolidate
    from ddp_plugin.testing.gpt import GPTModule, tensor_parallel_plan
    from torch.distributed.tensor.parallel import ColwiseParallel

    meta = torch.load(resumed["v2"] / "meta.pt", weights_only=False)
    assert meta[FORMAT_KEY] == FORMAT == 2
    stored = FileSystemReader(str(resumed["v2"])).read_metadata().state_dict_metadata
    assert not [key for key in stored if "@" in key or "#" in key]
    split = {key: md for key, md in stored.items() if isinstance(md, TensorStorageMetadata) and len(md.chunks) > 1}
    model = GPTModule(tie="vocab").model
    plan = tensor_parallel_plan(model, "vocab")  # every planned module's weight, a column split's bias too
    expected = {f"model.{name}.weight" for name in plan} | {
        f"model.{name}.bias" for name, style in plan.items()
        if isinstance(style, ColwiseParallel) and model.get_submodule(name).bias is not None}
    assert {key.removeprefix("model/") for key in split if key.startswith("model/")} == expected
    assert all(len(md.chunks) == 2 for md in split.values())
    consolidate(resumed["v2"], tmp_path / "whole.ckpt")
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=False)["state_dict"]
    for key, md in split.items():
        if key.startswith("model/"):
            read = {key: torch.empty(md.size, dtype=md.properties.dtype)}
            dcp.load(read, checkpoint_id=str(resumed["v2"]), no_dist=True)
            assert torch.equal(read[key], whole[key.removeprefix("model/")]), key


def test_a_layout_newer_than_this_version_reads_is_refused_naming_both(tmp_path):
    from ddp_plugin.checkpoints.sharded_checkpoint import FORMAT, FORMAT_KEY, load

    newer = tmp_path / "newer.ckpt"
    shutil.copytree(V1 / "0-vocab-sharded-step10.ckpt", newer)
    meta = torch.load(newer / "meta.pt", weights_only=False)
    torch.save({**meta, FORMAT_KEY: FORMAT + 1}, newer / "meta.pt")
    with pytest.raises(ValueError, match=rf"layout {FORMAT + 1}, written by a newer ddp_plugin; .* up to {FORMAT}"):
        load(newer)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_a_stored_dtensor_is_read_into_this_ranks_part_on_its_device(device, tmp_path):
    """DCP reads a stored shard into the DTensor's local tensor on the mesh's device (``from_local`` moves a CPU
    tensor there: the part read is the DTensor's own), on gloo/CPU and on NCCL/CUDA."""
    run_python(WORKERS / "stored_read.py", tmp_path, device)
    result = torch.load(tmp_path / "result.pt")
    assert result["stored"] == ["StoredTensor", "StoredTensor"] and result["dtensors"] == [True, True]
    expected = "cuda:0" if device == "cuda" else "cpu"
    assert result["devices"] == [expected, expected]
    assert result["w_equal"] and result["b_equal"]
