"""Pipeline parallelism benchmark: a GPT on the simulated 2-node x 2-rank cluster, a pipeline stage per node (P 2)
and data parallelism inside each node (D 2), against data parallelism across the nodes (ours, int8) and Lightning
``ddp``, at one or several inter-node link rates.

    python benchmarks/pipeline.py                               # 1 Gbit/s
    python benchmarks/pipeline.py --rates 100mbit,1gbit,none --repeats 2

The pipeline contenders: today's defaults (``ours_pp2``), each change for slow links alone (the tie's sum through
``compression="int8"``, ``pipeline_activations="bf16"``, ``pipeline_split="time"``) and all three together
(``ours_pp2_all``); ``ours_pp2_gpipe`` and ``ours_pp2_all_cut`` (the three with the middle block cut after its
attention, named: the cut the split by time makes with a rank per core) on request. The rate ``none`` runs the same cluster with the link uncapped:
each contender's compute floor, set beside its capped steps in a table of its own.

Every contender trains the same tied-embedding GPT (``ddp_plugin.testing.gpt``) from the same seed on the same token
windows, global batch B 16, AdamW, under Lightning, one torchrun per node (``benchmarks/pipeline.py --worker``).
Global rank = pipeline rank * 2 + data-parallel rank: node 0 runs stage 0 (embeddings and the first blocks), node
1 the rest (final norm and the head, tied to the embedding), and no data-parallel traffic crosses the link.
Measured on the timed window (after the warmup steps): the interval from one batch's start to the next's on rank
0, median over the steps; cross-node bytes per node and step from the node's veth counters (read by its local
rank 0 after a barrier at the window's start and end); our own accounting (``comm/cross_node_MB``); peak RSS of
every rank.

Predicted cross-node bytes per node and step of a pipeline contender (float32; s seq, d d_model, V vocab):

- activations: each of the D ranks of stage 0 sends M microbatches of B/(D*M) windows to its peer on stage 1
  (s*d*4 bytes per window), and gets their gradients back: B*s*d*4 bytes from each node;
- the tied embedding: its gradient summed between its copy on the first stage and on the last after the
  in-stage data-parallel mean (ZeRO stage 0): each of the D data-parallel positions sums its 1/D part in a 2-rank
  gloo all-reduce, each rank sending its part's bytes (half in the reduce-scatter, half in the all-gather;
  measured alone: 1.002 x on the veth), and the stage all-gathers the parts inside its node: V*d*4 bytes from
  each node;
- the step's mean loss, broadcast from the last stage: 4 bytes per data-parallel position, from node 1 (2*D per
  node on average). Frame headers and ACKs are not counted: the ratio measured / predicted shows them.

With ``pipeline_activations="bf16"`` the activations are B*s*d*2 bytes (``"int8"``: B*s*(d+4), a scale per row);
with the tie's sum through int8 each part crosses as int8 codes plus one fp32 scale per 1024 values, a
reduce-scatter and an all-gather of half the part each on the 2-rank group: V*d*4 (1/4 + 1/1024) bytes from each
node. At ZeRO stages 1-3 (the ``_z`` contenders) the same: each data-parallel rank sums its own 1/D part (its
shard at stages 2-3), and a stage's shards and gathered units stay inside its node.

Bubble: on every rank of a pipeline contender the benchmark times (wrapping methods of the strategy's schedule
and stages, not the library's code) the schedule's step and, inside it, the stage's forward, backward and loss
of each microbatch. Idle share = 1 - compute / schedule time: the time the stage waited for a neighbour, that is
the pipeline bubble plus activations and gradients in flight. It is set beside the schedule's ideal bubble for
equal stages, (P-1)/(M+P-1), and beside the ideal for stages with the measured compute times c_s (fill and drain,
no transfers): 1 - c_s / (max(c) (M-1)/M + sum(c)/M). The stages are balanced by parameter count (by time where
the contender says so, which may cut a block between the stages: the stage table shows where) and the last
also computes the head and the loss (its tied weight counts on both), so they are not equal. Caveat: 4 ranks
share the machine's cores, so a waiting rank lends its core to the others and compute times stretch with what
else runs: this is this machine's idle share, not that of a device per rank. ``--ranks-per-node 1`` runs P 2 x D 1
instead (2 ranks: one per core on a 2-core machine, none waiting for a core), which measures the schedule's idle
share itself; the data-parallel contenders then run on the same 2 ranks.

Writes ``benchmarks/results/pipeline.md`` (``--out``) and a PNG beside it. Needs root and iproute2; where the
cluster cannot be built it prints why and exits 0. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import MB

DEFAULT_OUT = harness.RESULTS / "pipeline.md"
P = 2  # pipeline stages: one per node

CONTENDERS = {
    "lightning_ddp": "Lightning `ddp`, the whole model on every rank",
    "ours_dp_int8": "ours, DP 4 across nodes, hierarchical, `compression=\"int8\"`",
    "ours_pp2": "ours, PP 2 (a stage per node) x DP 2, 1F1B",
    "ours_pp2_int8": "ours, PP 2 x DP 2, 1F1B, the tie's sum through `compression=\"int8\"`",
    "ours_pp2_bf16": "ours, PP 2 x DP 2, 1F1B, `pipeline_activations=\"bf16\"`",
    "ours_pp2_int8act": "ours, PP 2 x DP 2, 1F1B, `pipeline_activations=\"int8\"`",
    "ours_pp2_time": "ours, PP 2 x DP 2, 1F1B, `pipeline_split=\"time\"`",
    "ours_pp2_all": "ours, PP 2 x DP 2, 1F1B, int8 tie + bf16 activations + split by time",
    "ours_pp2_gpipe": "ours, PP 2 x DP 2, GPipe",
    "ours_pp2_all_cut": "ours, PP 2 x DP 2, 1F1B, int8 tie + bf16 activations, the middle block cut after its attention",
    **{f"ours_pp2_all_z{z}": f"ours, PP 2 x DP 2, 1F1B, int8 tie + bf16 activations + split by time, ZeRO stage {z}"
       for z in (1, 2, 3)},
}
DEFAULT_CONTENDERS = ("lightning_ddp", "ours_dp_int8", "ours_pp2", "ours_pp2_int8", "ours_pp2_bf16", "ours_pp2_time",
                      "ours_pp2_all")
PIPELINES = {  # the pipeline contenders: their schedule and flags
    "ours_pp2": ("1f1b", {}),
    "ours_pp2_int8": ("1f1b", {"compression": "int8"}),
    "ours_pp2_bf16": ("1f1b", {"pipeline_activations": "bf16"}),
    "ours_pp2_int8act": ("1f1b", {"pipeline_activations": "int8"}),
    "ours_pp2_time": ("1f1b", {"pipeline_split": "time"}),
    "ours_pp2_all": ("1f1b", {"compression": "int8", "pipeline_activations": "bf16", "pipeline_split": "time"}),
    "ours_pp2_gpipe": ("gpipe", {}),
    # the cut `pipeline_split="time"` makes with a rank per core, named (the setup's timing is not repeated)
    "ours_pp2_all_cut": ("1f1b", {"compression": "int8", "pipeline_activations": "bf16", "pipeline_split": "cut"}),
    **{f"ours_pp2_all_z{z}": ("1f1b", {"compression": "int8", "pipeline_activations": "bf16",
                                       "pipeline_split": "time", "zero_stage": z}) for z in (1, 2, 3)},
}
SCHEDULES = {name: schedule for name, (schedule, _) in PIPELINES.items()}
INT8_BLOCK = 1024  # the int8 codec's default values per scale


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    harness.add_names(p, "--contenders", CONTENDERS, DEFAULT_CONTENDERS)
    p.add_argument("--rates", "--rate", dest="rates", default="1gbit",
                   help="inter-node link rate(s) per direction, tc notation, comma-separated (one cluster each);"
                        " 'none': the link uncapped (the compute floor)")
    p.add_argument("--microbatches", type=int, default=8, help="M of the pipeline contenders")
    p.add_argument("--ranks-per-node", type=int, default=2, choices=(1, 2),
                   help="D: ranks per node, the data-parallel ranks of a stage (1: a rank per core, no rank waits"
                        " for a core; the idle share then measures the schedule, not the cores' sharing)")
    harness.add_gpt(p)
    harness.add_common(p, out=DEFAULT_OUT, repeats=1, repeats_help="runs per contender and rate, interleaved")
    args = p.parse_args(argv)
    args.contenders = harness.names(p, args.contenders, CONTENDERS)
    args.rates = harness.split(args.rates)
    D = args.ranks_per_node
    if args.global_batch % (D * args.microbatches) or args.microbatches < P:
        p.error(f"--microbatches {args.microbatches}: at least {P}, and --global-batch {args.global_batch} must"
                f" split into D={D} ranks x M={args.microbatches} microbatches")
    return args


def predicted_bytes(args: argparse.Namespace, name: str = "ours_pp2") -> dict[str, float]:
    """Cross-node bytes per node and step of a pipeline contender (mean of the 2 nodes), by the docstring's terms,
    with the contender's activation dtype and codec."""
    flags = PIPELINES[name][1]
    # bytes per value: int8 rows carry a 4-byte scale each
    width = {"bf16": 2, "fp16": 2, "int8": 1 + 4 / args.d_model}.get(flags.get("pipeline_activations"), 4)
    tie = args.vocab * args.d_model * 4
    if flags.get("compression") == "int8":  # a 2-rank group: 2(n-1)/n (S/4 + S/block) with n = 2
        tie = tie / 4 + tie / INT8_BLOCK
    return {"activations": args.global_batch * args.seq * args.d_model * width, "tie": tie, "loss": 4 * args.ranks_per_node / 2}


