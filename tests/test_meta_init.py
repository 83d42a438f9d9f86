"""Lightning's big-model recipe, ``trainer.init_module(empty_init=True)``: the model is built on the meta device
and each rank materializes and initializes what it holds in ``setup`` (ddp_plugin.parallel.materialize), on every layout.
Before, the recipe trained from uninitialized memory (the Lightning default of plain ``torch.empty``), on every
rank alike and without a word.

The layouts run in one launch of 4 CPU ranks (tests/workers/meta_init_run.py); ``materialize`` itself is tested
in this process.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.parallel.materialize import has_meta_tensors, materialize
from ddp_plugin.runtime.storage import unallocated
from ddp_plugin.testing import heap
from tests.support import WORKERS, run_python
from tests.workers.meta_init_run import CONVERGED, DEVICES, LAYOUTS, ONE_DEVICE, RESUMED

STEPS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta") / "result.jsonl"
    run_python(WORKERS / "meta_init_run.py", "--out", out, "--steps", str(STEPS), timeout=1200)
    return {r["case"]: r["ranks"] for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_the_recipe_builds_on_meta_and_every_rank_starts_initialized(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["built_on"] == "meta", (rank, r["built_on"])
        assert not r["meta_left"] and r["devices"] == ["cpu"], (rank, r)
        assert r["finite"], rank
        # reset_parameters() of every LayerNorm this rank holds; the model's init_weights() for the embeddings.
        assert r["norms"] > 0 and r["norms_reset"], (rank, r["norms"])
        if r["tok_std"] is not None:
            assert 0.015 < r["tok_std"] < 0.025, (rank, r["tok_std"])
        if r["tied"] is not None:
            assert r["tied"], rank  # the head is still the embedding's parameter
        assert r["replicas_identical"], rank


@pytest.mark.parametrize("case", ["tp2_dp2", "pp2_tp2", "tp2_dp2_zero3", "pp2_tp2_time"])
def test_what_the_tensor_parallel_ranks_replicate_starts_equal_on_each(runs, case):
    # A row-wise layer's bias is a DTensor replicated over the tensor-parallel group: each rank adds it to the
    # reduced output, so it must hold the same values on every rank of the group. Each rank initializes with its
    # own seed, and the group's ranks (0 and 1, 2 and 3 in both layouts) drew different biases before.
    ranks = runs[case]
    for group in ((0, 1), (2, 3)):
        first, second = (ranks[r]["replicated"] for r in group)
        assert first and first.keys() == second.keys(), group
        assert first == second, {n: (first[n], second[n]) for n in first if first[n] != second[n]}


def test_the_split_by_time_times_the_meta_built_tensor_parallel_blocks_and_every_rank_cuts_the_same_stages(runs):
    # Each block (its tensor-parallel shards: the timing's collectives over the group) materialized alone and
    # timed; the fastest rank's times, so one split everywhere.
    splits = [r["split"] for r in runs["pp2_tp2_time"]]
    assert splits[0] is not None and splits == [splits[0]] * 4, splits


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_the_meta_built_model_trains(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["steps"] == STEPS and r["finite_losses"], (rank, r)
    losses = runs[case][-1]["losses"]  # (the last rank holds the last pipeline stage: the loss is computed there)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_zero_stage_3_allocates_and_initializes_unit_by_unit(runs, case):
    # At ZeRO stage 3 the sharder allocates and initializes each unit's parameters (here the tiny GPT is one unit,
    # the root's; tests below measure a model of 9). With pipeline stages holding a tied copy, the stage is
    # materialized whole, then sharded; other stages materialize what they hold, as before.
    flags = LAYOUTS[case]
    by_unit = flags.get("zero_stage") == 3 and flags.get("pipeline_parallel_size", 1) == 1
    for rank, r in enumerate(runs[case]):
        assert (r["units_initialized"] > 0) is by_unit, (rank, r["units_initialized"])


@pytest.mark.skipif(heap.compiler() is None, reason="the heap tracker is compiled with cc or gcc")
@pytest.mark.parametrize("flags", [{}, {"tensor_parallel_size": 2, "devices_per_node": 2}], ids=["dp4", "tp2_dp2"])
def test_zero_stage_3_setup_never_holds_the_whole_model(tmp_path, heap_env, flags):
    # A GPT of 24 MB built on meta, ZeRO-3 over 4 ranks (units: its blocks): the heap a rank holds at most from
    # `trainer.fit` to the first batch (materialized, sharded, optimizer made). Before, each rank materialized
    # the whole model, then sharded it, with the gradient buckets beside it: 53.5 MB (2.2x the model). Now a
    # rank holds its quarter, one unit whole at a time, and a bucket: 13.5 MB (dp4), 10.8 MB (tp2_dp2).
    out = tmp_path / "zero3.json"
    run_python(WORKERS / "zero3_setup_run.py", "--out", out,
               "--flags", json.dumps({"zero_stage": 3, "auto_wrap_policy": ["Block"], **flags}), env=heap_env,
               timeout=600)
    for rank, r in enumerate(json.loads(out.read_text())):
        assert r["steps"] == 2 and r["finite"] and r["replicas_identical"], (rank, r)
        assert r["units_initialized"] == 9, (rank, r)  # 8 blocks and the root unit
        assert r["held"] < 0.3 * r["whole"], (rank, r)
        assert r["setup_peak"] < 0.75 * r["whole"], (rank, r["setup_peak"], r["whole"])


@pytest.mark.parametrize("case", CONVERGED)
def test_the_meta_built_model_trains_to_the_loss_of_the_eagerly_built_one(runs, case):
    # Same layout, data and seed, 32 steps: the initial values differ (each rank draws its own shards on meta), the
    # loss reached should not. Measured: P 2 x T 2 2.86 (meta) against 3.02 (eager), mean of the last 8 steps from
    # 3.49 (2.61 and 2.79 over 48 steps); at ZeRO-3 over 2 x 2 the tiny GPT is one unit, drawn in the eager order:
    # the same losses.
    last = runs[case][-1]  # (the last rank holds the last pipeline stage: the loss is computed there)
    meta, eager = (sum(losses[-8:]) / 8 for losses in (last["losses"], last["eager_losses"]))
    first = sum(last["eager_losses"][:4]) / 4
    assert meta < first - 0.3 and eager < first - 0.3, (meta, eager, first)
    assert abs(meta - eager) < 0.1 * eager, (meta, eager)


@pytest.mark.parametrize("case", RESUMED)
def test_a_checkpoint_loaded_into_a_meta_built_model_is_what_training_starts_from(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["built_on"] == "meta" and r["resumed_equal_to_saved"], rank
        assert r["steps"] == STEPS and r["finite_losses"], (rank, r)
        # A consolidated file is memory-mapped where no rank holds the whole model (each reads its part's pages),
        # read as usual where every rank holds it.
        assert r["mapped"] is (case == "resume:pp2_tp2"), (rank, r["mapped"])


@pytest.mark.parametrize("case", [c for c, flags in LAYOUTS.items() if flags.get("tensor_parallel_size", 1) > 1])
def test_tensor_parallel_shards_start_different(runs, case):
    # On CPU, DTensor's random ops draw each shard from the local generator: without a seed per rank every shard
    # of a matrix would start equal (heads and MLP halves identical), a symmetry training never breaks.
    by_position: dict[int, list[float]] = {}
    for r in runs[case]:
        by_position.setdefault(r["tp_rank"], r["q_local"])
    assert len(by_position) == 2 and by_position[0] != by_position[1]


# ---------------------------------------------------------------------- one rank, on CPU and on a GPU (NCCL)


@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("gpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def one_device(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "result.jsonl"
    run_python(WORKERS / "meta_init_run.py", "--out", out, "--steps", str(STEPS), "--accelerator", request.param,
               "--cases", ",".join([*ONE_DEVICE, "resume:one_zero3"]), timeout=900)
    runs = {r["case"]: r["ranks"][0] for r in map(json.loads, out.read_text().splitlines())}
    return DEVICES[request.param], runs


@pytest.mark.parametrize("case", list(ONE_DEVICE))
def test_one_rank_materializes_and_initializes_the_meta_built_model_on_its_device(one_device, case):
    # The one-GPU layout over NCCL: the model is allocated on the device (unit by unit at ZeRO-3), initialized by
    # its own initializers there (the device's generator), and trains.
    device, runs = one_device
    r = runs[case]
    assert r["built_on"] == "meta" and not r["meta_left"] and r["devices"] == [device], r
    assert r["finite"] and r["norms"] > 0 and r["norms_reset"] and r["tied"], r
    assert 0.015 < r["tok_std"] < 0.025, r["tok_std"]
    assert (r["units_initialized"] > 0) is (ONE_DEVICE[case].get("zero_stage") == 3), r["units_initialized"]
    assert r["steps"] == STEPS and r["finite_losses"] and r["losses"][-1] < r["losses"][0], r["losses"]


def test_one_rank_resumes_a_checkpoint_into_a_meta_built_model_on_its_device(one_device):
    device, runs = one_device
    r = runs["resume:one_zero3"]
    assert r["built_on"] == "meta" and r["devices"] == [device] and r["resumed_equal_to_saved"], r
    assert r["steps"] == STEPS and r["finite_losses"], r


# ---------------------------------------------------------------------- materialize, in this process


class Scale(nn.Module):
    """A module with a parameter and no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))


