"""C6: a bad flag fails at construction with a message naming the flag and the allowed values; the string names
are registered with Lightning."""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest
from torch import nn

import ddp_plugin
from ddp_plugin.zero.offload import OFFLOADS
from ddp_plugin import HierarchicalZeroStrategy


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"zero_stage": 4}, r"`zero_stage=4`.*allowed values: 0, 1, 2, 3"),
        ({"zero_stage": "2"}, r"`zero_stage='2'`.*allowed values: 0, 1, 2, 3"),
        ({"zero_stage": True}, r"`zero_stage=True`"),
        ({"devices_per_node": 0}, r"`devices_per_node=0`.*positive integer"),
        ({"devices_per_node": 1.5}, r"`devices_per_node=1.5`"),
        ({"compression": "zstd"}, r"`compression='zstd'`.*allowed values: None"),
        ({"compression_options": [1]}, r"`compression_options` must be a dict"),
        ({"bucket_size_mb": 0}, r"`bucket_size_mb=0` must be a positive number"),
        ({"bucket_size_mb": "25"}, r"`bucket_size_mb='25'`"),
        ({"process_group_backend": "tcp"}, r"`process_group_backend='tcp'`.*'gloo', 'nccl', 'mpi'"),
        ({"timeout": -1}, r"`timeout=-1`.*positive number of seconds"),
        ({"start_method": "thread"}, r"`start_method='thread'`.*'popen', 'spawn', 'fork', 'forkserver'"),
        ({"shard_scope": "rack"}, r"`shard_scope='rack'`.*allowed values: 'global', 'node'"),
        ({"zero_stage": 3, "auto_wrap_policy": 0}, r"`auto_wrap_policy=0` must be a positive parameter count"),
        ({"zero_stage": 3, "auto_wrap_policy": [3.5]}, r"`auto_wrap_policy=\[3.5\]`.*allowed values: None"),
        ({"zero_stage": 3, "prefetch_units": 3}, r"`prefetch_units=3`.*allowed values: 0, 1, 2"),
        ({"zero_stage": 3, "prefetch_units": True}, r"`prefetch_units=True`.*allowed values: 0, 1, 2"),
        ({"zero_stage": 3, "prefetch_units": -1}, r"`prefetch_units=-1`.*allowed values: 0, 1, 2"),
        ({"gradient_clip_norm": -1.0}, r"`gradient_clip_norm=-1.0` must be a positive number"),
        ({"checkpoint": "dcp"}, r"`checkpoint='dcp'`.*allowed values: 'master', 'sharded'"),
        ({"release_cpu_memory": 1}, r"`release_cpu_memory=1`.*allowed values: None, True, False"),
        ({"tensor_parallel_size": 0}, r"`tensor_parallel_size=0`.*positive integer that divides the ranks per node"),
        ({"tensor_parallel_size": 2.0}, r"`tensor_parallel_size=2.0`"),
        ({"tensor_parallel_size": 3, "devices_per_node": 4},
         r"`tensor_parallel_size=3` must divide `devices_per_node=4`.*Allowed values: 1, 2, 4"),
    ],
)
def test_bad_flag_fails_at_construction_naming_flag_and_allowed_values(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HierarchicalZeroStrategy(**kwargs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_names_select_the_sharder(stage):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=f"hierarchical_zero_stage_{stage}", logger=False)
    assert trainer.strategy.zero_stage == stage
    assert trainer.strategy.shard_scope == "global"


def test_mpi_backend_without_torch_mpi_support_is_refused(monkeypatch):
    monkeypatch.setattr("torch.distributed.is_mpi_available", lambda: False)
    with pytest.raises(ValueError, match=r"`process_group_backend='mpi'` needs a torch build with MPI"):
        HierarchicalZeroStrategy(process_group_backend="mpi")


def test_timeout_accepts_seconds():
    assert HierarchicalZeroStrategy(timeout=90).config.timeout == timedelta(seconds=90)


def test_string_name_selects_the_strategy():
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="hierarchical_zero", logger=False)
    assert isinstance(trainer.strategy, HierarchicalZeroStrategy)
    assert trainer.strategy.zero_stage == 0
    assert trainer.strategy.num_processes == 4
    spawn = L.Trainer(accelerator="cpu", devices=2, strategy="hierarchical_zero_spawn", logger=False)
    assert spawn.strategy.config.start_method == "spawn"


