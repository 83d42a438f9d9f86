"""A block cut between two pipeline stages, without processes: where a block can be cut, that its two parts compute
what the block computed (outputs and gradients bit for bit), the stages a named cut and the split by time make, and
the errors of a cut that cannot hold. The training runs with a cut block are in tests/test_pipeline.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddp_plugin.parallel.stages import cut as block_cut
from ddp_plugin.parallel.stages import BlockTimes, plan_stages, split_module
from ddp_plugin.testing.gpt import Block, GPTModule


def gpt(layers: int = 4) -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(layers=layers)


def test_a_pre_norm_block_cuts_where_one_value_crosses():
    # x + attn(ln1(x)) crosses before ln2; before attn (x and ln1(x)) or mlp (the sum and ln2 of it) two would
    cuts = block_cut.candidates(Block(16, 2))
    assert [(c.at, c.first, c.second) for c in cuts] == [("ln2", ("ln1", "attn"), ("ln2", "mlp"))]
    with pytest.raises(ValueError, match=r"2 values computed before `mlp` are used after it"):
        block_cut.find(Block(16, 2), "mlp")
    with pytest.raises(ValueError, match=r"first argument \(`x`, the hidden state\) is used after `attn`"):
        block_cut.find(Block(16, 2), "attn")
    with pytest.raises(ValueError, match=r"does not use `head`"):
        block_cut.find(Block(16, 2), "head")


class Branching(nn.Module):
    """A block whose parts would share a module, and one that returns two values: neither cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        return self.a(self.b(y))


class Pair(Branching):
    def forward(self, x):
        y = self.a(x)
        return self.b(y), y


class Untraceable(Branching):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
            x = self.a(x)
        return self.b(x)


def test_blocks_that_cannot_be_cut_say_why():
    assert block_cut.candidates(Branching()) == []
    with pytest.raises(ValueError, match=r"`a` runs both before and after `b`"):
        block_cut.find(Branching(), "b")
    with pytest.raises(ValueError, match="returns several values"):
        block_cut.find(Pair(), "b")
    assert block_cut.candidates(Untraceable()) == []
    with pytest.raises(ValueError, match="does not trace with torch.fx"):
        block_cut.find(Untraceable(), "b")


