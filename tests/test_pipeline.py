"""Pipeline stages (``pipeline_parallel_size``): the tiny tied-embedding GPT split into 2 stages of 2 data-parallel
ranks each (4 gloo ranks), with each schedule and ZeRO stage, equals Lightning ``ddp`` on 2 ranks with the same
global batch, with gradient clipping that binds; data-parallel replicas and the tied embedding's two copies (first
and last stage) stay bit-identical. The master checkpoint is the unsplit model's, and resumes on other layouts."""

from __future__ import annotations

import pytest
import torch

from ddp_plugin.testing.processes import runs_argument
from tests.support import WORKERS, relative_difference, run_python
from tests.workers.pp_run import EPOCH, STEPS

# Microbatching and the split change rounding only (a sum over microbatches instead of one mean); a real bug (a
# tied gradient not summed, a stage's norm missing from clipping, an unscaled microbatch) moves parameters by 1e-2
# or more.
RTOL = 3e-4
VARIANTS = ["1f1b", "gpipe:1", "interleaved_1f1b:2", "1f1b:3"]
P2 = ["--devices", "4", "--devices-per-node", "2", "--pp", "2"]
SHARDED = "--flags={\"checkpoint\": \"sharded\"}"
STAGE_3_UNITS = "--flags={\"auto_wrap_policy\": [\"Block\"]}"  # (ignored below stage 3)
# block 1 cut after its attention: its first part ends stage 0, its second starts stage 1
CUT = ("--flags={\"pipeline_split\": [[\"blocks.0\", \"blocks.1.attn\"], [\"blocks.1.mlp\", \"blocks.2\","
       " \"blocks.3\"]], \"auto_wrap_policy\": [\"Block\"]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pp")
    run_python(WORKERS / "pp_run.py", *runs_argument([
        ["--out", out, "--devices", "2", "--reference"],
        ["--out", out, "--devices", "2", "--reference", "--accumulate", "2", "--tag=-acc"],
        ["--out", out, "--devices", "2", "--reference", "--scheduler", "--tag=-sched"],
    ]))
    run_python(WORKERS / "pp_run.py", *runs_argument([
        ["--out", out, *P2, "--variants", ",".join(VARIANTS), "--save-at", "4", STAGE_3_UNITS],
        ["--out", out, *P2, "--variants", "interleaved_1f1b:1", "--accumulate", "2", "--tag=-acc"],
        # resumed on another ZeRO stage and schedule
        ["--out", out, *P2, "--variants", "1f1b:2", "--resume", out / "gpipe-1-step4.ckpt", "--tag=-resumed"],
        # data-parallel ranks reading 3 and 5 of each step's 8 samples (one microbatch: gpipe allows M < P)
        ["--out", out, *P2, "--variants", "gpipe", "--uneven", "--tag=-sample",
         "--flags={\"weighting\": \"sample\", \"pipeline_microbatches\": 1}"],
        ["--out", out, *P2, "--variants", "gpipe", "--uneven", "--tag=-rank", "--flags={\"pipeline_microbatches\": 1}"],
        ["--out", out, *P2, "--variants", "1f1b", "--nan-at", "5", "--tag=-nan", "--flags={\"skip_nonfinite\": true}"],
        # the blocks in an nn.ModuleDict keyed by layer id (torchtitan's models), saved for a resume below
        ["--out", out, *P2, "--variants", "1f1b", "--blocks", "dict", "--save-at", "4", "--tag=-dict"],
        ["--out", out, *P2, "--variants", "1f1b:1", "--scheduler", "--tag=-sched"],
        # stages named by the user: one block on the first, three on the last
        ["--out", out, *P2, "--variants", "1f1b", "--tag=-named", "--flags={\"pipeline_split\": [[\"tok\","
         " \"pos\", \"blocks.0\"], [\"model.blocks.1\", \"blocks.2\", \"blocks.3\", \"ln_f\", \"head\"]]}"],
        ["--out", out, *P2, "--variants", "1f1b:3", "--save-at", "4", "--tag=-cut", CUT],
        ["--out", out, *P2, "--variants", "1f1b", "--resume", out / "gpipe-1-step4.ckpt", "--tag=-into-cut", CUT],
        # checkpoint="sharded": each rank writes its stage's part, keyed by the unsplit model's names
        ["--out", out, *P2, "--variants", "1f1b:1", "--save-at", "4", "--tag=-sharded", SHARDED],
        ["--out", out, *P2, "--variants", "gpipe:3", "--resume", out / "1f1b-1-sharded-step4.ckpt",
         "--tag=-sharded-resumed", "--flags={\"checkpoint\": \"sharded\", \"auto_wrap_policy\": [\"Block\"]}"],
        ["--out", out, *P2, "--variants", "gpipe:1", "--resume", out / "1f1b-3-step4.ckpt", "--tag=-from-3"],
        # a P 2 x D 2 checkpoint resumed on 4 stages of one rank
        ["--out", out, "--devices", "4", "--pp", "4", "--variants", "1f1b", "--resume", out / "1f1b-step4.ckpt",
         "--tag=-p4", "--flags={\"pipeline_microbatches\": 4}"],
    ]), timeout=600)
    # Resumed without pipeline stages: ours on 2 ranks, and Lightning ddp itself.
    run_python(WORKERS / "pp_run.py", *runs_argument([
        ["--out", out, "--devices", "2", "--pp", "1", "--variants", "1f1b", "--resume", out / "1f1b-step4.ckpt",
         "--tag=-p1"],
        ["--out", out, "--devices", "2", "--reference", "--resume", out / "interleaved_1f1b-2-step4.ckpt",
         "--tag=-resumed"],
        ["--out", out, "--devices", "2", "--pp", "1", "--variants", "1f1b:1", "--resume",
         out / "1f1b-1-sharded-step4.ckpt", "--tag=-sharded-p1", SHARDED],
        # the ModuleDict model's checkpoint resumed into the ModuleList one: the same names
        ["--out", out, "--devices", "2", "--pp", "1", "--variants", "1f1b", "--resume", out / "1f1b-dict-step4.ckpt",
         "--tag=-dict-p1"],
        ["--out", out, "--devices", "2", "--pp", "1", "--variants", "1f1b", "--resume", out / "1f1b-3-cut-step4.ckpt",
         "--tag=-cut-p1"],
    ]))
    names = ["reference", "reference-acc", "reference-sched", *VARIANTS, "interleaved_1f1b:1-acc", "1f1b:2-resumed",
             "1f1b-p1", "reference-resumed", "gpipe-sample", "gpipe-rank", "1f1b-nan", "1f1b:1-sched",
             "1f1b:1-sharded", "gpipe:3-sharded-resumed", "1f1b-p4", "1f1b:1-sharded-p1", "gpipe:1-from-3",
             "1f1b-dict", "1f1b-dict-p1", "1f1b-named", "1f1b:3-cut", "1f1b-cut-p1", "1f1b-into-cut"]
    runs = {name: torch.load(out / f"{name.replace(':', '-')}.pt") for name in names}
    runs["checkpoints"] = out
    return runs