def test_plugin_authors_import_the_marker_from_the_package():
    from ddp_plugin.hookspecs import hookimpl

    assert ddp_plugin.hookimpl is hookimpl


def test_tensor_parallel_size_that_does_not_divide_the_ranks_per_node_fails_before_launch():
    with pytest.raises(ValueError, match=r"`tensor_parallel_size=4` must divide the ranks per node, 2.*1, 2\."):
        L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=HierarchicalZeroStrategy(tensor_parallel_size=4),
                  logger=False)


def test_tensor_parallel_sampler_splits_over_data_parallel_ranks():
    trainer = L.Trainer(accelerator="cpu", devices=4, logger=False,
                        strategy=HierarchicalZeroStrategy(tensor_parallel_size=2))
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_devices_per_node_that_does_not_divide_the_world_fails_before_launch():
    with pytest.raises(ValueError, match=r"`devices_per_node=3` does not divide the world size 4.*1, 2, 4"):
        L.Trainer(accelerator="cpu", devices=4, strategy=HierarchicalZeroStrategy(devices_per_node=3), logger=False)


# ---------------------------------------------------------------------------------------------- values that
# used to be accepted and then broke on every rank, or were silently taken for something else


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"bucket_size_mb": float("inf")}, r"`bucket_size_mb=inf` must be a positive number, finite"),
        ({"bucket_size_mb": float("nan")}, r"`bucket_size_mb=nan` must be a positive number, finite"),
        ({"bucket_size_mb": -1}, r"`bucket_size_mb=-1` must be a positive number, finite"),
        ({"bucket_size_mb": True}, r"`bucket_size_mb=True`"),
        ({"bucket_size_mb": 1e7}, r"`bucket_size_mb=10000000.0`.*at most 1048576 MiB \(1 TiB\)"),
        ({"gradient_clip_norm": float("nan")}, r"`gradient_clip_norm=nan` must be a positive number, finite"),
        ({"gradient_clip_norm": float("inf")}, r"`gradient_clip_norm=inf` must be a positive number, finite"),
        ({"gradient_clip_norm": 0}, r"`gradient_clip_norm=0` must be a positive number, finite"),
        ({"gradient_clip_norm": True}, r"`gradient_clip_norm=True`"),
        ({"timeout": float("nan")}, r"`timeout=nan`.*positive number of seconds, finite"),
        ({"timeout": float("inf")}, r"`timeout=inf`.*positive number of seconds, finite"),
        ({"timeout": 0}, r"`timeout=0`.*positive number of seconds, finite"),
        ({"timeout": True}, r"`timeout=True`"),
        ({"timeout": 1e12}, r"`timeout=1000000000000.0`.*at most 365 days"),
        ({"timeout": timedelta(seconds=-5)}, r"`timeout=datetime.timedelta\(days=-1, seconds=86395\)`.*positive"),
        ({"timeout": timedelta(0)}, r"`timeout=datetime.timedelta\(0\)`.*positive"),
        ({"timeout": timedelta(days=400)}, r"`timeout=datetime.timedelta\(days=400\)`.*at most 365 days"),
        ({"devices_per_node": True}, r"`devices_per_node=True`"),
        ({"devices_per_node": -2}, r"`devices_per_node=-2`"),
        ({"zero_stage": 2.0}, r"`zero_stage=2.0`"),
        ({"zero_stage": -1}, r"`zero_stage=-1`"),
        ({"zero_stage": 3, "auto_wrap_policy": True}, r"`auto_wrap_policy=True`"),
        ({"zero_stage": 3, "auto_wrap_policy": -5}, r"`auto_wrap_policy=-5` must be a positive parameter count"),
        ({"zero_stage": 3, "auto_wrap_policy": [nn.ModuleList]}, r"`auto_wrap_policy`.*ModuleList.*never called"),
    ],
)
def test_non_finite_negative_absurd_or_boolean_numbers_fail_at_construction_naming_the_flag(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HierarchicalZeroStrategy(**kwargs)


@pytest.mark.parametrize("flag", ["broadcast_buffers", "progress_bar_metrics", "skip_nonfinite",
                                  "optimizer_in_backward"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, 1.0, None])
def test_bool_flags_accept_only_bools(flag, value):
    with pytest.raises(ValueError, match=rf"`{flag}={value!r}` must be a bool; allowed values: True, False"):
        HierarchicalZeroStrategy(**{flag: value})


@pytest.mark.parametrize("value", ["off", 0, 1])
def test_hierarchical_accepts_only_none_or_a_bool(value):
    with pytest.raises(ValueError, match=rf"`hierarchical={value!r}`.*allowed values: None, True, False"):
        HierarchicalZeroStrategy(hierarchical=value)


def test_bool_flags_keep_the_bool_given():
    strategy = HierarchicalZeroStrategy(broadcast_buffers=False, progress_bar_metrics=True, skip_nonfinite=True)
    assert (strategy.broadcast_buffers, strategy.progress_bar_metrics, strategy.skip_nonfinite) == (False, True, True)


def test_compression_options_without_compression_fail_naming_both_flags():
    with pytest.raises(ValueError, match=r"`compression_options=\{'block_size': 256\}` has no effect.*`compression`"):
        HierarchicalZeroStrategy(compression_options={"block_size": 256})


class _ReadsOptions:
    """A plugin that takes the user's flags in ``on_setup``: it may read ``compression_options``."""

    @ddp_plugin.hookimpl
    def on_setup(self, options):
        self.options = options


class _ReadsNoOptions:
    @ddp_plugin.hookimpl
    def on_setup(self, topology):
        self.topology = topology


def test_compression_options_without_compression_reach_a_plugin_that_reads_options():
    strategy = HierarchicalZeroStrategy(compression_options={"my_knob": 3}, plugins=[_ReadsOptions()])
    assert strategy.compression_options == {"my_knob": 3}


def test_compression_options_without_compression_fail_when_no_plugin_reads_options():
    with pytest.raises(ValueError, match=r"`compression_options=\{'my_knob': 3\}` has no effect"):
        HierarchicalZeroStrategy(compression_options={"my_knob": 3}, plugins=[_ReadsNoOptions()])


def test_strategy_constructs_with_no_arguments_and_documented_defaults():
    strategy = HierarchicalZeroStrategy()
    assert (strategy.zero_stage, strategy.shard_scope, strategy.bucket_size_mb) == (0, "global", 25)
    assert (strategy.compression, strategy.gradient_clip_norm, strategy.checkpoint) == (None, None, "master")
    assert strategy.broadcast_buffers is True and strategy.skip_nonfinite is False


FT = {"replica_group": 1, "replica_groups": 3, "lighthouse": "http://lighthouse:29510"}


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"fault_tolerance": {**FT, "replica_group": 3}}, r"replica_group'\]=3` must be an integer from 0 to 2"),
    ({"fault_tolerance": {**FT, "lighthouse": "lighthouse:29510"}}, r"'http://host:port'"),
    ({"fault_tolerance": {**FT, "lighthouse": "http://a:29510,http://b:29510"}}, r"ddp-plugin-group --lighthouse"),
    ({"fault_tolerance": {**FT, "min_replicas": 4}}, r"min_replicas'\]=4` must be an integer from 1 to 3"),
    ({"fault_tolerance": {**FT, "replicas": 2}}, r"unknown key\(s\) 'replicas'; allowed keys: background_heal, data_split, dynamic_steps, heal_rate,"),
    ({"fault_tolerance": {**FT, "dynamic_steps": "yes"}}, r"dynamic_steps'\]='yes'` must be True or False"),
    ({"fault_tolerance": {**FT, "dynamic_steps": True}}, r"`fault_tolerance\['dynamic_steps'\]=True` needs a sync mode"
     r" \(`sync_every` > 1, got 1\)"),
    ({"fault_tolerance": "yes"}, r"`fault_tolerance='yes'` must be None, True, a FaultTolerance or a mapping"),
    ({"fault_tolerance": FT, "compression": "auto"}, r"not yet with `compression='auto'` \(the link probe"),
    ({"fault_tolerance": FT, "sync_every": 8, "sync_fragments": 4, "max_staleness": 2},
     r"`max_staleness=2` must be less than `sync_every // sync_fragments` \(2\) with `fault_tolerance`"),
    ({"fault_tolerance": FT, "zero_stage": 1}, r"`shard_scope='global'` cannot go with `fault_tolerance`: global"),
    ({"fault_tolerance": FT, "pipeline_parallel_size": 2, "sync_every": 4, "sync_fragments": 2},
     r"not yet with `pipeline_parallel_size` > 1 with `sync_fragments` > 1 \(each stage cuts its own"),
])
def test_fault_tolerance_is_checked_at_construction_and_refuses_what_cannot_run_yet(kwargs, pattern):
    with pytest.raises((ValueError, NotImplementedError), match=pattern):
        HierarchicalZeroStrategy(**kwargs)


