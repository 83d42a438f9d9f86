"""Adaptive communication: measure the links, fit a cost model, and plan each bucket's route and codec.

- :func:`ddp_plugin.strategy.link_probe.probe` times the collectives a bucket's reduction is made of, on the groups it
  runs on, at two sizes each: the in-node reduce-scatter and all-gather, and the cross-node stage of every candidate codec over the
  inter-node group (the hierarchical route, 1/k of a bucket per rank, every local rank at once as in
  training) and over the world (the flat route). A codec is timed as a whole (encode, collectives, decode),
  so its arithmetic on this machine's cores is in its cost, not assumed. Every rank takes part; each figure is
  the slowest rank's (one all-reduce), so every rank ends with the same numbers.
- :class:`CostModel` turns them into a latency + bytes / bandwidth line per stage and predicts a route's time
  for a bucket of any size; :meth:`CostModel.choose` is the cheapest (route, codec) for a bucket, and
  :meth:`CostModel.choose_bucket_bytes` the bucket size that balances per-bucket latency against the last bucket's
  transfer, which nothing overlaps, as the model's layers pack.
- :class:`CommPlan` is what was measured and decided, kept as ``strategy.comm_plan``: global rank 0 decides
  and broadcasts it, so no two ranks can plan differently.

The plugin that follows the plan while training (and re-plans when the measured times leave the prediction)
is :class:`ddp_plugin.plugins.adaptive.AdaptivePlanner`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddp_plugin.hookspecs import Bucket

FLAT, HIERARCHICAL = "flat", "hierarchical"
NO_CODEC = "none"
"""A plan's name for "no codec": the plain averaging all-reduce."""
DEFAULT_CANDIDATES = (None, "int8")
"""``compression="auto"``'s candidates unless ``compression_options["candidates"]`` lists others: PowerSGD and
top-k change convergence, so they are chosen only when listed."""
PILOT_BYTES = 2**20
LARGE_SECONDS = 0.08
"""The probe's larger size is grown from a pilot transfer of 1 MiB until the slowest stage (the plain mean over
the world) takes about this long, its smaller size a quarter of it: the probe then lasts about as long on a 100
Mbit/s link as on a 10 Gbit/s one (under 2 s for two routes and two codecs), and at both sizes the bandwidth,
not the latency or a link's burst allowance, dominates (at 20 Mbit/s, sizes of 32 and 256 KiB, within a
128 KiB token bucket's burst, had measured the link 4x faster than training then saw it)."""
MAX_PROBE_BYTES = 16 * 2**20
MIN_PROBE_BYTES = 64 * 2**10
"""The probe's largest size is the model's gradient bytes where they are fewer than :data:`MAX_PROBE_BYTES`
(no bucket holds more, so no prediction reaches beyond them), but never below this: four times the latency size,
so that the bandwidth has a line to be fitted through. A 0.1 MB model's probe then times 16, 16 and 64 KiB
instead of 16 KiB, 4 and 16 MiB (on 4 CPU ranks of 2 cores, 0.55-1.35 s of a fit's setup, and coding 16 MiB with
every candidate codec)."""
TINY_BYTES = 16 * 2**10
"""The probe's latency size: a message this small costs what any collective costs, whatever its size."""
BUCKET_CAPS_MIB = (1, 2, 4, 8, 16, 25, 32, 64, 128, 256)
"""The bucket capacities ``bucket_size_mb="auto"`` weighs: a fixed list, so that two runs of one job can take the same
one (the sqrt rule's capacity, sqrt(S a / b) for a latency a and a per-byte cost b, was weighed too until
2026-12-05: a figure of the probe's noise, 6.4-13.8 MiB at 10 and 1 Gbit/s in 10 runs, and the cheapest in 5 of
them, by how its buckets packed)."""
BUCKET_BAND = 0.25
"""``bucket_size_mb="auto"`` keeps the default 25 MiB (DDP's) unless another capacity is predicted to cost less by
more than this share; then it takes the cheapest. One comparison, against the default, and not the capacity at the
band's edge: with "the one nearest 25 MiB within 25 % of the least", two runs of one job at 100 Mbit/s took 32 and
16 MiB, the 32 MiB buckets costed 1.244 and 1.270 times the least (a ratio the layers' packing fixes near 1.25, with
the probe's noise either side of the band's edge). With this rule (and the latency timed 9 times) the default
costed 1.17-1.19 times the cheapest at 10 and 1 Gbit/s in 9 runs (kept), 1.31-1.37 at 100 Mbit/s in 6 (4 MiB taken,
8 MiB 1.05-1.06 times it)."""
DEFAULT_BUCKET_BYTES = 25 * 2**20
PREDICTION_BAND = 0.25
"""Options predicted within this share of the fastest (or :data:`CLOSE_S` of it) are not told apart, and the fixed
rule (:func:`preferred`) takes one of them: the probe's fits of one link move this much between runs of one job
(at 10 Gbit/s on 2 x 2, four runs: the flat all-reduce's bandwidth 428-702 MB/s, int8's over the world 436-554, the
cross-node stage's latency 0.85-1.78 ms), enough to rank flat against hierarchical without a codec, or int8 against
no codec, either way; with a band of :data:`CLOSE_S` alone one run in four planned hierarchical without a codec for
two buckets, the others flat. A codec that is predicted faster by less than this is not worth its rounding
either. A clear call stays one: at 1 Gbit/s int8 is predicted 2-3x faster than no codec, at 100 Mbit/s 3-4x."""

