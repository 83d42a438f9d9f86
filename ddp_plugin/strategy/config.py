"""The strategy's settings: one frozen, validated :class:`StrategyConfig`, built once from the flags and an
optional DeepSpeed config, that everything after construction trusts.

Precedence, for the flags a DeepSpeed config can set (:data:`CONFIG_FLAGS`): a flag that was given wins, also
when it equals its default; then the config's value; then the default. "Given" is decided by the sentinel
:data:`UNSET` in :meth:`StrategyConfig.from_flags`. ``HierarchicalZeroStrategy``'s signature cannot default to
a sentinel (LightningCLI checks every default against its type), so there ``None`` means "not set" for those
flags, and an explicit ``compression=None`` cannot switch off a config's ``zero_quantized_gradients``; a
config without that key can.

Each flag's documentation has one copy, its :class:`FlagDoc` in :data:`FLAGS`: README.md's flags table, the flag
tables of docs/sync.md and docs/pipeline.md and the ``Args:`` of ``HierarchicalZeroStrategy``'s docstring (what
LightningCLI's ``--help`` shows) are generated from it by ``python -m ddp_plugin.strategy.flag_docs --write``.

(About 600 lines: each flag's field, documentation and check, so that a flag is added, documented and checked in
one file; the checks of single values are :mod:`ddp_plugin.runtime.checks`.)
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from typing import Any, Generic, Never, NoReturn, Protocol, TypeVar, overload

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from ddp_plugin.fault_tolerance.options import check_composition as check_fault_tolerance_composition
from ddp_plugin.parallel.stage_module import ACTIVATION_DTYPES
from ddp_plugin.parallel.stages import SPLIT_METHODS
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
CONFIG_FLAGS = ("zero_stage", "shard_scope", "bucket_size_mb", "compression", "gradient_clip_norm", "offload",
                "offload_dir", "offload_params")
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
    """Every flag of ``HierarchicalZeroStrategy``, validated (:data:`FLAGS` documents them). Build it with
    :meth:`from_flags`; the constructor itself checks nothing."""

    zero_stage: int = 0
    shard_scope: str = "global"
    auto_wrap_policy: int | tuple[type | str, ...] = 1_000_000
    prefetch_units: int = 2
    optimizer_in_backward: bool = False
    offload: str | None = None
    offload_dir: str | None = None
    offload_params: bool = False
    gradient_clip_norm: float | None = None
    checkpoint: str = "master"
    release_cpu_memory: bool | None = None
    devices_per_node: int | None = None
    hierarchical: bool | None = None
    compression: str | None = None
    compression_options: dict[str, Any] = field(default_factory=dict)  # read-only by convention (pickled by spawn)
    bucket_size_mb: float | str = 25
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
    pipeline_parallel_size: int = 1
    pipeline_microbatches: int | None = None
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int | None = None
    pipeline_split: Any = "parameters"  # a str, or the module names of each stage (a tuple of tuples)
    pipeline_activations: str = "fp32"
    activation_checkpointing_policy: tuple[type | str, ...] | None = None
    pretrained: str | None = None
    fault_tolerance: Any = None
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


# ------------------------------------------------------------------------------------------ the flags' documentation


@dataclass(frozen=True)
class FlagDoc:
    """One flag's documentation, its only copy (:mod:`ddp_plugin.strategy.flag_docs` generates the README's table,
    the docs pages' tables and the strategy's docstring from it). Markdown: `code`, and links relative to the
    repository's root (``[docs](docs/zero.md#memory)``); no ``|``."""

    what: str
    """What it does, as README.md's table says it (a flag that shares a row: its part of the row)."""
    allowed: str
    """The values allowed (a flag that shares a README row: its part of the row)."""
    default: str | None = None
    """The default as shown; ``None``: the field's default (`0`, `"global"`, `None`)."""
    more: str = ""
    """Sentences that follow ``what`` in ``--help`` and on the docs pages; README.md stays under its 16 kB."""
    row: str = ""
    """Consecutive flags with the same non-empty ``row`` share one row of README.md's table."""


