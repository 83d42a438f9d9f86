"""Lightning tests that build a CPU ``DDPStrategy`` but do not apply to ``hierarchical_zero``, and applicable ones
that fail for a known reason. Keys are ``fnmatch`` patterns on pytest node ids (relative to Lightning's
``tests/``); values are ``(reason, stages)``: the ZeRO stages at which the entry holds. A listed test that
passes counts as passed."""

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
}

# Applicable tests that fail for a reason that is known and stated.
KNOWN_FAILURES: dict[str, tuple[str, tuple[int, ...]]] = {
    "tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations": (
        "counts `torch.save` calls: the default `AtomicCheckpointIO` writes torch.save's format itself (same files,"
        " 0 calls); a user's `checkpoint_io` gets torch.save", ALL),
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py::test_top_k_ddp*": (
        "mocks and counts `torch.save`: the default `AtomicCheckpointIO` writes torch.save's format itself (same"
        " files, 0 calls); a user's `checkpoint_io` gets torch.save", ALL),
    S + "test_ddp_integration.py::test_ddp_gradients_synced*": (
        "`param.grad` is None after backward at ZeRO stages 1-3: fixed by issue 14 item 1 (other branch)", ZERO),
}
