"""Lightning tests that build a CPU ``DDPStrategy`` but do not apply to ``hierarchical_zero``, and applicable ones
that fail for a known reason. Keys are ``fnmatch`` patterns on pytest node ids (relative to Lightning's
``tests/``); values are ``(reason, stages)``: the ZeRO stages at which the entry holds. A test that does not
apply counts as such whatever its outcome; a known failure that passes counts as passed."""

from __future__ import annotations

ALL = (0, 1, 2, 3)
ZERO = (1, 2, 3)

S = "tests_pytorch/strategies/"

# Tests of DDP itself: they assert what DDPStrategy is or holds, or behaviour ours deliberately differs in.
NOT_APPLICABLE: dict[str, tuple[str, tuple[int, ...]]] = {
    S + "test_ddp.py::test_ddp_kwargs_from_registry*": ("asserts DDPStrategy's `_ddp_kwargs` (find_unused_parameters)", ALL),
    S + "test_registry.py::test_ddp_find_unused_parameters_strategy_registry*": (
        "asserts `isinstance(trainer.strategy, DDPStrategy)` and its `_ddp_kwargs`", ALL),
    S + "test_registry.py::test_custom_registered_strategy_to_strategy_flag": (
        "asserts `isinstance(trainer.strategy, DDPStrategy)`", ALL),
    S + "test_ddp.py::test_ddp_configure_ddp": ("asserts the model is wrapped in `DistributedDataParallel`", ALL),
    S + "test_ddp_integration.py::test_ddp_cpu": ("asserts `isinstance(trainer.strategy, DDPStrategy)`", ALL),
    S + "test_ddp_integration.py::test_find_unused_parameters_ddp_*": (
        "expects DDP's error for parameters without a gradient; ours handles them (as single-process training)", ALL),
    S + "test_ddp_integration.py::test_ddp_wrapper*": (
        "asserts `DistributedDataParallel` wrapping and its `parameters_to_ignore`", ALL),
    S + "test_ddp_integration_comm_hook.py::*": (
        "DDP communication hooks (`ddp_comm_hook`, `ddp_comm_wrapper`, post-local SGD): ours has no such argument"
        " (the swap drops it; gradient compression is `compression=`), so a pass would prove nothing", ALL),
    "tests_pytorch/test_cli.py::test_ddpstrategy_instantiation_and_find_unused_parameters": (
        "builds `DDPStrategy(find_unused_parameters=...)` through LightningCLI: a DDP keyword argument (and"
        " jsonargparse reads the swap's `DDPStrategy.__new__`)", ALL),
    "tests_pytorch/deprecated_api/test_no_removal_version.py::test_ddp_is_distributed": (
        "asserts the deprecation warning of `DDPStrategy.is_distributed`", ALL),
    S + "test_ddp_integration.py::test_model_parameters_on_device_for_optimizer*": (
        "a CUDA test: asserts the parameters are on a CUDA device", ALL),
    S + "test_ddp.py::test_tensor_init_context*": ("a CUDA test: creates tensors on a CUDA device", ALL),
    S + "test_ddp_integration.py::test_ddp_strategy_checkpoint_zero_redundancy_optimizer*": (
        "torch's `ZeroRedundancyOptimizer` shards the optimizer itself; ZeRO stages 1-3 refuse an optimizer they"
        " cannot shard elementwise, with a message saying so (it passes at stage 0)", ZERO),
}

