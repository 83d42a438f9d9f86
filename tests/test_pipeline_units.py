"""Pipeline stages without processes (but the split by time's timing on two gloo ranks): the flags' errors, the
layout, where the stages split, what a stage keeps, and which parameters several stages share."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.parallel.pipeline import PipelineOutput
from ddp_plugin.parallel.ties import find_ties
from ddp_plugin.parallel.stage_module import CARRIER, Int8Rows, _packed, pack_rows, unpack_rows
from ddp_plugin.parallel.stages import StageBlocks, check_module, plan_stages, split_module
from ddp_plugin.testing.gpt import GPTModule
from ddp_plugin.runtime.topology import Layout


@pytest.mark.parametrize("flags, words", [
    ({"pipeline_parallel_size": 0}, ["pipeline_parallel_size", "positive integer"]),
    ({"pipeline_schedule": "zb"}, ["pipeline_schedule", "'1f1b'", "'gpipe'", "'interleaved_1f1b'"]),
    ({"pipeline_virtual_stages": 2}, ["pipeline_virtual_stages=2", "interleaved_1f1b"]),
    ({"pipeline_parallel_size": 2, "pipeline_microbatches": 1}, ["pipeline_microbatches=1", "at least"]),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b", "pipeline_microbatches": 3},
     ["pipeline_microbatches=3", "multiple of `pipeline_parallel_size=2`"]),
    ({"pipeline_split": "random"}, ["pipeline_split='random'", "'parameters'", "'uniform'", "'type:<regex>'"]),
    ({"pipeline_split": "type:(("}, ["pipeline_split='type:(('", "not a regular expression"]),
    ({"pipeline_split": [["blocks.0"], []]}, ["pipeline_split=", "one non-empty list per stage"]),
    ({"pipeline_parallel_size": 2, "pipeline_split": [["blocks.0", "blocks.1"]]},
     ["`pipeline_split` names the modules of 1 stages", "runs 2"]),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b", "pipeline_split": [["a"], ["b"]]},
     ["names the modules of 2 stages", "runs 4"]),
    ({"pipeline_activations": "int4"}, ["pipeline_activations='int4'", "'fp32'", "'bf16'", "'fp16'", "'int8'"]),
])
def test_bad_flags_fail_at_construction_naming_the_flag(flags, words):
    with pytest.raises(ValueError) as info:
        HierarchicalZeroStrategy(**flags)
    for w in words:
        assert w in str(info.value)


def test_a_layout_that_cannot_split_into_stages_names_the_allowed_sizes():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3.*Allowed values: 1, 2, 4, 8"):
        Layout(8, 4, 1, 3)
    with pytest.raises(ValueError, match=r"Allowed values: 1, 2, 4\b"):  # a stage must hold the 2 TP ranks
        Layout(8, 4, 2, 8)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3"):  # at the Trainer's construction
        L.Trainer(accelerator="cpu", devices=4, strategy=HierarchicalZeroStrategy(pipeline_parallel_size=3))


def test_the_stages_nodes_decide_which_boundaries_narrow_their_activations():
    from ddp_plugin.strategy.components import stage_nodes

    assert stage_nodes(Layout(8, 4, 1, 2)) == [0, 1]  # a stage per node: the boundary crosses the link
    assert stage_nodes(Layout(4, 4, 1, 4)) == [0, 0, 0, 0]  # 4 stages on one node: none does
    assert stage_nodes(Layout(8, 2, 1, 4)) == [0, 1, 2, 3]
    assert stage_nodes(Layout(8, 4, 1, 4)) == [0, 0, 1, 1]  # 2 stages per node: every other boundary
    assert stage_nodes(Layout(4, 1, 1, 2)) == [0, 2]  # a stage's 2 data-parallel ranks on 2 nodes


def test_layout_puts_pipeline_outermost_and_tensor_innermost():
    layout = Layout(8, 4, 2, 2)  # 2 nodes of 4: a stage per node, D 2 x T 2 inside it
    assert (layout.stage_size, layout.data_parallel_size) == (4, 2)
    assert layout.data_parallel_layout == Layout(2, 2)
    assert [layout.global_rank(0, d, t, p) for p in range(2) for d in range(2) for t in range(2)] == list(range(8))
    several = Layout(4, 4, 1, 4)  # 4 stages of one rank on one node
    assert several.data_parallel_layout == Layout(1, 1)
    across = Layout(4, 1, 1, 2)  # a stage's 2 data-parallel ranks on 2 nodes of one rank
    assert across.data_parallel_layout == Layout(2, 1)
    assert [across.global_rank(n, 0, 0, p) for p in range(2) for n in range(2)] == [0, 1, 2, 3]


def gpt(layers: int = 4) -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(layers=layers)


def test_stages_split_the_block_list_balanced_by_parameters():
    module = gpt(4)
    plan = plan_stages(module, 2)
    assert (plan.owner, plan.blocks, plan.before, plan.after) == ("model", "blocks", ("tok", "pos"), ("ln_f", "head"))
    assert plan.stage_blocks == ((0, 1), (2, 3))
    assert plan_stages(module, 4).stage_blocks == ((0,), (1,), (2,), (3,))
    # a heavy first stage (a big position embedding) gets fewer blocks
    big = GPTModule(seq=2048, layers=4)
    assert plan_stages(big, 2).stage_blocks == ((0,), (1, 2, 3))


def test_the_split_can_be_uniform_by_block_type_or_named():
    big = GPTModule(seq=2048, layers=4)  # a heavy first stage: by parameters it gets one block
    assert plan_stages(big, 2, "uniform").stage_blocks == ((0, 1), (2, 3))
    named = [["tok", "pos", "blocks.0", "blocks.1", "blocks.2"], ["model.blocks.3", "ln_f", "head"]]
    assert plan_stages(big, 2, named).stage_blocks == ((0, 1, 2), (3,))
    assert plan_stages(big, 2, [["blocks.0"], ["blocks.1", "blocks.2", "blocks.3"]]).stage_blocks == ((0,), (1, 2, 3))
    # DeepSpeed's "type:<regex>": balanced by the count of blocks whose class matches (a hybrid model here)
    module = gpt(4)
    mixed = [module.model.blocks[0], nn.Linear(16, 16), nn.Linear(16, 16), module.model.blocks[1],
             nn.Linear(16, 16), module.model.blocks[2]]
    module.model.blocks = nn.ModuleList(mixed)
    runs = plan_stages(module, 3, "type:^Block$").stage_blocks
    assert [sum(isinstance(mixed[i], type(mixed[0])) for i in run) for run in runs] == [1, 1, 1], runs
    assert [i for run in runs for i in run] == list(range(6))
    with pytest.raises(ValueError, match=r"matches none of the blocks of `model.blocks` \(Block, Linear\)"):
        plan_stages(module, 3, "type:Attention")
    dict_model = GPTModule(layers=4, blocks="dict")
    del dict_model.model.blocks["1"]
    assert plan_stages(dict_model, 2, [["blocks.0"], ["blocks.2", "blocks.3"]]).stage_blocks == ((0,), (1, 2))


class Repeated(nn.Module):
    """A block that applies its one layer ``times`` times: the same parameters, ``times`` x the compute."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times, self.layer, self.norm = times, nn.Linear(128, 128), nn.BatchNorm1d(128)

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.layer(x))
        return self.norm(x)