def test_fault_tolerance_takes_local_sgd_diloco_streaming_warmup_every_builtin_codec_and_zero_at_node_scope():
    for outer in ("average", "nesterov"):
        strategy = HierarchicalZeroStrategy(fault_tolerance=FT, sync_every=4, outer_optimizer=outer)
        assert strategy.config.fault_tolerance.replica_groups == 3
    assert HierarchicalZeroStrategy(fault_tolerance=FT, sync_every=4, sync_fragments=2).config.sync_fragments == 2
    assert HierarchicalZeroStrategy(fault_tolerance=FT, sync_every=8, sync_fragments=4,
                                    max_staleness=1).config.max_staleness == 1
    assert HierarchicalZeroStrategy(fault_tolerance=FT, tensor_parallel_size=2, sync_every=4).config.fault_tolerance
    assert HierarchicalZeroStrategy(fault_tolerance=FT, pipeline_parallel_size=2).config.fault_tolerance
    assert HierarchicalZeroStrategy(fault_tolerance=FT, pipeline_parallel_size=2, sync_every=4).config.fault_tolerance
    assert HierarchicalZeroStrategy(fault_tolerance=FT, sync_every=4, sync_warmup_steps=8).config.sync_warmup_steps == 8
    for codec in ("fp16", "bf16", "int8", "topk", "powersgd"):
        assert HierarchicalZeroStrategy(fault_tolerance=FT, compression=codec).config.compression == codec
    for stage in (1, 2, 3):
        for every in (1, 4):
            strategy = HierarchicalZeroStrategy(fault_tolerance=FT, zero_stage=stage, shard_scope="node",
                                                sync_every=every)
            assert strategy.config.zero_stage == stage