TRIAL_BAND = 0.05
"""A close call settled by measurement (:meth:`CommPlan.contested`) goes to the option measured faster only where
it was faster by more than the measurement's own spread (each option's slowest timed step over its fastest, the
larger of the two), taken at least this; within that the two are not told apart and :func:`preferred` decides, so
that two runs of one job plan alike. The spread is not capped: capped at 30 %, a trial whose steps were 74 % apart
took flat + int8 at 10 Gbit/s for measuring 47 % faster, where three other runs of the job kept no codec."""


def preferred(option: tuple[str, str], codecs: Sequence[str] = ()) -> tuple[bool, bool, int, str]:
    """The fixed rule between two ``(route, codec)`` options that measure alike (sort key, preferred first): no
    codec before a codec (nothing rounded); then, without a codec, the flat route (one collective, as ``ddp``: a
    link fast enough to need no codec is where the in-node stages cost what they save), with one the hierarchical
    route (fewer bytes across the nodes, 2 S (1 - 1/m) a node for m nodes against 2 S (1 - 1/n) for n ranks: what
    the slow link a codec is for wants); then the codec listed first in ``codecs`` (the candidates)."""
    route, codec = option
    coded = codec != NO_CODEC
    return coded, route != (HIERARCHICAL if coded else FLAT), list(codecs).index(codec) if codec in codecs else 0, codec


def holds_more(option: tuple[str, str], than: tuple[str, str]) -> bool:
    """Whether ``option`` holds more memory per rank than ``than``: the same codec on the flat route against the
    hierarchical one. The flat route codes the whole bucket on every rank (an error-feedback residual of the
    bucket's size, its codes sent and received), the hierarchical route the 1/k share the in-node reduce-scatter
    leaves it. Of two such options predicted within :data:`TRIAL_MARGIN` of each other the lighter is taken,
    untried (:meth:`CostModel.choose`), and a close call is never settled by trying the heavier
    (:meth:`CommPlan.contested`): a trial raises the fit's peak for good (the allocator keeps what it frees), and
    the probe, which codes without backward beside it, predicts the heavier one too fast. Measured with int8 at 1
    Gbit/s on 2 x 2 (the cluster benchmark): every trial of the two settled for hierarchical + int8 (9 runs; in the
    2 whose trial times were recorded flat + int8 stepped 29 and 58 % slower), and those runs peaked at 654-707 MB
    a rank against 605-632 MB for the runs without a trial."""
    return option[1] == than[1] != NO_CODEC and option[0] == FLAT and than[0] == HIERARCHICAL


