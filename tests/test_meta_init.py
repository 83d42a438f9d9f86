"""Lightning's big-model recipe, ``trainer.init_module(empty_init=True)``: the model is built on the meta device
and each rank materializes and initializes what it holds in ``setup`` (ddp_plugin.materialize), on every layout.
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
from ddp_plugin.materialize import has_meta_tensors, materialize
from tests.support import WORKERS, run_python
from tests.workers.meta_init_run import LAYOUTS, RESUMED

STEPS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta") / "result.jsonl"
    run_python(WORKERS / "meta_init_run.py", "--out", out, "--steps", str(STEPS), timeout=600)
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


@pytest.mark.parametrize("case", ["tp2_dp2", "pp2_tp2"])
def test_what_the_tensor_parallel_ranks_replicate_starts_equal_on_each(runs, case):
    # A row-wise layer's bias is a DTensor replicated over the tensor-parallel group: each rank adds it to the
    # reduced output, so it must hold the same values on every rank of the group. Each rank initializes with its
    # own seed, and the group's ranks (0 and 1, 2 and 3 in both layouts) drew different biases before.
    ranks = runs[case]
    for group in ((0, 1), (2, 3)):
        first, second = (ranks[r]["replicated"] for r in group)
        assert first and first.keys() == second.keys(), group
        assert first == second, {n: (first[n], second[n]) for n in first if first[n] != second[n]}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_the_meta_built_model_trains(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["steps"] == STEPS and r["finite_losses"], (rank, r)
    losses = runs[case][-1]["losses"]  # (the last rank holds the last pipeline stage: the loss is computed there)
    assert losses[-1] < losses[0], losses


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