class Stack(nn.Module):
    def __init__(self, times, width: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Repeated(t) if isinstance(t, int) else t for t in times)
        self.out = nn.Linear(width, width)

    def forward(self, x):  # (a module another stage holds is None)
        if self.inp is not None:
            x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x) if self.out is not None else x


def test_the_split_by_time_gives_a_heavy_block_a_stage_of_its_own():
    from ddp_plugin.parallel.stages.timing import time_blocks

    model = Stack([1, 1, 32, 32])  # equal parameters: by count two blocks per stage, the heavy two together
    assert plan_stages(model, 2).stage_blocks == ((0, 1), (2, 3))
    example = ((torch.randn(256, 128),), {})
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    for _ in range(5):
        measured = []

        def timer(owner, blocks, cuts):
            measured.append(time_blocks(owner, blocks, example, torch.device("cpu"), cuts=cuts))
            return measured[-1]

        plan = plan_stages(model, 2, "time", timer)
        times = measured[0]  # (the plan's own measurement: a second one on a busy machine may differ)
        # The two heavy blocks are the same computation: a timing that finds one 1.5x the other was spoiled by what
        # else ran (6 busy processes on 2 cores: 96 ms against 54 for the same block; in CI, beside launches of up to
        # 8 ranks, the plan once kept the split by parameters, within such a timing's noise). Timed again, up to 5
        # times.
        if max(times.blocks[2:]) < 1.5 * min(times.blocks[2:]):
            break
    assert len(times.blocks) == 4 and all(t > 0 for t in times.blocks) and sorted(times.shares) == [0, 1, 2, 3]
    assert 0 <= times.noise, times
    # the heavy blocks measured as such (a busy machine blurs the rest)
    assert min(times.blocks[2:]) > times.before + sum(times.blocks[:2]), times
    # a heavy block gets a stage of its own; the cuts (before each block's norm) would balance no better than
    # whole blocks within the timing's noise, so the stages hold whole blocks
    assert plan.stage_blocks == ((0, 1, 2), (3,)) and plan.cuts == (), plan
    # nothing left behind: no gradient, the batch norms' statistics and the generator as they were
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("blocks, noise, expected", [
    # equal blocks timed a little apart: the split by parameters, not a cut that balances 5 % better
    ((1.0, 1.1, 1.0, 1.0), 0.0, ((0, 1), (2, 3))),
    # the timing's own noise wider than the floor: the same
    ((1.0, 1.4, 1.0, 1.0), 0.25, ((0, 1), (2, 3))),
    # ... but a difference beyond 30 % is acted on, however noisy the timing
    ((1.0, 2.0, 1.0, 1.0), 0.9, ((0, 1), (2, 3))),
    ((1.0, 1.0, 3.0, 3.0), 0.9, ((0, 1, 2), (3,))),
    # two heavy blocks: apart, as whole blocks (the cuts' gain is within the noise)
    ((1.0, 1.0, 10.0, 10.0), 0.0, ((0, 1, 2), (3,))),
])
def test_the_split_by_time_keeps_the_simpler_split_within_the_timings_noise(blocks, noise, expected):
    from ddp_plugin.parallel.stages.timing import BlockTimes

    model = Stack([1, 1, 1, 1])
    plan = plan_stages(model, 2, "time",
                       lambda owner, listed, cuts: BlockTimes(0.05, blocks, 0.05, dict.fromkeys(cuts, 0.5), noise))
    assert (plan.stage_blocks, plan.cuts) == (expected, ())


