"""Adaptive communication (docs/adaptive.md): the cost model's choices, the flags, a codec switch that hands its
residual to the new route, the plan in training on 2 simulated nodes x 2 (the same on every rank) with ZeRO and a
sync mode, and, on a simulated cluster (root), a link that slows down mid-run and the plan that follows it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_plugin import Bucket, HierarchicalZeroStrategy
from ddp_plugin.codecs import BUILTIN_CODECS
from ddp_plugin.runtime.comm import TracedCommunicator
from ddp_plugin.gradients.planning import (BUCKET_BAND, BUCKET_CAPS_MIB, FLAT, HIERARCHICAL, PREDICTION_BAND, BucketPlan,
                                          CommPlan, CostModel, Fit, holds_more)
from ddp_plugin.strategy.plugin_manager import build_plugin_manager
from ddp_plugin.plugins.adaptive import TRIAL_STEPS, AdaptivePlanner
from ddp_plugin.testing.ranks import RankPool
from tests.support import WORKERS, needs_cluster, run_python

WORLD = 4
MB = 1e6


def link(latency_ms: float, mb_per_s: float) -> Fit:
    return Fit(latency_ms / 1e3, 1 / (mb_per_s * MB))


def model_of(cross_mb_per_s: float, int8_cpu_mb_per_s: float = 400.0) -> CostModel:
    """2 nodes x 2: a link of ``cross_mb_per_s`` per node, shared by the node's 2 ranks across nodes; int8 sends
    a quarter of the bytes and codes at ``int8_cpu_mb_per_s``; in-node stages at 2 GB/s."""
    cpu = 1 / (int8_cpu_mb_per_s * MB)
    world = 1.5 / (cross_mb_per_s * MB)  # a flat ring: 1.5 bucket sizes per node across
    inter = 2 * 1.0 / (cross_mb_per_s * MB)  # per rank's chunk: 2(M-1)/M of it, 2 ranks sharing the link
    return CostModel(num_nodes=2, ranks_per_node=2, cross={
        ("world", "none"): Fit(1e-3, world), ("world", "int8"): Fit(2e-3, world / 4 + cpu),
        ("inter", "none"): Fit(1e-3, inter), ("inter", "int8"): Fit(2e-3, inter / 4 + cpu),
    }, reduce_scatter=link(0.5, 2000), all_gather=link(0.5, 2000))


# ---------------------------------------------------------------------- the cost model


def test_fit_through_two_points_recovers_latency_and_bandwidth():
    fit = Fit.through((1e5, 0.002 + 1e5 / 1e8), (1e7, 0.002 + 1e7 / 1e8))
    assert fit.latency_s == pytest.approx(0.002)
    assert fit.describe()["MB_per_s"] == pytest.approx(100.0)
    # Noise that makes the larger transfer look faster never gives a negative bandwidth.
    assert Fit.through((1e5, 0.01), (1e6, 0.005)).seconds_per_byte > 0


@pytest.mark.parametrize(("mb_per_s", "route", "codec"), [
    (1250.0, FLAT, "none"),  # 10 Gbit/s: int8's arithmetic costs more than it saves, the flat ring is cheapest
    (125.0, HIERARCHICAL, "int8"),  # 1 Gbit/s
    (12.5, HIERARCHICAL, "int8"),  # 100 Mbit/s
])
def test_the_cheapest_route_and_codec_follow_the_link(mb_per_s, route, codec):
    chosen_route, chosen_codec, seconds = model_of(mb_per_s).choose(25 * 2**20)
    assert (chosen_route, chosen_codec) == (route, codec)
    every = [model_of(mb_per_s).route_seconds(r, c, 25 * 2**20) for r in (FLAT, HIERARCHICAL) for c in ("none", "int8")]
    assert seconds == min(every)


def test_a_route_or_codec_left_out_is_never_chosen():
    model = model_of(12.5)
    assert model.choose(25 * 2**20, routes=[FLAT], codecs=["none"])[:2] == (FLAT, "none")
    assert model.choose_codec("world", 25 * 2**20, ["none"])[0] == "none"
    assert model.choose_codec("world", 25 * 2**20)[0] == "int8"


def test_close_calls_are_left_to_measurement_and_clear_ones_are_not():
    # 300 MB/s: hierarchical + int8 is predicted 27 % faster than hierarchical without a codec (beyond the
    # prediction band, within the trial margin).
    plan = CommPlan(model_of(300.0), (FLAT, HIERARCHICAL), ("none", "int8"), 25.0, 0.0)
    plan.plan_buckets({"0": 25 * 2**20})
    assert plan.contested(margin=0.5) == {"0": [(HIERARCHICAL, "int8"), (HIERARCHICAL, "none")]}
    assert plan.contested(margin=0.3) == {}
    one_option = CommPlan(model_of(125.0), (FLAT,), ("none",), 25.0, 0.0)
    one_option.plan_buckets({"0": 25 * 2**20})
    assert one_option.contested() == {}


@pytest.mark.parametrize("mb_per_s", [300.0, 125.0])
def test_a_runner_up_that_holds_more_is_not_tried(mb_per_s):
    # Flat + int8 codes the whole bucket on every rank (its residual, its codes), hierarchical + int8 the share the
    # in-node reduce-scatter leaves: predicted 20 % (300 MB/s) and 28 % (1 Gbit/s) slower, it is not the runner-up
    # a trial would time (a trial of it raised int8's peak RSS 40-70 MB a rank for the fit, then lost). At 1 Gbit/s
    # no other option is close: no trial.
    plan = CommPlan(model_of(mb_per_s), (FLAT, HIERARCHICAL), ("none", "int8"), 25.0, 0.0)
    plan.plan_buckets({"0": 25 * 2**20})
    assert plan.decisions()["0"] == (HIERARCHICAL, "int8")
    assert (FLAT, "int8") not in plan.contested().get("0", [])
    if mb_per_s == 125.0:
        assert plan.contested() == {}
    assert holds_more((FLAT, "int8"), (HIERARCHICAL, "int8")) and not holds_more((HIERARCHICAL, "int8"), (FLAT, "int8"))
    assert not holds_more((FLAT, "none"), (HIERARCHICAL, "none")) and not holds_more((FLAT, "int8"), (HIERARCHICAL, "none"))


def ten_gbit_runs() -> list[CostModel]:
    """The cost models of four probes of one job's links (2 x 2 at 10 Gbit/s, 2026-12-05: each stage's latency and
    bandwidth as the plan logged them), which ranked the routes and codecs differently."""
    runs = [  # world/none, world/int8, inter/none, inter/int8, reduce-scatter, all-gather: (ms, MB/s)
        [(2.76, 453.5), (6.95, 435.8), (1.78, 459.4), (3.26, 525.1), (0.90, 1086.1), (0.77, 1356.1)],
        [(3.19, 574.2), (7.51, 456.5), (0.85, 476.0), (3.01, 456.5), (0.86, 1306.7), (0.50, 1855.8)],
        [(4.13, 428.2), (8.16, 554.0), (1.39, 488.9), (6.03, 462.4), (0.93, 1680.9), (1.76, 2033.0)],
        [(3.43, 701.9), (5.39, 474.8), (1.17, 524.6), (2.71, 593.2), (1.03, 1562.8), (0.82, 1725.1)],
    ]
    return [CostModel(2, 2, {("world", "none"): link(*r[0]), ("world", "int8"): link(*r[1]),
                             ("inter", "none"): link(*r[2]), ("inter", "int8"): link(*r[3])},
                      reduce_scatter=link(*r[4]), all_gather=link(*r[5])) for r in runs]


def test_four_probes_of_one_link_plan_alike():
    # The bucket sizes the benchmark's MLP packs at 25 MiB. With CLOSE_S alone the third probe planned bucket 1
    # hierarchical without a codec and bucket 2 flat + int8, both predicted faster than flat without a codec by
    # less than the probes differ; the others all flat without a codec. A close call tried in training is between
    # flat without a codec and an option predicted beyond the band.
    for model in ten_gbit_runs():
        plan = CommPlan(model, (FLAT, HIERARCHICAL), ("none", "int8"), 25.0, 0.0)
        plan.plan_buckets({"0": 50_000, "1": 25_190_000, "2": 21_120_000})
        assert plan.decisions() == {key: (FLAT, "none") for key in "012"}
        for chosen, runner_up in plan.contested().values():
            assert chosen == (FLAT, "none")
            assert plan.model.route_seconds(*runner_up, 21_120_000) > (1 + PREDICTION_BAND) * plan.buckets["2"].predicted_ms / 1e3


def test_a_heavier_option_predicted_fastest_does_not_set_the_band():
    # Three runs of one job at 10 Gbit/s (cluster.py, AdamW, 2026-12-05), the probe's fits as each plan logged them:
    # flat + int8 predicted fastest (the probe codes without backward beside it), the band measured from it, and
    # each run left a different option within it: hierarchical without a codec, flat without, hierarchical + int8.
    runs = [  # world/none, world/int8, inter/none, inter/int8, reduce-scatter, all-gather: (ms, MB/s)
        [(2.20, 372), (5.77, 537), (0.82, 592), (3.14, 534), (0.79, 1271), (0.74, 1297)],
        [(2.16, 402), (4.98, 480), (0.96, 559), (3.57, 381), (0.86, 1047), (0.69, 1534)],
        [(1.69, 424), (4.45, 587), (0.73, 591), (2.84, 673), (0.80, 1019), (0.75, 2302)],
    ]
    for r in runs:
        model = CostModel(2, 2, {("world", "none"): link(*r[0]), ("world", "int8"): link(*r[1]),
                                 ("inter", "none"): link(*r[2]), ("inter", "int8"): link(*r[3])},
                          reduce_scatter=link(*r[4]), all_gather=link(*r[5]))
        assert model.ranked(25_190_000)[0][1:] == FLAT_INT8
        plan = CommPlan(model, (FLAT, HIERARCHICAL), ("none", "int8"), 25.0, 0.0)
        plan.plan_buckets({"0": 50_000, "1": 25_190_000, "2": 21_120_000})
        assert plan.decisions() == {key: (FLAT, "none") for key in "012"}, r


def test_an_option_predicted_faster_within_the_band_goes_by_the_fixed_rule_and_one_beyond_it_does_not():
    model = CostModel(2, 2, {("world", "none"): Fit(0, 1.0), ("world", "int8"): Fit(0, 1 / (1 + PREDICTION_BAND) + 1e-3)})
    assert model.choose(10**6, [FLAT])[:2] == (FLAT, "none")  # int8 predicted ~ 25 % faster: not told apart
    assert model.choose_codec("world", 10**6)[0] == "none"
    faster = CostModel(2, 2, {("world", "none"): Fit(0, 1.0), ("world", "int8"): Fit(0, 0.7)})
    assert faster.choose(10**6, [FLAT])[:2] == (FLAT, "int8") and faster.choose_codec("world", 10**6)[0] == "int8"


@pytest.mark.parametrize(("in_node_mb_per_s", "chosen"), [(500.0, (HIERARCHICAL, "int8")), (300.0, (FLAT, "int8"))])
def test_the_lighter_route_of_one_codec_is_taken_untried_when_the_heavier_leads_by_less_than_the_trial_margin(
        in_node_mb_per_s, chosen):
    # Slow in-node stages put flat + int8 ahead: by 32 % (in-node 500 MB/s): hierarchical + int8, untried (the
    # probe put flat + int8 ahead at 1 Gbit/s, training measured it 29 and 58 % slower in two trials); by 80 %
    # (300 MB/s): flat + int8, a clear call.
    model = dataclasses.replace(model_of(125.0), reduce_scatter=link(0.5, in_node_mb_per_s),
                                all_gather=link(0.5, in_node_mb_per_s))
    assert model.ranked(25 * 2**20)[0][1:] == (FLAT, "int8")
    assert model.choose(25 * 2**20)[:2] == chosen
    plan = CommPlan(model, (FLAT, HIERARCHICAL), ("none", "int8"), 25.0, 0.0)
    plan.plan_buckets({"0": 25 * 2**20})
    assert plan.decisions()["0"] == chosen
    assert plan.buckets["0"].predicted_ms == pytest.approx(model.route_seconds(*chosen, 25 * 2**20) * 1e3)
    assert plan.contested() == {}


@pytest.mark.parametrize("codec, route", [("int8", HIERARCHICAL), ("none", FLAT)])
def test_a_small_buckets_options_a_few_milliseconds_apart_go_by_the_fixed_rule_whatever_their_ratio(codec, route):
    # 16 KiB: latencies only, flat 1-2 ms against the hierarchical stages' 2-3 ms (1.5-2x, but 1 ms apart: what
    # two probes of one link differ by): the fixed rule's route at once, not the probe's pick, and no trial.
    plan = CommPlan(model_of(125.0), (FLAT, HIERARCHICAL), (codec,), 25.0, 0.0)
    flat = plan.model.route_seconds(FLAT, codec, 2**14)
    hierarchical = plan.model.route_seconds(HIERARCHICAL, codec, 2**14)
    assert hierarchical > 1.4 * flat and hierarchical - flat < 5e-3
    plan.plan_buckets({"0": 2**14, "1": 25 * 2**20})
    assert plan.decisions()["0"] == (route, codec) and "0" not in plan.contested()


def settled_alone(chosen: dict[str, tuple[str, str]], runner_up: tuple[str, str],
                  seconds: dict[tuple[str, str], list[float]]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """One rank's planner (no other rank to sum with) whose buckets ``chosen`` (key -> the model's choice) are each
    a close call against the other of two options; each trial step's bucket takes ``seconds[option]``, one value
    after the other. The decisions it settles on, and the reasons it gives."""
    import time
    from types import SimpleNamespace

    model = CostModel(2, 2, {(stage, codec): Fit(0, 1e-9) for stage in ("world", "inter") for codec in ("none", "int8")},
                      reduce_scatter=Fit(0, 0), all_gather=Fit(0, 0))
    plan = CommPlan(model, (FLAT, HIERARCHICAL), ("none", "int8"), 25.0, 0.0)
    options = {key: [option, next(o for o in (runner_up, *seconds) if o != option)] for key, option in chosen.items()}
    for key, option in chosen.items():
        plan.buckets[key] = BucketPlan(key, 4096, *option, 1.0)
    plan.contested = lambda: options  # (the close calls as the model would find them)
    planner = AdaptivePlanner(plan, replan=lambda: None)
    planner._topology = SimpleNamespace(device=torch.device("cpu"))
    planner.report = lambda text: None
    planner.start_trials()
    taken = {option: iter(values) for option, values in seconds.items()}
    for step in range(TRIAL_STEPS + 2):  # a warm-up step, the timed ones, and the step that settles them
        if planner.trials and 1 <= planner._plan_steps <= TRIAL_STEPS:
            option = planner.choice("0")
            assert all(planner.choice(key) == option for key in chosen)  # (the pair's buckets go together)
            seconds_each = next(taken[option]) / len(chosen)
            for key in chosen:
                planner.time(key, time.perf_counter() - seconds_each, None)
        planner.on_after_backward()
        planner.on_after_optimizer_step()
    assert not planner.trials
    return plan.decisions(), plan.reasons


FLAT_INT8, HIER_INT8 = (FLAT, "int8"), (HIERARCHICAL, "int8")


@pytest.mark.parametrize("chosen", [FLAT_INT8, HIER_INT8])
def test_a_close_call_within_the_measured_spread_goes_by_the_fixed_rule_whatever_the_model_chose(chosen):
    # Flat measured 2 % faster (the spread 5 %): not told apart, so the route with fewer bytes across nodes,
    # whichever one the probe happened to predict faster (two runs of one job plan alike).
    decisions, reasons = settled_alone({"0": chosen}, HIER_INT8 if chosen == FLAT_INT8 else FLAT_INT8,
                                       {FLAT_INT8: [0.0200, 0.0203, 0.0201], HIER_INT8: [0.0205, 0.0206, 0.0204]})
    assert decisions == {"0": HIER_INT8}
    assert len(reasons) == 1 and "fixed rule" in reasons[0], reasons


def test_without_a_codec_a_close_call_within_the_spread_goes_flat():
    # No codec: the link is fast enough that the in-node stages cost what they save; the simpler route.
    flat, hierarchical = (FLAT, "none"), (HIERARCHICAL, "none")
    decisions, _ = settled_alone({"0": hierarchical}, flat,
                                 {hierarchical: [0.0200, 0.0203, 0.0201], flat: [0.0205, 0.0206, 0.0204]})
    assert decisions == {"0": flat}


def test_a_close_call_goes_to_the_option_measured_faster_beyond_the_spread():
    decisions, reasons = settled_alone({"0": HIER_INT8}, FLAT_INT8,
                                       {FLAT_INT8: [0.010, 0.011, 0.010], HIER_INT8: [0.020, 0.021, 0.020]})
    assert decisions == {"0": FLAT_INT8} and "beyond the band" in reasons[0], reasons


def test_noisy_trial_steps_widen_the_band_the_fixed_rule_holds():
    # Flat 20 % faster by the medians, but its own steps 40 % apart: not told apart.
    decisions, _ = settled_alone({"0": FLAT_INT8}, HIER_INT8,
                                 {FLAT_INT8: [0.010, 0.014, 0.010], HIER_INT8: [0.0125, 0.0125, 0.0126]})
    assert decisions == {"0": HIER_INT8}


def test_a_trial_whose_steps_spread_wider_than_the_difference_keeps_no_codec_however_wide_the_spread():
    # A run at 10 Gbit/s: int8 measured 47 % faster, no codec's steps 74 % apart. Capped at 30 %, the band let the
    # noise take int8 (three other runs of the job kept no codec).
    flat, flat_int8 = (FLAT, "none"), FLAT_INT8
    decisions, reasons = settled_alone({"0": flat}, flat_int8,
                                       {flat: [0.0551, 0.0560, 0.0958], flat_int8: [0.0375, 0.0400, 0.0380]})
    assert decisions == {"0": flat} and "fixed rule" in reasons[0] and "74 %" in reasons[0], reasons


def test_the_buckets_of_one_close_call_settle_together():
    # Two buckets, the model choosing each way: timed together, one decision for both (no mixed plan of a pair).
    decisions, reasons = settled_alone({"0": FLAT_INT8, "1": HIER_INT8}, HIER_INT8,
                                       {FLAT_INT8: [0.030, 0.031, 0.030], HIER_INT8: [0.020, 0.021, 0.020]})
    assert decisions == {"0": HIER_INT8, "1": HIER_INT8} and len(reasons) == 1 and "0, 1" in reasons[0], reasons


def greedy(sizes: list[int], cap: int) -> list[int]:
    """Bucket bytes as the engine packs ``sizes`` (launch order) under ``cap``."""
    out, current = [], 0
    for s in sizes:
        if current and current + s > cap:
            out.append(current)
            current = 0
        current += s
    return out + ([current] if current else [])


def test_bucket_size_weighs_how_the_layers_pack():
    # 11 layers of a 4 MiB weight and a 4 KiB bias: a capacity just below 4 MiB gives 22 buckets (each weight and
    # each bias alone), twice the latencies of one just above; the choice is never such a capacity.
    layers = [4096, 4 * 2**20] * 11
    model = model_of(125.0)
    cap = model.choose_bucket_bytes(lambda c: greedy(layers, c))
    assert len(greedy(layers, cap)) < 22
    assert cap in {c * 2**20 for c in BUCKET_CAPS_MIB}  # (a listed capacity: two runs can take the same one)
    costs = {c: sum(model.choose(s)[2] for s in greedy(layers, c)) + model.choose(greedy(layers, c)[-1])[2]
             for c in (2**20, 2**22, 2**23, 25 * 2**20)}
    chosen = sum(model.choose(s)[2] for s in greedy(layers, cap)) + model.choose(greedy(layers, cap)[-1])[2]
    assert chosen <= min(costs.values()) * (1 + BUCKET_BAND) + 1e-12


def test_bucket_sizes_that_cost_alike_keep_the_default():
    # Predicted costs 2 % apart (what two probes of one link differ by): 25 MiB, however the noise orders them; a
    # difference beyond the band picks the cheapest.
    for faster in (8, 16, 32):
        costs = {c * 2**20: 1.0 for c in BUCKET_CAPS_MIB}
        costs[faster * 2**20] = 0.98
        model = Priced(costs)
        assert model.choose_bucket_bytes(lambda cap: [cap]) == 25 * 2**20
    model = Priced({**{c * 2**20: 1.0 for c in BUCKET_CAPS_MIB}, 4 * 2**20: 0.7})
    assert model.choose_bucket_bytes(lambda cap: [cap]) == 4 * 2**20


def test_two_probes_of_one_slow_link_give_one_bucket_size():
    # Two runs of one job at 100 Mbit/s, each capacity's predicted ms as the plans logged them (the benchmark's
    # MLP: 4 MiB layers, so 1-4 MiB pack alike). "The nearest 25 MiB within 25 % of the least" took 16 MiB in one
    # and 32 in the other (32 MiB at 1.270 and 1.244 times the least); the default costs 1.33-1.35 times it.
    def priced(ms: tuple[float, ...]) -> Priced:  # (64-256 MiB: one bucket each, the same cost)
        return Priced({c * 2**20: seconds / 1e3 for c, seconds in zip(BUCKET_CAPS_MIB, ms + ms[-1:] * 2)})

    runs = [(1269.8, 1269.8, 1269.8, 1339.9, 1411.3, 1718.7, 1613.0, 2348.0),
            (1127.7, 1127.7, 1127.7, 1182.3, 1231.9, 1494.5, 1403.0, 2037.8)]
    assert {priced(ms).choose_bucket_bytes(lambda cap: [cap]) for ms in runs} == {4 * 2**20}
    # At 10 Gbit/s (and 1 Gbit/s) the default costs 1.11-1.19 times the least: kept.
    ten_gbit = (168.7, 168.7, 168.7, 147.6, 137.6, 159.8, 150.6, 212.6)
    assert priced(ten_gbit).choose_bucket_bytes(lambda cap: [cap]) == 25 * 2**20


class Priced(CostModel):
    """A cost model whose bucket of ``nbytes`` costs ``costs[nbytes]`` (the capacities' own costs, one bucket
    each)."""

    def __init__(self, costs):
        super().__init__(2, 2, {("world", "none"): Fit(0, 1e-9)})
        object.__setattr__(self, "costs", costs)

    def choose(self, nbytes, routes=None, codecs=None):
        return FLAT, "none", self.costs[nbytes] / 2  # (the last bucket counts twice)


# ---------------------------------------------------------------------- flags


@pytest.mark.parametrize("flags", [
    {"compression": "auto"},
    {"compression": "auto", "compression_options": {"candidates": [None, "int8", "powersgd"], "powersgd": {"rank": 2}}},
    {"bucket_size_mb": "auto"},
    {"compression": "auto", "bucket_size_mb": "auto", "hierarchical": None},
])
def test_auto_flags_are_accepted(flags):
    HierarchicalZeroStrategy(**flags)


@pytest.mark.parametrize(("flags", "names"), [
    ({"compression": "auto", "compression_options": {"candidates": ["int9"]}}, ["candidates", "'int8'", "None"]),
    ({"compression": "auto", "compression_options": {"candidates": []}}, ["candidates", "non-empty"]),
    ({"compression": "auto", "compression_options": {"powersgd": {"rank": 2}}}, ["'powersgd'", "candidates"]),
    ({"compression": "auto", "compression_options": {"candidates": ["int8"], "int8": {"block_size": 0}}},
     ["block_size"]),
    ({"bucket_size_mb": "big"}, ["bucket_size_mb", "'auto'"]),
    ({"compression": "automatic"}, ["compression", "'auto'"]),
])
def test_bad_auto_flags_fail_at_construction_naming_the_flag(flags, names):
    with pytest.raises(ValueError) as error:
        HierarchicalZeroStrategy(**flags)
    for name in names:
        assert name in str(error.value)


# ---------------------------------------------------------------------- a codec switch keeps the residual


@pytest.fixture(scope="module")
def ranks():
    with RankPool(WORLD) as pool:
        yield pool


def _bucket(numel: int) -> Bucket:
    p = nn.Parameter(torch.zeros(24, numel // 24))
    return Bucket(index=0, buffer=torch.zeros(numel), params=(p,), names=("w",), offsets=(0,))


def switch_codec(rank, world, name, options, data):
    """Step 1 through codec ``name``, step 2 with no codec after ``fold_residual``; returns both outputs."""
    codec = BUILTIN_CODECS[name](**options)
    codec.on_setup(comm=TracedCommunicator())
    bucket = _bucket(data.shape[-1])
    first = data[rank, 0].clone()
    codec.on_cross_node_reduce(tensor=first, group=dist.group.WORLD, bucket=bucket, offset=0).wait()
    second = data[rank, 1].clone()
    codec.fold_residual(0, second, rank, world)
    dist.all_reduce(second.div_(world))
    return first, second, 0 in codec.states


@pytest.mark.parametrize(("name", "options"), [
    ("int8", {"block_size": 128}), ("topk", {"ratio": 0.05}), ("powersgd", {"rank": 2, "start_iter": 0})])
def test_a_codec_switch_hands_the_residual_to_the_new_route(ranks, name, options):
    # What the codec held back on step 1 reaches the mean on step 2: the two steps' outputs sum to the exact means.
    data = torch.randn(WORLD, 2, 24 * 40, generator=torch.Generator().manual_seed(5))
    first, second, kept = ranks.run(switch_codec, name, options, data)[0]
    exact = data.mean(0)
    assert (first - exact[0]).abs().max() > 1e-2  # step 1 did hold something back
    torch.testing.assert_close(first + second, exact.sum(0), atol=1e-5, rtol=1e-5)
    assert not kept  # and the old codec forgot the bucket


def auto_codec_switch(rank, world, data):
    """The plugin path: ``compression="auto"`` with a plan that names int8 for bucket 0, then no codec."""
    model = CostModel(1, world, {("world", "none"): Fit(0, 1e-9), ("world", "int8"): Fit(0, 1e-9)})
    plan = CommPlan(model, (FLAT,), ("none", "int8"), 25.0, 0.0)
    plan.buckets["0"] = BucketPlan("0", data.shape[-1] * 4, FLAT, "int8", 1.0)
    planner = AdaptivePlanner(plan, replan=lambda: None)
    pm = build_plugin_manager("auto", (), planner=planner, compression_options={"int8": {"block_size": 128}})
    comm = TracedCommunicator()
    for name in ("mean_allreduce", "int8", "traffic"):
        pm.get_plugin(name).on_setup(comm=comm)
    pm.get_plugin("auto").on_setup(topology=None)
    bucket = _bucket(data.shape[-1])
    outs = []
    for step in range(2):
        tensor = data[rank, step].clone()
        pm.hook.on_cross_node_reduce(tensor=tensor, group=dist.group.WORLD, bucket=bucket, offset=0).wait()
        outs.append(tensor)
        plan.buckets["0"].codec = "none"
    return outs, pm.get_plugin("int8").states.keys() == set()


def route_switch(rank, world, first, second, data):
    """2 nodes x 2: bucket 0 takes ``first`` = (route, codec) on step 1 and ``second`` on step 2, through the plugins
    a plan sets up (reducer, auto codec, int8)."""
    from ddp_plugin.runtime.topology import Layout, build_topology

    topology = build_topology(Layout(world, 2), torch.device("cpu"))
    model = CostModel(2, 2, {(s, c): Fit(0, 1e-9) for s in ("world", "inter") for c in ("none", "int8")},
                      reduce_scatter=Fit(0, 1e-9), all_gather=Fit(0, 1e-9))
    plan = CommPlan(model, (FLAT, HIERARCHICAL), ("none", "int8"), 25.0, 0.0)
    plan.buckets["0"] = BucketPlan("0", data.shape[-1] * 4, *first, 1.0)
    planner = AdaptivePlanner(plan, replan=lambda: None)
    pm = build_plugin_manager("auto", (), hierarchical=True, planner=planner,
                              compression_options={"int8": {"block_size": 128}})
    bucket = _bucket(data.shape[-1])
    pm.hook.on_setup(topology=topology, buckets=[bucket], hook=pm.hook, options=None, module=None,
                     comm=TracedCommunicator(2))
    outs = []
    for step, (route, codec) in enumerate((first, second)):
        plan.buckets["0"].route, plan.buckets["0"].codec = route, codec
        bucket.buffer.copy_(data[rank, step])
        pm.hook.on_bucket_ready(bucket=bucket).wait()
        outs.append(bucket.buffer.clone())
    return outs


@pytest.mark.parametrize(("first", "second"), [
    ((HIERARCHICAL, "int8"), (FLAT, "none")), ((FLAT, "int8"), (HIERARCHICAL, "none")),
    ((HIERARCHICAL, "int8"), (HIERARCHICAL, "none"))])
def test_a_route_switch_hands_the_residual_over_in_the_old_routes_units(ranks, first, second):
    data = torch.randn(WORLD, 2, 24 * 40, generator=torch.Generator().manual_seed(7))
    outs = ranks.run(route_switch, first, second, data)
    exact = data.mean(0)
    assert (outs[0][0] - exact[0]).abs().max() > 1e-3  # int8 held something back on step 1
    for first_out, second_out in outs:  # every rank, and the two steps together exact
        torch.testing.assert_close(first_out + second_out, exact.sum(0), atol=1e-5, rtol=1e-5)


def test_auto_codec_follows_the_plan_and_carries_the_residual_across_a_switch(ranks):
    data = torch.randn(WORLD, 2, 24 * 40, generator=torch.Generator().manual_seed(6))
    (first, second), forgotten = ranks.run(auto_codec_switch, data)[0]
    exact = data.mean(0)
    assert (first - exact[0]).abs().max() > 1e-2  # int8 coded step 1
    torch.testing.assert_close(first + second, exact.sum(0), atol=1e-5, rtol=1e-5)
    assert forgotten


def settle_trials_per_position(rank, world, dimension, seconds):
    """4 ranks in 2 positions of ``dimension`` (pipeline stages, or tensor-parallel ranks) x 2 data-parallel ranks,
    each position with its own bucket "0" contested between no codec and int8: times each option as measured
    (``seconds[position] = (none, int8)``) on the trial steps; returns the codec each rank settles on, and the keys
    it settled."""
    import time

    from ddp_plugin.runtime.topology import Layout, build_topology

    layout = Layout(world, 2, **{f"{dimension}_parallel_size": 2})
    topology = build_topology(layout, torch.device("cpu"))
    position = topology.pipeline_parallel_rank if dimension == "pipeline" else topology.tensor_parallel_rank
    model = CostModel(1, 2, {("world", "none"): Fit(0.020, 1e-9), ("world", "int8"): Fit(0.026, 1e-9)})  # (close)
    plan = CommPlan(model, (FLAT,), ("none", "int8"), 25.0, 0.0)
    keys = [str(i) for i in range(1 + position)]  # the positions' buckets differ (position 1 has one more)
    for key in keys:
        plan.buckets[key] = BucketPlan(key, 4096, FLAT, "none", 1.0)
    planner = AdaptivePlanner(plan, replan=lambda: None)
    planner.on_setup(topology=topology, hook=None, comm=TracedCommunicator(2))
    planner.start_trials()
    assert sorted(planner.trials) == keys, planner.trials
    for _ in range(TRIAL_STEPS + 2):  # a warm-up step, the timed ones, and the step that settles them
        for key in keys:
            option = planner.trials[key][planner._plan_steps % 2][1] if planner.trials else "none"
            planner.time(key, time.perf_counter() - seconds[position][option == "int8"], None)
        planner.on_after_backward()
        planner.on_after_optimizer_step()
    return position, plan.buckets["0"].codec, sorted(plan.settled)


@pytest.mark.parametrize("dimension", ["pipeline", "tensor"])
def test_close_calls_are_settled_by_the_data_parallel_ranks_that_hold_the_bucket(ranks, dimension):
    # Bucket "0" of one pipeline stage (or tensor-parallel shard) and bucket "0" of the other are different
    # buckets: each position's data-parallel ranks settle theirs by their own times (summed over every rank,
    # position 0's 50 ms would outvote position 1), and a position with more close calls than the other settles
    # them all (different numbers of values to sum must not meet in one collective).
    settled = ranks.run(settle_trials_per_position, dimension, {0: (0.05, 0.01), 1: (0.01, 0.02)})
    assert sorted(settled) == [(0, "int8", ["0"])] * 2 + [(1, "none", ["0", "1"])] * 2


# ---------------------------------------------------------------------- the link probe


def probe_with(rank, world, names, max_bytes=None):
    """The link probe of 2 nodes x 2 over both routes, timing the codecs ``names`` alone (as ``compression=``
    one of them sets it up: no plain mean among the candidates), each a fresh instance; returns every call each
    codec got, as (bucket kind, key, values), and whether the probe fitted a model. ``max_bytes``: the probe's
    (a list: each rank's own)."""
    from ddp_plugin.strategy.link_probe import probe, probe_codecs
    from ddp_plugin.runtime.topology import Layout, build_topology

    topology = build_topology(Layout(world, 2), torch.device("cpu"))
    comm = TracedCommunicator(2)
    calls: dict[str, list[tuple[str, int | str, int]]] = {name: [] for name in names}
    live: dict[str, int] = dict.fromkeys(names, 0)  # the most bucket states a codec held at a call

    def recorded(name, reduce):
        def run(x, group, bucket):
            calls[name].append((bucket.kind, bucket.index, x.numel()))
            live[name] = max(live[name], len(reduce.codec.states))
            return reduce(x, group, bucket)
        run.codec = reduce.codec
        return run

    codecs = probe_codecs(names, names[0] if len(names) == 1 else "auto", {}, comm, {})
    model, _ = probe(topology, comm, {n: recorded(n, r) for n, r in codecs.items()}, (FLAT, HIERARCHICAL),
                     torch.device("cpu"), reps=2, max_bytes=None if max_bytes is None else max_bytes[rank])
    return calls, sorted(model.cross), live, {n: len(c.codec.states) for n, c in codecs.items()}


@pytest.mark.parametrize("names", [("powersgd",), ("int8", "topk", "powersgd")])
def test_the_probe_times_every_size_on_a_codec_state_of_its_own_after_a_warm_up(ranks, names):
    # PowerSGD alone (compression="powersgd", the route left to the plan) used to crash the probe: its pilot grew
    # the tensor under one bucket key, and the second size met the first size's state.
    for calls, fitted, _, _ in ranks.run(probe_with, names):
        assert fitted == sorted((stage, n) for stage in ("inter", "world") for n in names)
        for name in names:
            sizes: dict[int | str, set[int]] = {}
            counts: dict[int | str, int] = {}
            for kind, key, numel in calls[name]:
                assert kind == "probe"
                sizes.setdefault(key, set()).add(numel)
                counts[key] = counts.get(key, 0) + 1
            assert all(len(s) == 1 for s in sizes.values()), (name, sizes)  # one size per key: its own state
            assert min(counts.values()) >= 2, (name, counts)  # an untimed first call, then the timed ones
            assert len(counts) >= 6  # three sizes per route, at least


def test_the_probe_times_no_size_beyond_the_largest_ranks_gradients(ranks):
    """A model of 0.1 MB was probed at 16 KiB, 4 and 16 MiB, coding 16 MiB with every candidate (0.55-1.35 s of a
    2 x 2 fit's setup on 2 cores); no bucket of it holds more than its gradients. Each rank's cap is its own (a
    pipeline stage holds fewer parameters than another), the probe's sizes every rank's: the largest rank's cap.
    (A cap that is not a whole number of the probe's size unit left the pilot growing forever: the rounded size
    never reached the cap.)"""
    from ddp_plugin.gradients.planning import MIN_PROBE_BYTES

    caps = [70_001, 106_753, 90_000, 20_000]  # bytes, rank by rank; not multiples of the size unit
    for calls, fitted, _, _ in ranks.run(probe_with, ("int8",), caps):
        assert fitted == [("inter", "int8"), ("world", "int8")]
        sizes = sorted({numel * 4 for _, _, numel in calls["int8"]})
        assert max(sizes) <= max(caps), sizes
        assert max(sizes) > max(caps) * 0.9, sizes  # (grown to it: the latency's 16 KiB is not the bandwidth's)
        assert len(sizes) >= 2 and min(sizes) < max(sizes), sizes
    for calls, _, _, _ in ranks.run(probe_with, ("int8",), [1_000] * WORLD):  # a tiny model: at least 64 KiB
        assert max(numel * 4 for _, _, numel in calls["int8"]) == MIN_PROBE_BYTES


def test_the_probe_holds_one_sizes_codec_state_at_a_time(ranks):
    """Each timed size's codec state is dropped once that size is timed: held together (int8's residuals of up to
    16 MiB per stage and size), they made the probe the fit's peak of memory: with ``compression="int8"`` and
    ``hierarchical=None`` 505-516 MB of peak RSS a rank after the probe on the cluster benchmark, 455-468 after."""
    for _, _, live, left in ranks.run(probe_with, ("int8", "powersgd")):
        assert live == {"int8": 1, "powersgd": 1}, live  # (at a size's first call the state before it is gone)
        assert left == {"int8": 0, "powersgd": 0}, left


# ---------------------------------------------------------------------- training with a plan (2 x 2, loopback)


def train(tmp_path, configs: dict[str, dict], steps: int = 8, extra: dict[str, list[str]] | None = None
          ) -> dict[str, list[dict]]:
    """Every configuration one after the other in the same 4 processes (2 simulated nodes x 2); ``extra``: more
    arguments of the worker per configuration."""
    runs = [["--out", str(tmp_path / name), "--flags", json.dumps(flags), "--steps", str(steps),
             *(extra or {}).get(name, [])] for name, flags in configs.items()]
    for name in configs:
        (tmp_path / name).mkdir()
    run_python(WORKERS / "adaptive_run.py", "--runs", json.dumps(runs), timeout=900)
    return {name: [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(WORLD)]
            for name in configs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return train(tmp_path_factory.mktemp("adaptive"), {
        "auto": {"compression": "auto", "bucket_size_mb": "auto"},
        "route_only": {"bucket_size_mb": 0.25},
        "zero2": {"compression": "auto", "zero_stage": 2, "bucket_size_mb": 0.25},
        "diloco": {"compression": "auto", "sync_every": 3, "shard_scope": "node", "bucket_size_mb": 0.25},
        "fixed": {"hierarchical": True, "compression": "int8"},
        "diloco_zero2_replanned": {"compression": "auto", "sync_every": 3, "zero_stage": 2, "shard_scope": "node",
                                   "bucket_size_mb": 0.25},
    }, extra={"diloco_zero2_replanned": ["--replan-at", "4"]})


def test_a_replan_with_a_sync_mode_decides_its_cross_node_stage_again(runs):
    # The first probe times both routes and the plan keeps one for the fit (the sync mode's); a re-plan probed that
    # route's stages only, and the sync mode's cross-node stage then had no codec to choose from (a ValueError on
    # every rank, found by the default-paths matrix: DiLoCo, ZeRO 2, "auto", when a slowdown made it re-plan).
    results = runs["diloco_zero2_replanned"]
    plan = results[0]["plan"]
    assert [version for version, _, _ in plan["history"]][-1] >= 2 and any(
        step == 4 for version, step, _ in plan["history"] if version >= 2), plan["history"]
    assert all(r["plan"]["history"] == plan["history"] for r in results)
    assert all(b["codec"] in plan["codecs"] for b in plan["buckets"].values())
    assert all(r["params_finite"] for r in results)


@pytest.mark.parametrize("name", ["auto", "route_only", "zero2", "diloco"])
def test_every_rank_holds_rank_0s_plan(runs, name):
    results = runs[name]
    plans = [r["plan"] for r in results]
    assert plans[0] is not None
    for plan in plans[1:]:
        assert plan["history"] == plans[0]["history"]
        assert plan["links"] == plans[0]["links"]
    assert all(r["params_finite"] for r in results)


def test_the_plan_decides_every_bucket_from_measured_links(runs):
    result = runs["auto"][0]
    plan = result["plan"]
    assert set(plan["routes"]) == {FLAT, HIERARCHICAL} and plan["codecs"] == ["none", "int8"]
    assert set(result["engine_buckets"]) <= set(plan["buckets"])
    replanned_at_the_end = plan["history"][-1][1] == 8  # (a busy machine can make its times depart)
    for b in plan["buckets"].values():
        assert b["route"] in plan["routes"] and b["codec"] in plan["codecs"]
        assert b["predicted_ms"] > 0
        assert replanned_at_the_end or (b["measured_ms"] is not None and b["measured_ms"] > 0)
    for fit in plan["links"].values():
        assert fit["latency_ms"] >= 0 and fit["MB_per_s"] > 0
    assert 1.0 <= plan["bucket_size_mb"] <= 256.0
    assert 0 < plan["probe_s"] < 30
    metrics = result["metrics"]
    assert metrics["comm/predicted_ms"] > 0 and metrics["comm/measured_ms"] > 0 and metrics["comm/plan_version"] >= 1


def test_without_auto_flags_the_plan_chooses_the_route_only(runs):
    plan = runs["route_only"][0]["plan"]
    assert plan["codecs"] == ["none"] and set(plan["routes"]) == {FLAT, HIERARCHICAL}
    assert plan["bucket_size_mb"] == 0.25


def test_a_sharder_gets_one_route_for_the_fit_and_a_codec_per_bucket(runs):
    result = runs["zero2"][0]
    plan = result["plan"]
    assert len(plan["routes"]) == 1 and result["hierarchical"] == (plan["routes"] == [HIERARCHICAL])
    assert set(result["engine_buckets"]) <= set(plan["buckets"])


def test_a_sync_modes_outer_average_is_planned_too(runs):
    plan = runs["diloco"][0]["plan"]
    outer = [k for k in plan["buckets"] if k.startswith("pseudo_gradient/")]
    assert outer, plan["buckets"].keys()
    for key in outer:
        assert plan["buckets"][key]["codec"] in ("none", "int8")
        assert plan["buckets"][key]["measured_ms"] is not None


def test_nothing_is_probed_when_every_choice_is_set(runs):
    assert all(r["plan"] is None for r in runs["fixed"])


def test_auto_composes_with_tensor_and_pipeline_parallelism(tmp_path):
    # TP 2 inside each of 2 simulated nodes (data parallelism across them), and 2 pipeline stages x 2 data-parallel
    # ranks: the plan is made over each mesh's data-parallel ranks, and replicas and tied copies stay bit-identical.
    auto = json.dumps({"hierarchical": None, "compression": "auto"})
    run_python(WORKERS / "tp_run.py", "--out", tmp_path, "--devices", "4", "--devices-per-node", "2", "--tp", "2",
               "--variants", "0:replicated:auto", "--flags", auto, timeout=600)
    tp = torch.load(tmp_path / "0-replicated-auto.pt")
    assert tp["max_replica_diff"] == 0 and tp["metrics"]["comm/plan_version"] >= 1
    run_python(WORKERS / "pp_run.py", "--out", tmp_path, "--devices", "4", "--devices-per-node", "2", "--pp", "2",
               "--variants", "1f1b:0:auto", "--flags", auto, timeout=600)
    pp = torch.load(tmp_path / "1f1b-0-auto.pt")
    assert pp["max_replica_diff"] == 0 and pp["max_tie_diff"] == 0
    assert all(math.isfinite(loss) for loss in pp["losses"])


def test_a_tied_weights_codec_is_agreed_by_the_stages_that_plan_apart(tmp_path):
    # Each pipeline stage's data-parallel ranks probe and plan their own links; a tied embedding's sum runs between
    # the stages. Here the last stage's plan takes int8 wherever it can and the first stage's the plain mean, as
    # probes on a busy machine can measure: the sum's collectives must still match (before, the stages ran
    # different collectives on the tie's group and hung, once in CI).
    auto = json.dumps({"hierarchical": None, "compression": "auto", "timeout": 120})
    run_python(WORKERS / "pp_run.py", "--out", tmp_path, "--devices", "4", "--devices-per-node", "2", "--pp", "2",
               "--variants", "1f1b:0:auto", "--flags", auto, "--prefer-codecs-on-last-stage", timeout=600)
    pp = torch.load(tmp_path / "1f1b-0-auto.pt")
    assert pp["max_replica_diff"] == 0 and pp["max_tie_diff"] == 0
    assert all(math.isfinite(loss) for loss in pp["losses"])


# ---------------------------------------------------------------------- a link that changes (simulated cluster)


@needs_cluster
def test_the_plan_follows_a_link_that_slows_down_within_a_few_steps(cluster, tmp_path):
    slow_at, steps = 12, 22
    attempts = 3
    for attempt in range(attempts):
        out = tmp_path / str(attempt)
        out.mkdir()
        cluster.set_rate("10gbit")
        try:
            results = cluster.launch([str(WORKERS / "adaptive_run.py"), "--out", str(out), "--num-nodes", "2",
                                      "--devices", "2", "--width", "512", "--layers", "3", "--steps", str(steps),
                                      "--flags", json.dumps({"compression": "auto", "bucket_size_mb": 1}),
                                      "--slow-at", str(slow_at), "--slow-rate", "20mbit"],
                                     nproc_per_node=2, timeout=600)
        finally:
            cluster.set_rate("1gbit")
        for r in sorted(results, key=lambda r: r.killed):
            assert r.ok, f"node {r.node} exited with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
        plans = [r["plan"] for r in ranks]
        for plan in plans[1:]:
            assert plan["history"] == plans[0]["history"]  # no rank disagreed, at any version
        history = plans[0]["history"]
        replans = [step for version, step, _ in history if version > 1]
        assert replans, history
        # A re-plan before the link changed answered this machine's load (another test's heavy I/O beside this
        # one, seen once in CI), and then kept the next plan from coming for 10 steps, past the slowdown: the
        # latency this test measures cannot be read from such a run. Run again; three times in a row fails (twice
        # in a row was seen in CI, with the other worker's 4-rank runs beside it).
        if replans[0] > slow_at or attempt == attempts - 1:
            break
    # Detected within a few steps of the slowdown: close calls settled (steps 2-7), 1 warm-up + 3 baseline steps
    # happened before it, then 3 departing steps, and the agreement on them comes back after the next step.
    assert slow_at < replans[0] <= slow_at + 6, history
    # At 20 Mbit/s int8 carries a quarter of the bytes: every large bucket takes it after the re-plan.
    final = history[-1][2]
    large = [k for k, b in plans[0]["buckets"].items() if b["nbytes"] >= 2**19]
    assert large and all(final[k][1] == "int8" for k in large), final