def test_fault_tolerance_refuses_an_installed_codec_naming_the_builtin_ones(monkeypatch):
    from ddp_plugin.fault_tolerance import options

    monkeypatch.setattr(options, "_builtin_codecs", lambda: ["fp16", "int8"])
    with pytest.raises(NotImplementedError, match=r"`compression='topk'`, an installed codec .* built-in: 'fp16'"):
        options.check_composition({"fault_tolerance": object(), "sync_fragments": 1, "max_staleness": 0,
                                   "sync_warmup_steps": 0, "sync_every": 1, "zero_stage": 0, "compression": "topk",
                                   "pipeline_parallel_size": 1, "tensor_parallel_size": 1, "plugins": []})


def test_fault_tolerance_true_reads_torchfts_environment_variables_and_names_the_missing_ones(monkeypatch):
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="needs replica_group, replica_groups, lighthouse: .* REPLICA_GROUP_ID"):
        HierarchicalZeroStrategy(fault_tolerance=True)
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "4")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://host:29510")
    ft = HierarchicalZeroStrategy(fault_tolerance=True).config.fault_tolerance
    assert (ft.replica_group, ft.replica_groups, ft.lighthouse, ft.min_replicas) == (2, 4, "http://host:29510", 1)


def test_fault_tolerance_splits_the_data_over_every_replica_groups_ranks():
    # Group 2 of 3, 2 ranks each: its rank 0 reads part 4 of 6 (before the launch, this process is rank 0).
    trainer = L.Trainer(accelerator="cpu", devices=2, logger=False,
                        strategy=HierarchicalZeroStrategy(fault_tolerance={**FT, "replica_group": 2}))
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 6, "rank": 4}