def test_the_split_by_time_cuts_a_block_where_that_balances_beyond_the_noise():
    from ddp_plugin.parallel.stages.timing import BlockTimes

    model = Stack([1, 1, 1])  # two stages of three equal blocks: whole blocks give one stage 2/3 of the time
    plan = plan_stages(model, 2, "time",
                       lambda owner, listed, cuts: BlockTimes(0.0, (1.0, 1.0, 1.0), 0.0, dict.fromkeys(cuts, 0.5), 0.0))
    assert plan.stage_blocks == ((0, 1), (1, 2)) and [i for i, _ in plan.cuts] == [1], plan


def _timed_with_rank_one_held(rank, world):
    """``time_blocks`` on two ranks over gloo, on rank 1 every pass of the first block held 50 ms (what a rank
    whose core something else takes sees), and the split those times give."""
    import time

    from ddp_plugin.parallel.stages.timing import time_blocks

    torch.manual_seed(0)
    model = Stack([1, 1, 16, 16])
    if rank == 1:
        model.blocks[0].register_forward_hook(lambda *_: time.sleep(0.05))
    example = ((torch.randn(64, 128, generator=torch.Generator().manual_seed(1)),), {})
    times = time_blocks(model, list(model.blocks), example, torch.device("cpu"))
    return times, plan_stages(model, 2, "time", lambda owner, listed, cuts: times).stage_blocks


@pytest.fixture(scope="module")
def two_ranks():
    from ddp_plugin.testing.ranks import RankPool

    with RankPool(2) as pool:
        yield pool


def test_the_split_by_time_takes_the_fastest_rank_so_a_held_rank_moves_no_stage(two_ranks):
    (mine, split), (theirs, their_split) = two_ranks.run(_timed_with_rank_one_held)
    assert mine == theirs and split == their_split  # (every rank cuts the same stages)
    # rank 0's first block (no hold): averaged with rank 1's, it weighed 25 ms and more
    assert mine.blocks[0] < 0.025 < 0.05, mine
    assert split == ((0, 1, 2), (3,)), mine  # (held into the mean, the light blocks shared a stage with none)


