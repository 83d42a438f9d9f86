"""Setup memory benchmark: models that no rank holds whole, built with Lightning's big-model recipe
(``with trainer.init_module(empty_init=True): model = ...``), per layout and model size: the peak resident memory
of every rank through ``setup`` and through two optimizer steps, against the share of the model it holds.

    python benchmarks/setup_memory.py                                   # writes benchmarks/results/setup_memory.md
    python benchmarks/setup_memory.py --sizes small --layouts ours_pp2_tp2,lightning_model_parallel --out /tmp/s.md
    python benchmarks/setup_memory.py --quick                           # smallest size, 2 layouts, < 1 minute

Each (layout, size) is one fresh launch of CPU ranks over gloo under Lightning's launcher (this script re-executed
once per rank with ``--worker``), a GPT of ``ddp_plugin.testing.gpt`` (vocab 32, seq 8, 8 heads, embedding and
head tied; ``--tie``: replicated over the tensor-parallel ranks, or split by vocabulary), AdamW, batch 8 per
data-parallel rank, 2 steps.
Every layout but Lightning ``ddp`` builds the model on the meta device. Per rank:

- *import baseline*: the RSS right after importing torch, lightning and ddp_plugin (``rss_bytes``); the kernel's
  high-water mark of the process (``VmHWM``) is reset to it there (``/proc/self/clear_refs``) and a ``PeakRSS``
  sampler (every millisecond) starts; a peak below is the larger of the two (the kernel's mark misses nothing
  that is unmapped, the sampler catches what ``madvise`` releases between samples);
- *peak through setup*: that peak at ``on_train_batch_start`` of batch 0, minus the baseline;
- *peak through 2 steps*: that peak at ``on_train_batch_end`` of batch 1, minus the baseline;
- *weights held*: the bytes of the parameters the rank's optimizer steps, their local parts
  (``ddp_plugin.hookspecs.local_tensor``: a DTensor's local shard, a ZeRO shard's pieces, a pipeline stage's
  parameters); *share* = 4 x that (the parameters, their gradients, AdamW's two moments);
- *time to first step*: from the rank's ``trainer.fit`` call to ``on_train_batch_end`` of batch 0 (rank 0's
  includes starting the other ranks, which Lightning's launcher does inside ``fit``).

The table shows the max over ranks of each column (peak/share: the max of the ranks' ratios). This is a benchmark:
it asserts nothing; memory does not depend on what else runs on the machine, timings do (``--quiet`` records
that nothing else ran).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import MB, ROOT

DEFAULT_OUT = harness.RESULTS / "setup_memory.md"

# name -> (label, ranks, strategy flags or None for Lightning's)
LAYOUTS: dict[str, tuple[str, int, dict[str, Any] | None]] = {
    "ours_pp2_tp2": ("ours, P 2 x T 2", 4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
    "ours_pp4": ("ours, P 4 (M 4)", 4, {"pipeline_parallel_size": 4, "pipeline_microbatches": 4}),
    "ours_pp4_tp2": ("ours, P 4 x T 2, 8 ranks", 8, {"pipeline_parallel_size": 4, "tensor_parallel_size": 2}),
    "ours_zero3": ("ours, ZeRO-3, units `Block`", 4, {"zero_stage": 3, "auto_wrap_policy": ["Block"]}),
    "ours_zero3_inbw": ("ours, ZeRO-3, units `Block`, `optimizer_in_backward`", 4,
                        {"zero_stage": 3, "auto_wrap_policy": ["Block"], "optimizer_in_backward": True}),
    "ours_zero3_inbw_p1": ("ours, ZeRO-3, units `Block`, `optimizer_in_backward`, `prefetch_units=1`", 4,
                           {"zero_stage": 3, "auto_wrap_policy": ["Block"], "optimizer_in_backward": True,
                            "prefetch_units": 1}),
    "fsdp2_full": ("Lightning `ModelParallelStrategy`, DP 4 + `fully_shard` (FSDP2 full shard)", 4, None),
    "lightning_model_parallel": ("Lightning `ModelParallelStrategy`, DP 2 x TP 2 + `fully_shard`", 4, None),
    "lightning_ddp": ("Lightning `ddp`, eager build (no meta)", 4, None),
}
SIZES: dict[str, dict[str, int]] = {
    "small": {"d_model": 512, "layers": 8},
    "medium": {"d_model": 512, "layers": 16},
    "large": {"d_model": 1024, "layers": 8},
}
VOCAB, SEQ, HEADS, BATCH, STEPS = 32, 8, 8, 8, 2
QUICK_LAYOUTS = "ours_pp2_tp2,lightning_model_parallel"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__)
    harness.add_names(p, "--sizes", SIZES, SIZES)
    harness.add_names(p, "--layouts", LAYOUTS, LAYOUTS)
    p.add_argument("--skip", default="ours_pp4_tp2:large",
                   help="layout:size pairs not run (comma-separated; default: the 8-rank layout at the large size,"
                   " 8 ranks on 2 cores being slow); '' runs every pair")
    p.add_argument("--quick", action="store_true",
                   help=f"smallest size, layouts {QUICK_LAYOUTS}; writes to a temporary file unless --out is given")
    p.add_argument("--tie", choices=["replicated", "vocab"], default="replicated",
                   help="GPTModule's tie: the tied embedding and head replicated over the tensor-parallel ranks"
                   " (default) or split by vocabulary (vocab 32: a few kB either way)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per launch before it is killed")
    harness.add_common(p, out=None, out_help=f"markdown table (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--size", choices=list(SIZES), help=argparse.SUPPRESS)
    p.add_argument("--json-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.layouts = next(iter(SIZES)), QUICK_LAYOUTS
        if args.out is None:
            args.out = Path(tempfile.gettempdir()) / "setup_memory_quick.md"
    if args.out is None:
        args.out = DEFAULT_OUT
    args.sizes = harness.names(p, args.sizes, SIZES, "size")
    args.layouts = harness.names(p, args.layouts, LAYOUTS, "layout")
    args.skip = {tuple(x.split(":", 1)) for x in args.skip.split(",") if ":" in x}
    return args


# ---------------------------------------------------------------------------------------------- worker (per rank)


def _hwm_bytes() -> int:
    """The kernel's high-water mark of this process's RSS (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _reset_hwm() -> bool:
    """Reset ``VmHWM`` to the RSS now (Linux 4.0+); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def first_line(err: BaseException) -> str:
    """``Type: message``, the message's first non-empty line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def worker(args: argparse.Namespace) -> None:
    import gc

    import lightning as L
    import torch

    import ddp_plugin  # noqa: F401  (registers the strategy names; part of the baseline)
    from ddp_plugin.runtime import cpu_memory
    from ddp_plugin.testing.memory import PeakRSS, rss_bytes

    torch.set_num_threads(1)
    gc.collect()
    baseline = rss_bytes()
    exact = _reset_hwm()
    sampler = PeakRSS()
    sampler.start()

    from torch.utils.data import DataLoader

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.hookspecs import local_tensor
    from ddp_plugin.testing.gpt import GPTModule, token_dataset

    layout, size = args.layout, SIZES[args.size]
    _, world, flags = LAYOUTS[layout]
    out: dict[str, Any] = {"layout": layout, "size": args.size, "baseline": baseline, "exact_peak": exact,
                           "pid": os.getpid()}

    def peak() -> tuple[int, int]:
        """(peak RSS since the baseline: the larger of the kernel's high-water mark and the sampler's; the
        sampler's alone) in bytes. The kernel updates ``VmHWM`` when memory is unmapped, not when it is released
        with ``madvise`` (as ``malloc_trim`` does), so the sampler can see a peak it missed."""
        sampled = max(sampler.bytes, rss_bytes())
        return (max(_hwm_bytes(), sampled) if exact else sampled), sampled

    def optimizer_params(trainer: Any) -> list:
        seen: dict[int, Any] = {}
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def nbytes(t: Any) -> int:
        t = local_tensor(t)
        return t.numel() * t.element_size()

    class Measure(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx != 0:
                return
            out["setup_s"] = time.perf_counter() - out["t_fit"]
            out["peak_setup"], out["sampled_setup"] = peak()
            params = optimizer_params(trainer)
            out["held"] = sum(nbytes(p) for p in params)
            out["module_local"] = sum(nbytes(p) for p in {id(p): p for p in pl_module.parameters()}.values())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 0:
                out["first_step_s"] = time.perf_counter() - out["t_fit"]
                out["peak_step1"] = peak()[0]
            if batch_idx != STEPS - 1:
                return
            out["peak_steps"], out["sampled_steps"] = peak()
            out["rank"] = trainer.global_rank
            state = [v for opt in trainer.optimizers for s in opt.state.values() for k, v in s.items()
                     if k != "step" and torch.is_tensor(v)]
            out["adam_state"] = sum(nbytes(v) for v in state)
            out["steps"] = trainer.global_step
            # What of the peak is memory freed into the C heap but not returned to the OS: the RSS once glibc
            # hands every free page back (training ends with this batch, so nothing measured follows it).
            gc.collect()
            if cpu_memory.trim():
                out["after_trim"] = rss_bytes()

    L.seed_everything(0, verbose=False)
    tp = bool(flags and flags.get("tensor_parallel_size", 1) > 1) or layout == "lightning_model_parallel"
    fsdp2 = layout in ("lightning_model_parallel", "fsdp2_full")
    out["tie"] = args.tie if tp else None
    if layout == "lightning_ddp":
        strategy: Any = "ddp"
    elif layout == "lightning_model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    elif layout == "fsdp2_full":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)
    else:
        strategy = HierarchicalZeroStrategy(**flags)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Measure()])
    cls = harness.fully_shard_gpt() if fsdp2 else GPTModule
    kwargs = dict(vocab=VOCAB, d_model=size["d_model"], heads=HEADS, layers=size["layers"], seq=SEQ,
                  tie=args.tie if tp else "replicated", lr=3e-4)
    if layout == "lightning_ddp":
        model = cls(**kwargs)  # eager: the whole model on every rank, as built
    else:
        with trainer.init_module(empty_init=True):
            model = cls(**kwargs)
    out["built_on"] = str(next(model.parameters()).device)
    out["params"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    data = token_dataset(BATCH * world * (STEPS + 1), seq=SEQ, vocab=VOCAB)
    out["t_fit"] = time.perf_counter()
    try:
        trainer.fit(model, DataLoader(data, batch_size=BATCH))
    except BaseException as err:  # noqa: BLE001 - reported in the table
        out["error"] = first_line(err)
        cause = err
        while cause.__cause__ is not None or (cause.__context__ is not None and not cause.__suppress_context__):
            cause = cause.__cause__ or cause.__context__
        if cause is not err:
            out["cause"] = first_line(cause)
    out["sampler_final"] = sampler.finish()
    harness.write_rank(args.json_dir, out.setdefault("rank", trainer.global_rank), out)
    if "error" in out:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------- driver


def launch(args: argparse.Namespace, layout: str, size: str, tmp: Path) -> dict[str, Any]:
    json_dir = tmp / f"{layout}-{size}"
    log = tmp / f"{layout}-{size}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--layout", layout, "--size", size,
           "--json-dir", str(json_dir), "--tie", args.tie]
    load_before = harness.load_average()
    # (the driver stays free of torch, whose import costs seconds on 2 cores)
    done = harness.run_local(cmd, log=log, timeout=args.timeout, env=harness.RANK_ENV)
    rc, wall = done.returncode, done.wall_s
    ranks = sorted((json.loads(f.read_text()) for f in json_dir.glob("rank*.json")), key=lambda r: r["rank"])
    world = LAYOUTS[layout][1]
    result: dict[str, Any] = {"layout": layout, "size": size, "wall_s": wall, "load_before": load_before,
                              "load_after": harness.load_average(), "ranks": ranks}
    errors = list(dict.fromkeys(r["error"] + (f" (root cause: {r['cause']})" if "cause" in r else "")
                                for r in ranks if "error" in r))
    if rc != 0 or errors or len(ranks) != world or any("peak_steps" not in r for r in ranks):
        text = done.log
        if errors:
            reason = errors[0]
        elif rc is None:
            reason = f"timed out after {args.timeout:.0f} s"
        elif rc < 0 or rc == 137:
            reason = f"killed by signal {-rc if rc < 0 else 9} (out of memory?)"
        else:
            lines = [ln for ln in text.splitlines() if re.search(r"\b\w*(Error|Exception)\b:", ln)]
            reason = lines[0].strip() if lines else f"exit code {rc}, {len(ranks)} of {world} ranks reported"
        result["error"] = reason
        print(f"{layout} {size}: FAILED ({reason}) after {wall:.0f} s; log tail:\n{text[-3000:]}", flush=True)
    return result


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    ranks = result["ranks"]
    row = {k: result[k] for k in ("layout", "size", "wall_s", "load_before", "load_after")}
    if "error" in result:
        row["error"] = result["error"]
        return row
    row["params"] = ranks[0]["params"]
    row["model_bytes"] = ranks[0]["model_bytes"]
    row["built_on"] = sorted({r["built_on"] for r in ranks})
    row["held"] = max(r["held"] for r in ranks)
    row["held_min"] = min(r["held"] for r in ranks)
    row["share"] = 4 * row["held"]
    row["setup"] = max(r["peak_setup"] - r["baseline"] for r in ranks)
    row["steps"] = max(r["peak_steps"] - r["baseline"] for r in ranks)
    row["sampled_steps"] = max(r["sampled_steps"] - r["baseline"] for r in ranks)
    row["step1"] = max(r["peak_step1"] - r["baseline"] for r in ranks)
    if all("after_trim" in r for r in ranks):
        row["trimmed"] = max(r["after_trim"] - r["baseline"] for r in ranks)
    row["hwm_gap"] = max(abs(r["peak_steps"] - r["sampled_steps"]) for r in ranks)
    row["ratio"] = max((r["peak_steps"] - r["baseline"]) / (4 * r["held"]) for r in ranks)
    row["first_step_s"] = max(r["first_step_s"] for r in ranks)
    row["setup_s"] = max(r["setup_s"] for r in ranks)
    row["baselines"] = [r["baseline"] for r in ranks]
    row["adam_over_held"] = [r["adam_state"] / r["held"] for r in ranks]
    row["exact"] = all(r["exact_peak"] for r in ranks)
    return row