def test_a_decayed_sparse_accumulator_needs_a_sync_mode():
    """``decay`` < 1 is SparseLoCo's accumulator of pseudo-gradients; on every step's gradients it would drop what the
    codec did not send: refused at construction, naming the flags; with a sync mode it is taken."""
    with pytest.raises(ValueError, match=r"`compression_options\['decay'\]=0.95` with `compression='sparse'` needs a"
                                         r" sync mode \(`sync_every` > 1\)"):
        HierarchicalZeroStrategy(compression="sparse", compression_options={"decay": 0.95})
    strategy = HierarchicalZeroStrategy(compression="sparse", compression_options={"decay": 0.95}, sync_every=16,
                                        outer_optimizer="average")
    assert strategy.compression_options == {"decay": 0.95}


# ---------------------------------------------------------------------------------------------- flags as attributes


def _declared_flags() -> dict[str, str]:
    """The ``name = Flag[T]()`` declarations in the class body of ``HierarchicalZeroStrategy``: name -> ``T``, as a
    type checker reads them (from the source, so that a loop or a ``setattr`` would not count)."""
    import ast
    import inspect

    from ddp_plugin.strategy import hierarchical_zero

    tree = ast.parse(inspect.getsource(hierarchical_zero))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HierarchicalZeroStrategy")
    declared = {}
    for node in cls.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Subscript)
                and ast.unparse(node.value.func.value) == "Flag"):
            declared[node.targets[0].id] = ast.unparse(node.value.func.slice)
        elif isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in node.decorator_list):
            declared[node.name] = "property"
    return declared


def test_every_flag_is_declared_in_the_class_with_its_fields_type():
    """Editors and type checkers see each flag attribute: declared in the class body, with the type of its
    ``StrategyConfig`` field (``process_group_backend``: a property, the backend chosen at setup)."""
    import ast
    from dataclasses import fields

    from ddp_plugin.strategy.config import StrategyConfig, flag_names

    declared = _declared_flags()
    types = {f.name: ast.unparse(ast.parse(f.type, mode="eval")) for f in fields(StrategyConfig)}
    expected = {name: "property" if name == "process_group_backend" else types[name] for name in flag_names()}
    assert {name: declared.get(name) for name in expected} == expected
    assert "__getattr__" not in vars(HierarchicalZeroStrategy)  # (nothing answers for names not declared)


@pytest.mark.parametrize("kwargs", [
    {"zero_stage": 2, "shard_scope": "node", "prefetch_units": 1, "gradient_clip_norm": 1.5, "checkpoint": "sharded",
     "release_cpu_memory": False, "devices_per_node": 2, "hierarchical": True, "compression": "int8",
     "compression_options": {"block_size": 256}, "bucket_size_mb": 10, "plugins": [_ReadsOptions()],
     "broadcast_buffers": False, "progress_bar_metrics": True, "skip_nonfinite": True, "weighting": "sample",
     "process_group_backend": "gloo", "timeout": 60, "start_method": "spawn", "sync_every": 4,
     "outer_optimizer": "average", "sync_fragments": 2, "max_staleness": 1, "sync_warmup_steps": 3,
     "activation_checkpointing_policy": [nn.Linear]},
    {"zero_stage": 3, "shard_scope": "node", "auto_wrap_policy": [nn.Linear], "tensor_parallel_size": "auto",
     "pipeline_parallel_size": 2,
     "pipeline_microbatches": 4, "pipeline_schedule": "interleaved_1f1b", "pipeline_virtual_stages": 2,
     "pipeline_split": "uniform", "pipeline_activations": "bf16", "fault_tolerance": FT},
], ids=["data-parallel", "model-parallel"])
def test_every_flag_reads_back_as_an_attribute(kwargs):
    strategy = HierarchicalZeroStrategy(**kwargs)
    from ddp_plugin.strategy.config import flag_names

    assert {name: getattr(strategy, name) for name in flag_names()} == {
        name: getattr(strategy.config, name) for name in flag_names()}
    defaults = HierarchicalZeroStrategy()
    assert all(getattr(strategy, name) != getattr(defaults, name) for name in kwargs), "a flag read its default"