def test_the_split_by_time_needs_a_timer_and_times_a_whole_model_only_with_real_weights():
    from ddp_plugin.parallel.stages.timing import time_blocks

    with torch.device("meta"):
        model = Stack([1, 1])
    with pytest.raises(ValueError, match=r"meta device: time it a block at a time \(`time_meta_blocks`\)"):
        time_blocks(model, list(model.blocks), ((torch.randn(2, 128),), {}), torch.device("cpu"))
    with pytest.raises(ValueError, match="when a fit sets the stages up"):
        plan_stages(gpt(4), 2, "time")


def test_a_meta_built_model_is_timed_a_block_at_a_time_and_split_by_its_time():
    # Built on meta, as `trainer.init_module(empty_init=True)` builds: each block materialized alone, timed on the
    # previous one's output, dropped. Equal parameters: by count two blocks per stage, the heavy two together.
    import weakref

    from ddp_plugin.parallel.stages.timing import time_meta_blocks

    with torch.device("meta"):
        model = Stack([1, 1, 32, 32])
    layout = plan_stages(model, 4, "uniform")  # (a stage per block: what the fit's timer times)
    example = ((torch.randn(64, 128, generator=torch.Generator().manual_seed(1)),), {})
    seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    copies: list[weakref.ref] = []  # the blocks' copies' parameters
    held: list[int] = []

    def count(block, *_):  # (on the blocks' copies, at their first pass: a module's hooks are copied with it)
        if block not in seen:
            seen.add(block)
            copies.extend(weakref.ref(p) for p in block.parameters())
            held.append(sum(p.numel() * p.element_size() for r in copies if (p := r()) is not None))

    for block in model.blocks:
        block.register_forward_hook(count)
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as the workers: two threads a process, beside the other tests' processes, spin)
    try:
        for _ in range(5):
            measured, held[:] = [], []

            def timer(owner, blocks, cuts, measured=measured):
                measured.append(time_meta_blocks(owner, layout, example, torch.device("cpu"), cuts=cuts))
                return measured[-1]

            plan = plan_stages(model, 2, "time", timer)
            times = measured[0]
            # (timed again where what else ran spoiled it: the heavy blocks apart, or a light one as slow)
            if max(times.blocks[2:]) < 1.5 * min(times.blocks[2:]) and max(times.blocks[:2]) < min(times.blocks[2:]):
                break
    finally:
        torch.set_num_threads(threads)
    assert len(times.blocks) == 4 and all(t > 0 for t in times.blocks) and sorted(times.shares) == [0, 1, 2, 3]
    assert min(times.blocks[2:]) > times.before + sum(times.blocks[:2]), times
    # a heavy block gets a stage of its own (a busy machine that timed the light blocks slower may send block 2's
    # norm, after the cut, to the last stage)
    assert plan.stage_blocks in (((0, 1, 2), (3,)), ((0, 1, 2), (2, 3))), plan
    # one block held at a time: each block's copy is gone when the next runs (a block holds 129 x 128 + 2 x 128
    # parameters: its linear layer and its norm)
    assert held == [(129 * 128 + 2 * 128) * 4] * 4, held
    # the meta model left as it was, the generator too (the model's own initialization draws the same)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert torch.equal(torch.get_rng_state(), rng)


def test_timing_a_meta_built_model_holds_about_one_block_of_memory():
    # 32 blocks of 2 MB (66 MB) built on meta: timing them holds one block (its parameters, gradients, activations)
    # at a time. Measured, after a first timing of 2 such blocks (what the process allocates once: 29 MB): 0-2 MB
    # more at the peak (48 blocks: the same); 55 MB for 32 blocks of 8 MB (264 MB) without one. Holding the blocks
    # would take the model's 66 MB and their gradients.
    from ddp_plugin.parallel.stages.timing import time_meta_blocks
    from ddp_plugin.testing.memory import PeakRSS, rss_bytes

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)

        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    def timed(blocks: int) -> int:
        with torch.device("meta"):
            model = Stack([Wide() for _ in range(blocks)], width=512)
        example = ((torch.zeros(4, 512),), {})
        time_meta_blocks(model, plan_stages(model, blocks, "uniform"), example, torch.device("cpu"))
        return sum(p.numel() * 4 for p in model.parameters())

    timed(2)
    before = rss_bytes()
    with PeakRSS() as peak:
        whole = timed(32)
    assert peak.bytes - before < whole / 4, (peak.bytes - before, whole)


