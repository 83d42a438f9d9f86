"""``pretrained=``: a Hugging Face style ``safetensors`` checkpoint read into the model once it is split,
parallelized and materialized, each rank reading only its part (torch's ``HuggingFaceStorageReader``).

Multi-process (4 gloo ranks, tests/workers/pretrained_run.py): into models built on meta at P 2 x T 2 (two bf16
files whose names carry another prefix), GPipe over 4 stages (one fp32 file without the tied head, as Hugging Face
saves a tied model: the last stage's copy comes from the first's), T 2 x D 2 and plain ZeRO-3 (fitted: the first
loss is the file's model's), an eager 2 x 2 model, and with ``ckpt_path`` (the checkpoint wins). Units: the
prefix match, the warnings' lists, and the errors at construction and before anything is read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddp_plugin import HierarchicalZeroStrategy

from ddp_plugin.checkpoints import pretrained
from ddp_plugin.testing.gpt import GPT, GPTModule
from tests.support import WORKERS, run_python
from tests.workers.pretrained_run import CASES, SIZE

safetensors_torch = pytest.importorskip("safetensors.torch")


def write_weights(folder) -> None:
    torch.manual_seed(7)
    state = GPT(SIZE["vocab"], SIZE["d_model"], SIZE["heads"], SIZE["layers"], SIZE["seq"]).state_dict()
    for name, tensor in state.items():
        tensor.add_(0.01 * torch.randn_like(tensor))  # (not the constructor's values: LayerNorms too)
    state = {k: v.clone() for k, v in state.items()}
    (folder / "sharded").mkdir()
    names = list(state)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        safetensors_torch.save_file({f"transformer.{k}": state[k].to(torch.bfloat16) for k in part},
                                    folder / "sharded" / f"model-0000{i + 1}-of-00002.safetensors")
    safetensors_torch.save_file({k: v for k, v in state.items() if k != "head.weight"},
                                folder / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    write_weights(weights)
    out = tmp_path_factory.mktemp("pretrained") / "result.jsonl"
    run_python(WORKERS / "pretrained_run.py", "--weights", weights, "--out", out, timeout=600)
    return {r["case"]: r["ranks"] for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("resume")])
def test_every_rank_starts_from_the_file(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["error"] < 1e-5, (case, rank, r)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("resume")])
def test_a_checkpoint_given_as_ckpt_path_wins_over_the_file(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["error"] < 1e-5, (case, rank, r)
        assert r["file_error"] > 1e-3, (case, rank, r)  # (the file's model would predict otherwise)


def test_a_later_setup_of_the_same_module_does_not_read_the_file_again(runs):
    for rank, r in enumerate(runs["dp_eager"]):
        assert r["after_fit"] < 1e-5, (rank, r)  # (the fitted model's predictions, not the file's model's)


@pytest.mark.parametrize("case, most", [("pp2_tp2_meta", 0.5), ("gpipe_p4_meta", 0.5), ("tp2_dp2_zero3_meta", 0.6)])
def test_a_rank_reads_only_its_part_of_the_file(runs, case, most):
    # its stages' tensors and, of a tensor-parallel one, its slice (P 2 x T 2: about a quarter of the file; the
    # embeddings, LayerNorms and row-wise biases are replicated over the tensor-parallel ranks)
    for rank, r in enumerate(runs[case]):
        assert 0 < r["read"] < most * r["stored"], (case, rank, r)


# -- units ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("file_keys, module_names, expected", [
    (["a.weight", "b.bias"], ["a.weight", "b.bias"], ("", "")),
    (["transformer.a.weight", "transformer.b.bias"], ["model.a.weight", "model.b.bias"], ("transformer.", "model.")),
    (["model.layers.0.w", "model.norm.w", "lm_head.w"], ["model.model.layers.0.w", "model.model.norm.w",
                                                         "model.lm_head.w"], ("", "model.")),
    (["model.layers.0.w", "model.norm.w"], ["layers.0.w", "norm.w"], ("model.", "")),
])
def test_the_prefix_pair_matching_most_names_is_found(file_keys, module_names, expected):
    key_map, matched = pretrained.find_key_map(file_keys, module_names)
    assert (key_map.strip, key_map.add) == expected
    assert matched == len(file_keys)


def test_the_plan_lists_what_the_file_lacks_and_what_the_model_lacks(tmp_path):
    torch.manual_seed(0)
    model = GPTModule(**SIZE)
    state = {f"transformer.{k}": v.contiguous() for k, v in model.model.state_dict().items()
             if k not in ("head.weight", "ln_f.bias")}
    state["transformer.rotary.inv_freq"] = torch.ones(4)
    safetensors_torch.save_file(state, tmp_path / "model.safetensors")
    with torch.device("meta"):
        meta = GPTModule(**SIZE)
    plan = pretrained.plan(meta, str(tmp_path / "model.safetensors"))
    assert str(plan.key_map) == "`transformer.*` read as `model.*`"
    assert plan.missing == ["model.ln_f.bias"]  # (the tied head is the embedding, which the file has)
    assert plan.unexpected == ["transformer.rotary.inv_freq"]
    fresh = GPTModule(**SIZE)
    assert pretrained.load(fresh, plan) == len(state) - 1
    assert torch.equal(fresh.model.head.weight, model.model.tok.weight)
    assert torch.equal(fresh.model.blocks[1].mlp.fc.weight, model.model.blocks[1].mlp.fc.weight)


def test_a_shape_that_differs_fails_before_anything_is_read(tmp_path):
    state = {k: v.clone() for k, v in GPT(**SIZE).state_dict().items() if k != "head.weight"}
    state["ln_f.weight"] = torch.ones(SIZE["d_model"] + 1)
    safetensors_torch.save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"shapes differ.*`ln_f.weight` is \(33,\) in the file, `model.ln_f.weight`"):
        pretrained.plan(GPTModule(**SIZE), str(tmp_path))


def test_a_file_whose_names_match_nothing_fails_naming_both(tmp_path):
    safetensors_torch.save_file({"encoder.x": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"none of its 1 names .* The file's: encoder.x, ...; the model's: model"):
        pretrained.plan(GPTModule(**SIZE), str(tmp_path))


@pytest.mark.parametrize("value, message", [
    ("no/such/folder", "no such file or folder"),
    (".", "is not a `.safetensors` file and holds none"),
    (3, "allowed values are None or the path"),
])
def test_a_bad_path_fails_at_construction_naming_the_flag(value, message):
    with pytest.raises(ValueError, match=rf"`pretrained=.*{message}"):
        HierarchicalZeroStrategy(pretrained=value)


def test_the_flag_takes_a_file_or_a_folder(tmp_path):
    safetensors_torch.save_file({"w": torch.ones(1)}, tmp_path / "model.safetensors")
    assert HierarchicalZeroStrategy(pretrained=tmp_path).config.pretrained == os.fspath(tmp_path)
    file = tmp_path / "model.safetensors"
    assert HierarchicalZeroStrategy(pretrained=file).config.pretrained == os.fspath(file)
