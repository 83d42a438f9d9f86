"""ZeRO stages 1-3: C1 and C2 for every stage on 2 ranks (one node), and on 4 ranks (2 simulated nodes x 2) for
every pair of a stage, a shard scope and hierarchical on/off (every combination with ``--full-matrix``), with accumulation, clipping by the global norm, an LR scheduler, a frozen
layer, a tied weight and a branch only some ranks use; bf16-mixed; bad input."""

from __future__ import annotations

import itertools
import json
import os
import re

import pytest
import torch

from ddp_plugin.testing.pairwise import covering_pairs, pairs_covered
from tests.support import WORKERS, matrix, run_python

CONFIGS = ["plain", "everything"]  # "everything": AdamW, accumulation 3, clipping 0.05, StepLR
ATOL = 1e-5  # as at stage 0 (tests/test_equivalence.py); measured: below 2e-7 for every variant
# (label, devices, devices_per_node, variants): within a launch the variants run one after the other.
ONE_NODE = ["1:global:auto", "2:global:auto", "3:global:auto"]  # one node: the scopes coincide, nothing to split
TWO_NODE_FACTORS = {"stage": (1, 2, 3), "scope": ("global", "node"), "hier": ("on", "off")}
ALL_TWO_NODES = [":".join(map(str, row)) for row in itertools.product(*TWO_NODE_FACTORS.values())]
TWO_NODES = matrix([":".join(map(str, row)) for row in covering_pairs(
    TWO_NODE_FACTORS, required=[(1, "global", "on"), (1, "global", "off")])], ALL_TWO_NODES)
"""2 nodes x 2: every pair of a stage, a shard scope and a route in some variant (7 of the 12; each variant trains
both configurations), the route's two values at stage 1 among them; ``pytest --full-matrix`` runs all 12."""
LAUNCHES = [("2 ranks", 2, None, ONE_NODE), ("2 nodes x 2", 4, 2, TWO_NODES)]
CASES = [(label, v) for label, _, _, variants in LAUNCHES for v in variants]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = {}
    ref_dir = tmp_path_factory.mktemp("reference")
    run_python(WORKERS / "equivalence.py", "--out", ref_dir, "--devices", "0", "--configs", ",".join(CONFIGS))
    out["reference"] = {c: torch.load(ref_dir / f"{c}-0.pt") for c in CONFIGS}
    for label, devices, per_node, variants in LAUNCHES:
        d = tmp_path_factory.mktemp(f"zero{devices}")
        args = ["--out", d, "--devices", str(devices), "--configs", ",".join(CONFIGS), "--variants", ",".join(variants)]
        args += ["--devices-per-node", str(per_node)] if per_node else []
        run_python(WORKERS / "equivalence.py", *args, timeout=600)
        for v in variants:
            out[(label, v)] = {c: torch.load(d / f"{c}-{devices}-{v.replace(':', '-')}.pt") for c in CONFIGS}
    return out


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("launch", "variant"), CASES)
def test_c1_gathered_parameters_identical_on_every_rank(results, launch, variant, config):
    run = results[(launch, variant)][config]
    assert run["history"].shape[0] == 20
    assert run["max_rank_diff"] == 0.0


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("launch", "variant"), CASES)
def test_c2_sharded_training_equals_single_process(results, launch, variant, config):
    run, ref = results[(launch, variant)][config], results["reference"][config]
    torch.testing.assert_close(run["history"], ref["history"], atol=ATOL, rtol=0)
    assert (ref["history"][-1] - ref["history"][0]).abs().max() > 1e-2


def test_the_two_node_variants_cover_every_pair_of_stage_scope_and_route():
    def rows(variants):
        return [tuple(v.split(":")) for v in variants]

    assert pairs_covered(rows(TWO_NODES)) == pairs_covered(rows(ALL_TWO_NODES))
    assert len(ALL_TWO_NODES) == 12 and set(TWO_NODES) <= set(ALL_TWO_NODES)


def test_variants_ran_the_reducer_they_name(results):
    assert results[("2 nodes x 2", "1:global:on")]["plain"]["hierarchical"] is True
    assert results[("2 nodes x 2", "1:global:off")]["plain"]["hierarchical"] is False


# ---------------------------------------------------------------------------------------------- bf16-mixed