def test_timing_a_meta_built_model_names_a_block_that_cannot_be_initialized():
    from ddp_plugin.parallel.stages.timing import time_meta_blocks

    class Scale(nn.Module):  # a parameter, no `reset_parameters`: materialized, it would be uninitialized memory
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(128))

        def forward(self, x):
            return x * self.w

    class Scaled(Repeated):
        def __init__(self) -> None:
            super().__init__(1)
            self.scale = Scale()

    with torch.device("meta"):
        model = Stack([1, Scaled()])
    with pytest.raises(TypeError) as info:
        time_meta_blocks(model, plan_stages(model, 2, "uniform"), ((torch.zeros(4, 128),), {}), torch.device("cpu"))
    for w in ["`pipeline_split='time'`", "block 1", "`blocks.1.scale` (Scale)", "reset_parameters()",
              "`pipeline_split='parameters'`"]:
        assert w in str(info.value), str(info.value)


class DictBatches(L.LightningModule):
    """A module whose steps take batch dicts and call ``self.net`` with a keyword; ``before`` runs first."""

    def __init__(self, before=None) -> None:
        super().__init__()
        self.net = Stack([1, 1])
        self.before = before

    def training_step(self, batch, batch_idx):
        if self.before is not None:
            self.before(self)
        return self.net(x=batch["x"] * 2).sum()


def fitting(module: L.LightningModule, data) -> L.Trainer:
    """A Trainer as a fit's setup sees it: fitting, the data attached, the module's trainer set."""
    from lightning.pytorch.trainer.states import TrainerFn

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    trainer.state.fn = TrainerFn.FITTING
    trainer.strategy.connect(module)
    trainer._data_connector.attach_data(module, train_dataloaders=data)
    module.trainer = trainer
    return trainer


def test_the_split_by_time_finds_the_first_microbatch_by_running_the_step_up_to_the_models_call():
    from torch.utils.data import DataLoader

    from ddp_plugin.parallel.stages.timing import first_microbatch

    rows = [{"x": torch.full((128,), float(i))} for i in range(40)]
    module = DictBatches()
    fitting(module, DataLoader(rows, batch_size=8, shuffle=True))
    rng = torch.get_rng_state()
    args, kwargs = first_microbatch(module, module.net, 4, torch.device("cpu"))
    # the step's own transformation, the first 8 / 4 samples of a shuffled batch, the model's keyword
    assert args == () and list(kwargs) == ["x"] and kwargs["x"].shape == (2, 128)
    assert all(float(v) % 2 == 0 for v in kwargs["x"][:, 0]), kwargs  # (doubled by the step)
    assert torch.equal(torch.get_rng_state(), rng)  # the shuffle's draw undone: training reads the same order
    assert "forward" not in module.net.__dict__  # the model's own call back


def test_a_fits_split_by_time_times_a_meta_built_module_on_its_first_microbatch():
    # What the strategy's setup runs: the step run up to the model's call (a keyword argument here) on the meta
    # build, then the blocks timed one at a time under their module path (`net`).
    from torch.utils.data import DataLoader

    from ddp_plugin.parallel.stages import fit_timer

    with torch.device("meta"):
        module = DictBatches()
    fitting(module, DataLoader([{"x": torch.full((128,), float(i))} for i in range(8)], batch_size=4))
    timed = []
    timer = fit_timer(module, torch.device("cpu"), 2)
    plan = plan_stages(module, 2, "time", lambda *args: timed.append(timer(*args)) or timed[-1])
    assert plan.owner == "net" and plan.num_stages == 2, plan  # (the light blocks may be cut: balanced by time)
    assert len(timed[0].blocks) == 2 and all(t > 0 for t in (timed[0].before, *timed[0].blocks, timed[0].after))
    assert all(t.is_meta for t in module.parameters())


@pytest.mark.parametrize("before, error, words", [
    (lambda m: 1 / 0, RuntimeError, ["`training_step` on the first batch", "failed before that call",
                                     "ZeroDivisionError"]),
    # (logging before the model's call: Lightning has no loop to log to at setup)
    (lambda m: m.log("seen", 1.0), RuntimeError, ["failed before that call", "self.log"]),
])
def test_the_split_by_time_says_why_a_step_gave_no_microbatch(before, error, words):
    from torch.utils.data import DataLoader

    from ddp_plugin.parallel.stages.timing import first_microbatch

    module = DictBatches(before)
    fitting(module, DataLoader([{"x": torch.zeros(128)}] * 4, batch_size=4))
    with pytest.raises(error) as info:
        first_microbatch(module, module.net, 2, torch.device("cpu"))
    for w in words:
        assert w in str(info.value), str(info.value)
    assert "forward" not in module.net.__dict__