def fmt(x: float) -> str:
    return f"{x / MB:.1f}"


def markdown(args: argparse.Namespace, bench: harness.Run, rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "error" not in r]
    baselines = [b for r in ok for b in r["baselines"]]
    lines = [
        "# Setup memory: models no rank holds whole, built on the meta device",
        "",
        *bench.header(),
        "- CPU ranks over gloo, `torch.set_num_threads(1)` per rank; the launches ran one after another; load average"
        f" before each launch {min(r['load_before'] for r in rows):.2f}-{max(r['load_before'] for r in rows):.2f}",
        f"- model: GPT (`ddp_plugin.testing.gpt`), vocab {VOCAB}, seq {SEQ}, {HEADS} heads, embedding tied to the"
        f" head (`tie={args.tie!r}` where tensor parallelism is on: "
        + ("replicated over the tensor-parallel ranks" if args.tie == "replicated" else "split by vocabulary")
        + "); AdamW; batch"
        f" {BATCH} per data-parallel rank; {STEPS} steps. Built with `trainer.init_module(empty_init=True)` (meta)"
        " on every layout but Lightning `ddp`, which builds it whole on every rank",
        "- layouts: " + "; ".join(f"`{n}`: {LAYOUTS[n][0]} ({LAYOUTS[n][1]} ranks)" for n in args.layouts),
        "- import baseline (RSS after importing torch, lightning, ddp_plugin): "
        + ("-" if not baselines else f"{min(baselines) / MB:.0f} MB on every rank of every launch"
           if f"{min(baselines) / MB:.0f}" == f"{max(baselines) / MB:.0f}"
           else f"{min(baselines) / MB:.0f}-{max(baselines) / MB:.0f} MB over all ranks and launches"),
        "- columns, max over ranks: *held* = bytes of the parameters the rank's optimizer steps, local parts (a"
        " DTensor's shard, a ZeRO shard, a pipeline stage); *share* = 4 x held (parameters, gradients, AdamW's two"
        " moments); *setup peak* = the rank's peak RSS (the larger of the kernel's high-water mark `VmHWM`, reset"
        " after the imports, and a 1 ms `PeakRSS` sampler) at `on_train_batch_start` of batch 0, minus its"
        " baseline; *2-step peak* = the same at the end of step 2;"
        " *peak/share* = 2-step peak / share, the largest rank's ratio; *first step* = seconds from the rank's"
        " `trainer.fit` call to the end of its first optimizer step (rank 0's includes starting the other ranks)",
        "",
    ]
    for size in args.sizes:
        srows = [r for r in rows if r["size"] == size]
        if not srows:
            continue
        sized = next((r for r in srows if "params" in r), None)
        head = f"## {size}: d_model {SIZES[size]['d_model']}, {SIZES[size]['layers']} layers"
        if sized:
            head += (f", {sized['params'] / 1e6:.1f}M parameters, whole model {fmt(sized['model_bytes'])} MB"
                     f" (4 x: {fmt(4 * sized['model_bytes'])} MB)")
        cells = []
        for r in srows:
            label, world = LAYOUTS[r["layout"]][0], LAYOUTS[r["layout"]][1]
            if "error" in r:
                cells.append([label, world, f"failed: {r['error'][:240].replace('|', '/')}"])
                continue
            held = fmt(r["held"])
            if held != fmt(r["held_min"]):
                held += f" (min {fmt(r['held_min'])})"
            cells.append([label, world, held, fmt(r["share"]), fmt(r["setup"]), fmt(r["steps"]), f"{r['ratio']:.2f}",
                          f"{r['first_step_s']:.1f}"])
        lines += [head, "", *harness.table(["layout", "ranks", "weights held per rank (MB)", "share (MB)",
                                            "peak above baseline through setup (MB)", "peak through 2 steps (MB)",
                                            "peak/share", "time to first step (s)"], cells)]
        skipped = [n for n in args.layouts if (n, size) in args.skip]
        if skipped:
            lines.append("")
            lines.append("Not run at this size (`--skip`): " + ", ".join(f"`{n}`" for n in skipped) + ".")
        lines.append("")
    lines += reading(args, rows)
    checks = []
    if ok:
        adam = [x for r in ok for x in r["adam_over_held"]]
        checks.append(f"AdamW state measured after step 2: {min(adam):.3f}-{max(adam):.3f} x the weights held, on"
                      " every rank")
        if not all(r["exact"] for r in ok):
            checks.append("`/proc/self/clear_refs` could not be written on some ranks: their peaks are the sampler's"
                          " alone")
        gap = max(r["hwm_gap"] / MB for r in ok)
        checks.append(f"the 1 ms sampler's own 2-step peak was within {gap:.1f} MB of the reported one (the larger of"
                      " it and the kernel's mark) on every rank")
    lines += ["", "Checks: " + "; ".join(checks) + "."] if checks else []
    lines += ["", "## Details", "",
              "Max over ranks, MB above the import baseline. *step-1 peak*: the peak at the end of the first step;"
              " *after trim*: the RSS at the end of step 2 once glibc's `malloc_trim(0)` returned the C heap's free"
              " pages to the OS (what the process still uses: the rest of the peak is memory that was freed but kept"
              " by the allocator, or the transient peak of a phase); *setup s*: from `trainer.fit` to batch 0's start;"
              " *launch s*: the launch's wall time, process starts and exits included; *load*: the machine's"
              " 1-minute load average before the launch.", "",
              *harness.table(["layout", "size", "step-1 peak", "2-step peak", "after trim", "AdamW state / held",
                              "setup s", "first step s", "launch s", "load"], (
                  [f"`{r['layout']}`", r["size"], "failed", "", "", "", "", "", f"{r['wall_s']:.0f}",
                   f"{r['load_before']:.2f}"] if "error" in r else
                  [f"`{r['layout']}`", r["size"], fmt(r["step1"]), fmt(r["steps"]),
                   fmt(r["trimmed"]) if "trimmed" in r else "-", f"{max(r['adam_over_held']):.3f}",
                   f"{r['setup_s']:.1f}", f"{r['first_step_s']:.1f}", f"{r['wall_s']:.0f}", f"{r['load_before']:.2f}"]
                  for r in rows), "ll" + "r" * 8)]
    return "\n".join(lines) + "\n"


