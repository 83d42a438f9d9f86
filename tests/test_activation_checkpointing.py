"""Activation checkpointing (``activation_checkpointing_policy``): the named blocks keep only their inputs and
run their forward again in the backward. The same training as without it, on every layout (data parallel,
ZeRO-3, tensor parallel, pipeline stages, their mixes, and a model built on the meta device), with fewer bytes
saved for the backward. One launch of 4 CPU ranks (tests/workers/activation_checkpointing_run.py); the flag's
checks and the module patching run in this process."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.parallel.activation_checkpointing import apply, check_present, is_checkpointed
from ddp_plugin.testing.gpt import GPT, Block
from tests.support import WORKERS, run_python

CASES = ["dp", "2x2_zero3", "tp2_dp2", "pp2_dp2", "pp2_dp2_zero3", "pp2_tp2", "pp2_tp2:meta"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ac") / "result.jsonl"
    run_python(WORKERS / "activation_checkpointing_run.py", "--out", out, "--cases", ",".join(CASES), timeout=900)
    return {r["case"]: r["ranks"] for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("case", CASES)
def test_checkpointed_blocks_train_exactly_as_without_and_save_less_for_the_backward(runs, case):
    for rank, r in enumerate(runs[case]):
        plain, checkpointed = r["plain"], r["checkpointed"]
        assert plain["steps"] == checkpointed["steps"] == 3, rank
        # Every block this rank holds (its pipeline stage's) is checkpointed, and only with the flag.
        assert checkpointed["blocks"] > 0 and checkpointed["checkpointed"] == checkpointed["blocks"], (rank, r)
        assert plain["checkpointed"] == 0, rank
        # The recomputed forward is the same computation: the parameters end the same, up to the order in which
        # float sums are taken (bit for bit in most runs; ZeRO-3 once ended 5e-7 apart on a busy machine). A
        # block recomputed wrongly (other inputs, no gathered parameters, another dropout mask) is 1e-3 off or more.
        assert len(plain["params"]) == len(checkpointed["params"]) > 0, rank
        assert max(abs(a - b) for a, b in zip(plain["params"], checkpointed["params"])) <= 1e-5, rank
        # What the blocks saved for the backward is gone: their inputs are kept instead.
        assert checkpointed["saved_bytes"] < 0.6 * plain["saved_bytes"], (rank, plain["saved_bytes"],
                                                                          checkpointed["saved_bytes"])


def test_the_flag_takes_classes_or_names_and_refuses_anything_else():
    assert HierarchicalZeroStrategy(activation_checkpointing_policy={Block}).config \
        .activation_checkpointing_policy == (Block,)
    assert HierarchicalZeroStrategy(activation_checkpointing_policy=["Block"]).config \
        .activation_checkpointing_policy == ("Block",)
    assert HierarchicalZeroStrategy().config.activation_checkpointing_policy is None
    with pytest.raises(ValueError, match=r"`activation_checkpointing_policy=3` is not supported; allowed values"):
        HierarchicalZeroStrategy(activation_checkpointing_policy=3)
    with pytest.raises(ValueError, match="names ModuleList, a container whose forward is never called"):
        HierarchicalZeroStrategy(activation_checkpointing_policy=[nn.ModuleList])


def test_a_policy_that_matches_no_module_is_refused_naming_the_classes_there_are():
    with pytest.raises(ValueError, match=r"names 'TransformerBlock', which matches no module of GPT; its module"
                                         r" classes are: .*Block"):
        check_present(GPT(), ("TransformerBlock",))


def test_names_stay_the_outermost_match_only_and_a_deep_copy_calls_its_own_forward():
    torch.manual_seed(0)
    gpt = GPT(vocab=32, d_model=16, heads=2, layers=2, seq=8)
    names = [n for n, _ in gpt.named_parameters()]
    x = torch.randint(0, 32, (2, 8))
    expected = gpt(x)
    # Block and the MLP inside it: the MLP is recomputed with its block already.
    done = apply(gpt, (Block, "MLP"))
    assert done == ["blocks.0", "blocks.1"]
    assert not any(is_checkpointed(m) for n, m in gpt.named_modules() if n.endswith("mlp"))
    assert apply(gpt, (Block,)) == done and is_checkpointed(gpt.blocks[0])  # a second fit
    assert [n for n, _ in gpt.named_parameters()] == names and list(gpt.state_dict()) == list(
        GPT(vocab=32, d_model=16, heads=2, layers=2, seq=8).state_dict())
    assert torch.equal(gpt(x), expected)
    twin = copy.deepcopy(gpt)
    with torch.no_grad():
        twin.blocks[0].mlp.fc.weight.zero_()
    assert not torch.equal(twin(x), expected) and torch.equal(gpt(x), expected)
    assert twin.blocks[0].forward.module is twin.blocks[0]