# ---------------------------------------------------------------------------------------------- worker (per rank)


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.gpt import GPTModule
    from ddp_plugin.testing.windows import StepWindow

    torch.set_num_threads(1)
    name = args.contender
    size = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers, seq=args.seq)

    class Window(StepWindow):
        """The timed window, and per timed step the seconds spent in the pipeline's parts."""

        def __init__(self) -> None:
            super().__init__(args.warmup, args.steps)
            self.timers: dict[str, float] = {}  # this step's seconds in the pipeline's parts
            self.steps: list[dict[str, float]] = []  # the timed steps' timers

        def _timed(self, obj: Any, method: str, key: str) -> None:
            original = getattr(obj, method)

            def timed(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return original(*a, **k)
                finally:
                    self.timers[key] = self.timers.get(key, 0.0) + time.perf_counter() - t0

            setattr(obj, method, timed)  # on the instance: the schedule calls self._stage.forward_one_chunk(...)

        def on_train_start(self, trainer, pl_module) -> None:
            runner = getattr(getattr(trainer.strategy, "fit", None), "pipeline", None)  # (benchmark instrumentation only)
            if runner is None:
                return
            self._timed(runner.schedule, "step", "schedule_s")
            self._timed(runner.schedule, "_maybe_compute_loss", "loss_s")
            self._timed(runner.tied, "sum", "tie_s")
            self._timed(runner, "synchronize", "sync_s")  # the stage's sync, tie all-reduce included
            for stage in runner.stages:
                self._timed(stage, "forward_one_chunk", "forward_s")
                self._timed(stage, "backward_one_chunk", "backward_s")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            self.timers = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= args.warmup and self.timers:
                self.steps.append(dict(self.timers))
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    L.seed_everything(0, verbose=False)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    world = int(os.environ["WORLD_SIZE"])
    if name == "lightning_ddp":
        strategy: Any = "ddp"
    elif name == "ours_dp_int8":
        strategy = HierarchicalZeroStrategy(hierarchical=True, compression="int8")
    else:
        schedule, flags = PIPELINES[name]
        if flags.get("pipeline_split") == "cut":  # block layers // 2 cut after its attention, one stage each side
            middle = args.layers // 2
            flags = {**flags, "pipeline_split": [[*(f"blocks.{i}" for i in range(middle)), f"blocks.{middle}.attn"],
                                                 [f"blocks.{middle}.mlp",
                                                  *(f"blocks.{i}" for i in range(middle + 1, args.layers))]]}
        strategy = HierarchicalZeroStrategy(pipeline_parallel_size=P, pipeline_microbatches=args.microbatches,
                                            pipeline_schedule=schedule, devices_per_node=per_node, **flags)
    model = GPTModule(lr=3e-4, **size)
    window = Window()

    def stages(out: dict[str, Any]) -> None:
        out["steps"] = window.steps
        plan = getattr(model, "_ddp_plugin_stages", None)  # (private: which blocks each stage ran)
        out["stage_blocks"] = [list(b) for b in plan[0].stage_blocks] if plan else None
        out["cuts"] = [[i, cut.at] for i, cut in plan[0].cuts] if plan else []

    harness.fit_gpt_window(args, strategy, model, window, per_node if name in SCHEDULES else world, stages)


# ---------------------------------------------------------------------------------------------- driver


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if not harness.need_cluster("pipeline.py"):
        return 0
    from ddp_plugin.testing.simcluster import SimulatedCluster

    bench = harness.Run(__file__, argv, quiet=args.quiet, ranks=2 * args.ranks_per_node)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {(r, c): [] for r in args.rates for c in args.contenders}
    for rate in args.rates:
        with SimulatedCluster(nodes=2, rate=None if rate == "none" else rate, prefix="ddppp") as cluster, \
                tempfile.TemporaryDirectory() as tmp:
            for i, name in enumerate(harness.interleaved(args.contenders, args.repeats)):
                results[rate, name].append(harness.launch_gpt(cluster, __file__, args, name, Path(tmp) / f"{i}-{name}",
                                                              args.ranks_per_node, f"{rate} {name}",
                                                              ("microbatches", "ranks_per_node")))
    rows = [summarize(args, rate, name, results[rate, name]) for rate in args.rates for name in args.contenders]
    png = args.out.with_suffix(".png")
    plotted = plot(rows, png, args.rates)
    harness.write(args.out, markdown(args, bench, rows), also=[png] if plotted else [])
    return 0


def summarize(args: argparse.Namespace, rate: str, name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r["ranks"] for r in runs if "ranks" in r]
    label = CONTENDERS[name].replace("DP 2", f"DP {args.ranks_per_node}").replace("DP 4", f"DP {2 * args.ranks_per_node}")
    row: dict[str, Any] = {"rate": rate, "name": name, "label": label}
    if not ok:
        row["error"] = runs[-1]["error"]
        return row
    row.update(harness.gpt_row(ok, args.steps))
    # Every rank's last loss, averaged: the global batch's mean loss under every layout (a pipeline stage reports
    # its data-parallel rank's mean over the microbatches).
    row["final_loss"] = statistics.mean(statistics.mean(r["losses"][-1] for r in ranks) for ranks in ok)
    # (for a convergence comparison over many steps: the last 10 steps' mean, less noisy than the last step's)
    row["tail_loss"] = statistics.mean(statistics.mean(statistics.mean(r["losses"][-10:]) for r in ranks)
                                       for ranks in ok)
    if name in SCHEDULES:
        row["predicted_mb"] = sum(predicted_bytes(args, name).values()) / MB
        stages = []
        for s in range(P):  # rank // D is the pipeline rank (= the node)
            mine = [step for ranks in ok for r in ranks if r["rank"] // args.ranks_per_node == s
                    for step in r["steps"]]

            def med(key: str, of: list[dict[str, float]] = mine) -> float:
                return statistics.median(step.get(key, 0.0) for step in of)

            compute = [st.get("forward_s", 0) + st.get("backward_s", 0) + st.get("loss_s", 0) for st in mine]
            stages.append({"schedule_s": med("schedule_s"), "compute_s": statistics.median(compute),
                           "idle": statistics.median(1 - c / st["schedule_s"] for c, st in zip(compute, mine)),
                           "sync_s": med("sync_s"), "tie_s": med("tie_s")})
        m, c = args.microbatches, [st["compute_s"] for st in stages]
        ideal_s = max(c) * (m - 1) / m + sum(c) / m  # fill and drain: one microbatch of every other stage
        for st in stages:
            st["ideal_idle"] = 1 - st["compute_s"] / ideal_s
        row["stages"] = stages
        row["ideal_bubble"] = (P - 1) / (m + P - 1)
        row["stage_blocks"] = ok[0][0].get("stage_blocks")
        row["cuts"] = ok[0][0].get("cuts", [])
    return row


def markdown(args: argparse.Namespace, bench: harness.Run, rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "median_s" in r]
    ref = {r["rate"]: r for r in ok if r["name"] == "lightning_ddp"}
    pred = predicted_bytes(args)
    m, D = args.microbatches, args.ranks_per_node
    lines = [
        f"# Pipeline parallelism: 2 nodes x {D} rank{'s' if D > 1 else ''}, inter-node link {', '.join(args.rates)}",
        "",
        *bench.header(),
        f"- model: GPT (`ddp_plugin.testing.gpt`), vocab {args.vocab}, d {args.d_model}, {args.heads} heads,"
        f" {args.layers} layers, seq {args.seq}, tied embedding"
        + (f", {ok[0]['params']:,} parameters, S = {ok[0]['s_mb']:.2f} MB of fp32 gradients" if ok else "")
        + f"; global batch {args.global_batch}, AdamW, {args.warmup} warmup + {args.steps} timed steps,"
        f" {args.repeats} run(s) per contender and rate",
        f"- pipeline contenders: P {P} (node 0 stage 0, node 1 stage 1), D {D} inside each node, M {m} microbatches"
        f" of {args.global_batch // (D * m)}; the blocks split by parameter count unless the contender says"
        " otherwise (the split is in the stage table)",
        "- s/step: interval from one batch's start to the next's on rank 0, median; cross-node MB: the node's veth"
        " counter over the window / steps, mean of the 2 nodes; final loss: the last step's, mean over the ranks;"
        " last 10: the mean of the last 10 steps' losses"
        " (the global batch's mean); peak RSS: max over ranks",
        "- our accounting (`comm/cross_node_MB`, summed over the node's ranks) counts the data-parallel sync and,"
        " with pipeline stages, the schedule's sends, the tied-embedding sum and the loss broadcast",
        f"- predicted (pipeline): activations B*s*d*4 = {pred['activations'] / MB:.4f} MB + tied-embedding"
        f" all-reduce V*d*4 = {pred['tie'] / MB:.4f} MB + loss broadcast {pred['loss']:.0f} B ="
        f" {sum(pred.values()) / MB:.4f} MB per node and step (the docstring derives it); with bf16 activations"
        " B*s*d*2, with int8 activations B*s*(d+4), with the tie through int8 V*d*4 (1/4 + 1/1024) (codes and"
        " one fp32 scale per 1024 values)",
        "",
    ]
    cells = []
    for r in rows:
        if "median_s" not in r:
            cells.append([r["rate"], r["label"], f"failed: {str(r['error'])[:200]}"])
            continue
        predicted = ([f"{r['predicted_mb']:.3f}", f"{r['tx_mb'] / r['predicted_mb']:.4f}"] if "predicted_mb" in r
                     else ["-", "-"])
        cells.append([r["rate"], r["label"], f"{r['median_s']:.3f}",
                      f"{r['median_s'] / ref[r['rate']]['median_s']:.3f}" if r["rate"] in ref else "-",
                      f"{r['tx_mb']:.3f}", f"{r['tx_mb'] / r['s_mb']:.3f}", *predicted,
                      harness.fmt(r.get("ours_mb"), ".2f"), f"{r['final_loss']:.4f}", f"{r['tail_loss']:.4f}",
                      f"{r['peak_rss_mb']:.0f}"])
    lines += harness.table(["link", "contender", "median s/step", "vs Lightning `ddp`", "cross-node MB / node / step",
                            "x S", "predicted MB", "measured / predicted", "our accounting MB", "final loss",
                            "last 10", "peak RSS MB"], cells, "ll" + "r" * 10)
    floor = {r["name"]: r for r in ok if r["rate"] == "none"}
    capped = [r for r in ok if r["rate"] != "none" and r["name"] in floor]
    if capped:
        lines += [
            "",
            "Against the compute floor: each contender's step at a capped link / the same contender's step with the"
            " link uncapped (`none`) in this run.",
            "",
            *harness.table(["link", "contender", "median s/step", "uncapped s/step", "x the floor"],
                           ([r["rate"], r["name"], f"{r['median_s']:.3f}", f"{floor[r['name']]['median_s']:.3f}",
                             f"{r['median_s'] / floor[r['name']]['median_s']:.3f}"] for r in capped), "llrrr"),
        ]
    piped = [r for r in ok if "stages" in r]
    if piped:
        cells = []
        for r in piped:
            for s, st in enumerate(r["stages"]):
                cut = dict(r.get("cuts", []))  # a block cut between two stages: up to / from its module `at`
                blocks = ",".join(
                    (f"{i} (from `{cut[i]}`)" if s and i in r["stage_blocks"][s - 1] else f"{i} (to `{cut[i]}`)")
                    if i in cut else str(i) for i in r["stage_blocks"][s]) if r.get("stage_blocks") else "?"
                cells.append([r["rate"], r["name"], f"{r['node_mb'][0]:.3f} / {r['node_mb'][1]:.3f}", s, blocks,
                              f"{st['schedule_s']:.3f}", f"{st['compute_s']:.3f}", f"{st['idle']:.3f}",
                              f"{r['ideal_bubble']:.3f}", f"{st['ideal_idle']:.3f}", f"{st['sync_s']:.3f}",
                              f"{st['tie_s']:.3f}"])
        lines += [
            "",
            "Pipeline stages, per step (medians over the timed steps and the stage's ranks). Schedule: wall time"
            " of the schedule's step; compute: the stage's forward, backward and loss in it; idle share = 1 -"
            " compute / schedule (bubble + transfers waited for); ideal, equal stages: (P-1)/(M+P-1); ideal, these"
            " stages: 1 - compute / (max(compute) (M-1)/M + sum(compute)/M), the fill-and-drain time of stages"
            " with the measured compute times, no transfer time; sync: the stage's gradient sync after the"
            " schedule, of which tie: the tied embedding's all-reduce across the link. See the docstring's caveats.",
            "",
            *harness.table(["link", "contender", "node MB sent (0 / 1)", "stage", "blocks", "schedule s", "compute s",
                            "idle share", "ideal, equal stages", "ideal, these stages", "sync s", "tie s"], cells,
                           "llrrl" + "r" * 7),
        ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], png: Path, rates: list[str]) -> bool:
    ok = [r for r in rows if "median_s" in r]
    plt = harness.pyplot() if ok else None
    if plt is None:
        return False
    names = list(dict.fromkeys(r["name"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    height = 0.8 / max(len(rates), 1)
    for k, rate in enumerate(rates):
        mine = {r["name"]: r for r in ok if r["rate"] == rate}
        ys = [i + k * height for i, n in enumerate(names) if n in mine]
        axes[0].barh(ys, [mine[n]["median_s"] for n in names if n in mine], height, label=rate)
        axes[1].barh(ys, [mine[n]["tx_mb"] for n in names if n in mine], height, label=rate)
    axes[0].set_xlabel("median s / step")
    axes[1].set_xlabel("cross-node MB / node / step")
    for ax in axes:
        ax.set_yticks([i + height * (len(rates) - 1) / 2 for i in range(len(names))], names)
        ax.invert_yaxis()
    axes[0].legend(title="link")
    fig.suptitle("GPT, 2 nodes: pipeline (a stage per node) vs data parallelism")
    harness.save_figure(fig, png)
    return True


def main(argv: list[str] | None = None) -> int:
    return harness.dispatch(argv, parse_args, worker, run)


if __name__ == "__main__":
    sys.exit(main())
