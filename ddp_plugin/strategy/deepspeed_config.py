"""DeepSpeed config -> ``HierarchicalZeroStrategy`` flags, for users migrating from DeepSpeed.

A DeepSpeed config mixes three kinds of settings: ZeRO and communication settings, which have counterparts
among this strategy's flags; training-loop settings (batch size, optimizer, precision, logging), which belong to
Lightning's ``Trainer`` and ``LightningModule``; and DeepSpeed features ddp_plugin does not have (offload
tuning, parameters in host memory, weight quantization, pipeline parallelism). Silently dropping the last two would let a migrated run differ from
the DeepSpeed run without anyone noticing, so :func:`from_deepspeed_config` maps what it can and returns every
other key, with where to set it instead; the strategy warns with :func:`describe_ignored`.

The mapping is pure: no ``torch.distributed``, no Lightning, so it can be tested and used without a cluster.

(About 430 lines: one table per part of a DeepSpeed config, what each key maps to or why it has none, and the
mapping; the tables are most of it.)

Values that mean "not set" are skipped everywhere, mapped or not: the string ``"auto"`` (what Hugging Face's
Trainer fills in itself) and JSON ``null``. A section whose ``enabled`` is ``"auto"`` is skipped whole.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_plugin.runtime.checks import check_bool, check_int, check_number

ZERO = "zero_optimization"
ALLOWED_STAGES = (0, 1, 2, 3)
GRADIENT_BYTES = 4
"""Bytes per gradient element assumed when converting ``reduce_bucket_size`` (elements) to MiB: fp32 gradients,
which is what Lightning's mixed precision keeps (``"16-mixed"``, ``"bf16-mixed"``)."""
MAX_BUCKET_ELEMENTS = 2**40 // GRADIENT_BYTES
"""The largest ``reduce_bucket_size`` taken: the strategy's ``bucket_size_mb`` limit, 1 TiB."""

_UNSET = "auto"
_UNKNOWN = "not a DeepSpeed option ddp_plugin knows"
_DISABLED = "disabled"

_PRECISION_16 = 'set `Trainer(precision="16-mixed")` instead (Lightning scales the loss)'
_PRECISION_BF16 = 'set `Trainer(precision="bf16-mixed")` instead'
_LOGGER = "set `Trainer(logger=...)` instead"
_PROFILER = "use a Lightning profiler instead: `Trainer(profiler=...)`"
_LEGACY_OFFLOAD = "DeepSpeed's legacy offload key: use `zero_optimization.offload_optimizer` (mapped to `offload`)"
_OFFLOAD_DETAIL = ("no counterpart: a detail of DeepSpeed's offload (ddp_plugin reads one bucket ahead and writes"
                   " one behind; `offload=\"cpu\"` pins host memory)")
_PARAM_OFFLOAD_CPU = ("no counterpart: parameters are not kept in host memory; `offload_param.device: nvme` (with"
                      " `offload_optimizer.device: nvme`) puts stage 3's parameter shards on disk")
_PARAM_OFFLOAD_ALONE = ("ddp_plugin puts the parameter shards on disk only with the optimizer state: set"
                        " `offload_optimizer.device: nvme` too")
_PARAM_OFFLOAD_BELOW_STAGE3 = "DeepSpeed offloads parameters at stage 3 only, and so does ddp_plugin"
_STAGE3_UNITS = "no counterpart: stage 3 gathers and frees whole units; choose the units with `auto_wrap_policy`"
_STAGE3_DETAIL = "no counterpart: a detail of DeepSpeed's stage 3 implementation"
_SCALING = "no counterpart: ddp_plugin sums the gradients, then divides once by the number of ranks"
_CHECKPOINTS = "checkpoints are Lightning's: use `ModelCheckpoint` or `trainer.save_checkpoint`"

