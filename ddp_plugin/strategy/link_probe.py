"""The link probe: the collectives a bucket's reduction is made of, timed on the groups they run on with every
candidate codec (:func:`probe`), each codec on an instance of its own that training never sees
(:func:`probe_codecs`); :func:`agree` makes global rank 0's figures every rank's. What they are fitted into, and the
plan made of them, is :mod:`ddp_plugin.gradients.planning`."""

from __future__ import annotations

import itertools
import logging
import math
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_plugin.hookspecs import Bucket
from ddp_plugin.gradients.planning import (
    FLAT,
    HIERARCHICAL,
    LARGE_SECONDS,
    MAX_PROBE_BYTES,
    MIN_PROBE_BYTES,
    NO_CODEC,
    PILOT_BYTES,
    TINY_BYTES,
    CodecReduce,
    CostModel,
    Fit,
)
from ddp_plugin.plugins.adaptive import codec_options

if TYPE_CHECKING:
    from torch import Tensor

    from ddp_plugin.hookspecs import Communicator, Topology

log = logging.getLogger(__name__)


def _numel_for(nbytes: int, unit: int) -> int:
    """float32 elements for about ``nbytes``, a multiple of ``unit`` (so every split is exact)."""
    return max(unit, (nbytes // 4) // unit * unit)


def _probe_bucket(tensor: torch.Tensor, index: int) -> Bucket:
    """A bucket around ``tensor`` that a codec can code like a gradient bucket: one matrix-shaped parameter (for
    PowerSGD's low-rank products), ``kind="probe"`` (its state never mixes with a gradient bucket's)."""
    numel = tensor.numel()
    rows = math.gcd(numel, 1024)
    param = torch.nn.Parameter(torch.empty(rows, numel // rows, device=tensor.device))
    return Bucket(index=index, buffer=tensor, params=(param,), names=("probe",), offsets=(0,), kind="probe")


def probe(topology: Topology, comm: Communicator, candidates: Mapping[str, CodecReduce | None],
          routes: Sequence[str], device: torch.device, reps: int = 3, max_bytes: int | None = None
          ) -> tuple[CostModel, float]:
    """Time the stages of ``routes`` with every candidate codec (name -> reduce, ``None``: the plain mean) and fit
    a :class:`CostModel`; returns it with the probe's wall time. Collective over every rank of the data-parallel
    world; runs on the topology's side groups (the training thread's).

    ``max_bytes``: the most any stage will be handed in training (the model's gradient bytes: no bucket holds
    more), the largest of the ranks' taken; the probe times no larger size than that (nor than
    :data:`MAX_PROBE_BYTES`, nor less than :data:`MIN_PROBE_BYTES`).

    A codec is timed in its steady state: every size on a bucket key of its own (``kind="probe"``, so its state
    never meets another size's or a gradient bucket's), after one untimed call that makes that state."""
    started = time.perf_counter()
    t = topology
    k, m = t.ranks_per_node, t.num_nodes
    world, inter, intra = t.side_world_group, t.side_inter_node_group, t.side_intra_node_group
    unit = k * m * 64
    gen = torch.Generator().manual_seed(1234)
    flag = torch.zeros(1, device=device)
    largest = MAX_PROBE_BYTES
    if max_bytes is not None:
        # Every rank must time the same sizes (each is a collective): the largest rank's gradients decide (a
        # pipeline stage or a tensor-parallel shard holds less than another).
        most = torch.tensor([float(max_bytes)], dtype=torch.float64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=world)
        largest = int(min(MAX_PROBE_BYTES, max(most.item(), MIN_PROBE_BYTES)))

    def barrier() -> None:
        dist.all_reduce(flag, group=world)
        if device.type == "cuda":
            # (NCCL's all-reduce returns once queued: the clock starts when every rank is here, not before)
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], Any]) -> float:
        barrier()
        start = time.perf_counter()
        result = fn()
        if result is not None and hasattr(result, "wait"):
            result.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    # Samples are copies of one normal draw (the first ``numel`` values of it) into one buffer, both grown by the
    # pilot only: drawing every sample afresh into a new tensor was 45 % of a 2 x 2 CPU fit's probe (4 ranks on
    # 2 cores; 16 MiB drawn in 90 ms, copied in 2). Each call gets the source's values again (a collective
    # overwrites its input). Nothing timed keeps a sample: each call waits for its collective, and a codec's
    # state for the probe's key is dropped after it.
    source: list[torch.Tensor] = []

    def sample(numel: int) -> torch.Tensor:
        if not source or source[0].numel() < numel:
            source.clear()  # (before the larger ones: never both)
            drawn = torch.randn(numel, generator=gen).to(device)
            source.extend((drawn, torch.empty_like(drawn)))
        return source[1][:numel].copy_(source[0][:numel])

    def cross_stage(stage: str, name: str) -> Callable[[int, int], float]:
        group = world if stage == "world" else inter
        reduce = candidates[name]

        def run(numel: int, key: int) -> float:
            x = sample(numel)
            if reduce is None:
                return timed(lambda: comm.all_reduce(x.div_(dist.get_world_size(group)), group=group,
                                                     async_op=True))
            bucket = _probe_bucket(x, key)
            return timed(lambda: reduce(x, group, bucket))

        return run

    # Every timed size gets a bucket key of its own: a codec keeps state per bucket (PowerSGD its layout, int8
    # and top-k their residuals), and one key's state met with another size is what crashed PowerSGD here.
    keys = itertools.count()

    def steady(run: Callable[[int, int], float], numel: int, repeats: int, codec: bool) -> float:
        """The fastest of ``repeats`` calls at ``numel`` on a fresh bucket key, after an untimed first call on it
        where ``run`` is a ``codec``'s: its state is made then (buffers, residuals, PowerSGD's Q), so what is
        timed is its cost on every later step, as in training. That key's state is dropped after: the probe's
        sizes are never coded again, and their residuals (up to MAX_PROBE_BYTES each, per stage and size) held
        together made the probe the fit's peak of memory (int8 with ``hierarchical=None``: 722 MB peak RSS a
        rank against 610 with the route fixed, on the cluster benchmark)."""
        key = next(keys)
        if codec:
            run(numel, key)
        try:
            return min(run(numel, key) for _ in range(repeats))
        finally:
            if codec:
                _drop_probe_states(candidates)

    def intra_reduce_scatter(numel: int, index: int) -> float:
        x = sample(numel)
        c = numel // k
        return timed(lambda: comm.reduce_scatter(x[t.local_rank * c:(t.local_rank + 1) * c], x, group=intra))

    def intra_all_gather(numel: int, index: int) -> float:
        x = sample(numel)
        c = numel // k
        return timed(lambda: comm.all_gather(x, x[t.local_rank * c:(t.local_rank + 1) * c], group=intra))

    # (stage, what), how to time it at a size, whether a codec runs it
    stages: list[tuple[tuple[str, str], Callable[[int, int], float], bool]] = []
    if FLAT in routes:
        stages += [(("world", name), cross_stage("world", name), candidates[name] is not None) for name in candidates]
    if HIERARCHICAL in routes:
        stages += [(("intra", "reduce_scatter"), intra_reduce_scatter, False),
                   (("intra", "all_gather"), intra_all_gather, False)]
        stages += [(("inter", name), cross_stage("inter", name), candidates[name] is not None) for name in candidates]

    # The pilot: the plain mean over the world (or the node's chunk across nodes), the slowest stage per byte,
    # grown until it takes about LARGE_SECONDS (every rank takes the slowest rank's time, so all grow alike).
    pilot_stage = "world" if FLAT in routes else "inter"
    pilot_name = NO_CODEC if NO_CODEC in candidates else next(iter(candidates))
    pilot_run, pilot_codec = cross_stage(pilot_stage, pilot_name), candidates[pilot_name] is not None
    numel = _numel_for(min(PILOT_BYTES, largest), unit)
    if not pilot_codec:  # (a codec warms up at every size, in `steady`)
        pilot_run(numel, next(keys))  # warm-up: first-call allocations, lazy connections
    while True:
        took = torch.tensor([steady(pilot_run, numel, 1, pilot_codec)], dtype=torch.float64, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=world)
        grown = _numel_for(int(min(numel * 4 * min(LARGE_SECONDS / max(took.item(), 1e-6), 8.0), largest)), unit)
        if took.item() >= LARGE_SECONDS / 2 or grown <= numel:  # (long enough, or as large as it may be)
            break
        numel = grown
    # Three sizes: a tiny one for the latency (what every bucket pays, the call's own overhead included), and a
    # quarter of the pilot's and the pilot's for the bandwidth.
    sizes = (_numel_for(TINY_BYTES, unit), max(unit, numel // 4 // unit * unit), numel)

    # The fastest of a few: noise only ever adds time. The large size, where it matters less, one time fewer; the
    # latency size, a few ms a call, three times as often: the fastest of 3 put the flat all-reduce's latency at
    # 2.6-6.2 ms in six runs of one job at 100 Mbit/s, and with it what `bucket_size_mb="auto"` weighs (11 bias
    # buckets' latencies against 3 larger buckets').
    counts = (3 * reps, reps, max(reps - 1, 1))
    best: dict[tuple[int, int], float] = {}
    # The stages without a codec (the routes' plain all-reduce, the in-node stages) in turns, one call each: a
    # stretch of a slow machine then slows every route alike instead of the one timed during it (timed stage after
    # stage, four runs of one job at 10 Gbit/s predicted the hierarchical route 0.91-1.47x the flat one's time).
    plain = [index for index, (_, _, codec) in enumerate(stages) if not codec]
    for index in plain:
        stages[index][1](sizes[1], next(keys))  # warm-up of the stage's group
    for turn in range(max(counts)):
        for i, numel in enumerate(sizes):
            if turn < counts[i]:
                for index in plain:
                    took = stages[index][1](numel, next(keys))
                    best[index, i] = min(best.get((index, i), took), took)
    for index, (_, run, codec) in enumerate(stages):
        if codec:  # (a codec's state per size is made, timed and dropped in `steady`: one size's state at a time)
            for i, numel in enumerate(sizes):
                best[index, i] = steady(run, numel, counts[i], codec)
    times = [best[index, i] for index in range(len(stages)) for i in range(len(sizes))]
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=world)
    measured = slowest.tolist()
    fits: dict[tuple[str, str], Fit] = {}
    for index, (name, _, _) in enumerate(stages):
        tiny, small, large = measured[3 * index: 3 * index + 3]
        # Fits are in bytes of what the stage is handed: the bucket for the in-node stages and the flat route, a
        # rank's 1/k chunk for the hierarchical cross-node stage.
        line = Fit.through((sizes[1] * 4, small), (sizes[2] * 4, large))
        fits[name] = Fit(latency_s=max(min(tiny, large), 0.0), seconds_per_byte=line.seconds_per_byte)
    model = CostModel(
        num_nodes=m, ranks_per_node=k,
        cross={key: fit for key, fit in fits.items() if key[0] != "intra"},
        reduce_scatter=fits.get(("intra", "reduce_scatter")), all_gather=fits.get(("intra", "all_gather")),
    )
    comm.release_scratch()
    return model, time.perf_counter() - started


def _drop_probe_states(candidates: Mapping[str, CodecReduce | None]) -> None:
    """Forget what the candidate codecs keep for the probe's buckets (``kind="probe"``, which
    :func:`~ddp_plugin.codecs.base.state_key` keys ``"probe/<index>"``), never a gradient bucket's."""
    for reduce in candidates.values():
        states = getattr(getattr(reduce, "codec", None), "states", None)
        if isinstance(states, dict):
            for key in [k for k in states if isinstance(k, str) and k.startswith("probe/")]:
                del states[key]


def agree(obj: Any, topology: Topology) -> Any:
    """Global rank 0's ``obj`` (of the data-parallel world), on every rank: one decides, all agree."""
    group = topology.side_world_group
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def probe_codecs(names: Sequence[str], compression: str | None, options: dict[str, Any], comm: Communicator,
                 setup_kwargs: dict[str, Any], options_of: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """name -> reduce(tensor, group, bucket) for the probe, each on a codec of its own that training never sees
    (its state thrown away after the probe), registered in a plugin manager of its own and called through its
    hook: a built-in codec is a fresh instance, PowerSGD without its uncompressed warm-up iterations; an installed
    codec is a fresh instance of the class of the object its entry point names, built without arguments and set
    up for the probe (``on_setup`` without buckets, with the options training gets). Only where that class cannot
    be built so (the entry point names a module, or a class that needs arguments) is it the registered object
    itself, set up once more, its probe state under ``kind="probe"`` keys."""
    from ddp_plugin.codecs import BUILTIN_CODECS, installed_plugins
    from ddp_plugin.strategy.plugin_manager import new_plugin_manager

    installed = None
    out: dict[str, Any] = {}
    for name in names:
        if name == NO_CODEC:
            out[name] = None
            continue
        pm = new_plugin_manager()
        if name in BUILTIN_CODECS:
            cls = BUILTIN_CODECS[name]
            opts = codec_options(name, compression, options)
            if "start_iter" in cls.defaults:
                opts["start_iter"] = 0
            codec = cls(**opts)
            codec.comm = comm
            pm.register(codec, name=name)
        else:
            installed = installed_plugins() if installed is None else installed
            pm.register(_fresh(installed[name]), name=name)
            pm.hook.on_setup(**{"topology": None, "buckets": (), "hook": None, "module": None, "comm": comm,
                                **setup_kwargs, "options": options_of(name) if options_of is not None else None})

        def run(x: Tensor, group: dist.ProcessGroup, bucket: Bucket, hook: Any = pm.hook) -> Any:
            return hook.on_cross_node_reduce(tensor=x, group=group, bucket=bucket, offset=0)

        run.codec = pm.get_plugin(name)  # type: ignore[attr-defined]  # (the object the probe times)
        out[name] = run
    return out


def _fresh(plugin: Any) -> Any:
    """A new instance of ``plugin``'s class, built without arguments; ``plugin`` itself where there is none to
    build (a module, a class that needs arguments)."""
    if isinstance(plugin, (type, types.ModuleType)):
        return plugin
    try:
        return type(plugin)()
    except TypeError:
        log.info("ddp_plugin: the link probe times the codec %r itself (its class needs constructor arguments);"
                 " its probe state is kept under keys of kind 'probe'.", plugin)
        return plugin