def test_the_parts_compute_the_block_bit_for_bit_under_its_own_names():
    torch.manual_seed(0)
    block = Block(16, 2)
    first, second = copy.deepcopy(block), copy.deepcopy(block)
    cut = block_cut.find(block, "ln2")
    block_cut.keep_part(first, cut, second=False)
    block_cut.keep_part(second, cut, second=True)
    assert type(first) is Block and type(second) is Block  # (the class stays: units and policies match it)
    assert [n for n, _ in first.named_parameters()] + [n for n, _ in second.named_parameters()] == [
        n for n, _ in block.named_parameters()]
    x = torch.randn(3, 8, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    expected = block(x)
    got = second(first(x2))
    assert torch.equal(got, expected)
    expected.square().sum().backward()
    got.square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    parts = dict(first.named_parameters()) | dict(second.named_parameters())
    for name, p in block.named_parameters():
        assert torch.equal(parts[name].grad, p.grad), name


def test_stages_named_with_a_blocks_parts_cut_it_there():
    module = gpt(4)
    split = [["tok", "pos", "blocks.0", "blocks.1", "blocks.2.ln1", "blocks.2.attn"],
             ["model.blocks.2.mlp", "blocks.3", "ln_f", "head"]]
    plan = plan_stages(module, 2, split)
    assert plan.stage_blocks == ((0, 1, 2), (2, 3))
    assert [(i, c.at) for i, c in plan.cuts] == [(2, "ln2")]
    assert plan.stage_of("model.blocks.2.attn.q.weight") == {0}
    assert plan.stage_of("model.blocks.2.mlp.fc.weight") == {1}
    assert plan.stage_of("model.blocks.2.ln2.bias") == {1}  # (not named: it runs after the cut)
    assert plan.stage_of("model.blocks.3.ln1.bias") == {1}
    torch.manual_seed(1)
    x = torch.randint(0, 32, (2, 8))
    expected = module.model(x)
    stages = [copy.deepcopy(module) for _ in range(2)]
    for s, stage in enumerate(stages):
        split_module(stage, plan, [s])
    names = [[n for n, _ in stage.named_parameters()] for stage in stages]
    assert "model.blocks.2.attn.q.weight" in names[0] and "model.blocks.2.attn.q.weight" not in names[1]
    assert "model.blocks.2.mlp.fc.weight" in names[1] and "model.blocks.2.mlp.fc.weight" not in names[0]
    assert torch.equal(stages[1].model(stages[0].model(x)), expected)


@pytest.mark.parametrize("split, words", [
    ([["blocks.0", "blocks.1", "blocks.2.attn"], ["blocks.2.ln2", "blocks.2.mlp", "blocks.3"]], None),
    ([["blocks.0", "blocks.1", "blocks.2.ln1"], ["blocks.2.attn", "blocks.3"]],
     ["cuts `model.blocks.2` between two stages", "first argument (`x`, the hidden state) is used after `attn`"]),
    ([["blocks.0", "blocks.1", "blocks.2.attn"], ["blocks.3"]],
     ["names parts of `model.blocks.2` (`model.blocks.2.attn`) in stage 0", "consecutive stages"]),
    ([["blocks.0", "blocks.1.attn", "blocks.2"], ["blocks.1.mlp", "blocks.3"]],
     ["names parts of `model.blocks.1`", "last in one stage and its second part's first in the next"]),
    ([["blocks.0", "blocks.1", "blocks.2.mlp"], ["blocks.2.attn", "blocks.3"]],
     ["cuts `model.blocks.2` between two stages (`model.blocks.2.mlp` before, `model.blocks.2.attn` after)"]),
])
def test_a_named_cut_that_cannot_hold_says_why(split, words):
    if words is None:
        assert plan_stages(gpt(4), 2, split).stage_blocks == ((0, 1, 2), (2, 3))
        return
    with pytest.raises(ValueError) as info:
        plan_stages(gpt(4), 2, split)
    for w in words:
        assert w in str(info.value), str(info.value)


def fake_timer(before, blocks, after, share):
    """A timer that reports the given seconds (and the first part's ``share`` of each cut block)."""
    def timer(owner, listed, cuts):
        assert len(listed) == len(blocks)
        return BlockTimes(before, tuple(blocks), after, dict.fromkeys(cuts, share), 0.0)
    return timer


def test_the_split_by_time_cuts_inside_a_block_only_where_that_balances_better():
    # The benchmark GPT's proportions: blocks of 22 ms, attention 0.41 of one, head and loss 18 ms. Whole blocks
    # give 50 | 62 ms; cutting block 2 after its attention gives 59 | 53.
    plan = plan_stages(gpt(4), 2, "time", fake_timer(5, [22, 22, 22, 22], 18, 0.41))
    assert plan.stage_blocks == ((0, 1, 2), (2, 3)) and [i for i, _ in plan.cuts] == [2]
    # without the head's weight whole blocks balance: no cut
    plan = plan_stages(gpt(4), 2, "time", fake_timer(0, [22, 22, 22, 22], 0, 0.41))
    assert plan.stage_blocks == ((0, 1), (2, 3)) and plan.cuts == ()
    # four stages of one block each: none cut; two stages of three equal blocks: the middle one cut in halves
    assert plan_stages(gpt(4), 4, "time", fake_timer(0, [22] * 4, 0, 0.5)).cuts == ()
    plan = plan_stages(gpt(3), 2, "time", fake_timer(0, [30, 30, 30], 0, 0.5))
    assert plan.stage_blocks == ((0, 1), (1, 2)) and [i for i, _ in plan.cuts] == [1]


def test_the_split_by_time_measures_each_cut_blocks_parts():
    from ddp_plugin.parallel.stages.timing import time_blocks

    torch.manual_seed(0)
    model = GPTModule(vocab=64, d_model=64, heads=2, layers=2, seq=32).model
    cuts = {i: block_cut.candidates(b)[0] for i, b in enumerate(model.blocks)}
    times = time_blocks(model, list(model.blocks), ((torch.randint(0, 64, (2, 32)),), {}), torch.device("cpu"),
                        cuts=cuts)
    assert len(times.blocks) == 2 and sorted(times.shares) == [0, 1], times
    assert all(0 < s < 1 for s in times.shares.values()), times
    assert all(p.grad is None for p in model.parameters())


def test_a_cut_block_trains_under_activation_checkpointing():
    from ddp_plugin.parallel import activation_checkpointing

    module = gpt(2)
    plan = plan_stages(module, 2, [["blocks.0.attn"], ["blocks.0.mlp", "blocks.1"]])
    stage = copy.deepcopy(module)
    split_module(stage, plan, [1])
    assert activation_checkpointing.apply(stage, (Block,)) == ["model.blocks.0", "model.blocks.1"]
    x = torch.randn(2, 8, 16, requires_grad=True)
    loss = F.mse_loss(stage.model(x), torch.zeros(2, 8, 32))
    loss.backward()
    assert all(p.grad is not None for p in stage.parameters())