# Top-level keys with no counterpart among the strategy's flags -> where to set them instead.
_TOP_LEVEL: dict[str, str] = {
    "train_batch_size": (
        "set the DataLoader's `batch_size` (per rank) instead; the global batch is batch_size x world size x"
        " `Trainer(accumulate_grad_batches=...)`"
    ),
    "train_micro_batch_size_per_gpu": "set the DataLoader's `batch_size` (per rank) instead",
    "gradient_accumulation_steps": "set `Trainer(accumulate_grad_batches=...)` instead",
    "optimizer": "create the optimizer in `LightningModule.configure_optimizers` instead",
    "scheduler": "return the LR scheduler from `LightningModule.configure_optimizers` instead",
    "fp16": _PRECISION_16,
    "amp": _PRECISION_16,
    "bf16": _PRECISION_BF16,
    "bfloat16": _PRECISION_BF16,
    "torch_autocast": 'set `Trainer(precision="16-mixed")` or `"bf16-mixed"` instead',
    "communication_data_type": (
        'gradients are communicated in their own dtype; pass `compression="fp16"` or `"bf16"` to send them in'
        " 16 bits"
    ),
    "prescale_gradients": _SCALING,
    "gradient_predivide_factor": _SCALING,
    "data_types": "no counterpart: gradients are accumulated in the parameters' dtype",
    "steps_per_print": "set `Trainer(log_every_n_steps=...)` instead",
    "wall_clock_breakdown": _PROFILER,
    "memory_breakdown": _PROFILER,
    "flops_profiler": _PROFILER,
    "dump_state": "no counterpart",
    "zero_allow_untested_optimizer": (
        "not needed: ZeRO stages accept elementwise optimizers (SGD, Adam, AdamW, ...); declare another one with"
        " `ddp_plugin.zero.allow_optimizer`"
    ),
    "zero_force_ds_cpu_optimizer": "no counterpart: with offload your own optimizer steps, bucket by bucket",
    "allgather_size": "no counterpart: parameters are all-gathered in the gradient buckets (`bucket_size_mb`)",
    "activation_checkpointing": "apply `torch.utils.checkpoint` in your LightningModule instead",
    "tensorboard": _LOGGER,
    "wandb": _LOGGER,
    "csv_monitor": _LOGGER,
    "comet": _LOGGER,
    "comms_logger": "ddp_plugin logs its own `comm/...` metrics (`progress_bar_metrics=True` shows them)",
    "checkpoint": _CHECKPOINTS,
    "nebula": _CHECKPOINTS,
    "elasticity": "no counterpart: the world size is fixed for a run",
    "autotuning": "no counterpart",
    "compile": "call `torch.compile` on your model instead",
    "pipeline": "no counterpart: ddp_plugin is data-parallel only",
    "sparse_attention": "no counterpart: attention kernels belong in the model",
    "data_efficiency": "no counterpart: data sampling belongs in your DataLoader",
    "curriculum_learning": "no counterpart: data sampling belongs in your DataLoader",
    "compression_training": "no counterpart for model compression (gradient compression is `compression=`)",
    "quantize_training": "no counterpart",
    "eigenvalue": "no counterpart",
    "progressive_layer_drop": "no counterpart",
    "aio": "no counterpart: `offload=\"disk\"` maps its files; DeepSpeed's async I/O settings do not apply",
    "hybrid_engine": "no counterpart",
}

# Sections switched by an `enabled` key that defaults to false in DeepSpeed.
_ENABLED_SECTIONS = frozenset(
    {
        "fp16", "amp", "bf16", "bfloat16", "torch_autocast", "flops_profiler", "tensorboard", "wandb",
        "csv_monitor", "comet", "comms_logger", "nebula", "elasticity", "autotuning", "eigenvalue",
        "progressive_layer_drop", "compile", "hybrid_engine",
    }
)

