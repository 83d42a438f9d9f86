"""Following a :class:`~ddp_plugin.gradients.planning.CommPlan` while training, and re-planning when the link changes.

- :class:`AdaptivePlanner` is the reducer when a plan is made (``hierarchical=None`` over several nodes of
  several ranks, ``compression="auto"`` or ``bucket_size_mb="auto"``): each bucket takes the route its plan
  names (the flat all-reduce or the hierarchical stages), and each step's measured time per bucket is set
  against the prediction.
- :class:`AutoCodec` (``compression="auto"``) answers ``on_cross_node_reduce`` with the codec the plan names
  for the bucket, among the candidates, which are registered as plugins of their own (their state, their
  checkpoints). A bucket whose codec changes hands the old codec's error-feedback residual to the new route
  (added to the next gradient it sends), so nothing a codec held back is dropped.

Re-planning: after a plan, the first step is a warm-up and the next three set the baseline (measured over
predicted, per step); a step whose ratio leaves ``[1/tolerance, tolerance]`` times the baseline (2x by default)
and whose time is more than 10 ms from what the baseline expects departs (after a re-plan, not before its tenth
step: a probe costs up to seconds, and a busy machine's noise must not buy one after another).
Every step each rank sends its count of consecutive departing steps in one all-reduce (MAX), started after the
optimizer step and read after the next one, so it never waits on the link; when the agreed count reaches
``patience`` every rank probes the links again and re-plans, at that step boundary, from global rank 0's
measurements. Bucket sizes stay as built.

(Over 400 lines for a reason: the two plugins are one plan's two halves, sharing its bucket keys, its trials and
the timing of each bucket; the probe and the codecs it times are :mod:`ddp_plugin.strategy.link_probe`.)
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_plugin.runtime.clock import Clock, Stamp
from ddp_plugin.codecs.base import state_key
import pluggy

from ddp_plugin.hookspecs import PROJECT_NAME, hookimpl, hooks
from ddp_plugin.gradients.planning import FLAT, HIERARCHICAL, NO_CODEC, TRIAL_BAND, CommPlan, preferred
from ddp_plugin.plugins.flat_reducer import FlatReducer
from ddp_plugin.plugins.hierarchical_reducer import HierarchicalReducer

if TYPE_CHECKING:
    from torch import Tensor

    from ddp_plugin.hookspecs import Bucket, Communicator, Topology
    from ddp_plugin.gradients.planning import CostModel

log = logging.getLogger(__name__)

MIN_TIMED_S = 2e-3
"""A step whose timed communication is shorter than this says nothing about the link (timer and scheduler
noise on a busy machine): it neither departs nor sets the baseline."""
MIN_DEPARTURE_S = 10e-3
"""A step departs only when its measured time is this far from the baseline's expectation as well: on a busy
machine a few milliseconds of scheduling swing small steps by several times, and a re-probe costs more than
such steps could gain."""
TRIAL_STEPS = 6
"""Steps after a plan on which close calls alternate between their two options (after one warm-up step): three
timed steps each."""
MIN_STEPS_BETWEEN_PLANS = 10
"""Optimizer steps after a plan before the next re-plan may start (a probe costs up to a few seconds)."""


def _log_on_rank_zero(text: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(text)


def _key(bucket: Bucket) -> str:
    return str(state_key(bucket))


def own_hooks(plugin: object) -> pluggy.HookRelay:
    """The hooks of ``plugin`` alone, through a plugin manager of its own (it stays registered in the fit's too): a
    candidate codec's ``on_setup``, ``on_cross_node_reduce`` or ``on_fold_residual``, with none of the other
    plugins' implementations or wrappers around it."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hooks)
    pm.register(plugin)
    return pm.hook


class AdaptivePlanner(HierarchicalReducer):
    """The reducer that follows the plan (see the module docstring). ``replan`` is the session's: probe again
    and return the new model (collective)."""

    def __init__(self, plan: CommPlan, replan: Callable[[], tuple[CostModel, float]], patience: int = 3,
                 tolerance: float = 2.0) -> None:
        super().__init__()
        self.plan = plan
        self._replan = replan
        self.patience = patience
        self.tolerance = tolerance
        self._lock = threading.Lock()
        self._local = threading.local()
        self._records: list[list[Any]] = []  # [key, start, done or None]: stamps of self.clock
        self.clock = Clock(torch.device("cpu"))
        """Stamps the reductions (on CUDA, events on the communication thread's stream: a collective's call and its
        future's completion only mark its enqueueing there); set for the topology's device at setup."""
        self._since_plan = 0
        self._calibration: list[float] = []
        self._baseline: float | None = None
        self._streak = 0
        self._pending: tuple[Any, Tensor] | None = None
        self._agree_group: dist.ProcessGroup | None = None
        self._trial_group: dist.ProcessGroup | None = None
        self._step = 0
        self._step_ms = (0.0, 0.0)
        self._plan_steps = 0
        """Optimizer steps since the current plan was made."""
        self.trials: dict[str, list[tuple[str, str]]] = {}
        """Close calls being settled by measurement: key -> [the option of even steps, of odd steps] (see
        :meth:`start_trials`)."""
        self._contested: dict[str, list[tuple[str, str]]] = {}
        self._pairs: dict[tuple[tuple[str, str], tuple[str, str]], list[str]] = {}
        self._trial_times: list[list[float]] = []
        self._last_choice: dict[str, tuple[str, str]] = {}
        self.report: Callable[[str], None] = _log_on_rank_zero
        """Where the plan is told, once per plan (its close calls settled): the strategy's rank-zero info."""
        self.codec_hooks: dict[str, pluggy.HookRelay] = {}
        """Candidate name -> its codec's own hooks (set by :class:`AutoCodec`), to hand a residual over on a route
        switch."""

    def start_trials(self) -> None:
        """Time both options of every close call (:meth:`CommPlan.contested`) on alternate steps while training,
        every bucket of the same two options together: steps 2-7 after the plan (the first is a warm-up), the
        option :func:`~ddp_plugin.gradients.planning.preferred` ranks second, then the first, three times; then
        :meth:`_settle_trials`. With none, the plan is told now (else once they are settled)."""
        self._contested = self.plan.contested()
        self._pairs = {}
        for key, options in self._contested.items():
            pair = tuple(sorted(options, key=lambda option: preferred(option, self.plan.codecs)))
            self._pairs.setdefault(pair, []).append(key)
        self.trials = {key: list(pair) for pair, keys in self._pairs.items() for key in keys}
        self._trial_times = [[0.0] * len(self._pairs) for _ in range(TRIAL_STEPS)]
        self._plan_steps = 0
        if not self.trials:
            self.report(self.plan.table())

    def choice(self, key: str) -> tuple[str, str] | None:
        """The ``(route, codec)`` bucket ``key`` takes this step (``None``: not a bucket the planner routes)."""
        trial = self.trials.get(key)
        if trial is not None:
            return trial[self._plan_steps % 2]
        planned = self.plan.buckets.get(key)
        if planned is None or planned.route not in (FLAT, HIERARCHICAL):
            return None
        return planned.route, planned.codec

    @hookimpl
    def on_setup(self, topology: Topology, hook: Any, comm: Communicator) -> None:
        super().on_setup(topology=topology, hook=hook, comm=comm)
        self.clock = Clock(topology.device)
        # Every rank (all data-parallel replicas of a tensor- or pipeline-parallel mesh re-plan together).
        self._agree_group = comm.new_group()
        # A close call is settled by the ranks that hold its bucket: the data-parallel ranks of this rank's pipeline
        # stage and tensor-parallel position (another stage's or shard's buckets are other buckets, with the same
        # keys, and may have other close calls).
        t = topology
        self._trial_group = self._agree_group
        if t.tensor_parallel_size * t.pipeline_parallel_size > 1:
            for stage in range(t.pipeline_parallel_size):  # (creating a group is collective: every position's)
                for position in range(t.tensor_parallel_size):
                    group = comm.new_group([t.global_rank(r, position, stage) for r in range(t.world_size)])
                    if (stage, position) == (t.pipeline_parallel_rank, t.tensor_parallel_rank):
                        self._trial_group = group

    @property
    def splits(self) -> bool:
        return HIERARCHICAL in self.plan.routes and super().splits

    # ------------------------------------------------------------------ following the plan

    @hookimpl(trylast=True)
    def on_bucket_ready(self, bucket: Bucket) -> torch.futures.Future:
        key = _key(bucket)
        chosen = self.choice(key) or (self.plan.routes[0], NO_CODEC)
        route = chosen[0]
        last = self._last_choice.get(key)
        if last is not None and last[0] != route and last[1] != NO_CODEC:
            self._hand_over(bucket, last)
        self._last_choice[key] = chosen
        self._local.routing = True
        start = self.clock.stamp()
        try:
            if route == HIERARCHICAL and self.splits:
                future = HierarchicalReducer.on_bucket_ready(self, bucket)
            else:
                future = FlatReducer.on_bucket_ready(self, bucket)
        finally:
            self._local.routing = False
        self.time(key, start, future)
        return future

    def _hand_over(self, bucket: Bucket, last: tuple[str, str]) -> None:
        """The bucket leaves route ``last[0]``, where codec ``last[1]`` kept an error-feedback residual shaped for
        that route's cross-node tensor: add it to the bucket's gradients (this rank's), scaled so that it reaches
        the global mean as it would have on that route's next step, before the new route starts."""
        codec = self.codec_hooks.get(last[1])
        if codec is None:
            return
        t, key = self._topology, state_key(bucket)
        if last[0] == FLAT:  # the whole bucket, averaged over every rank: the bucket's own units
            codec.on_fold_residual(key=key, tensor=bucket.buffer, rank=t.rank, size=t.world_size)
            return
        # This rank's chunk of the node's mean, averaged over the nodes: k times its units in the bucket.
        c = self.shard_numel(bucket)
        owed = bucket.buffer.new_zeros(c)
        if not codec.on_fold_residual(key=key, tensor=owed, rank=t.node_rank, size=t.num_nodes):
            return
        mine = bucket.buffer[t.local_rank * c: min((t.local_rank + 1) * c, bucket.numel)]
        mine.add_(owed[: mine.numel()], alpha=t.ranks_per_node)

    def routing(self) -> bool:
        """Whether this thread is inside a bucket this planner routes (its cross-node stage is timed with it)."""
        return getattr(self._local, "routing", False)

    def time(self, key: str, start: Stamp, future: torch.futures.Future | None) -> None:
        """Record when ``key``'s reduction started and (once ``future`` completes) ended: a stamp taken in the
        future's done-callback, which on CUDA runs on a stream that waits for the future's work, so the stamp
        completes with the work, not with its enqueueing."""
        record = [key, start, None]
        with self._lock:
            self._records.append(record)

        def done(_: torch.futures.Future) -> None:
            record[2] = self.clock.stamp()

        if future is None:
            record[2] = self.clock.stamp()
        else:
            future.add_done_callback(done)

    def _take_busy(self) -> dict[str, float]:
        """Seconds each completed reduction kept the link busy: from its start, or from the end of the one before
        it when it queued behind that one (collectives run one at a time per group), to its end."""
        clock = self.clock
        with self._lock:
            # (seconds once the device has reached both stamps; the others wait for the next step's reading)
            times = [(r, clock.seconds(r[1]), clock.seconds(r[2]) if r[2] is not None else None)
                     for r in self._records]
            finished = [(r[0], a, b) for r, a, b in times if a is not None and b is not None]
            self._records = [r for r, a, b in times if a is None or b is None]
        busy: dict[str, float] = {}
        previous_end = float("-inf")
        for key, start, end in sorted(finished, key=lambda r: r[1]):
            busy[key] = busy.get(key, 0.0) + max(end - max(start, previous_end), 0.0)
            previous_end = max(previous_end, end)
        return busy

    # ------------------------------------------------------------------ measuring against the prediction

    @hookimpl
    def on_after_backward(self) -> None:
        busy = self._take_busy()
        if self.trials:
            if 1 <= self._plan_steps <= TRIAL_STEPS:
                row = self._trial_times[self._plan_steps - 1]
                for i, keys in enumerate(self._pairs.values()):
                    row[i] += sum(busy.get(key, 0.0) for key in keys)
            for key, seconds in busy.items():  # (the others' times count as ever; the step's is no baseline)
                planned = self.plan.buckets.get(key)
                if planned is not None and key not in self.trials:
                    planned.record(seconds)
            return
        measured = predicted = 0.0
        for key, seconds in busy.items():
            planned = self.plan.buckets.get(key)
            if planned is None:
                continue
            planned.record(seconds)
            measured += seconds
            predicted += planned.predicted_ms / 1e3
        self._step_ms = (predicted * 1e3, measured * 1e3)
        if predicted <= 0 or measured < MIN_TIMED_S:
            return
        ratio = measured / predicted
        self._since_plan += 1
        if self._since_plan <= 1:
            return  # the first step after a plan: first-use allocations
        if self._baseline is None:
            self._calibration.append(ratio)
            if len(self._calibration) == 3:
                self._baseline = statistics.median(self._calibration)
            return
        relative = ratio / self._baseline
        departed = ((relative > self.tolerance or relative < 1 / self.tolerance)
                    and abs(measured - self._baseline * predicted) > MIN_DEPARTURE_S
                    and (self.plan.version == 1 or self._since_plan > MIN_STEPS_BETWEEN_PLANS - self.patience))
        self._streak = self._streak + 1 if departed else 0

    @hookimpl
    def on_after_optimizer_step(self) -> None:
        self._step += 1
        self._plan_steps += 1
        if self.trials and self._plan_steps > TRIAL_STEPS:
            self._settle_trials()
        if self._pending is not None:
            work, agreed = self._pending
            self._pending = None
            work.wait()
            if agreed.item() >= self.patience:
                self.replan(f"step {self._step}: {int(agreed.item())} steps more than {self.tolerance:g}x off the"
                            " times the baseline expects")
        if self._agree_group is not None and dist.get_world_size(self._agree_group) > 1:
            # (on the device: an NCCL group takes CUDA tensors only)
            streak = torch.tensor([float(self._streak)], device=self._topology.device)
            self._pending = (dist.all_reduce(streak, op=dist.ReduceOp.MAX, group=self._agree_group, async_op=True),
                             streak)
        elif self._streak >= self.patience:
            self.replan(f"step {self._step}: measured times departed from the prediction")

    def _settle_trials(self) -> None:
        """Each pair of options' timed steps, the seconds of its buckets summed over the data-parallel ranks of this
        rank's pipeline stage and tensor-parallel position, the ones that hold those buckets (one all-reduce: every
        one of them the same figures): the pair's buckets take the option whose median step was faster by more
        than the steps' spread (each option's slowest over its fastest step, the larger, at least
        :data:`~ddp_plugin.gradients.planning.TRIAL_BAND`), else the one the fixed rule prefers (collective over
        those ranks)."""
        totals = torch.tensor(self._trial_times, dtype=torch.float64, device=self._topology.device)
        ranks = dist.get_world_size(self._trial_group) if self._trial_group is not None else 1
        if ranks > 1:
            dist.all_reduce(totals, group=self._trial_group)
        steps = totals.tolist()  # (step 1 of the trial is row 0: odd steps time a pair's second option)
        reasons = []
        for i, (pair, keys) in enumerate(self._pairs.items()):
            first = sorted(row[i] for row in steps[1::2])
            second = sorted(row[i] for row in steps[0::2])
            spread = max((t[-1] - t[0]) / t[0] if t[0] > 0 else 0.0 for t in (first, second))
            band = max(TRIAL_BAND, spread)
            a, b = statistics.median(first), statistics.median(second)
            option = pair[1] if b * (1 + band) < a else pair[0]
            why = ("measured faster beyond the band" if option == pair[1] or a * (1 + band) < b
                   else "within the band: the fixed rule (no codec first; flat without a codec, hierarchical with one)")
            names = ["+".join(o) for o in pair]
            reasons.append(f"{names[0]} {a * 1e3 / ranks:.1f} ms against {names[1]} {b * 1e3 / ranks:.1f} ms a rank"
                           f" and step (buckets {', '.join(keys)}; steps {100 * spread:.0f} % apart, band"
                           f" {100 * band:.0f} %): {'+'.join(option)}, {why}")
            for key in keys:
                planned = self.plan.buckets[key]
                planned.route, planned.codec = option
                planned.predicted_ms = self.plan.model.route_seconds(*option, planned.nbytes) * 1e3
                planned.measured_ms, planned.steps = None, 0
        self.plan.record(self._step)
        self.plan.settled = {key: [list(option) for option in self._contested[key]]
                             for key in sorted(self._contested, key=lambda k: (len(k), k))}
        self.plan.reasons = reasons
        self.trials, self._contested, self._pairs, self._trial_times = {}, {}, {}, []
        self._restart_baseline()
        self.report(self.plan.table())

    def _restart_baseline(self) -> None:
        """A plan changed: the measured-over-predicted baseline is set again, from the next steps."""
        self._since_plan, self._calibration, self._baseline, self._streak = 0, [], None, 0

    def replan(self, reason: str) -> None:
        """Probe the links again and re-decide every bucket (collective: every rank, at a step boundary, with the
        communication thread idle)."""
        old = self.plan
        model, seconds = self._replan()  # (global rank 0's, on every rank)
        plan = CommPlan(model, old.routes, old.codecs, old.bucket_size_mb, seconds, version=old.version + 1,
                        reason=reason, history=list(old.history))
        plan.plan_buckets({k: b.nbytes for k, b in old.buckets.items() if b.route in (FLAT, HIERARCHICAL)})
        for key, b in old.buckets.items():
            if b.route not in (FLAT, HIERARCHICAL):
                plan.plan_stage(key, b.route, b.nbytes)
        plan.record(self._step)
        self.plan = plan
        self._restart_baseline()
        self.start_trials()

    @hookimpl
    def on_collect_metrics(self) -> dict[str, float]:
        predicted, measured = self._step_ms
        return {"comm/predicted_ms": predicted, "comm/measured_ms": measured,
                "comm/plan_version": float(self.plan.version)}


class AutoCodec:
    """``compression="auto"``: the codec the plan names for each bucket, among the ``candidates`` (name -> plugin,
    each registered in the fit's plugin manager under its name; ``"none"`` is the plain mean), each called through
    hooks of its own."""

    def __init__(self, planner: AdaptivePlanner, candidates: Mapping[str, object]) -> None:
        self.planner = planner
        self._hooks = {name: own_hooks(plugin) for name, plugin in candidates.items()}
        self._last: dict[str, str] = {}
        self._reduce: dict[str, Any] = {}
        self._topology: Topology | None = None

    @hookimpl
    def on_setup(self, topology: Topology) -> None:
        self._topology = topology
        for name in self.planner.plan.codecs:
            self._reduce[name] = self._hooks[name].on_cross_node_reduce
            self.planner.codec_hooks[name] = self._hooks[name]

    def _stage(self, group: dist.ProcessGroup) -> str:
        t, cross = self._topology, self.planner.plan.model.cross
        inter = any(s == "inter" for s, _ in cross)
        world = any(s == "world" for s, _ in cross)
        if inter and (not world or (t.ranks_per_node > 1 and dist.get_world_size(group) == t.num_nodes)):
            return "inter"
        return "world"

    @hookimpl(tryfirst=True)
    def on_cross_node_reduce(self, tensor: Tensor, group: dist.ProcessGroup, bucket: Bucket, offset: int
                             ) -> torch.futures.Future:
        key = _key(bucket)
        plan = self.planner.plan
        chosen = self.planner.choice(key)  # (a gradient bucket's, under trial or as planned)
        if chosen is not None:
            codec = chosen[1]
        else:
            planned = plan.buckets.get(key)
            nbytes = tensor.numel() * tensor.element_size()
            if planned is None or (planned.route not in (FLAT, HIERARCHICAL) and planned.nbytes != nbytes):
                planned = plan.plan_stage(key, self._stage(group), nbytes)
            codec = planned.codec
        if bucket.kind == "tied_gradient":
            codec = self._agreed(codec, group, tensor.device)
        last = self._last.get(key)
        if last is not None and last != codec:
            self._carry(last, state_key(bucket), tensor, group)
        self._last[key] = codec
        timed = not self.planner.routing()
        start = self.planner.clock.stamp()
        future = self._reduce[codec](tensor=tensor, group=group, bucket=bucket, offset=offset)
        if timed:
            self.planner.time(key, start, future)
        return future

    def _agreed(self, codec: str, group: dist.ProcessGroup, device: torch.device) -> str:
        """A tied weight's copies are summed by ranks of different pipeline stages, each stage probing and
        planning its own links: they take the latest candidate any of them chose (one scalar all-reduce over the
        tie's group, every step), so that every copy runs the same codec's collectives."""
        names = self.planner.plan.codecs  # (the same candidates, in the same order, on every rank)
        choice = torch.tensor([names.index(codec)], dtype=torch.int64, device=device)
        dist.all_reduce(choice, op=dist.ReduceOp.MAX, group=group)
        return names[int(choice.item())]

    def _carry(self, old: str, key: int | str, tensor: Tensor, group: dist.ProcessGroup) -> None:
        """Hand codec ``old``'s error-feedback residual for ``key`` to the route the bucket takes now."""
        if old == NO_CODEC:
            return
        folded = self._hooks[old].on_fold_residual(key=key, tensor=tensor, rank=dist.get_rank(group),
                                                   size=dist.get_world_size(group))
        if not folded:
            log.info("ddp_plugin: codec %r keeps its residual of bucket %s (it cannot hand it over); it is"
                     " applied when the bucket takes that codec again.", old, key)


def candidate_names(compression: str | None, options: dict[str, Any]) -> tuple[str, ...]:
    """The plan's codec names: ``compression="auto"``'s candidates (``None`` -> ``"none"``), or the one codec."""
    from ddp_plugin.gradients.planning import DEFAULT_CANDIDATES

    if compression == "auto":
        listed = options.get("candidates", DEFAULT_CANDIDATES)
        return tuple(dict.fromkeys(NO_CODEC if c is None else c for c in listed))
    return (compression or NO_CODEC,)


def codec_options(name: str, compression: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """The constructor options of candidate ``name``: under ``"auto"`` the dict keyed by its name."""
    if compression == "auto":
        return dict(options.get(name, {}))
    return dict(options)