TRIAL_MARGIN = 0.5
"""An option predicted less than this much slower than the chosen one is a close call (:meth:`CommPlan.contested`)."""

CLOSE_S = 5e-3
"""Options predicted within this many seconds of the fastest are not told apart, whatever their ratio, and the
fixed rule (:func:`preferred`) takes one of them at once: a small bucket's time is the latencies, which the probe
measures milliseconds apart from run to run (int8's over the world: 6.5, 7.8 and 10.3 ms in three runs), and which
timing in training cannot settle either (a 50 KB bucket measured 40-80 ms a step, against 5 ms predicted)."""


def alike(seconds: float, fastest: float) -> bool:
    """Whether an option predicted to take ``seconds`` is not told apart from the ``fastest``: within
    :data:`PREDICTION_BAND` of it, or :data:`CLOSE_S`."""
    return seconds - fastest <= max(CLOSE_S, PREDICTION_BAND * fastest)


CodecReduce = Callable[[torch.Tensor, dist.ProcessGroup, Bucket], Any]
"""A candidate codec as the probe runs it: reduce ``tensor`` over ``group`` for ``bucket`` (returns a future or
None); ``None`` in a candidates map stands for the plain mean."""


@dataclass(frozen=True)
class Fit:
    """Seconds to move ``nbytes``: ``latency_s + seconds_per_byte * nbytes`` (alpha + beta n)."""

    latency_s: float
    seconds_per_byte: float

    def __call__(self, nbytes: float) -> float:
        return self.latency_s + self.seconds_per_byte * nbytes

    @classmethod
    def through(cls, small: tuple[float, float], large: tuple[float, float]) -> Fit:
        """The line through two (bytes, seconds) points, never negative in either coefficient."""
        (n0, t0), (n1, t1) = small, large
        slope = max((t1 - t0) / (n1 - n0), 0.0) if n1 > n0 else 0.0
        if slope == 0.0:
            slope = t1 / n1 if n1 else 0.0
        return cls(latency_s=max(t0 - slope * n0, 0.0), seconds_per_byte=slope)

    def describe(self) -> dict[str, float]:
        return {"latency_ms": self.latency_s * 1e3,
                "MB_per_s": 1e-6 / self.seconds_per_byte if self.seconds_per_byte > 0 else math.inf}