# `zero_optimization` keys with no counterpart -> why, or where to set them instead.
_ZERO_IGNORED: dict[str, str] = {
    "allgather_bucket_size": "no counterpart: parameters are all-gathered in the gradient buckets (`bucket_size_mb`)",
    "use_multi_rank_bucket_allreduce": "no counterpart: the reducer plugins choose the collectives",
    "cpu_offload": _LEGACY_OFFLOAD,
    "cpu_offload_param": _LEGACY_OFFLOAD,
    "cpu_offload_params": _LEGACY_OFFLOAD,
    "cpu_offload_use_pin_memory": _LEGACY_OFFLOAD,
    "sub_group_size": "no counterpart: each rank steps its whole shard at once",
    "round_robin_gradients": "no counterpart: a detail of DeepSpeed's CPU offload",
    "zero_quantized_weights": (
        "no weight quantization (ZeRO++ qwZ): parameters are all-gathered in their own dtype; `compression=`"
        " compresses gradients only"
    ),
    "zero_quantized_nontrainable_weights": (
        "no weight quantization: frozen parameters keep their dtype and are not sharded"
    ),
    "stage3_prefetch_bucket_size": (
        "no counterpart in elements: stage 3 prefetches whole units, `prefetch_units` of them (default 2); choose"
        " the units with `auto_wrap_policy`"
    ),
    "stage3_param_persistence_threshold": _STAGE3_UNITS,
    "stage3_model_persistence_threshold": _STAGE3_UNITS,
    "stage3_max_live_parameters": _STAGE3_UNITS,
    "stage3_max_reuse_distance": _STAGE3_UNITS,
    "stage3_gather_16bit_weights_on_model_save": _CHECKPOINTS,
    "stage3_gather_fp16_weights_on_model_save": _CHECKPOINTS,
    "gather_16bit_weights_on_model_save": _CHECKPOINTS,
    "load_from_fp32_weights": (
        "no counterpart: the parameters are the master weights (fp32 under Lightning's mixed precision)"
    ),
    "elastic_checkpoint": "no counterpart (DeepSpeed no longer supports it either)",
    "ignore_unused_parameters": "not needed: unused parameters are always allowed",
    "legacy_stage1": "no counterpart",
    "mics_shard_size": (
        'no counterpart; the closest is `shard_scope="node"` (shard inside each node, replicate across nodes)'
    ),
    "mics_hierarchical_params_gather": 'no counterpart; the closest is `shard_scope="node"`',
    "memory_efficient_linear": _STAGE3_DETAIL,
    "override_module_apply": _STAGE3_DETAIL,
    "pipeline_loading_checkpoint": _STAGE3_DETAIL,
    "use_all_reduce_for_fetch_params": _STAGE3_DETAIL,
    "module_granularity_threshold": _STAGE3_UNITS,
    "zeropp_loco_param": "no counterpart for LoCo error feedback (see `compression=` for gradient codecs)",
    "log_trace_cache_warnings": _STAGE3_DETAIL,
}

# `zero_optimization` switches whose `true` is what ddp_plugin always does -> why `false` cannot be honoured.
_ALWAYS_ON: dict[str, str] = {
    "overlap_comm": "ddp_plugin always overlaps gradient reduction with backward",
    "contiguous_gradients": "ddp_plugin always copies gradients into contiguous buckets",
    "reduce_scatter": "ddp_plugin always reduce-scatters gradients to the shards when sharding",
    "allgather_partitions": "ddp_plugin always all-gathers the updated parameters (no broadcast fallback)",
}

_HPZ_BELOW_STAGE3 = (
    'DeepSpeed uses hpZ only at stage 3; for node-scoped sharding at stages 1-2 pass `shard_scope="node"`'
)
_QGZ_BELOW_STAGE3 = (
    'DeepSpeed quantizes gradients (qgZ) only at stage 3; for int8 gradient compression pass `compression="int8"`'
)