def test_the_split_by_time_says_so_where_the_step_never_calls_the_pipelined_model():
    from torch.utils.data import DataLoader

    from ddp_plugin.parallel.stages.timing import first_microbatch

    class Elsewhere(DictBatches):
        def training_step(self, batch, batch_idx):
            return batch["x"].sum()

    module = Elsewhere()
    fitting(module, DataLoader([{"x": torch.zeros(128)}] * 4, batch_size=4))
    with pytest.raises(TypeError, match=r"returned without calling it \(`self\.net\(\.\.\.\)`\)"):
        first_microbatch(module, module.net, 2, torch.device("cpu"))


@pytest.mark.parametrize("split, words", [
    ([["blocks.0", "blocks.2"], ["blocks.1", "blocks.3"]], ["once, in order", "named: blocks.0, blocks.2, blocks.1"]),
    ([["blocks.0"], ["blocks.1", "blocks.2"]], ["missing: blocks.3"]),
    ([["blocks.0", "blocks.1"], ["blocks.1", "blocks.2", "blocks.3"]], ["once, in order"]),
    ([["blocks.0", "blocks.1"], ["tok", "blocks.2", "blocks.3"]], ["`tok` is in stage 1", "first stage (0)"]),
    ([["head", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]], ["`head` is in stage 0", "last stage (1)"]),
    ([["blocks.0", "blocks.1"], ["blocks.2", "block.3"]], ["`block.3` is not a block of `model.blocks`",
                                                          "before them: tok, pos", "after them: ln_f, head"]),
    ([["tok", "pos"], ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]], ["stage 0 (['tok', 'pos']) names no block"]),
    ([["blocks.0"], ["blocks.1"], ["blocks.2", "blocks.3"]], ["names 3 stages; the pipeline runs 2"]),
])
def test_a_named_split_that_cannot_hold_says_why(split, words):
    with pytest.raises(ValueError) as info:
        plan_stages(gpt(4), 2, split)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_a_stage_keeps_its_modules_under_the_unsplit_names():
    module = gpt(4)
    plan = plan_stages(module, 2)
    split_module(module, plan, [1])
    names = [n for n, _ in module.named_parameters()]
    assert names[0].startswith("model.blocks.2.") and "model.head.weight" in names
    assert not any(n.startswith(("model.tok", "model.pos", "model.blocks.0", "model.blocks.1")) for n in names)
    assert module.model.tok is None and isinstance(module.model.blocks, StageBlocks)
    assert [b is module.model.blocks._modules[k] for k, b in zip(("2", "3"), module.model.blocks)] == [True, True]
    assert module.model.blocks[0] is module.model.blocks._modules["2"] and len(module.model.blocks) == 2
    x = torch.randn(2, 8, 16)
    assert module.model(x).shape == (2, 8, 32)  # the last stage: activations in, logits out


def test_blocks_in_a_module_dict_split_under_their_keys_as_torchtitan_holds_them():
    # torchtitan's models: `self.layers = nn.ModuleDict({str(i): Block() ...})`, and a layer removed keeps the
    # others' names. Here layer "1" was removed before the split.
    module = GPTModule(layers=5, blocks="dict")
    del module.model.blocks["1"]
    plan = plan_stages(module, 2)
    assert (plan.blocks, plan.is_dict, plan.keys) == ("blocks", True, ("0", "2", "3", "4"))
    assert plan.stage_blocks == ((0, 1), (2, 3))
    assert plan.stage_of("model.blocks.3.attn.q.weight") == {1} and plan.stage_of("model.blocks.2.ln1.bias") == {0}
    x = torch.randint(0, 32, (2, 8))
    whole = module.model(x)
    split_module(module, plan, [0])
    assert isinstance(module.model.blocks, nn.ModuleDict) and list(module.model.blocks) == ["0", "2"]
    names = {n for n, _ in module.named_parameters()}
    assert "model.blocks.2.attn.q.weight" in names and not any(n.startswith("model.blocks.3") for n in names)
    assert module.model.head is None
    # the first stage's forward: tokens in, the activations after its blocks out
    assert module.model(x).shape == (2, 8, 16) and whole.shape == (2, 8, 32)