@dataclass(frozen=True)
class CostModel:
    """Per-stage fits for a layout of ``num_nodes`` x ``ranks_per_node`` ranks.

    ``cross[(stage, codec)]``: the cross-node stage with ``codec`` (``"none"``: the plain mean), ``stage``
    ``"inter"`` (the hierarchical route's, in bytes of the 1/k chunk a rank sends) or ``"world"`` (the flat
    route's, in bytes of the bucket); ``reduce_scatter`` / ``all_gather``: the in-node stages (bytes of the
    bucket), ``None`` without a hierarchical route."""

    num_nodes: int
    ranks_per_node: int
    cross: Mapping[tuple[str, str], Fit]
    reduce_scatter: Fit | None = None
    all_gather: Fit | None = None

    @property
    def routes(self) -> tuple[str, ...]:
        return tuple(r for r, stage in ((FLAT, "world"), (HIERARCHICAL, "inter"))
                     if any(s == stage for s, _ in self.cross))

    @property
    def codecs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c for _, c in self.cross))

    def route_seconds(self, route: str, codec: str, nbytes: int) -> float:
        """Predicted seconds to average a bucket of ``nbytes`` by ``route`` with ``codec``."""
        if route == FLAT:
            return self.cross[("world", codec)](nbytes)
        k = self.ranks_per_node
        return (self.reduce_scatter(nbytes) + self.cross[("inter", codec)](nbytes / k)
                + self.all_gather(nbytes))

    def stage_seconds(self, stage: str, codec: str, nbytes: int) -> float:
        return self.cross[(stage, codec)](nbytes)

    def choose(self, nbytes: int, routes: Sequence[str] | None = None, codecs: Sequence[str] | None = None
               ) -> tuple[str, str, float]:
        """The ``(route, codec, seconds)`` for a bucket of ``nbytes``: of the options predicted :func:`alike` the
        cheapest, the one the fixed rule prefers (:func:`preferred`, the codecs in the order of ``codecs``). An
        option that :func:`holds_more` than one predicted within :data:`TRIAL_MARGIN` of it is not weighed (the
        probe predicts it too fast), nor made the cheapest the others are measured against: at 10 Gbit/s flat +
        int8, predicted fastest, put the band where each of three runs of one job left a different option."""
        codecs = codecs or self.codecs
        ranked = self.ranked(nbytes, routes, codecs)
        ranked = [o for o in ranked
                  if not any(holds_more(o[1:], p[1:]) and p[0] <= o[0] * (1 + TRIAL_MARGIN) for p in ranked)]
        seconds, route, codec = min((o for o in ranked if alike(o[0], ranked[0][0])),
                                    key=lambda o: preferred(o[1:], codecs))
        return route, codec, seconds

    def ranked(self, nbytes: int, routes: Sequence[str] | None = None, codecs: Sequence[str] | None = None
               ) -> list[tuple[float, str, str]]:
        """Every ``(seconds, route, codec)`` for a bucket of ``nbytes``, cheapest first."""
        return sorted((self.route_seconds(r, c, nbytes), r, c) for r in (routes or self.routes)
                      for c in (codecs or self.codecs) if (("world" if r == FLAT else "inter"), c) in self.cross)

    def choose_codec(self, stage: str, nbytes: int, codecs: Sequence[str] | None = None) -> tuple[str, float]:
        """The codec for a cross-node stage alone (a sharder's or a sync mode's, whose route is theirs): of those
        predicted :func:`alike` the cheapest, no codec first, then the first in ``codecs``."""
        codecs = codecs or self.codecs
        options = [(self.stage_seconds(stage, c, nbytes), c) for c in codecs if (stage, c) in self.cross]
        least = min(t for t, _ in options)
        seconds, codec = min((o for o in options if alike(o[0], least)),
                             key=lambda o: (o[1] != NO_CODEC, list(codecs).index(o[1])))
        return codec, seconds

    def best_route(self, sizes: Sequence[int], routes: Sequence[str] | None = None,
                   codecs: Sequence[str] | None = None) -> str:
        """The route with the least predicted time over buckets of ``sizes``, each with its best codec (for a
        fit whose route is fixed at setup: a sharder's layout)."""
        routes = routes or self.routes
        totals = [(sum(self.choose(n, [r], codecs)[2] for n in sizes), i, r) for i, r in enumerate(routes)]
        return min(totals)[2]

    def choose_bucket_bytes(self, buckets_for: Callable[[int], Sequence[int]],
                            routes: Sequence[str] | None = None, codecs: Sequence[str] | None = None) -> int:
        """The bucket capacity, among :data:`BUCKET_CAPS_MIB`, whose buckets (as the
        engine would pack them: ``buckets_for(cap)``, bytes in launch order) cost least: every bucket's predicted
        time (its own route and codec) plus the last one's again, which no backward overlaps. Packing matters: a
        capacity just below a layer's size puts each layer and each bias in buckets of their own, twice the
        latencies of one just above it. The default 25 MiB unless another is cheaper by more than
        :data:`BUCKET_BAND`, then the cheapest (:func:`capacity_of`)."""
        return capacity_of(self.bucket_costs(buckets_for, routes, codecs))

    def bucket_costs(self, buckets_for: Callable[[int], Sequence[int]],
                     routes: Sequence[str] | None = None, codecs: Sequence[str] | None = None) -> dict[int, float]:
        """Each capacity :meth:`choose_bucket_bytes` weighs -> the predicted seconds of its buckets."""
        caps = [int(c * 2**20) for c in BUCKET_CAPS_MIB]

        def cost(cap: int) -> float:
            sizes = [s for s in buckets_for(cap) if s > 0]
            if not sizes:
                return 0.0
            return sum(self.choose(s, routes, codecs)[2] for s in sizes) + self.choose(sizes[-1], routes, codecs)[2]

        return {cap: cost(cap) for cap in caps}

    def describe(self) -> dict[str, dict[str, float]]:
        out = {f"{stage}/{codec}": fit.describe() for (stage, codec), fit in self.cross.items()}
        if self.reduce_scatter is not None:
            out["intra/reduce_scatter"] = self.reduce_scatter.describe()
            out["intra/all_gather"] = self.all_gather.describe()
        return out