@dataclass(frozen=True)
class DeepSpeedMapping:
    """What a DeepSpeed config means for ``HierarchicalZeroStrategy``.

    Attributes:
        flags: keyword arguments for ``HierarchicalZeroStrategy``, only those the config sets (a subset of
            ``zero_stage``, ``shard_scope``, ``bucket_size_mb``, ``compression``, ``gradient_clip_norm``, ``offload``,
            ``offload_dir``, ``offload_params``).
        ignored: dotted config key (``"zero_optimization.offload_optimizer"``) -> why it has no effect, and where
            to set it instead when there is such a place; in the config's order.
        hpz_partition_size: ``zero_optimization.zero_hpz_partition_size`` when it is above 1 (at stage 3); the
            strategy checks that it equals the ranks per node, the group ``shard_scope="node"`` shards over.
    """

    flags: dict[str, Any] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    hpz_partition_size: int | None = None


def from_deepspeed_config(config: str | os.PathLike | Mapping[str, Any]) -> DeepSpeedMapping:
    """Map a DeepSpeed config (a path to a JSON file, or the parsed dict) to strategy flags.

    Mapped keys:

    - ``zero_optimization.stage`` -> ``zero_stage`` (0, 1, 2 or 3). The legacy ``"zero_optimization": true``
      means stage 1, ``false`` stage 0, as in DeepSpeed.
    - ``zero_optimization.reduce_bucket_size`` -> ``bucket_size_mb``. DeepSpeed counts the bucket in
      elements, ddp_plugin in MiB: ``bucket_size_mb = elements * 4 / 2**20``, assuming fp32 gradients (true
      under Lightning's ``"16-mixed"`` and ``"bf16-mixed"``, where parameters stay fp32; with 16-bit parameters
      the bucket holds twice the elements DeepSpeed's would).
    - ``zero_optimization.zero_hpz_partition_size`` above 1 -> ``shard_scope="node"`` and
      :attr:`DeepSpeedMapping.hpz_partition_size`; 0 or 1 means no hpZ.
    - ``zero_optimization.zero_quantized_gradients: true`` -> ``compression="int8"``.
    - ``gradient_clipping`` above 0 -> ``gradient_clip_norm`` (DeepSpeed clips by the global 2-norm too);
      0 disables clipping.
    - ``zero_optimization.offload_optimizer.device`` ``"cpu"`` -> ``offload="cpu"``; ``"nvme"`` -> ``offload="disk"``
      with ``offload_dir`` from its ``nvme_path``. ``zero_optimization.offload_param.device: "nvme"`` at stage 3,
      beside an ``nvme`` optimizer offload -> ``offload_params=True`` (else listed in ``ignored`` with why). Their
      tuning keys (``pin_memory``, ``buffer_count``, ...) are listed in ``ignored``.

    ZeRO++ hpZ and qgZ are stage 3 features in DeepSpeed, which ignores them at lower stages; so does this
    mapping, which lists them in ``ignored`` with the flag that gives the same effect at stages 1-2.

    ``overlap_comm``, ``contiguous_gradients``, ``reduce_scatter`` and ``allgather_partitions`` set to
    ``true`` are what ddp_plugin always does and are dropped quietly; ``false`` is listed in ``ignored``.
    Every other key is listed in ``ignored`` (an ignored section as one entry, not its sub-keys); a section
    whose ``enabled`` is false or missing (``fp16``, ``bf16``, ``tensorboard``, ...) or an offload section with
    ``"device": "none"`` with the reason ``"disabled"``. ``"auto"`` and ``null`` values are skipped.

    Raises:
        FileNotFoundError: ``config`` is a path that does not exist.
        ValueError: the file is not valid JSON (hjson, which DeepSpeed also reads, is not supported), holds a
            duplicate key or is not a JSON object, or a mapped key has a value DeepSpeed would not accept
            either.
        TypeError: ``config`` is neither a path nor a mapping.
    """
    config = _load(config)
    flags: dict[str, Any] = {}
    ignored: dict[str, str] = {}
    hpz_partition_size: int | None = None
    for key, value in config.items():
        key = str(key)
        if _unset(value):
            continue
        if key == ZERO:
            hpz_partition_size = _map_zero(value, flags, ignored)
        elif key == "gradient_clipping":
            clip = _number(key, value, "a number >= 0 (0 disables clipping)", minimum=0)
            if clip > 0:
                flags["gradient_clip_norm"] = float(clip)
        elif key in _TOP_LEVEL:
            if isinstance(value, Mapping) and _unset(value.get("enabled")) and "enabled" in value:
                continue
            if key in _ENABLED_SECTIONS and isinstance(value, Mapping) and value.get("enabled", False) is False:
                ignored[key] = _DISABLED
            else:
                ignored[key] = _TOP_LEVEL[key]
        else:
            ignored[key] = _UNKNOWN
    return DeepSpeedMapping(flags=flags, ignored=ignored, hpz_partition_size=hpz_partition_size)


