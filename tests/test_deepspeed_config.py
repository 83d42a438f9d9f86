"""DeepSpeed config -> strategy flags: mapped keys become flags, everything else is named with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_plugin.strategy.deepspeed_config import DeepSpeedMapping, describe_ignored, from_deepspeed_config

ZERO2 = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999]}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "steps_per_print": 100,
}


def test_typical_zero2_config():
    mapped = from_deepspeed_config(ZERO2)
    assert mapped.flags == {"zero_stage": 2, "bucket_size_mb": 5e8 * 4 / 2**20, "gradient_clip_norm": 1.0,
                            "offload": "cpu"}
    assert round(mapped.flags["bucket_size_mb"], 1) == 1907.3
    assert mapped.hpz_partition_size is None
    # One entry per ignored section, in the config's order; the true switches are not listed.
    assert list(mapped.ignored) == [
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "fp16",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.offload_optimizer.pin_memory",
        "steps_per_print",
    ]
    assert "DataLoader's `batch_size`" in mapped.ignored["train_micro_batch_size_per_gpu"]
    assert "Trainer(accumulate_grad_batches=...)" in mapped.ignored["gradient_accumulation_steps"]
    assert "LightningModule.configure_optimizers" in mapped.ignored["optimizer"]
    assert "LightningModule.configure_optimizers" in mapped.ignored["scheduler"]
    assert 'Trainer(precision="16-mixed")' in mapped.ignored["fp16"]
    assert "a detail of DeepSpeed's offload" in mapped.ignored["zero_optimization.offload_optimizer.pin_memory"]


@pytest.mark.parametrize(("zero", "flags", "ignored"), [
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
      "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 5}},
     {"zero_stage": 3, "offload": "disk", "offload_dir": "/nvme", "offload_params": True},
     {"zero_optimization.offload_param.buffer_count": "a detail of DeepSpeed's offload"}),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
     {"zero_stage": 3, "offload": "cpu"}, {"zero_optimization.offload_param": "parameters are not kept in host memory"}),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
     {"zero_stage": 3}, {"zero_optimization.offload_param": "only with the optimizer state"}),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
      "offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
     {"zero_stage": 2, "offload": "disk", "offload_dir": "/nvme"},
     {"zero_optimization.offload_param": "at stage 3 only"}),
])
def test_offload_sections_map_to_the_offload_flags(zero, flags, ignored):
    mapped = from_deepspeed_config({"zero_optimization": zero})
    assert mapped.flags == flags
    assert set(mapped.ignored) == set(ignored)
    for key, text in ignored.items():
        assert text in mapped.ignored[key]


@pytest.mark.parametrize(("section", "pattern"), [
    ({"device": "nvme"}, r"`zero_optimization.offload_optimizer.device` is 'nvme', which needs"
     r" `zero_optimization.offload_optimizer.nvme_path`"),
    ({"device": "gpu"}, r"`zero_optimization.offload_optimizer.device='gpu'` is not a DeepSpeed offload device;"
     r" allowed values: 'none', 'cpu', 'nvme'"),
    ("cpu", r"`zero_optimization.offload_optimizer` must be a JSON object"),
])
def test_a_bad_offload_section_fails_naming_the_key(section, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_deepspeed_config({"zero_optimization": {"stage": 2, "offload_optimizer": section}})


def test_mapping_is_frozen():
    mapped = from_deepspeed_config({})
    assert mapped == DeepSpeedMapping(flags={}, ignored={}, hpz_partition_size=None)
    with pytest.raises(AttributeError):
        mapped.hpz_partition_size = 2  # type: ignore[misc]


@pytest.mark.parametrize("as_path", [str, Path])
def test_config_file_read_by_path(tmp_path, as_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO2))
    assert from_deepspeed_config(as_path(path)) == from_deepspeed_config(ZERO2)


def test_hpz_at_stage3_shards_per_node():
    mapped = from_deepspeed_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert mapped.flags == {"zero_stage": 3, "shard_scope": "node"}
    assert mapped.hpz_partition_size == 8
    assert mapped.ignored == {}


@pytest.mark.parametrize("size", [0, 1])
def test_hpz_of_one_is_no_hpz(size):
    mapped = from_deepspeed_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": size}})
    assert mapped.flags == {"zero_stage": 3}
    assert mapped.hpz_partition_size is None
    assert mapped.ignored == {}


def test_zero_plus_plus_below_stage3_is_ignored_as_deepspeed_does():
    mapped = from_deepspeed_config(
        {"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}}
    )
    assert mapped.flags == {"zero_stage": 2}
    assert mapped.hpz_partition_size is None
    assert 'shard_scope="node"' in mapped.ignored["zero_optimization.zero_hpz_partition_size"]
    assert 'compression="int8"' in mapped.ignored["zero_optimization.zero_quantized_gradients"]


def test_quantized_gradients_map_to_int8():
    mapped = from_deepspeed_config({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
    assert mapped.flags == {"zero_stage": 3, "compression": "int8"}
    assert mapped.ignored == {}
    off = from_deepspeed_config({"zero_optimization": {"stage": 3, "zero_quantized_gradients": False}})
    assert off.flags == {"zero_stage": 3}
    assert off.ignored == {}


def test_auto_and_null_values_are_not_set():
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto", "loss_scale": 0},
        "bf16": {"enabled": "auto"},
        "scheduler": None,
        "zero_optimization": {
            "stage": "auto",
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "offload_param": None,
        },
    }
    mapped = from_deepspeed_config(config)
    assert mapped == DeepSpeedMapping(flags={}, ignored={}, hpz_partition_size=None)
    assert describe_ignored(mapped) == ""


def test_gradient_clipping_zero_disables():
    assert from_deepspeed_config({"gradient_clipping": 0}).flags == {}
    assert from_deepspeed_config({"gradient_clipping": 0.5}).flags == {"gradient_clip_norm": 0.5}
    with pytest.raises(ValueError, match=r"`gradient_clipping=-1` must be a number >= 0"):
        from_deepspeed_config({"gradient_clipping": -1})


def test_false_switches_and_disabled_sections():
    mapped = from_deepspeed_config(
        {
            "fp16": {"enabled": False},
            "bf16": {"enabled": True},
            "tensorboard": {"output_path": "logs"},  # `enabled` defaults to false
            "zero_optimization": {
                "stage": 1,
                "overlap_comm": False,
                "contiguous_gradients": False,
                "reduce_scatter": False,
                "allgather_partitions": True,
                "offload_optimizer": {"device": "none"},
            },
        }
    )
    assert mapped.flags == {"zero_stage": 1}
    assert mapped.ignored == {
        "fp16": "disabled",
        "bf16": 'set `Trainer(precision="bf16-mixed")` instead',
        "tensorboard": "disabled",
        "zero_optimization.overlap_comm": "ddp_plugin always overlaps gradient reduction with backward",
        "zero_optimization.contiguous_gradients": "ddp_plugin always copies gradients into contiguous buckets",
        "zero_optimization.reduce_scatter": "ddp_plugin always reduce-scatters gradients to the shards when sharding",
        "zero_optimization.offload_optimizer": "disabled",
    }


def test_unknown_and_stage3_keys():
    mapped = from_deepspeed_config(
        {
            "my_option": 1,
            "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_new_knob": 1, "foo": 2},
        }
    )
    assert mapped.ignored["my_option"] == "not a DeepSpeed option ddp_plugin knows"
    assert mapped.ignored["zero_optimization.foo"] == "not a DeepSpeed option ddp_plugin knows"
    assert "auto_wrap_policy" in mapped.ignored["zero_optimization.stage3_max_live_parameters"]
    assert "auto_wrap_policy" in mapped.ignored["zero_optimization.stage3_new_knob"]


@pytest.mark.parametrize(("legacy", "stage"), [(True, 1), (False, 0)])
def test_legacy_boolean_zero_optimization(legacy, stage):
    assert from_deepspeed_config({"zero_optimization": legacy}).flags == {"zero_stage": stage}


@pytest.mark.parametrize("stage", [4, -1, "2", True, 2.0])
def test_bad_stage(stage):
    with pytest.raises(ValueError, match=r"`zero_optimization\.stage=.*allowed values: 0, 1, 2, 3\.") as info:
        from_deepspeed_config({"zero_optimization": {"stage": stage}})
    assert f"zero_optimization.stage={stage!r}" in str(info.value)


@pytest.mark.parametrize(
    ("zero", "pattern"),
    [
        ([2], r"`zero_optimization` must be a JSON object"),
        ({"reduce_bucket_size": 0}, r"`zero_optimization\.reduce_bucket_size=0` must be a positive number"),
        ({"reduce_bucket_size": "5e8"}, r"`zero_optimization\.reduce_bucket_size='5e8'`"),
        ({"reduce_bucket_size": 1e15},
         r"`zero_optimization\.reduce_bucket_size=1000000000000000\.0`.*at most 274877906944"),
        ({"zero_hpz_partition_size": -2}, r"`zero_optimization\.zero_hpz_partition_size=-2`"),
        ({"zero_quantized_gradients": 1}, r"`zero_optimization\.zero_quantized_gradients=1`.*true, false"),
        ({"overlap_comm": "yes"}, r"`zero_optimization\.overlap_comm='yes'`.*true, false"),
    ],
)
def test_bad_values_name_the_key(zero, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_deepspeed_config({"zero_optimization": zero})


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        from_deepspeed_config(path)


def test_invalid_json(tmp_path):
    path = tmp_path / "ds.hjson"
    path.write_text("{zero_optimization: {stage: 2}}")  # hjson, not JSON
    with pytest.raises(ValueError, match=r"as JSON.*hjson") as info:
        from_deepspeed_config(str(path))
    assert str(path) in str(info.value)


def test_file_must_hold_an_object(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"must hold a JSON object, got a JSON list"):
        from_deepspeed_config(path)


def test_duplicate_keys_rejected(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": 1.0, "gradient_clipping": 0.0}')
    with pytest.raises(ValueError, match=r"'gradient_clipping' twice"):
        from_deepspeed_config(path)


def test_config_of_wrong_type():
    with pytest.raises(TypeError, match=r"`config` must be a path to a DeepSpeed JSON config or a dict, got list"):
        from_deepspeed_config([("zero_optimization", {})])  # type: ignore[arg-type]


def test_describe_ignored_names_every_key():
    mapped = from_deepspeed_config(ZERO2)
    text = describe_ignored(mapped)
    lines = text.splitlines()
    assert lines[0] == "8 DeepSpeed config keys have no effect with HierarchicalZeroStrategy:"
    assert lines[1:] == [f"  - {key}: {reason}" for key, reason in mapped.ignored.items()]
    assert "  - optimizer: create the optimizer in `LightningModule.configure_optimizers` instead" in lines
    assert "optimizer.params" not in text
    one = describe_ignored(from_deepspeed_config({"wall_clock_breakdown": True}))
    assert one == (
        "1 DeepSpeed config key has no effect with HierarchicalZeroStrategy:\n"
        "  - wall_clock_breakdown: use a Lightning profiler instead: `Trainer(profiler=...)`"
    )
    assert describe_ignored(from_deepspeed_config({"zero_optimization": {"stage": 2}})) == ""


# ---------------------------------------------------------------------------------------------- the strategy


def test_strategy_takes_its_flags_from_a_deepspeed_config_and_names_what_it_ignores(tmp_path):
    import json

    import pytest

    from ddp_plugin import HierarchicalZeroStrategy

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 2**20, "zero_quantized_gradients": True,
                              "offload_optimizer": {"device": "cpu"}},
    }))
    with pytest.warns(UserWarning, match=r"(?s)train_micro_batch_size_per_gpu.*optimizer"):
        strategy = HierarchicalZeroStrategy(config=str(path))
    assert strategy.offload == "cpu"
    assert strategy.zero_stage == 3
    assert strategy.bucket_size_mb == 4.0
    assert strategy.compression == "int8"
    assert strategy.gradient_clip_norm == 1.0
    # A flag passed explicitly wins over the config.
    with pytest.warns(UserWarning):
        assert HierarchicalZeroStrategy(config=str(path), zero_stage=2).zero_stage == 2


# ---------------------------------------------------------------------------------------------- precedence


STAGE3_CONFIG = {
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 2**20, "zero_hpz_partition_size": 2,
                          "zero_quantized_gradients": True},
}


@pytest.mark.parametrize(
    ("flag", "explicit", "from_config"),
    [
        ("zero_stage", 0, 3),  # the documented defaults, passed explicitly
        ("shard_scope", "global", "node"),
        ("bucket_size_mb", 25, 4.0),
        ("zero_stage", 1, 3),  # and other values
        ("shard_scope", "node", "node"),
        ("bucket_size_mb", 2, 4.0),
        ("compression", "fp16", "int8"),
        ("gradient_clip_norm", 0.5, 1.0),
    ],
)
def test_a_flag_passed_explicitly_wins_over_the_config_even_when_it_equals_the_default(flag, explicit, from_config):
    from ddp_plugin import HierarchicalZeroStrategy

    assert getattr(HierarchicalZeroStrategy(config=STAGE3_CONFIG), flag) == from_config
    assert getattr(HierarchicalZeroStrategy(config=STAGE3_CONFIG, **{flag: explicit}), flag) == explicit


def test_a_stage_2_config_with_an_explicit_stage_0_trains_unsharded():
    from ddp_plugin import HierarchicalZeroStrategy

    strategy = HierarchicalZeroStrategy(config={"zero_optimization": {"stage": 2}}, zero_stage=0)
    assert strategy.zero_stage == 0
    assert strategy.config.zero_stage == 0  # what the plugins are built with


def test_flags_left_unset_take_the_documented_defaults_without_a_config():
    from ddp_plugin import HierarchicalZeroStrategy

    strategy = HierarchicalZeroStrategy(config={})
    assert (strategy.zero_stage, strategy.shard_scope, strategy.bucket_size_mb) == (0, "global", 25)
    assert (strategy.compression, strategy.gradient_clip_norm) == (None, None)


def _cli(tmp_path, init_args: str):
    from lightning.pytorch.cli import LightningCLI

    import lightning as L

    class Model(L.LightningModule):
        pass

    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20}}))
    config = tmp_path / "config.yaml"
    config.write_text(f"""
trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy:
    class_path: ddp_plugin.HierarchicalZeroStrategy
    init_args: {{config: {tmp_path / 'ds.json'}{init_args}}}
""")
    return LightningCLI(Model, run=False, save_config_callback=None, args=["--config", str(config)]).trainer.strategy


def test_lightning_cli_yaml_takes_the_config_for_flags_it_does_not_set(tmp_path):
    strategy = _cli(tmp_path, "")
    assert (strategy.zero_stage, strategy.bucket_size_mb, strategy.shard_scope) == (2, 4.0, "global")


def test_lightning_cli_yaml_flag_equal_to_the_default_wins_over_the_config(tmp_path):
    strategy = _cli(tmp_path, ", zero_stage: 0, bucket_size_mb: 25")
    assert (strategy.zero_stage, strategy.bucket_size_mb) == (0, 25)