def _code(*values: Any) -> str:
    """Values as the tables show them: `0`, `"global"`, `None`."""
    return ", ".join(f'`"{v}"`' if isinstance(v, str) else f"`{v!r}`" for v in values)


FLAGS: dict[str, FlagDoc] = {
    "zero_stage": FlagDoc(
        what="`0`: plain data parallelism; `1`: shard the optimizer state; `2`: also the gradients; `3`: also the"
             " parameters ([docs](docs/zero.md))",
        allowed=_code(*ZERO_STAGES)),
    "shard_scope": FlagDoc(
        what="stages 1-3: shard over every rank, or over the ranks of a node with a replica per node, so parameter"
             " all-gathers never cross the slow link (HSDP, ZeRO++ hpZ)",
        allowed=_code(*SHARD_SCOPES)),
    "auto_wrap_policy": FlagDoc(
        what="stage 3 units: `None`: modules grouped into units of at least 1M parameters (an int sets it), or each"
             " instance of the classes given ([docs](docs/zero.md#stage-3-units))",
        allowed="`None`, a positive int, module classes or class names",
        default="`None`",  # (the field holds what `None` means: 1,000,000)
        more="Modules are grouped into units bottom-up; containers are never units."),
    "prefetch_units": FlagDoc(
        what="stage 3: units whose all-gathers run ahead of the one computing, in forward and backward",
        allowed=_code(0, 1, 2),
        more="1 as FSDP; with 2 a step took 1.12-1.20x `ddp`'s, with 1 1.32-1.37x; each one more holds one more"
             " gathered unit."),
    "optimizer_in_backward": FlagDoc(
        what="stages 2-3: step each bucket's shard once its gradient is reduced, in backward"
             " ([docs](docs/zero.md#the-step-in-backward))",
        allowed=_code(False, True),
        more="Its gradient is freed there, so a rank never holds all of its gradient shards; the same update, element"
             " by element. Not with clipping, `skip_nonfinite`, a loss scaler, manual optimization, sync modes, fault"
             " tolerance, tensor or pipeline parallelism."),
    "offload": FlagDoc(
        what="stages 1-3: optimizer state in host memory or files ([docs](docs/zero.md#offload))",
        allowed=_code(None, "cpu", "disk"), row="offload",
        more="`\"disk\"` (CPU ranks): each bucket's state in a mapped file in `offload_dir`, read ahead of its step and written"
             " back behind it; `\"cpu\"`: in pinned host memory, copied to the device for its step (on a CPU-only"
             " run the state is in host memory already)."),
    "offload_dir": FlagDoc(
        what="its directory", allowed="a path (with `\"disk\"`)", row="offload",
        more="Each rank's files are unlinked as soon as they are mapped: nothing is left behind."),
    "offload_params": FlagDoc(
        what="stage 3: parameter shards too", allowed=_code(False, True), row="offload"),
    "gradient_clip_norm": FlagDoc(
        what="clip to this global 2-norm before every step, across shards at stages 1-3"
             " (`Trainer(gradient_clip_val=...)` works too)",
        allowed="positive finite number",
        default="`None` (no clipping)"),
    "config": FlagDoc(
        what="a DeepSpeed config whose ZeRO settings become these flags; flags you pass win"
             " ([migrating](docs/zero.md#migrating-from-deepspeed))",
        allowed="path to a JSON file, or a dict",
        default="`None`",
        more="Its other keys are named in a warning."),
    "checkpoint": FlagDoc(
        what='`"master"`: global rank 0 writes one consolidated file atomically; `"sharded"`: every rank its part'
             " through `torch.distributed.checkpoint` ([docs](docs/checkpoints.md))",
        allowed=_code(*CHECKPOINT_MODES),
        more="A master file loads anywhere; sharded checkpoints are resharded on load."),
    "release_cpu_memory": FlagDoc(
        what="on CPU, return freed buffers of 1 MiB or more to the OS (process-wide); `None`: on at stages 2-3"
             " ([why](docs/zero.md#memory))",
        allowed=_code(None, True, False),
        more="1 MiB: glibc's mmap threshold."),
    "devices_per_node": FlagDoc(
        what="ranks per node; `None` takes the launcher's. Set it to simulate nodes on one machine",
        allowed="positive int dividing the world size"),
    "tensor_parallel_size": FlagDoc(
        what='split layers over this many ranks of a node (`configure_model` on `self.device_mesh["tensor_parallel"]`);'
             " other flags act over data-parallel ranks ([docs](docs/tensor_parallel.md))",
        allowed='positive int dividing the ranks per node, `"auto"` (all)',
        more="The module parallelizes itself as for Lightning's `ModelParallelStrategy` (whose default is"
             ' `"auto"`); the data-parallel features run over `"data_parallel"`, on the local shards.'),
    "pipeline_parallel_size": FlagDoc(
        what="split the model's block list into P stages (`torch.distributed.pipelining` schedules); other flags act"
             " per stage; a tied weight's gradient crosses once a step ([docs](docs/pipeline.md))",
        allowed="P: stages of whole nodes or part of one",
        more='P divides the world size; the mesh becomes `("pipeline_parallel", "data_parallel",'
             ' "tensor_parallel")`.'),
    "pipeline_schedule": FlagDoc(
        what="schedule", allowed=_code(*PIPELINE_SCHEDULES), row="pipeline",
        more='One of `torch.distributed.pipelining`\'s; only `"interleaved_1f1b"` runs several stages per rank.'),
    "pipeline_microbatches": FlagDoc(
        what="M microbatches a batch", allowed="M", default="P", row="pipeline",
        more="M is a positive int (`None`: P, `pipeline_parallel_size`); a data-parallel rank's batch must split into"
             ' M equal microbatches; M >= P with `"1f1b"`, a multiple of P with `"interleaved_1f1b"`.'),
    "pipeline_virtual_stages": FlagDoc(
        what="V stages a rank (interleaved: 2)", allowed="V", row="pipeline",
        more='V is a positive int; `None`: 2 with `"interleaved_1f1b"`, else 1 (the only schedule that runs'
             " several)."),
    "pipeline_split": FlagDoc(
        what="where stages split",
        allowed=f"{_code(*SPLIT_METHODS)}, names per stage (a block may be cut)",
        row="pipeline split",
        more="The blocks split into contiguous runs, one per stage: `\"parameters\"` balances their parameter"
             ' counts, `"time"` their compute (each block timed at setup on the data\'s first microbatch; a model'
             " built on meta one block at a time, each materialized alone),"
             ' `"uniform"` their number, `"type:<regex>"` the number of blocks whose class name matches; or the'
             ' module names of each stage (`[["tok", "blocks.0"], ["blocks.1", "head"]]`).'),
    "pipeline_activations": FlagDoc(
        what="the dtype sent between stages on two nodes ([docs](docs/pipeline.md#flags))",
        allowed=_code(*ACTIVATION_DTYPES), row="pipeline split",
        more='The activations and their gradients: `"fp32"` as computed, `"bf16"` and `"fp16"` half the bytes,'
             ' `"int8"` (a scale per row) about a quarter.'),
    "activation_checkpointing_policy": FlagDoc(
        what="these blocks recompute activations in the backward, on every layout"
             " ([docs](docs/activation_checkpointing.md))",
        allowed="classes or class names",
        more="As `FSDPStrategy`'s flag, e.g. `{Block}`; `None`: off."),
    "pretrained": FlagDoc(
        what="read at the first setup, each rank its part"
             " ([docs](docs/checkpoints.md#pretrained-weights-pretrained-safetensors))",
        allowed="a `.safetensors` file or folder",
        more="Hugging Face style, read after the model is split and materialized: each rank reads only its stages"
             " and its tensor-parallel slices. Skipped when `ckpt_path` resumes."),
    "fault_tolerance": FlagDoc(
        what="torchft replica groups: a lost node stops none, one back heals from a peer (sync modes: in"
             ' background); `dynamic_steps`: none waits for a slow one; `data_split="quorum"`: new groups join;'
             " built-in codecs, ZeRO, TP, PP ([docs](docs/fault_tolerance.md))",
        allowed="`None`, `True`, a mapping",
        more="A group is a node; `True` reads the groups from the environment (torchft's variables), a mapping or"
             " a `ddp_plugin.fault_tolerance.FaultTolerance` gives them."),
    "hierarchical": FlagDoc(
        what="reduce inside nodes, cross nodes with 1/k of the data; `False`: flat, like DDP; `None`: chosen per"
             " bucket from measured links ([docs](docs/adaptive.md))",
        allowed=_code(None, True, False),
        more="`None` chooses only where the layout leaves a choice (several nodes of several ranks)."),
    "compression": FlagDoc(
        what="codec for the cross-node stage ([docs](docs/compression.md)); `\"auto\"`: per bucket, the fastest of"
             ' `compression_options["candidates"]` as measured',
        allowed='`None`, `"auto"`, `"fp16"`, `"bf16"`, `"int8"`, `"topk"`, `"powersgd"`, `"sparse"`, an installed'
                " codec"),
    "compression_options": FlagDoc(
        what="the codec's options, validated at construction, handed to plugins in `on_setup(options=...)`; refused"
             " without `compression` unless a plugin takes them",
        allowed="dict"),
    "sync_every": FlagDoc(
        what="nodes synchronize every H optimizer steps, ranks inside a node every step; 1: synchronous"
             " ([docs](docs/sync.md))",
        allowed="positive int"),
    "outer_optimizer": FlagDoc(
        what="with `sync_every > 1`: local SGD, DiLoCo (Nesterov, lr 0.7, momentum 0.9), or"
             " `params -> torch.optim.Optimizer` (YAML: `class_path` + `init_args`)",
        allowed=f"{_code(*OUTER_OPTIMIZERS)}, callable",
        more="It moves the global copy by the averaged pseudo-gradient (the parameters' change): `\"average\"` is SGD"
             " with lr 1 (the global copy becomes the nodes' mean), `\"nesterov\"` SGD with Nesterov momentum; the"
             " callable's YAML is as for the model's optimizer."),
    "sync_fragments": FlagDoc(
        what="sync the parameters in F staggered fragments: S/F every H/F steps",
        allowed="1 to `sync_every`",
        more="S: the gradient bytes. Streaming DiLoCo: the flat parameters (bucket order) are cut into F contiguous"
             " fragments of equal size, across parameter boundaries, each synced every H steps, H/F steps apart; F is"
             " at most the number of trainable parameters (checked at setup)."),
    "max_staleness": FlagDoc(
        what="run each outer all-reduce behind the next steps and apply it this many steps late",
        allowed="0 to `sync_every - 1`",
        more="0: the outer sync blocks the step that starts it."),
    "sync_warmup_steps": FlagDoc(
        what="with `sync_every > 1`: train this many steps synchronously first, then start the sync mode",
        allowed="int >= 0",
        more="They average gradients over every rank, and the sync mode starts from the model they reached:"
             " post-local SGD, and the way DiLoCo is meant to be used (from a synchronously trained model)."),
    "bucket_size_mb": FlagDoc(
        what='gradient bucket capacity; `"auto"`: from the measured link',
        allowed='positive number (at most 1 TiB), `"auto"`',
        more="In MiB; `\"auto\"`: chosen by the link probe ([docs](docs/adaptive.md))."),
    "plugins": FlagDoc(
        what="extra plugins; called before the built-ins",
        allowed="plugin objects"),
    "broadcast_buffers": FlagDoc(
        what="broadcast buffers from rank 0 before each step, as DDP",
        allowed="bool"),
    "skip_nonfinite": FlagDoc(
        what="a NaN/Inf gradient on any rank skips the step everywhere (`train/skipped_steps`)",
        allowed="bool"),
    "weighting": FlagDoc(
        what='`"rank"`: DDP\'s mean over ranks; `"sample"`: weighted by batch size (exact)',
        allowed=_code(*WEIGHTINGS)),
    "progress_bar_metrics": FlagDoc(
        what="show `comm/...` in the bar too",
        allowed="bool"),
    "process_group_backend": FlagDoc(
        what="`None`: NCCL on CUDA, gloo on CPU, MPI under mpirun if torch has it (PyPI's has not)",
        allowed=_code(None, *BACKENDS)),
    "timeout": FlagDoc(
        what="collective timeout",
        allowed=f"`timedelta` or seconds, positive, at most {MAX_TIMEOUT.days} days",
        more="Connecting waits at least 5 minutes."),
    "start_method": FlagDoc(
        what="as `DDPStrategy`",
        allowed=_code(*START_METHODS)),
}
"""Every flag's documentation, in README.md's order: the fields of :class:`StrategyConfig` but
``hpz_partition_size`` (a DeepSpeed config's alone), and ``HierarchicalZeroStrategy``'s ``config``."""