def test_materialize_keeps_ties_and_references_and_initializes_each_module():
    with torch.device("meta"):
        emb, head, norm = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.BatchNorm1d(3)
        head.weight = emb.weight
        model = nn.Sequential(emb, norm, head)
    held = emb.weight
    materialize(model, torch.device("cpu"))
    assert not has_meta_tensors(model)
    assert head.weight is emb.weight is held  # one parameter, the same object
    assert torch.equal(norm.weight, torch.ones(3)) and torch.equal(norm.running_var, torch.ones(3))
    assert isinstance(held, nn.Parameter) and held.requires_grad and torch.isfinite(held).all()


def test_materialize_leaves_tensors_that_were_built_for_real_alone():
    real = nn.Linear(2, 2)
    before = real.weight.detach().clone()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    model.append(real)
    materialize(model, torch.device("cpu"))
    assert torch.equal(real.weight, before) and not has_meta_tensors(model)


def test_init_weights_initializes_its_whole_subtree():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = Scale()  # no reset_parameters: covered by the model's init_weights

        def init_weights(self) -> None:
            nn.init.constant_(self.scale.gain, 2.0)

    with torch.device("meta"):
        model = Model()
    materialize(model, torch.device("cpu"))
    assert torch.equal(model.scale.gain, torch.full((3,), 2.0))