def capacity_of(costs: Mapping[int, float]) -> int:
    """Of the capacities in ``costs`` (capacity -> predicted seconds): the default 25 MiB, unless another is
    predicted to cost less by more than :data:`BUCKET_BAND`; then the cheapest (of capacities that pack alike, and
    so cost the same, the one nearest the default; the larger of two as near)."""
    least = min(costs.values())
    if costs.get(DEFAULT_BUCKET_BYTES, math.inf) <= least * (1 + BUCKET_BAND):
        return DEFAULT_BUCKET_BYTES
    cheapest = [cap for cap in costs if costs[cap] <= least * (1 + 1e-9)]
    return min(cheapest, key=lambda c: (abs(math.log(c / DEFAULT_BUCKET_BYTES)), -c))


@dataclass
class BucketPlan:
    """One bucket's decision: its route and codec, the predicted time, and the measured one (mean over the
    steps since the plan was made; ``None`` until a step ran). For buckets whose route is a sharder's or a sync
    mode's, ``route`` is the stage the cross-node reduce runs on and the times are that stage's."""

    key: str
    nbytes: int
    route: str
    codec: str
    predicted_ms: float
    measured_ms: float | None = None
    steps: int = 0

    def record(self, seconds: float) -> None:
        self.steps += 1
        ms = seconds * 1e3
        self.measured_ms = ms if self.measured_ms is None else self.measured_ms + (ms - self.measured_ms) / self.steps