def flag_default(name: str) -> str:
    """The default of flag ``name`` as the tables show it: its :class:`FlagDoc`'s, else the field's."""
    doc = FLAGS[name]
    if doc.default is not None:
        return doc.default
    value = getattr(StrategyConfig(), name)  # (the constructor checks nothing, and makes the default factories')
    if isinstance(value, timedelta):
        return f"{value.total_seconds() / 60:g} min"
    return _code(value)


# ---------------------------------------------------------------------------------------------- flags as attributes

T = TypeVar("T")


class _HasConfig(Protocol):
    @property
    def config(self) -> StrategyConfig: ...


class Flag(Generic[T]):
    """A flag read as an attribute of the strategy (``strategy.zero_stage`` is ``strategy.config.zero_stage``),
    declared one by one in the class's body with the field's type (``zero_stage = Flag[int]()``), so that editors
    and type checkers see it. Read-only: the config is validated once, at construction."""

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Flag[T]: ...

    @overload
    def __get__(self, obj: _HasConfig, owner: type | None = None) -> T: ...

    def __get__(self, obj: _HasConfig | None, owner: type | None = None) -> Flag[T] | T:
        if obj is None:
            return self
        return getattr(obj.config, self.name)

    def __set__(self, obj: object, value: Never) -> NoReturn:  # (Never: type checkers flag an assignment too)
        raise AttributeError(
            f"`{self.name}` is read-only: pass it to the constructor, `HierarchicalZeroStrategy({self.name}=...)`"
            f" (the flags are validated together, once; `strategy.config` is frozen).")