BF16_VARIANTS = ["0:global:auto", "2:global:on", "3:node:on", "3:global:off"]
# bf16 matmuls round differently for a batch of 16 in one process and 4 batches of 4: the single-process bf16
# run and any 4-rank bf16 run (stage 0 included) differ by ~1e-2 (measured 0.0100). Sharding itself adds
# nothing on top: the sharded runs equal the 4-rank stage 0 run to fp32 rounding.
BF16_ATOL_VS_SINGLE = 2e-2


@pytest.fixture(scope="module")
def bf16_results(tmp_path_factory) -> dict:
    ref_dir, d = tmp_path_factory.mktemp("bf16ref"), tmp_path_factory.mktemp("bf16")
    common = ["--precision", "bf16-mixed", "--configs", "everything"]
    run_python(WORKERS / "equivalence.py", "--out", ref_dir, "--devices", "0", *common)
    run_python(WORKERS / "equivalence.py", "--out", d, "--devices", "4", "--devices-per-node", "2", *common,
               "--variants", ",".join(BF16_VARIANTS), timeout=600)
    out = {"reference": torch.load(ref_dir / "everything-0.pt")}
    for v in BF16_VARIANTS:
        out[v] = torch.load(d / ("everything-4.pt" if v == "0:global:auto" else f"everything-4-{v.replace(':', '-')}.pt"))
    return out


@pytest.mark.parametrize("variant", BF16_VARIANTS[1:])
def test_bf16_mixed_sharded_equals_unsharded_and_single_process_within_bf16_rounding(bf16_results, variant):
    run = bf16_results[variant]
    assert run["max_rank_diff"] == 0.0
    torch.testing.assert_close(run["history"], bf16_results["0:global:auto"]["history"], atol=ATOL, rtol=0)
    torch.testing.assert_close(run["history"], bf16_results["reference"]["history"], atol=BF16_ATOL_VS_SINGLE, rtol=0)


# ---------------------------------------------------------------------------------------------- memory

N = 4


@pytest.fixture(scope="module")
def memory(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    run_python(WORKERS / "zero_run.py", "--mode", "memory", "--out", out)
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


# Bytes per parameter, fp32 AdamW (ZeRO paper): parameters + gradients + optimizer state (exp_avg, exp_avg_sq).
FORMULAS = {0: 4 + 4 + 8, 1: 4 + 4 + 8 / N, 2: 4 + (4 + 8) / N, 3: 16 / N}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_bytes_per_rank_match_the_zero_formulas(memory, stage):
    row = memory[stage]
    expected = FORMULAS[stage] * row["numel"]
    assert row["total"] == row["params"] + row["grads"] + row["optimizer_state"]
    assert abs(row["total"] - expected) / expected < 0.05, (row, expected)


def test_stage_3_peak_adds_at_most_the_gathered_unit_and_the_prefetched_one(memory):
    row = memory[3]
    assert row["largest_unit"] == (512 * 512 + 512) * 4  # one Linear per unit
    shards = FORMULAS[3] * row["numel"]
    assert row["peak_gathered"] <= 2 * row["largest_unit"]
    assert shards + row["peak_gathered"] < FORMULAS[2] * row["numel"]


# ---------------------------------------------------------------------------------------------- bad input


def test_an_optimizer_that_cannot_be_sharded_fails_before_the_first_step_saying_why():
    proc = run_python(WORKERS / "zero_run.py", "--mode", "optimizer", "--optimizer", "lbfgs", check=False)
    assert proc.returncode != 0
    assert "ZeRO stages 1-3 cannot shard the optimizer LBFGS: it re-evaluates the closure" in proc.stderr
    assert "training_step" not in proc.stderr  # refused in setup, before any step ran


def test_an_optimizer_subclassing_an_elementwise_one_is_refused_naming_it_and_the_opt_in():
    # LARS subclasses SGD but scales each tensor's step by a norm over the whole tensor: sharded, it trains to
    # another result than unsharded, so it must be refused like LBFGS unless the user vouches for it.
    proc = run_python(WORKERS / "zero_run.py", "--mode", "optimizer", "--optimizer", "lars", check=False)
    assert proc.returncode != 0
    assert "ZeRO stages 1-3 cannot shard the optimizer LARS" in proc.stderr
    assert "subclasses SGD" in proc.stderr
    assert "allow_optimizer(LARS)" in proc.stderr
    assert "training_step" not in proc.stderr


def test_an_optimizer_subclass_declared_with_allow_optimizer_is_sharded():
    run_python(WORKERS / "zero_run.py", "--mode", "optimizer", "--optimizer", "lars", "--allow")


def test_check_optimizer_takes_exact_classes_and_subclasses_only_when_declared():
    from ddp_plugin.zero import ELEMENTWISE_OPTIMIZERS, allow_optimizer, check_optimizer

    class MyAdam(torch.optim.Adam):
        pass

    class MyAdamChild(MyAdam):
        pass

    params = [torch.nn.Parameter(torch.zeros(2))]
    check_optimizer(torch.optim.Adam(params))
    with pytest.raises(ValueError, match=r"cannot shard the optimizer MyAdam: it subclasses Adam.*allow_optimizer"):
        check_optimizer(MyAdam(params))
    try:
        assert allow_optimizer(MyAdam) is MyAdam
        check_optimizer(MyAdam(params))
        with pytest.raises(ValueError, match=r"optimizer MyAdamChild: it subclasses MyAdam"):
            check_optimizer(MyAdamChild(params))  # vouching for a class is not vouching for its subclasses
    finally:
        ELEMENTWISE_OPTIMIZERS.remove(MyAdam)


# ---------------------------------------------------------------------------------------------- stage 3 units

GPT_VARIANTS = ["1:default", "2:default", "3:default", "3:Block"]


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory) -> dict:
    ref, d = tmp_path_factory.mktemp("gpt_ref"), tmp_path_factory.mktemp("gpt")
    run_python(WORKERS / "zero_run.py", "--mode", "modulelist", "--out", ref, "--devices", "0")
    run_python(WORKERS / "zero_run.py", "--mode", "modulelist", "--out", d, "--devices", "2",
               "--variants", ",".join(GPT_VARIANTS), timeout=600)
    out = {"reference": torch.load(ref / "gpt-0-default.pt")}
    for v in GPT_VARIANTS:
        out[v] = torch.load(d / f"gpt-{v.replace(':', '-')}.pt")
    return out