def test_flag_attributes_are_read_only_and_unknown_names_fail_as_usual():
    strategy = HierarchicalZeroStrategy(zero_stage=1)
    with pytest.raises(AttributeError, match=r"`zero_stage` is read-only: pass it to the constructor,"
                                             r" `HierarchicalZeroStrategy\(zero_stage=...\)`"):
        strategy.zero_stage = 2
    assert strategy.zero_stage == 1 and strategy.config.zero_stage == 1
    with pytest.raises(AttributeError, match="has no attribute 'zero_stag'"):
        strategy.zero_stag  # noqa: B018


def test_the_signatures_literal_choices_are_the_configs():
    """The ``Literal[...]`` types LightningCLI checks values against are the choices the config accepts."""
    import ast
    import inspect

    from ddp_plugin.parallel.stage_module import ACTIVATION_DTYPES
    from ddp_plugin.strategy import config

    choices = {}
    for name, parameter in inspect.signature(HierarchicalZeroStrategy).parameters.items():
        for node in ast.walk(ast.parse(str(parameter.annotation), mode="eval")):
            if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal":
                elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                choices[name] = tuple(ast.literal_eval(e) for e in elements)
    assert choices == {"shard_scope": config.SHARD_SCOPES, "checkpoint": config.CHECKPOINT_MODES,
                       "weighting": config.WEIGHTINGS, "start_method": config.START_METHODS,
                       "tensor_parallel_size": ("auto",), "pipeline_schedule": config.PIPELINE_SCHEDULES,
                       "pipeline_activations": tuple(ACTIVATION_DTYPES),
                       "offload": tuple(v for v in OFFLOADS if v is not None)}


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"zero_stage": 0}, r"`zero_stage=0`: it needs `zero_stage=2` or `3`"),
    ({"zero_stage": 1}, r"`zero_stage=1`: it needs `zero_stage=2` or `3`"),
    ({"zero_stage": 3, "gradient_clip_norm": 1.0}, r"`gradient_clip_norm=1.0`: clipping needs the global norm"),
    ({"zero_stage": 3, "skip_nonfinite": True}, r"`skip_nonfinite=True`"),
    ({"zero_stage": 2, "shard_scope": "node", "sync_every": 4}, r"`sync_every=4`"),
    ({"zero_stage": 3, "tensor_parallel_size": 2}, r"`tensor_parallel_size=2`"),
    ({"zero_stage": 3, "pipeline_parallel_size": 2}, r"`pipeline_parallel_size=2`"),
    ({"zero_stage": 2, "shard_scope": "node", "fault_tolerance": {"replica_group": 0, "replica_groups": 2,
                                                                   "lighthouse": "http://localhost:29510"}},
     r"`fault_tolerance`"),
])
def test_optimizer_in_backward_refuses_at_construction_what_needs_the_whole_step_first(kwargs, pattern):
    with pytest.raises(ValueError, match=r"`optimizer_in_backward=True` steps each bucket's shard as soon as its"
                       r" gradient is reduced, in backward, which cannot go with " + pattern):
        HierarchicalZeroStrategy(optimizer_in_backward=True, **kwargs)