def reading(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """What the numbers show, computed from them (so a rerun rewrites it with its own numbers)."""
    by = {(r["layout"], r["size"]): r for r in rows if "error" not in r}
    out = []
    for size in args.sizes:
        ours, mps = by.get(("ours_pp2_tp2", size)), by.get(("lightning_model_parallel", size))
        if ours and mps:
            out.append(f"At {size}, ours P 2 x T 2 peaks at {fmt(ours['steps'])} MB per rank through 2 steps,"
                       f" {ours['steps'] / mps['steps']:.2f}x `ModelParallelStrategy`'s {fmt(mps['steps'])} MB, each"
                       f" rank holding the same quarter of the weights ({fmt(ours['held'])} MB against"
                       f" {fmt(mps['held'])} MB); through setup ours peaks higher, {fmt(ours['setup'])} against"
                       f" {fmt(mps['setup'])} MB.")
    setup_x = [(r["setup"] / r["held"], layout) for (layout, _), r in by.items()]
    ours_x = [x for x, layout in setup_x if layout in ("ours_pp2_tp2", "ours_pp4", "ours_pp4_tp2")]
    mps_x = [x for x, layout in setup_x if layout == "lightning_model_parallel"]
    if ours_x and mps_x:
        def span(xs: list[float]) -> str:
            return f"{min(xs):.2f}x" if f"{min(xs):.2f}" == f"{max(xs):.2f}" else f"{min(xs):.2f}-{max(xs):.2f}x"

        out.append(f"Setup peaks in units of the weights held: {span(ours_x)} for our pipeline and tensor-parallel"
                   f" layouts, {span(mps_x)} for `ModelParallelStrategy`: our"
                   " gradient engine allocates its gradient buckets (1x the weights held) in setup"
                   " (`ddp_plugin/gradients/engine.py`), FSDP2 allocates gradients in the first backward.")
    whole = sorted(((r["setup"] / r["model_bytes"], layout, size) for (layout, size), r in by.items()
                    if layout != "lightning_ddp"), reverse=True)
    if whole:
        reach = [f"`{layout}` at {size} ({x:.2f}x)" for x, layout, size in whole if x >= 1]
        below = [(x, layout, size) for x, layout, size in whole if x < 1]
        text = "Of the meta-built layouts, "
        if reach:
            text += "the setup peak of a rank reached the whole model's size on " + ", ".join(reach)
            ddp = [(by[(layout, size)]["setup"], by[("lightning_ddp", size)]["setup"], size)
                   for _, layout, size in whole if layout == "ours_zero3" and ("lightning_ddp", size) in by]
            if ddp:
                text += ("; ZeRO-3's setup peak against Lightning `ddp`'s eager one: " + ", ".join(
                    f"{fmt(a)} against {fmt(b)} MB at {size}" for a, b, size in ddp))
            text += "."
            if any(layout == "ours_zero3" for x, layout, _size in whole if x >= 1):
                text += (" At ZeRO stage 3 a rank materializes the whole model (its part of it: here all of it) before"
                         " sharding it ([meta_init.md](../../docs/meta_init.md#what-is-not-done-yet)), and the gradient"
                         " engine's buckets, as large, are allocated beside it before ZeRO releases them bucket by"
                         " bucket.")
        if below:
            x, layout, size = below[0]
            text += (f" {'No other' if reach else 'No'} rank's setup peak reached it: the highest, `{layout}` at"
                     f" {size}, is {x:.2f}x the whole model.")
        out.append(text)
    trims = [(r["steps"] - r["trimmed"], r["steps"], layout, size) for (layout, size), r in by.items()
             if "trimmed" in r]
    for layout in ("lightning_model_parallel", "ours_pp2_tp2"):
        mine = [(a, b, size) for a, b, lay, size in trims if lay == layout]
        if mine:
            out.append(f"`{layout}`: of the 2-step peak, " + ", ".join(
                f"{fmt(a)} of {fmt(b)} MB at {size}" for a, b, size in mine)
                + " were gone once glibc returned its free pages to the OS (*after trim*, Details): memory the step"
                " had freed but the C heap kept, or a transient of one phase.")
    ratios = sorted(((r["ratio"], layout, size) for (layout, size), r in by.items()), reverse=True)
    if ratios:
        out.append("Peak/share ranged from " + f"{ratios[-1][0]:.2f} (`{ratios[-1][1]}` at {ratios[-1][2]}) to"
                   f" {ratios[0][0]:.2f} (`{ratios[0][1]}` at {ratios[0][2]}).")
    failed = [r for r in rows if "error" in r]
    if failed:
        out.append("Failed: " + ", ".join(f"`{r['layout']}` at {r['size']} ({r['error'][:160]})" for r in failed)
                   + ".")
    return ["## Reading (computed from the tables above)", "", "- " + "\n- ".join(out)] if out else []


def driver(args: argparse.Namespace, argv: list[str]) -> int:
    bench = harness.Run(__file__, argv, quiet=args.quiet)
    results = []
    with tempfile.TemporaryDirectory(prefix="setup_memory_") as tmp:
        for size in args.sizes:
            for layout in args.layouts:
                if (layout, size) in args.skip:
                    continue
                result = launch(args, layout, size, Path(tmp))
                results.append(result)
                row = summarize(result)
                if "error" not in row:
                    print(f"{layout:26s} {size:6s} held {fmt(row['held']):>7s} MB, setup peak {fmt(row['setup']):>7s}"
                          f" MB, 2-step peak {fmt(row['steps']):>7s} MB, peak/share {row['ratio']:.2f}, first step"
                          f" {row['first_step_s']:.1f} s ({result['wall_s']:.0f} s wall)", flush=True)
    harness.write(args.out, markdown(args, bench, [summarize(r) for r in results]))
    return 0


def main(argv: list[str] | None = None) -> int:
    return harness.dispatch(argv, parse_args, worker, driver)


if __name__ == "__main__":
    sys.exit(main())
