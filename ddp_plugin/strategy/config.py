"""The strategy's settings: one frozen, validated :class:`StrategyConfig`, built once from the flags and an
optional DeepSpeed config, that everything after construction trusts.

Precedence, for the flags a DeepSpeed config can set (:data:`CONFIG_FLAGS`): a flag that was given wins, also
when it equals its default; then the config's value; then the default. "Given" is decided by the sentinel
:data:`UNSET` in :meth:`StrategyConfig.from_flags`. ``HierarchicalZeroStrategy``'s signature cannot default to
a sentinel (LightningCLI checks every default against its type), so there ``None`` means "not set" for those
flags, and an explicit ``compression=None`` cannot switch off a config's ``zero_quantized_gradients``; a
config without that key can.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from ddp_plugin.fault_tolerance.options import check_composition as check_fault_tolerance_composition
from ddp_plugin.runtime.checks import (
    check_bool,
    check_choice,
    check_int,
    check_mapping,
    check_positive_number,
    invalid,
)

ZERO_STAGES = (0, 1, 2, 3)
SHARD_SCOPES = ("global", "node")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
WEIGHTINGS = ("rank", "sample")
CHECKPOINT_MODES = ("master", "sharded")
BACKENDS = ("gloo", "nccl", "mpi")
OUTER_OPTIMIZERS = ("average", "nesterov")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
MAX_BUCKET_SIZE_MB = 2**20  # 1 TiB: no device holds a bucket near that; inf overflowed `int(mb * 2**20)`
MAX_TIMEOUT = timedelta(days=365)  # much beyond, torch's deadlines (int64 nanoseconds) overflow: about 292 years
CONFIG_FLAGS = ("zero_stage", "shard_scope", "bucket_size_mb", "compression", "gradient_clip_norm")
"""The flags a DeepSpeed ``config`` can set."""


class _Unset:
    """The type of :data:`UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"  # pickles as the module-level singleton


UNSET: Any = _Unset()
"""A flag that was not given."""


@dataclass(frozen=True)
class StrategyConfig:
    """Every flag of ``HierarchicalZeroStrategy``, validated (see its docstring for their meaning). Build it
    with :meth:`from_flags`; the constructor itself checks nothing."""

    zero_stage: int = 0
    shard_scope: str = "global"
    auto_wrap_policy: int | tuple[type | str, ...] = 1_000_000
    prefetch_units: int = 2
    gradient_clip_norm: float | None = None
    checkpoint: str = "master"
    release_cpu_memory: bool | None = None
    devices_per_node: int | None = None
    hierarchical: bool | None = None
    compression: str | None = None
    compression_options: dict[str, Any] = field(default_factory=dict)  # read-only by convention (pickled by spawn)
    bucket_size_mb: float | str = 25
    """MiB, or ``"auto"``: chosen by the link probe (docs/adaptive.md)."""
    plugins: tuple[object, ...] = ()
    broadcast_buffers: bool = True
    progress_bar_metrics: bool = False
    skip_nonfinite: bool = False
    weighting: str = "rank"
    process_group_backend: str | None = None
    timeout: timedelta | None = default_pg_timeout
    start_method: str = "popen"
    sync_every: int = 1
    outer_optimizer: Any = "nesterov"
    sync_fragments: int = 1
    max_staleness: int = 0
    sync_warmup_steps: int = 0
    tensor_parallel_size: int | str = 1
    """A positive int, or ``"auto"``: the ranks per node (``ModelParallelStrategy``'s default)."""
    pipeline_parallel_size: int = 1
    pipeline_microbatches: int | None = None
    """``None``: as many as pipeline stages."""
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int | None = None
    """Stages per rank; ``None``: 2 with ``"interleaved_1f1b"``, else 1."""
    pipeline_split: Any = "parameters"
    """How the blocks split into stages: ``"parameters"``, ``"uniform"``, ``"type:<regex>"``, or the module names
    of each stage (a tuple of tuples)."""
    pipeline_activations: str = "fp32"
    """The dtype of the activations and their gradients sent between stages on different nodes: ``"fp32"`` (as
    computed), ``"bf16"`` or ``"fp16"``."""
    activation_checkpointing_policy: tuple[type | str, ...] | None = None
    """Module classes (or names) whose forward is recomputed in the backward; ``None``: off."""
    pretrained: str | None = None
    """A ``.safetensors`` file or folder read into the model at its first setup; ``None``: none."""
    fault_tolerance: Any = None
    """Replica groups on torchft (:class:`~ddp_plugin.fault_tolerance.FaultTolerance`); ``None``: off."""
    hpz_partition_size: int | None = None
    """From a DeepSpeed config's ``zero_hpz_partition_size``: must equal the ranks per node (checked at setup)."""

    @classmethod
    def from_flags(cls, config: str | os.PathLike | Mapping[str, Any] | None = None, **flags: Any) -> StrategyConfig:
        """Validate ``flags`` (keyword arguments named like the fields; :data:`UNSET` or missing = not given)
        and merge the DeepSpeed ``config`` into those it can set. Raises ``ValueError`` naming the flag, the value
        and the allowed values; ``TypeError`` for an unknown flag."""
        unknown = sorted(set(flags) - {f.name for f in fields(cls)} - {"hpz_partition_size"})
        if unknown:
            raise TypeError(f"Unknown flag(s) {', '.join(unknown)} for HierarchicalZeroStrategy.")
        given = {k: v for k, v in flags.items() if v is not UNSET}
        merged: dict[str, Any] = {}
        if config is not None:
            mapped = _from_deepspeed_config(config)
            merged.update(mapped.flags)
            merged["hpz_partition_size"] = mapped.hpz_partition_size
        merged.update(given)
        return cls(**_validated(merged))

    @property
    def pipeline_stages(self) -> int:
        """The pipeline's stages: ``pipeline_parallel_size`` x the stages per rank."""
        virtual = self.pipeline_virtual_stages or (2 if self.pipeline_schedule == "interleaved_1f1b" else 1)
        return self.pipeline_parallel_size * virtual

    @property
    def uses_sharding(self) -> bool:
        return self.zero_stage > 0

    @property
    def adaptive(self) -> bool:
        """Whether a flag asks the link probe to decide (``"auto"``); ``hierarchical=None`` asks it too, where the
        layout leaves a choice (several nodes of several ranks)."""
        return self.compression == "auto" or self.bucket_size_mb == "auto"


def _validated(values: dict[str, Any]) -> dict[str, Any]:
    """Each given value checked and normalized; missing ones keep their defaults."""
    from ddp_plugin.codecs import check_compression
    from ddp_plugin.strategy.plugin_manager import check_plugins
    from ddp_plugin.parallel.activation_checkpointing import check_policy as check_activation_checkpointing_policy
    from ddp_plugin.zero.units import check_auto_wrap_policy
    from ddp_plugin.parallel.stage_module import ACTIVATION_DTYPES
    from ddp_plugin.parallel.stages import check_split as check_pipeline_split
    from ddp_plugin.checkpoints.pretrained import check_pretrained
    from ddp_plugin.fault_tolerance.options import check_fault_tolerance

    out: dict[str, Any] = {}
    checks = {
        "zero_stage": lambda v: check_int("zero_stage", v, 0, 3, expected="an integer; allowed values: 0, 1, 2, 3"),
        "shard_scope": lambda v: check_choice("shard_scope", v, SHARD_SCOPES),
        "auto_wrap_policy": check_auto_wrap_policy,
        "prefetch_units": lambda v: check_int("prefetch_units", v, 0, 2, expected="an integer; allowed values: 0, 1, 2"),
        "gradient_clip_norm": lambda v: None if v is None else check_positive_number("gradient_clip_norm", v),
        "checkpoint": lambda v: check_choice("checkpoint", v, CHECKPOINT_MODES),
        "release_cpu_memory": lambda v: check_bool("release_cpu_memory", v, none=True),
        "devices_per_node": _check_devices_per_node,
        "hierarchical": lambda v: check_bool("hierarchical", v, none=True),
        "compression_options": lambda v: check_mapping("compression_options", v),
        "bucket_size_mb": lambda v: v if v == "auto" else check_positive_number(
            "bucket_size_mb", v, maximum=MAX_BUCKET_SIZE_MB, unit=" MiB (1 TiB), or 'auto'"),
        "plugins": lambda v: tuple(v),
        "broadcast_buffers": lambda v: check_bool("broadcast_buffers", v),
        "progress_bar_metrics": lambda v: check_bool("progress_bar_metrics", v),
        "skip_nonfinite": lambda v: check_bool("skip_nonfinite", v),
        "weighting": lambda v: check_choice("weighting", v, WEIGHTINGS),
        "process_group_backend": _check_backend,
        "timeout": _check_timeout,
        "start_method": lambda v: check_choice("start_method", v, START_METHODS),
        "sync_every": lambda v: check_int("sync_every", v, minimum=1),
        "outer_optimizer": _check_outer_optimizer,
        "sync_fragments": lambda v: check_int("sync_fragments", v, minimum=1),
        "max_staleness": lambda v: check_int("max_staleness", v, minimum=0),
        "sync_warmup_steps": lambda v: check_int("sync_warmup_steps", v, minimum=0),
        "tensor_parallel_size": lambda v: v if v == "auto" else check_int("tensor_parallel_size", v, minimum=1,
            expected="a positive integer that divides the ranks per node (`devices_per_node`), or 'auto'"),
        "pipeline_parallel_size": lambda v: check_int("pipeline_parallel_size", v, minimum=1, expected=(
            "a positive integer that divides the world size into stages of whole nodes or parts of one node")),
        "pipeline_microbatches": lambda v: None if v is None else check_int("pipeline_microbatches", v, minimum=1),
        "pipeline_schedule": lambda v: check_choice("pipeline_schedule", v, PIPELINE_SCHEDULES),
        "pipeline_virtual_stages": lambda v: None if v is None else check_int("pipeline_virtual_stages", v,
                                                                              minimum=1),
        "pipeline_split": check_pipeline_split,
        "pipeline_activations": lambda v: check_choice("pipeline_activations", v, ACTIVATION_DTYPES),
        "pretrained": check_pretrained,
        "activation_checkpointing_policy": check_activation_checkpointing_policy,
        "fault_tolerance": check_fault_tolerance,
        "hpz_partition_size": lambda v: v,
    }
    for name, value in values.items():
        if name != "compression":
            out[name] = checks[name](value)
    # The codec last: its options are checked by the codec itself, and options nobody reads are refused.
    compression = values.get("compression")
    options = out.get("compression_options", {})
    plugins = out.get("plugins", ())
    check_compression(compression, options)
    check_plugins(plugins, compression, options)
    if "compression" in values:
        out["compression"] = compression
    every_flag = {**{f.name: f.default for f in fields(StrategyConfig) if f.default is not MISSING}, **out}
    _check_sync_mode(every_flag)
    _check_tensor_parallel(every_flag)
    _check_pipeline(every_flag)
    check_fault_tolerance_composition(every_flag)
    return out


def _check_pipeline(c: dict[str, Any]) -> None:
    """The pipeline flags together, and what cannot run with pipeline stages yet (the rest is the layout's)."""
    p, m, schedule, virtual = (c["pipeline_parallel_size"], c["pipeline_microbatches"], c["pipeline_schedule"],
                               c["pipeline_virtual_stages"])
    if virtual is not None and virtual > 1 and schedule != "interleaved_1f1b":
        raise ValueError(
            f"`pipeline_virtual_stages={virtual}` needs `pipeline_schedule='interleaved_1f1b'` (the only schedule that"
            f" runs several stages per rank); `pipeline_schedule={schedule!r}` runs one. Allowed: 1 or None."
        )
    split = c["pipeline_split"]
    stages = p * (virtual or (2 if schedule == "interleaved_1f1b" else 1))
    if not isinstance(split, str) and len(split) != stages:
        raise ValueError(
            f"`pipeline_split` names the modules of {len(split)} stages; `pipeline_parallel_size={p}` with"
            f" `pipeline_schedule={schedule!r}` runs {stages} (`pipeline_virtual_stages` per rank): one list per"
            " stage."
        )
    if p == 1:
        return
    microbatches = p if m is None else m
    if schedule == "1f1b" and microbatches < p:
        raise ValueError(
            f"`pipeline_microbatches={m}` must be at least `pipeline_parallel_size={p}` with"
            " `pipeline_schedule='1f1b'` (every stage holds a microbatch in its warm-up)."
        )
    if schedule == "interleaved_1f1b" and microbatches % p:
        raise ValueError(
            f"`pipeline_microbatches={m}` must be a multiple of `pipeline_parallel_size={p}` with"
            " `pipeline_schedule='interleaved_1f1b'` (it runs them in rounds of one per stage)."
        )


def _check_tensor_parallel(c: dict[str, Any]) -> None:
    """What can be checked before the layout is known (the rest is :class:`~ddp_plugin.runtime.topology.Layout`'s)."""
    tp, per_node = c["tensor_parallel_size"], c["devices_per_node"]
    if per_node is not None and tp != "auto" and per_node % tp:
        raise ValueError(
            f"`tensor_parallel_size={tp}` must divide `devices_per_node={per_node}`: a tensor-parallel group is"
            " consecutive ranks inside one node. Allowed values:"
            f" {', '.join(str(d) for d in range(1, per_node + 1) if per_node % d == 0)}."
        )
    if tp != "auto":  # (``"auto"``: checked at setup, once the node's size gives it)
        from ddp_plugin.parallel.tensor_parallel import check_flags

        check_flags(tp, c["zero_stage"], c["compression"])


def _check_outer_optimizer(value: Any) -> Any:
    if callable(value) and not isinstance(value, str):
        return value
    if value not in OUTER_OPTIMIZERS:
        raise ValueError(
            f"`outer_optimizer={value!r}` is not supported; allowed values: 'average', 'nesterov', or a callable"
            " that builds a torch optimizer over the outer parameters (e.g. `lambda p: torch.optim.SGD(p, lr=0.5)`)."
        )
    return value


def _check_sync_mode(c: dict[str, Any]) -> None:
    """The sync-mode flags together: what each allows depends on ``sync_every``."""
    every, fragments, staleness = c["sync_every"], c["sync_fragments"], c["max_staleness"]
    if staleness >= every and (staleness or every > 1):
        raise ValueError(
            f"`max_staleness={staleness}` must be less than `sync_every={every}`: an outer sync is applied at most"
            " `max_staleness` steps after it starts, and before the same fragment's next one."
        )
    if fragments > every:
        raise ValueError(
            f"`sync_fragments={fragments}` must be at most `sync_every={every}`: each fragment crosses nodes once"
            f" every `sync_every` steps, on a step of its own."
        )
    if c["sync_warmup_steps"] and every == 1:
        raise ValueError(
            f"`sync_warmup_steps={c['sync_warmup_steps']}` needs a sync mode (`sync_every` > 1): it is the number of"
            " synchronous steps before the sync mode starts, and `sync_every=1` is synchronous throughout."
        )
    decay = (c.get("compression_options") or {}).get("decay", 1.0) if c["compression"] == "sparse" else 1.0
    if decay < 1 and every == 1:
        raise ValueError(
            f"`compression_options['decay']={decay}` with `compression='sparse'` needs a sync mode (`sync_every` > 1):"
            " a decayed error-feedback accumulator stands in for the outer momentum of the pseudo-gradients"
            " (SparseLoCo); on every step's gradients it would drop what was not sent. Use decay 1.0 (the default)"
            " here, or a sync mode."
        )
    if every > 1 and c["zero_stage"] and c["shard_scope"] == "global":
        raise ValueError(
            f"`shard_scope='global'` cannot go with `sync_every={every}`: a sync mode keeps every node a whole"
            " replica for `sync_every` steps, and global shards spread one copy over every node. Use"
            " `shard_scope='node'` (shards inside a node, replicas across nodes), or `sync_every=1`."
        )


def _check_devices_per_node(value: Any) -> int | None:
    if value is None:
        return None
    return check_int("devices_per_node", value, minimum=1, expected=(
        "a positive integer that divides the world size, or None to use the launcher's ranks per node"))


def _check_backend(backend: Any) -> str | None:
    if backend is None:
        return None
    check_choice("process_group_backend", backend, BACKENDS)
    import torch.distributed as dist

    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError(
            "`process_group_backend='mpi'` needs a torch build with MPI support, and this one has none; use"
            " 'gloo' (CPU) or 'nccl' (CUDA). `mpirun` launches still work with those backends."
        )
    return backend


def _check_timeout(timeout: Any) -> timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        ok = timedelta(0) < timeout <= MAX_TIMEOUT
    else:
        ok = (not isinstance(timeout, bool) and isinstance(timeout, (int, float)) and math.isfinite(timeout)
              and 0 < timeout <= MAX_TIMEOUT.total_seconds())
    if not ok:
        # A negative timedelta used to fail only at connect, nan and inf with errors that did not name the flag.
        raise invalid("timeout", timeout, "a datetime.timedelta or a positive number of seconds, finite and at"
                      f" most {MAX_TIMEOUT.days} days")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)


def _from_deepspeed_config(config: Any) -> Any:
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from ddp_plugin.strategy.deepspeed_config import describe_ignored, from_deepspeed_config

    mapped = from_deepspeed_config(config)
    message = describe_ignored(mapped)
    if message:
        rank_zero_warn(message)
    return mapped


def flag_names() -> Iterable[str]:
    """The user-facing flags (every field but what a DeepSpeed config alone sets)."""
    return (f.name for f in fields(StrategyConfig) if f.name != "hpz_partition_size")