def test_optimizer_in_backward_is_accepted_at_stages_2_and_3():
    for stage in (2, 3):
        assert HierarchicalZeroStrategy(zero_stage=stage, optimizer_in_backward=True).optimizer_in_backward is True
    assert HierarchicalZeroStrategy().optimizer_in_backward is False


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"offload": "disk", "zero_stage": 0, "offload_dir": "/tmp"}, r"`offload='disk'` keeps each rank's shard of the"
     r" optimizer state out of memory, which cannot go with `zero_stage=0`: it needs `zero_stage` 1, 2 or 3"),
    ({"offload": "cpu", "zero_stage": 2, "sync_every": 4}, r"cannot go with `sync_every=4`"),
    ({"offload": "cpu", "zero_stage": 3, "tensor_parallel_size": 2}, r"cannot go with `tensor_parallel_size=2`"),
    ({"offload": "cpu", "zero_stage": 3, "pipeline_parallel_size": 2}, r"cannot go with `pipeline_parallel_size=2`"),
    ({"offload": "cpu", "zero_stage": 3, "skip_nonfinite": True}, r"cannot go with `skip_nonfinite=True`"),
    ({"offload": "cpu", "zero_stage": 2, "shard_scope": "node", "fault_tolerance": {
        "replica_group": 0, "replica_groups": 2, "lighthouse": "http://localhost:29510"}}, r"cannot go with `fault_tolerance`"),
    ({"offload": "disk", "zero_stage": 3}, r"`offload='disk'` needs `offload_dir`"),
    ({"offload": "cpu", "zero_stage": 3, "offload_dir": "/tmp"}, r"`offload_dir` is for `offload='disk'`"),
    ({"zero_stage": 3, "offload_dir": "/tmp"}, r"`offload_dir` is for `offload='disk'`, and `offload` is None"),
    ({"zero_stage": 3, "offload_params": True}, r"`offload_params=True` is for `offload='disk'`"),
    ({"offload": "disk", "zero_stage": 2, "offload_dir": "/tmp", "offload_params": True},
     r"`offload_params=True` puts stage 3's parameter shards on disk: it needs `offload='disk'` and `zero_stage=3`"),
    ({"offload": "nvme", "zero_stage": 3}, r"`offload='nvme'` is not supported; allowed values: None, 'cpu', 'disk'"),
    ({"offload": "disk", "zero_stage": 3, "offload_dir": 3}, r"`offload_dir=3`: expected a directory path"),
])
def test_offload_refuses_at_construction_what_it_cannot_go_with_naming_the_flags(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HierarchicalZeroStrategy(**kwargs)


def test_disk_offload_is_refused_at_setup_where_the_parameters_are_on_an_accelerator():
    import torch

    from ddp_plugin.zero.offload import DiskOffload, make_offload

    with pytest.raises(ValueError, match=r"`offload='disk'` runs the update on the host.*parameters on cuda.*"
                                         r"Allowed: `offload='cpu'`"):
        make_offload("disk", "/tmp", False, torch.device("cuda", 0))
    assert isinstance(make_offload("disk", "/tmp", True, torch.device("cpu")), DiskOffload)


def test_offload_flags_are_accepted_and_read_back(tmp_path):
    s = HierarchicalZeroStrategy(zero_stage=3, offload="disk", offload_dir=tmp_path, offload_params=True)
    assert (s.offload, s.offload_dir, s.offload_params) == ("disk", str(tmp_path), True)
    for stage in (1, 2, 3):
        assert HierarchicalZeroStrategy(zero_stage=stage, offload="cpu").offload == "cpu"
    assert HierarchicalZeroStrategy().offload is None


@pytest.mark.parametrize("value", ["no", "False", 0, 1, 1.0])
def test_offload_params_accepts_only_bools_or_none_for_not_set(value):
    # (None: not set, so that a DeepSpeed `config`'s `offload_param` can set it)
    with pytest.raises(ValueError, match=rf"`offload_params={value!r}` must be a bool; allowed values: True, False"):
        HierarchicalZeroStrategy(zero_stage=3, offload="disk", offload_dir="/tmp", offload_params=value)