@dataclass
class CommPlan:
    """What the link probe measured and what was decided from it (``strategy.comm_plan``).

    Attributes:
        model: the fitted :class:`CostModel` (``model.describe()``: latency and bandwidth per stage).
        buckets: per bucket key (``"3"``, ``"pseudo_gradient/0"``): its :class:`BucketPlan`.
        routes: the routes the plan chooses between (one when ``hierarchical`` was set, or a sharder or sync mode
            fixes it for the fit).
        codecs: the candidate codecs (``"none"``: no codec).
        bucket_size_mb: the bucket capacity in use (chosen with ``bucket_size_mb="auto"``).
        version: 1 for the plan made at setup, +1 per re-plan.
        probe_s: seconds the last probe took.
        reason: why the last plan was made (``"setup"``, or the step whose times departed).
        history: ``(version, step, {key: (route, codec)})`` of every plan, oldest first (and of every settling of
            close calls, under the same version).
        settled: the close calls settled by measurement while training.
    """

    model: CostModel
    routes: tuple[str, ...]
    codecs: tuple[str, ...]
    bucket_size_mb: float
    probe_s: float
    buckets: dict[str, BucketPlan] = field(default_factory=dict)
    version: int = 1
    reason: str = "setup"
    history: list[tuple[int, int, dict[str, tuple[str, str]]]] = field(default_factory=list)
    settled: dict[str, list[list[str]]] = field(default_factory=dict)
    """The close calls this plan settled by timing both options while training: key -> [chosen by the model,
    runner-up] (the decision is in ``buckets``)."""
    reasons: list[str] = field(default_factory=list)
    """Why each close call went the way it did: the times measured, the spread, the rule (in :meth:`table`)."""
    bucket_reason: str = ""
    """With ``bucket_size_mb="auto"``: each capacity's predicted seconds, and the band the one taken is in."""

    def plan_buckets(self, sizes: Mapping[str, int]) -> None:
        """Decide every bucket of ``sizes`` (key -> bytes) from the model (:meth:`CostModel.choose`): of the options
        predicted :func:`alike` the fastest, the one the fixed rule prefers (the heavier route of one codec left out
        unless it leads by more than :data:`TRIAL_MARGIN`)."""
        for key, nbytes in sizes.items():
            route, codec, seconds = self.model.choose(nbytes, self.routes, self.codecs)
            self.buckets[key] = BucketPlan(key, nbytes, route, codec, seconds * 1e3)

    def contested(self, margin: float = TRIAL_MARGIN) -> dict[str, list[tuple[str, str]]]:
        """The buckets whose chosen ``(route, codec)`` and the next best are predicted less than ``margin`` apart,
        but not :func:`alike` (where the fixed rule has chosen): key -> [chosen, runner-up], to be settled by
        timing both while training (the probe runs without backward beside it; training does not, and a close
        call can go either way there). The runner-up is the fastest of the others that is not alike the chosen
        option and does not :func:`hold more <holds_more>` than it."""
        out = {}
        for key, b in self.buckets.items():
            if b.route not in (FLAT, HIERARCHICAL):
                continue
            chosen = self.model.route_seconds(b.route, b.codec, b.nbytes)
            options = [(t, (r, c)) for t, r, c in self.model.ranked(b.nbytes, self.routes, self.codecs)
                       if (r, c) != (b.route, b.codec) and not holds_more((r, c), (b.route, b.codec))
                       and not alike(max(t, chosen), min(t, chosen))]
            if options and options[0][0] <= chosen * (1 + margin):
                out[key] = [(b.route, b.codec), options[0][1]]
        return out

    def plan_stage(self, key: str, stage: str, nbytes: int) -> BucketPlan:
        """Decide a cross-node stage whose route is not ours (first seen while training: every rank of the plan sees
        the same key and size, and holds the same model, so they decide the same; a tied weight's sum between
        pipeline stages, whose plans are made apart, is agreed by :class:`~ddp_plugin.plugins.adaptive.AutoCodec`)."""
        codec, seconds = self.model.choose_codec(stage, nbytes, self.codecs)
        plan = self.buckets[key] = BucketPlan(key, nbytes, stage, codec, seconds * 1e3)
        return plan

    def record(self, step: int) -> None:
        """Add the current decisions to ``history``, as made at optimizer step ``step``."""
        self.history.append((self.version, step, self.decisions()))

    def decisions(self) -> dict[str, tuple[str, str]]:
        return {key: (b.route, b.codec) for key, b in self.buckets.items()}

    def table(self) -> str:
        """The plan as text, for the log."""
        lines = [f"ddp_plugin comm plan v{self.version} ({self.reason}; probe {self.probe_s:.2f} s, buckets of"
                 f" {self.bucket_size_mb:.1f} MiB):"]
        for name, fit in self.model.describe().items():
            lines.append(f"  link {name:<24} latency {fit['latency_ms']:8.3f} ms   {fit['MB_per_s']:10.1f} MB/s")
        for key, b in self.buckets.items():
            lines.append(f"  bucket {key:<12} {b.nbytes / 1e6:8.2f} MB  {b.route:<12} {b.codec:<8}"
                         f" predicted {b.predicted_ms:8.2f} ms")
        if self.bucket_reason:
            lines.append(f"  bucket size: {self.bucket_reason}")
        lines += [f"  close call: {reason}" for reason in self.reasons]
        return "\n".join(lines)