def describe_ignored(mapping: DeepSpeedMapping) -> str:
    """One message naming every ignored key and why, one key a line; ``""`` when nothing was ignored."""
    if not mapping.ignored:
        return ""
    lines = [f"  - {key}: {reason}" for key, reason in mapping.ignored.items()]
    count = len(lines)
    head = (
        f"{count} DeepSpeed config key{'s' if count != 1 else ''} ha{'ve' if count != 1 else 's'} no effect with"
        " HierarchicalZeroStrategy:"
    )
    return "\n".join([head, *lines])


# ---------------------------------------------------------------------------------------------- helpers


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == _UNSET)


def _load(config: str | os.PathLike | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"`config` must be a path to a DeepSpeed JSON config or a dict, got {type(config).__name__}."
        )
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file not found: {str(path)!r}.")
    text = path.read_text(encoding="utf-8")
    try:
        loaded = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"Could not parse the DeepSpeed config {str(path)!r} as JSON: {err}. DeepSpeed also reads hjson;"
            " ddp_plugin reads JSON only, so convert the file to JSON."
        ) from err
    if not isinstance(loaded, dict):
        raise ValueError(
            f"The DeepSpeed config {str(path)!r} must hold a JSON object, got a JSON {type(loaded).__name__}."
        )
    return loaded


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # DeepSpeed rejects duplicate keys too: with `json`'s last-one-wins, one of the two would be silently lost.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"The DeepSpeed config has the key {key!r} twice in one object.")
        result[key] = value
    return result


def _map_zero(zero: Any, flags: dict[str, Any], ignored: dict[str, str]) -> int | None:
    """Map the ``zero_optimization`` section into ``flags``/``ignored``; return the hpZ partition size."""
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true is stage 1
        flags["zero_stage"] = 1 if zero else 0
        return None
    if not isinstance(zero, Mapping):
        raise ValueError(
            f"`{ZERO}` must be a JSON object (or the legacy true/false), got {type(zero).__name__} {zero!r}."
        )
    stage = zero.get("stage")
    if not _unset(stage):
        flags["zero_stage"] = check_int(
            f"{ZERO}.stage", stage, min(ALLOWED_STAGES), max(ALLOWED_STAGES),
            expected=f"a ZeRO stage; allowed values: {', '.join(map(str, ALLOWED_STAGES))}",
        )
    effective_stage = flags.get("zero_stage", 0)
    hpz_partition_size: int | None = None
    offload: dict[str, Any] = {}
    for key, value in zero.items():
        key = str(key)
        dotted = f"{ZERO}.{key}"
        if key == "stage" or _unset(value):
            continue
        if key == "reduce_bucket_size":
            elements = _number(dotted, value, f"a positive number of elements, at most {MAX_BUCKET_ELEMENTS} (1 TiB"
                               " of fp32)", minimum=0, strict=True, maximum=MAX_BUCKET_ELEMENTS)
            flags["bucket_size_mb"] = elements * GRADIENT_BYTES / 2**20
        elif key == "zero_hpz_partition_size":
            check_int(dotted, value, minimum=0,
                      expected="a non-negative integer: the ranks per node to shard over (0 or 1: no hpZ)")
            if value > 1:
                if effective_stage == 3:
                    flags["shard_scope"] = "node"
                    hpz_partition_size = value
                else:
                    ignored[dotted] = _HPZ_BELOW_STAGE3
        elif key == "zero_quantized_gradients":
            if _bool(dotted, value):
                if effective_stage == 3:
                    flags["compression"] = "int8"
                else:
                    ignored[dotted] = _QGZ_BELOW_STAGE3
        elif key in _ALWAYS_ON:
            if not _bool(dotted, value):
                ignored[dotted] = _ALWAYS_ON[key]
        elif key in ("offload_optimizer", "offload_param") and isinstance(value, Mapping) and (
            value.get("device") in (None, "none")
        ):
            ignored[dotted] = _DISABLED
        elif key in ("offload_optimizer", "offload_param"):
            offload[key] = value
        elif key in _ZERO_IGNORED:
            ignored[dotted] = _ZERO_IGNORED[key]
        elif key.startswith("stage3_"):
            ignored[dotted] = _STAGE3_UNITS
        else:
            ignored[dotted] = _UNKNOWN
    _map_offload(offload, effective_stage, flags, ignored)
    return hpz_partition_size