def test_clipping_binds_and_training_moves_parameters(runs):
    reference = runs["reference"]
    assert len(reference["grad_norms"]) == STEPS
    assert sum(n > 0.3 for n in reference["grad_norms"]) >= STEPS - 2, reference["grad_norms"]  # pp_run.CLIP
    assert relative_difference(reference["initial"], reference["state"]) > 1000 * RTOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_equals_ddp_on_the_whole_model(runs, variant):
    assert relative_difference(runs[variant]["state"], runs["reference"]["state"]) <= RTOL


def test_zero_stage_3_gathers_each_unit_once_a_step_over_the_microbatches(runs):
    # Each microbatch runs the stage's forward and backward: a unit gathered again for each would be gathered 2M
    # times a step (4 here); held from the first forward to the step's end, once. The worker's checks gather every
    # unit once more a step (`full_parameters()`), and validation's forward-only passes (after steps 4 and 8) add
    # about 0.6 a step: 2.6 gathers per unit and step measured (2.2 over 20 steps), 5.3 before units were held.
    run = runs["1f1b:3"]
    assert run["units"] and run["unit_gathers"] <= 3 * run["units"], (run["unit_gathers"], run["units"])


def test_blocks_in_a_module_dict_keyed_by_layer_id_split_and_train_as_a_module_list(runs):
    # torchtitan's models hold their blocks in an nn.ModuleDict (names stay stable when layers are removed); the
    # stages keep their keys, and the parameter names are those of the list: same training, same checkpoints.
    assert relative_difference(runs["1f1b-dict"]["state"], runs["reference"]["state"]) <= RTOL
    assert relative_difference(runs["1f1b-dict"]["state"], runs["1f1b"]["state"]) <= 1e-6
    assert relative_difference(runs["1f1b-dict-p1"]["state"], runs["1f1b-p1"]["state"]) <= 1e-6