# Lightning's strategy-selection tests: they assert that "ddp"/"ddp_spawn"/... (or `devices>1` on CPU) select
# `DDPStrategy`, i.e. `isinstance(trainer.strategy, DDPStrategy)`.
C = "tests_pytorch/trainer/connectors/test_accelerator_connector.py::"
_ISINSTANCE = ("asserts `isinstance(trainer.strategy, DDPStrategy)`", ALL)
NOT_APPLICABLE.update({
    C + name: _ISINSTANCE for name in (
        "test_custom_cluster_environment_in_slurm_environment",
        "test_strategy_choice_ddp_on_cpu",
        "test_accelerator_gpu_with_devices*",
        "test_accelerator_cpu_with_devices*",
        "test_strategy_choice_cpu_str*",
        "test_strategy_choice_cpu_instance",
        "test_strategy_choice_ddp_spawn_cpu",
        "test_strategy_choice_ddp_fork_in_interactive",
        "test_strategy_choice_ddp_fork_cpu",
        "test_strategy_choice_ddp_cpu_kubeflow",
        "test_strategy_choice_ddp_cpu_slurm*",
        "test_strategy_str_passed_being_case_insensitive*",
    )
})
NOT_APPLICABLE.update({
    "tests_pytorch/trainer/test_trainer.py::test_trainer_config_strategy*": _ISINSTANCE,
    "tests_pytorch/trainer/test_trainer.py::test_spawn_predict_return_predictions": _ISINSTANCE,
    S + "test_ddp_integration.py::test_ddp_with_2_gpus": (
        "a CUDA test: asserts `isinstance(trainer.strategy, DDPStrategy)` and CUDA memory", ALL),
    "tests_pytorch/core/test_metric_result_integration.py::test_result_reduce_ddp": (
        "a CUDA test: launches its processes on `torch.device('cuda:0')` and `'cuda:1'` itself", ALL),
    "tests_pytorch/plugins/test_amp_plugins.py::test_amp_gradient_unscale*": (
        "a CUDA test of 16-mixed's GradScaler: on CPU Lightning has no scaler and calls"
        " `optimizer.step(closure=...)`, which the test's optimizer does not take (as with DDPStrategy)", ALL),
    "tests_pytorch/utilities/test_dtype_device_mixin.py::test_submodules_multi_gpu_ddp_spawn": (
        "a CUDA test: asserts `model.device.index == rank` (cuda:<rank>)", ALL),
    S + "test_ddp_integration.py::test_ddp_barrier_non_consecutive_device_ids": (
        "a CUDA test: asserts NCCL's `barrier(device_ids=[1])` on GPU 1", ALL),
})

# Applicable tests that fail for a reason that is known and stated.
KNOWN_FAILURES: dict[str, tuple[str, tuple[int, ...]]] = {
    "tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations": (
        "counts `torch.save` calls: the default `AtomicCheckpointIO` writes torch.save's format itself (same files,"
        " 0 calls); a user's `checkpoint_io` gets torch.save", ALL),
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py::test_top_k_ddp*": (
        "mocks and counts `torch.save`: the default `AtomicCheckpointIO` writes torch.save's format itself (same"
        " files, 0 calls); a user's `checkpoint_io` gets torch.save", ALL),
    "tests_pytorch/utilities/test_compile.py::test_trainer_compiled_model_ddp": (
        "Lightning takes a `torch.compile`d LightningModule only with SingleDevice, DDP or FSDP strategies"
        " (`_verify_strategy_supports_compile`, an isinstance check); compile submodules inside the LightningModule"
        " instead", ALL),
    S + "test_model_parallel_integration.py::test_load_*": (
        "`strategy.optimizer_state()` and `trainer.save_checkpoint()` after `fit` at ZeRO stages 1-3 give rank 0's"
        " 1-D shard pieces instead of the consolidated state: issue 11 item 3 (other branch)", ZERO),
    # Standalone tests whose process was killed (a rank failed, Lightning's launcher ends the others) before
    # pytest reported, in the first full run; not investigated yet.
    "tests_pytorch/profilers/test_profiler.py::test_pytorch_profiler_trainer_ddp": (_DIED := (
        "a CUDA standalone test run on CPU: its process was killed before reporting; not investigated yet"), ALL),
    S + "test_fsdp.py::test_strategy_load_optimizer_states*": (_DIED, ALL),
    "tests_pytorch/trainer/optimization/test_optimizers.py::test_optimizer_state_on_device": (_DIED, ALL),
    S + "test_ddp_integration.py::test_ddp_gradients_synced*": (
        "`param.grad` is None after backward at ZeRO stages 1-3: fixed by issue 14 item 1 (other branch)", ZERO),
}