def test_the_tied_embedding_is_shared_by_the_first_and_the_last_stage():
    module = gpt(4)
    from ddp_plugin.parallel.tensor_parallel import shared_parameters

    shared = shared_parameters(module)
    assert shared == [("model.tok.weight", "model.head.weight")]
    ties = find_ties(shared, plan_stages(module, 2), 2)
    assert [(t.names, t.ranks) for t in ties] == [(("model.tok.weight", "model.head.weight"), (0, 1))]
    # interleaved, 2 ranks x 2 stages each: the first stage on rank 0, the last (3) on rank 1
    assert find_ties(shared, plan_stages(module, 4), 2)[0].ranks == (0, 1)
    assert find_ties(shared, plan_stages(module, 2), 1) == []  # one rank holds both


def test_what_a_model_must_have_is_named():
    class Flat(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

    with pytest.raises(TypeError, match="nn.ModuleList"):
        plan_stages(Flat(), 2)

    class Loose(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    with pytest.raises(TypeError, match="'scale' belongs to no child module"):
        plan_stages(Loose(), 2)
    with pytest.raises(ValueError, match="has 4 blocks, fewer than the 8 pipeline stages"):
        plan_stages(gpt(4), 8)
    with pytest.raises(TypeError, match=r"pipeline_loss\(output, target\)"):
        check_module(Flat(), 2)


def test_the_placeholder_says_how_to_use_it():
    with pytest.raises(AttributeError, match=r"self.pipeline_loss\(output, target\)"):
        PipelineOutput((torch.zeros(1),), {}).argmax()


# ---------------------------------------------------------------------- int8 activations (pipeline_activations)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_carry_each_row_within_half_a_step_of_its_scale_both_ways(dtype):
    # The sending stage packs its output; the receiving stage unpacks it and, in its backward, packs the gradient
    # of what it received, which the sending stage's backward unpacks: each way a row's values come back within
    # half of its scale (its absolute maximum / 127), in the shape and dtype they left in.
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 16) * torch.logspace(-3, 3, 16)).to(dtype).requires_grad_()
    before = x.detach().clone()
    carrier = Int8Rows.apply(x)
    assert carrier.dtype == CARRIER and carrier.shape == (2, 3, 10)  # 16 int8 + a 4-byte scale per row
    assert carrier.numel() * carrier.element_size() == 6 * 20
    assert torch.equal(x.detach(), before)  # (the activation itself is left alone)
    received = carrier.detach().requires_grad_()
    y = Int8Rows.unpack(received, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    half_step = before.float().abs().amax(-1, keepdim=True) / 127 / 2
    tolerance = half_step * 1.01 + (0 if dtype == torch.float32 else before.float().abs() / 128)
    assert ((y.detach().float() - before.float()).abs() <= tolerance).all()
    grad = torch.randn(2, 3, 16, dtype=dtype)
    y.backward(grad)
    assert received.grad.dtype == CARRIER and received.grad.shape == carrier.shape
    carrier.backward(received.grad)
    half_step = grad.float().abs().amax(-1, keepdim=True) / 127 / 2
    tolerance = half_step * 1.01 + (0 if dtype == torch.float32 else grad.float().abs() / 128)
    assert x.grad.dtype == dtype and ((x.grad.float() - grad.float()).abs() <= tolerance).all()


def test_int8_rows_with_a_non_finite_value_unpack_to_nan_and_zero_rows_to_zeros():
    x = torch.randn(3, 8)
    x[0, 2], x[1, 5], x[2] = float("inf"), float("nan"), 0.0
    y = unpack_rows(pack_rows(x), torch.float32)
    assert torch.isnan(y[0]).all() and torch.isnan(y[1]).all()  # (a loss scaler sees the overflow)
    assert torch.equal(y[2], torch.zeros(8))


def test_int8_activations_refuse_an_odd_last_dimension_naming_the_flag():
    with pytest.raises(ValueError, match=r"pipeline_activations='int8'.*shape \(4, 7\).*'bf16'"):
        _packed(torch.randn(4, 7))
    tokens = torch.arange(4)
    assert _packed((tokens, torch.randn(2, 2)))[0] is tokens  # (integer tensors pass as they are)