def test_stages_named_by_the_user_split_there_and_train_as_ddp(runs):
    assert runs["1f1b"]["stage_blocks"] == ((0, 1), (2, 3))  # (balanced by parameters)
    assert runs["1f1b-named"]["stage_blocks"] == ((0,), (1, 2, 3))
    assert relative_difference(runs["1f1b-named"]["state"], runs["reference"]["state"]) <= RTOL


def test_a_block_cut_between_two_stages_trains_and_resumes_as_ddp(runs):
    # ZeRO-3 with each block a unit: the cut block is a unit on each stage (its part); the checkpoint, written under
    # the unsplit model's names, resumes without stages, and one written by whole-block stages resumes into the cut.
    run = runs["1f1b:3-cut"]
    assert run["stage_blocks"] == ((0, 1), (1, 2, 3))
    assert relative_difference(run["state"], runs["reference"]["state"]) <= RTOL
    assert run["max_replica_diff"] == 0.0 and run["max_tie_diff"] == 0.0
    assert run["losses"] == pytest.approx(runs["reference"]["losses"], rel=1e-3)
    assert run["units"] == 2 and run["unit_gathers"] <= 3 * run["units"]  # (rank 0: blocks 0 and 1's part)
    assert relative_difference(runs["1f1b-cut-p1"]["state"], runs["reference"]["state"]) <= RTOL
    assert relative_difference(runs["1f1b-into-cut"]["state"], runs["reference"]["state"]) <= RTOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_replicas_and_tied_copies_bit_identical(runs, variant):
    assert runs[variant]["max_replica_diff"] == 0.0
    assert runs[variant]["max_tie_diff"] == 0.0