@pytest.mark.parametrize("variant", GPT_VARIANTS)
def test_blocks_in_a_module_list_train_like_one_process_ties_kept_ranks_identical(gpt_runs, variant):
    run, ref = gpt_runs[variant], gpt_runs["reference"]
    assert run["max_rank_diff"] == 0.0
    assert run["tied"]
    torch.testing.assert_close(run["history"], ref["history"], atol=ATOL, rtol=0)
    assert (ref["history"][-1] - ref["history"][0]).abs().max() > 1e-2


def test_default_policy_groups_the_blocks_of_a_module_list_into_called_units(gpt_runs):
    # Three blocks reach 1,000,000 parameters: one unit of three called blocks, never the ModuleList itself; the
    # fourth block (and the embeddings) stay in the root unit.
    assert gpt_runs["3:default"]["units"] == [["Block", "Block", "Block"]]
    assert gpt_runs["3:Block"]["units"] == [["Block"]] * 4


def _plan(model: torch.nn.Module, policy):
    from ddp_plugin.zero import check_auto_wrap_policy
    from ddp_plugin.zero.units import plan_units

    return plan_units(model, list(model.named_parameters()), check_auto_wrap_policy(policy))


def _nested_containers() -> torch.nn.Module:
    model = torch.nn.Module()
    model.stages = torch.nn.ModuleDict({
        "a": torch.nn.ModuleList([torch.nn.Linear(10, 10) for _ in range(3)]),
        "b": torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU()) for _ in range(3)]),
    })
    model.head = torch.nn.Linear(10, 1)
    return model


@pytest.mark.parametrize("policy", [100, 200, 500])
def test_units_are_made_of_called_modules_never_of_containers(policy):
    model = _nested_containers()
    plan = _plan(model, policy)
    modules = dict(model.named_modules())
    members = [m for unit, _ in plan.order if unit for m in unit.split("+")]  # a unit is named by its modules
    assert members  # some units were formed (each Linear has 110 parameters)
    for name in members:
        assert not isinstance(modules[name], (torch.nn.ModuleList, torch.nn.ModuleDict)), name
    # Every parameter is in at most one unit.
    claimed = [p for unit, params in plan.order if unit for _, p in params]
    assert len({id(p) for p in claimed}) == len(claimed)