def _offload_section(key: str, value: Any) -> tuple[str, str | None]:
    """An offload section's device (``"cpu"`` or ``"nvme"``) and ``nvme_path`` (required with ``"nvme"``)."""
    dotted = f"{ZERO}.{key}"
    if not isinstance(value, Mapping):
        raise ValueError(f"`{dotted}` must be a JSON object with a `device`, got {type(value).__name__} {value!r}.")
    device = value.get("device")
    if device not in ("cpu", "nvme"):
        raise ValueError(f"`{dotted}.device={device!r}` is not a DeepSpeed offload device; allowed values: 'none',"
                         " 'cpu', 'nvme'.")
    path = value.get("nvme_path")
    if device == "nvme" and (_unset(path) or not isinstance(path, str)):
        raise ValueError(f"`{dotted}.device` is 'nvme', which needs `{dotted}.nvme_path`: the directory on a local disk"
                         " for the files (ddp_plugin's `offload_dir`).")
    return device, path


def _map_offload(offload: Mapping[str, Any], stage: int, flags: dict[str, Any], ignored: dict[str, str]) -> None:
    """``offload_optimizer`` -> ``offload`` (``"cpu"``, or ``"disk"`` with ``offload_dir`` from ``nvme_path``);
    ``offload_param`` with ``nvme`` -> ``offload_params`` at stage 3 beside an ``nvme`` optimizer offload. Their
    tuning keys (``pin_memory``, ``buffer_count``, ``ratio``, ...) are listed in ``ignored``."""
    for key, value in offload.items():
        device, path = _offload_section(key, value)
        dotted = f"{ZERO}.{key}"
        if key == "offload_optimizer":
            flags["offload"] = "disk" if device == "nvme" else "cpu"
            if device == "nvme":
                flags["offload_dir"] = path
        elif device == "cpu":
            ignored[dotted] = _PARAM_OFFLOAD_CPU
            continue
        elif stage != 3:
            ignored[dotted] = _PARAM_OFFLOAD_BELOW_STAGE3
            continue
        elif offload.get("offload_optimizer", {}).get("device") != "nvme":
            ignored[dotted] = _PARAM_OFFLOAD_ALONE
            continue
        else:
            flags["offload_params"] = True
        for sub, v in value.items():
            if sub not in ("device", "nvme_path") and not _unset(v):
                ignored[f"{dotted}.{sub}"] = _OFFLOAD_DETAIL


def _bool(key: str, value: Any) -> bool:
    return check_bool(key, value, spelled="true, false")  # JSON's spelling


def _number(key: str, value: Any, expected: str, minimum: float, strict: bool = False,
            maximum: float = math.inf) -> float:
    return check_number(key, value, minimum=minimum, maximum=maximum, strict=strict, expected=expected)