def test_a_module_that_cannot_be_initialized_is_named_before_anything_is_allocated():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), Scale())
    with pytest.raises(TypeError, match=r"`1` \(Scale\) cannot be initialized.*reset_parameters\(\).*init_weights"):
        materialize(model, torch.device("cpu"))
    assert has_meta_tensors(model[0])


def test_init_module_is_lightnings_without_empty_init_and_the_meta_device_with_it():
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HierarchicalZeroStrategy(), logger=False)
    torch.manual_seed(0)
    with trainer.init_module():
        eager = nn.Linear(2, 2)
    with trainer.init_module(empty_init=True):
        lazy = nn.Linear(2, 2)
    torch.manual_seed(0)
    assert eager.weight.device.type == "cpu" and torch.equal(eager.weight, nn.Linear(2, 2).weight)
    assert lazy.weight.is_meta


def test_deferred_parameters_are_initialized_group_by_group_and_nothing_else_is_touched():
    # What ZeRO stage 3 does with a model built on meta: the trainable parameters get no memory at first; each
    # unit's get it (here: a NaN-filled flat buffer) and are initialized, while what is initialized already
    # (a frozen layer, earlier units, a buffer) keeps its values exactly.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2), nn.BatchNorm1d(2))
    model[2].weight.requires_grad_(False)
    init = materialize(model, torch.device("cpu"), deferred=[p for p in model.parameters() if p.requires_grad])
    assert init is not None and not has_meta_tensors(model)
    assert [unallocated(p) for p in model.parameters()] == [True, True, True, True, False, True, True, True]
    frozen, done = model[2].weight.clone(), []
    for group in ([model[0].weight, model[0].bias], [model[1].weight, model[1].bias],
                  [model[2].bias, model[3].weight, model[3].bias]):
        flat = torch.full((sum(p.numel() for p in group),), float("nan"))
        at = 0
        for p in group:
            p.data = flat[at : at + p.numel()].view_as(p)
            at += p.numel()
        before = [p.clone() for p in done]
        assert init.on_initialize_parameters(group) is True
        assert torch.isfinite(flat).all()
        assert all(torch.equal(a, p) for a, p in zip(before, done))
        done += group
    assert torch.equal(model[2].weight, frozen) and init.groups == 3
    assert torch.equal(model[1].weight, torch.ones(4)) and torch.equal(model[3].running_var, torch.ones(2))
    assert model[0].weight.std() > 0  # (reset_parameters' draws, not a constant)