def test_gradient_accumulation_equals_ddps(runs):
    assert relative_difference(runs["interleaved_1f1b:1-acc"]["state"], runs["reference-acc"]["state"]) <= RTOL
    assert relative_difference(runs["reference-acc"]["state"], runs["reference"]["state"]) > 10 * RTOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_is_known_on_every_stage(runs, variant):
    # Rank 0 runs the first stage; its returned and logged loss is the last stage's mean over the microbatches of
    # its data-parallel rank's samples, which the reference's rank 0 read too.
    ours, reference = runs[variant], runs["reference"]
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-3)
    assert ours["logged_loss"] == pytest.approx(reference["logged_loss"], rel=1e-3)
    assert ours["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-3)  # (a forward-only schedule)


def test_sampler_splits_over_data_parallel_ranks(runs):
    assert runs["1f1b"]["sampler"] == {"num_replicas": 2, "rank": 0}


@pytest.mark.parametrize("variant", ["1f1b:2-resumed", "1f1b-p1", "reference-resumed", "1f1b-p4", "1f1b:1-sharded",
                                     "gpipe:3-sharded-resumed", "1f1b:1-sharded-p1", "gpipe:1-from-3"])
def test_resumes_on_another_layout_as_if_uninterrupted(runs, variant):
    # ZeRO-1 gpipe -> ZeRO-2 1f1b; 1f1b on P 2 x D 2 -> no stages (ours), -> P 4; interleaved ZeRO-2 -> Lightning
    # ddp; ZeRO-3 -> ZeRO-1; a sharded ZeRO-1 checkpoint -> ZeRO-3 gpipe, -> no stages (ours).
    assert relative_difference(runs[variant]["state"], runs["reference"]["state"]) <= RTOL


@pytest.mark.parametrize("variant", ["1f1b", "gpipe-1", "1f1b-3"])
def test_master_checkpoint_is_the_unsplit_models(runs, variant):
    from ddp_plugin.testing.gpt import GPTModule

    checkpoint = torch.load(runs["checkpoints"] / f"{variant}-step4.ckpt", weights_only=False)
    state = checkpoint["state_dict"]
    assert state["model.head.weight"].untyped_storage().data_ptr() == \
        state["model.tok.weight"].untyped_storage().data_ptr()  # the tied weight once
    model = GPTModule(layers=4)
    model.load_state_dict(state, strict=True)  # one plain process, every stage's parameters
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # numbered as the unsplit model's optimizer
    assert len(optimizer.state) == len(list(model.parameters()))
    assert checkpoint["optimizer_states"][0]["param_names"] == [n for n, _ in model.named_parameters()]


def test_consolidated_state_holds_every_stage(runs):
    assert runs["1f1b"]["tied_in_state"]
    assert runs["1f1b"]["state"].keys() == runs["reference"]["state"].keys()


def test_sample_weighting_counts_every_sample_once(runs):
    # Data-parallel ranks reading 3 and 5 samples: weighted by samples, the whole batch's mean (the reference's);
    # weighted by rank, visibly not.
    assert relative_difference(runs["gpipe-sample"]["state"], runs["reference"]["state"]) <= RTOL
    assert relative_difference(runs["gpipe-rank"]["state"], runs["reference"]["state"]) > 10 * RTOL


def test_a_nan_on_one_rank_of_one_stage_skips_the_step_everywhere(runs):
    run = runs["1f1b-nan"]
    assert run["skipped_steps"] == 1
    assert run["max_replica_diff"] == 0.0 and run["max_tie_diff"] == 0.0
    assert all(bool(torch.isfinite(v).all()) for v in run["state"].values())


def test_lr_scheduler_and_checkpoint_callback(runs, tmp_path):
    from ddp_plugin.testing.gpt import GPTModule

    ours, reference = runs["1f1b:1-sched"], runs["reference-sched"]
    assert ours["lr"] == reference["lr"] == pytest.approx(1e-2 / 2 ** (STEPS // 3))  # halved every 3 steps
    assert relative_difference(ours["state"], reference["state"]) <= RTOL
    saved = sorted((runs["checkpoints"] / "1f1b-1-sched-callback").glob("*.ckpt"))
    assert [p.name for p in saved] == [f"epoch=1-step={2 * EPOCH}.ckpt", f"epoch=3-step={4 * EPOCH}.ckpt"]
    model = GPTModule(layers=4)
    model.load_state_dict(torch.load(saved[-1], weights_only=False)["state_dict"], strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, ours["state"][name]), name


def test_sharded_checkpoint_consolidates_to_the_unsplit_models(runs, tmp_path):
    from ddp_plugin.checkpoints.sharded_checkpoint import consolidate
    from ddp_plugin.testing.gpt import GPTModule

    out = tmp_path / "whole.ckpt"
    consolidate(runs["checkpoints"] / "1f1b-1-sharded-step4.ckpt", out)
    checkpoint = torch.load(out, weights_only=False)
    model = GPTModule(layers=4)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert len(optimizer.state) == len(list(model.parameters()))
    master = torch.load(runs["checkpoints"] / "1f1b-step4.ckpt", weights_only=False)  # same training, stage 0
    for name, value in master["state_dict"].items():
        torch.testing.assert_close(checkpoint["state_dict"][name], value, rtol=RTOL, atol=1e-6, msg=name)