@pytest.mark.parametrize("policy", [["Lienar"], [torch.nn.Conv2d]])
def test_a_wrap_policy_entry_that_matches_no_module_fails_at_setup_naming_it_and_existing_classes(policy):
    name = policy[0] if isinstance(policy[0], str) else policy[0].__name__
    with pytest.raises(ValueError, match=rf"`auto_wrap_policy`.*'{name}'.*matches no module.*Linear.*Sequential"):
        _plan(_nested_containers(), policy)


def test_a_wrap_policy_name_that_matches_a_container_fails_at_setup():
    with pytest.raises(ValueError, match=r"`auto_wrap_policy`.*'ModuleList'.*never called"):
        _plan(_nested_containers(), ["ModuleList"])


# ---------------------------------------------------------------------------------------------- optimizer_in_backward

INBW_CONFIGS = ["plain", "accumulate", "sgd_schedule"]  # (clipping cannot go with it: refused, tested below)
INBW_VARIANTS = ["2:global:on", "3:global:off", "3:node:on"]
INBW_DISK = "3:node:on:inbw:disk"  # with offload="disk" too: the same bits


@pytest.fixture(scope="module")
def inbw_results(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("inbw")
    variants = [v + suffix for v in INBW_VARIANTS for suffix in ("", ":inbw")] + [INBW_DISK]
    run_python(WORKERS / "equivalence.py", "--out", d, "--devices", "4", "--devices-per-node", "2", "--configs",
               ",".join(INBW_CONFIGS), "--variants", ",".join(variants), timeout=600)
    return {(v, c): torch.load(d / f"{c}-4-{v.replace(':', '-')}.pt") for v in variants for c in INBW_CONFIGS}


@pytest.mark.parametrize("config", INBW_CONFIGS)
@pytest.mark.parametrize("variant", INBW_VARIANTS)
def test_optimizer_in_backward_trains_the_same_bits_as_the_step_after_backward(inbw_results, variant, config):
    # AdamW and SGD with momentum and weight decay, a scheduler, accumulation over 2 batches; the model's branch
    # bias gets no gradient on the steps where no rank takes the branch (its bucket is stepped after backward,
    # once the ranks agreed it was used nowhere: not at all), a tied weight, a frozen layer.
    after, during = inbw_results[(variant, config)], inbw_results[(variant + ":inbw", config)]
    assert torch.equal(during["history"], after["history"])
    assert during["max_rank_diff"] == 0.0
    assert after["stepped_in_backward"] is None
    # Buckets were stepped in backward on every step (1 KiB buckets: 3 to 4 of them a step here).
    assert during["stepped_in_backward"] >= 20 * 3, during["stepped_in_backward"]
    used = during["branch_used"].bool().any(dim=0)
    assert not used.all(), "the data must leave the branch unused on some steps"


@pytest.mark.parametrize("config", INBW_CONFIGS)
def test_optimizer_in_backward_with_disk_offload_trains_the_same_bits(inbw_results, config):
    after, during = inbw_results[("3:node:on", config)], inbw_results[(INBW_DISK, config)]
    assert torch.equal(during["history"], after["history"])
    assert during["max_rank_diff"] == 0.0
    assert during["stepped_in_backward"] >= 20 * 3, during["stepped_in_backward"]
    inside, total = during["state_in_files"]
    assert inside == total > 0  # every piece's state entry lies in a mapped offload file
    assert during["offload_files"] == []  # unlinked once mapped: nothing is left behind


@pytest.mark.parametrize(("refuse", "pattern"), [
    ("clip", r"`optimizer_in_backward=True` cannot go with `Trainer\(gradient_clip_val=1.0\)`"),
    ("manual", r"`optimizer_in_backward=True` needs Lightning's automatic optimization"),
])
def test_optimizer_in_backward_refuses_clipping_and_manual_optimization_at_setup(refuse, pattern):
    proc = run_python(WORKERS / "zero_run.py", "--mode", "in_backward", "--refuse", refuse, check=False)
    assert proc.returncode != 0
    assert re.search(pattern, proc.stderr), proc.stderr[-3000:]


def test_optimizer_in_backward_refuses_a_loss_scaler_naming_the_precisions_that_work():
    from ddp_plugin.zero.backward_step import check_trainer

    with pytest.raises(ValueError, match=r"cannot go with a loss scaler \(`precision='16-mixed'`\).*'bf16-mixed'"):
        check_trainer(None, True, loss_scaler=True)
    check_trainer(None, True, loss_scaler=False)  # what the strategy passes for 32-true and bf16-mixed


def test_a_checkpoint_saved_with_optimizer_in_backward_resumes_with_it_or_without_it(tmp_path):
    # Lightning's default callbacks and logger on (ModelCheckpoint saved it); stage 3, AdamW with weight decay, a
    # scheduler: the optimizer state made in backward is the one the step after backward would have made.
    run_python(WORKERS / "zero_run.py", "--mode", "in_backward_resume", "--out", tmp_path, timeout=600)
    digests = json.loads((tmp_path / "digests.json").read_text())
    assert digests["resumed"] == digests["plain"] == digests["resumed_plain"]
    assert digests["first"] != digests["plain"]
    assert digests["plain:batches"] == 6 and digests["first:batches"] == 3
    assert digests["resumed:batches"] == digests["resumed_plain:batches"] == 3  # (from the checkpoint's step 3)


# ---------------------------------------------------------------------------------------------- offload

OFFLOAD_CONFIGS = ["accumulate", "clip_and_schedule"]  # AdamW, accumulation; SGD, clipping, a scheduler
OFFLOAD_PAIRS = {  # offloaded variant -> the same run without offload
    "1:global:on:disk": "1:global:on",
    "2:global:on:disk": "2:global:on",
    "3:global:off:disk:params": "3:global:off",
    "3:global:off:cpu": "3:global:off",
}


@pytest.fixture(scope="module")
def offload_results(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("offload")
    variants = sorted({*OFFLOAD_PAIRS, *OFFLOAD_PAIRS.values()})
    run_python(WORKERS / "equivalence.py", "--out", d, "--devices", "4", "--devices-per-node", "2", "--configs",
               ",".join(OFFLOAD_CONFIGS), "--variants", ",".join(variants), timeout=600)
    return {(v, c): torch.load(d / f"{c}-4-{v.replace(':', '-')}.pt") for v in variants for c in OFFLOAD_CONFIGS}


@pytest.mark.parametrize("config", OFFLOAD_CONFIGS)
@pytest.mark.parametrize("variant", list(OFFLOAD_PAIRS))
def test_offload_trains_the_same_bits_as_without_it(offload_results, variant, config):
    # The update bucket by bucket, after Lightning's clipping (Trainer(gradient_clip_val=...)) and with the
    # scheduler's learning rate of each step; the optimizer's own step finds nothing left to do.
    plain, offloaded = offload_results[(OFFLOAD_PAIRS[variant], config)], offload_results[(variant, config)]
    assert torch.equal(offloaded["history"], plain["history"])
    assert offloaded["max_rank_diff"] == 0.0
    assert plain["offload_stepped"] is None
    assert offloaded["offload_stepped"] >= 20 * 3, offloaded["offload_stepped"]  # every bucket, every step
    if ":disk" in variant:
        inside, total = offloaded["state_in_files"]
        assert inside == total > 0, (inside, total)  # the state (and with params, stage 3's shards) in the files
        assert offloaded["offload_files"] == []


@pytest.mark.parametrize("layout", ["master", "sharded"])
def test_a_checkpoint_saved_with_disk_offload_resumes_with_it_or_without_it_and_the_other_way_round(tmp_path, layout):
    # Lightning's default callbacks and logger on; stage 3 with the parameter shards on disk too, AdamW with weight
    # decay, a scheduler: the state read from the files is the one without offload, and a checkpoint saved without
    # it goes into the files on a resume. The offloaded runs save consolidated (master) or sharded checkpoints.
    run_python(WORKERS / "zero_run.py", "--mode", "offload_resume", "--checkpoint", layout, "--out", tmp_path,
               timeout=600)
    digests = json.loads((tmp_path / "digests.json").read_text())
    assert digests["resumed"] == digests["plain"] == digests["resumed_plain"] == digests["resumed_on"]
    assert digests["first"] == digests["plain_first"] != digests["plain"]
    assert digests["resumed_on:batches"] == digests["resumed:batches"] == 3  # (from the checkpoint's step 3)
    assert os.listdir(tmp_path / "offload") == []