def _validated(values: dict[str, Any]) -> dict[str, Any]:
    """Each given value checked and normalized; missing ones keep their defaults."""
    from ddp_plugin.codecs import check_compression
    from ddp_plugin.strategy.plugin_manager import check_plugins
    from ddp_plugin.parallel.activation_checkpointing import check_policy as check_activation_checkpointing_policy
    from ddp_plugin.zero.backward_step import check_flags as check_optimizer_in_backward
    from ddp_plugin.zero.offload import OFFLOADS, check_directory as check_offload_dir
    from ddp_plugin.zero.offload import check_flags as check_offload
    from ddp_plugin.zero.units import check_auto_wrap_policy
    from ddp_plugin.parallel.stages import check_split as check_pipeline_split
    from ddp_plugin.checkpoints.pretrained import check_pretrained
    from ddp_plugin.fault_tolerance.options import check_fault_tolerance

    out: dict[str, Any] = {}
    checks = {
        "zero_stage": lambda v: check_int("zero_stage", v, 0, 3, expected="an integer; allowed values: 0, 1, 2, 3"),
        "shard_scope": lambda v: check_choice("shard_scope", v, SHARD_SCOPES),
        "auto_wrap_policy": check_auto_wrap_policy,
        "prefetch_units": lambda v: check_int("prefetch_units", v, 0, 2, expected="an integer; allowed values: 0, 1, 2"),
        "optimizer_in_backward": lambda v: check_bool("optimizer_in_backward", v),
        "offload": lambda v: check_choice("offload", v, OFFLOADS),
        "offload_dir": lambda v: None if v is None else check_offload_dir(v),
        "offload_params": lambda v: check_bool("offload_params", v),
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
    check_optimizer_in_backward(every_flag)
    check_offload(every_flag)
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
