"""A pytest plugin that runs Lightning's own tests with ``HierarchicalZeroStrategy`` wherever a test builds a CPU
``DDPStrategy`` (``strategy="ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``, ``"ddp_notebook"``, ``DDPStrategy(...)``, or
``"auto"`` on several CPU devices). Loaded by ``tests/conformance/run.py`` as ``-p lightning_swap``; not a test
module, and not collected by the project's own test run.

Options (environment variables, so that the processes Lightning's launchers start behave alike):

- ``DDP_PLUGIN_CONFORMANCE_STAGE``: the ``zero_stage`` of the swapped-in strategy (default 0).
- ``DDP_PLUGIN_CONFORMANCE_SWAP``: ``0`` keeps Lightning's ``DDPStrategy`` (a baseline for the same selection).
- ``DDP_PLUGIN_CONFORMANCE_SELECT``: a file of node ids (one a line); only those items run.
- ``DDP_PLUGIN_CONFORMANCE_GPU``: ``1`` runs tests written for CUDA GPUs on CPU: their ``RunIf(min_cuda_gpus=...)``
  skip is lifted and ``accelerator="gpu"``/``"cuda"`` becomes ``"cpu"`` (device lists become a count).
- ``DDP_PLUGIN_CONFORMANCE_REPORT``: a JSON-lines file; one line per test: node id, outcome, whether our strategy
  was swapped in, the first line of the failure.
- ``DDP_PLUGIN_CONFORMANCE_MARKS``: a folder where the tests that ran ``fit`` with our strategy are noted.
- ``DDP_PLUGIN_CONFORMANCE_COLLECT``: a JSON file to write the selected items' properties to (with
  ``--collect-only``): node id, standalone, converted from CUDA, the skip reason when it cannot run here.
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

STAGE = int(os.environ.get("DDP_PLUGIN_CONFORMANCE_STAGE", "0"))
GPU_TO_CPU = os.environ.get("DDP_PLUGIN_CONFORMANCE_GPU") == "1"
MARKS_DIR = os.environ.get("DDP_PLUGIN_CONFORMANCE_MARKS")

_swapped: list[str] = []


def _current_test() -> str:
    # pytest keeps "<node id> (<phase>)" here; processes started by spawn inherit it.
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def _mark(kind: str) -> None:
    if MARKS_DIR and _current_test():
        with open(Path(MARKS_DIR) / f"{os.getpid()}.txt", "a") as f:
            f.write(f"{_current_test()}\t{kind}\n")


_DDP_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
             "process_group_backend", "timeout", "start_method")


def _install() -> None:
    import inspect

    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.connectors import accelerator_connector as connector_module

    from ddp_plugin import HierarchicalZeroStrategy

    signature = inspect.signature(DDPStrategy.__init__)

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        """``DDPStrategy(...)``, directly or through the registry (``"ddp"``, ``"ddp_spawn"``, ...), builds ours
        from the arguments both take (launch method, backend, timeout, plugins); DDP's own options (comm hooks,
        ``find_unused_parameters``, ...) have no counterpart and are dropped. Subclasses are left alone."""
        if cls is not DDPStrategy:
            return object.__new__(cls)
        given = signature.bind(None, *args, **kwargs).arguments
        ours = HierarchicalZeroStrategy(zero_stage=STAGE, **{k: given[k] for k in _DDP_ARGS if k in given})
        ours._conformance_ddp_args = (args, kwargs)
        _swapped.append(_current_test())
        return ours

    if os.environ.get("DDP_PLUGIN_CONFORMANCE_SWAP", "1") != "0":  # "0": Lightning's own DDP, for comparison
        DDPStrategy.__new__ = staticmethod(__new__)
        _install_model_parallel_swap(HierarchicalZeroStrategy)

    connector = connector_module._AcceleratorConnector
    init_strategy = connector._init_strategy

    def _init_strategy(self: Any) -> None:
        init_strategy(self)
        ddp_args = getattr(self.strategy, "_conformance_ddp_args", None)
        if ddp_args is not None and not isinstance(self.accelerator, CPUAccelerator):
            # Not a CPU DDPStrategy (a test that mocks CUDA devices): Lightning's own, and not counted.
            genuine = object.__new__(DDPStrategy)
            genuine.__init__(*ddp_args[0], **ddp_args[1])
            self.strategy = genuine
            if _current_test() in _swapped:
                _swapped.remove(_current_test())

    connector._init_strategy = _init_strategy

    if GPU_TO_CPU:
        init = connector.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            accelerator = kwargs.get("accelerator")
            if accelerator in ("gpu", "cuda") or isinstance(accelerator, CUDAAccelerator):
                kwargs["accelerator"] = "cpu"
                devices = kwargs.get("devices")
                if isinstance(devices, (list, tuple)):
                    kwargs["devices"] = len(devices)
                elif isinstance(devices, str) and "," in devices:
                    kwargs["devices"] = len([d for d in devices.split(",") if d.strip()])
            init(self, *args, **kwargs)

        connector.__init__ = __init__

    from lightning.pytorch.trainer import call as call_module

    call_and_handle_interrupt = call_module._call_and_handle_interrupt

    def noting_call(trainer: Any, trainer_fn: Any, *args: Any, **kwargs: Any) -> Any:
        # In the test's own process, also when the launcher runs `fit` in spawned processes.
        if isinstance(trainer.strategy, HierarchicalZeroStrategy) and getattr(trainer_fn, "__name__", "") == "_fit_impl":
            _mark("fit")
        return call_and_handle_interrupt(trainer, trainer_fn, *args, **kwargs)

    call_module._call_and_handle_interrupt = noting_call


def _install_model_parallel_swap(ours: type) -> None:
    """``ModelParallelStrategy(data_parallel_size, tensor_parallel_size, ...)`` builds ours with the same
    ``tensor_parallel_size`` (``"auto"``: the ranks of a node, its default); the data-parallel size follows from the
    world size, and a module's ``fully_shard`` is refused by ours (data parallelism is the strategy's)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    signature = inspect.signature(ModelParallelStrategy.__init__)

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is not ModelParallelStrategy:
            return object.__new__(cls)
        given = signature.bind(None, *args, **kwargs).arguments
        strategy = ours(tensor_parallel_size=given.get("tensor_parallel_size", "auto"), zero_stage=STAGE,
                        **{k: given[k] for k in ("process_group_backend", "timeout") if k in given})
        _swapped.append(_current_test())
        return strategy

    ModelParallelStrategy.__new__ = staticmethod(__new__)


def pytest_configure(config: pytest.Config) -> None:
    _install()


# ---------------------------------------------------------------------------------------------- selection

_REASONS = re.compile(r"Requires: \[(.*)\]")
_GPU_REASON = re.compile(r"GPUs>=\d+")


def _runif(item: pytest.Item) -> tuple[list[pytest.Mark], list[str]]:
    """Lightning's ``RunIf`` skip marks on ``item`` (the function's and its parameters') and their unmet reasons."""
    marks, reasons = [], []
    for mark in item.iter_markers("skipif"):
        if "min_cuda_gpus" in mark.kwargs or "standalone" in mark.kwargs:
            marks.append(mark)
            found = _REASONS.search(mark.kwargs.get("reason", ""))
            if found and ((mark.args and mark.args[0]) or mark.kwargs.get("condition")):
                reasons += found.group(1).split(" + ")
    return marks, reasons


def _unmet(item: pytest.Item) -> list[str]:
    """What still keeps the item from running here once CUDA tests run on CPU and standalone tests alone."""
    _, reasons = _runif(item)
    lifted = {"Standalone execution"}
    return [r for r in reasons if r not in lifted and not (GPU_TO_CPU and _GPU_REASON.fullmatch(r))]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    select_file = os.environ.get("DDP_PLUGIN_CONFORMANCE_SELECT")
    if select_file:
        wanted = set(Path(select_file).read_text().splitlines())
        items[:] = [item for item in items if item.nodeid in wanted]
    rows = []
    for item in items:
        marks, _ = _runif(item)
        unmet = _unmet(item)
        rows.append({
            "nodeid": item.nodeid,
            "standalone": any("standalone" in m.kwargs for m in marks),
            "cuda": any("min_cuda_gpus" in m.kwargs for m in marks),
            "unmet": unmet,
            "source_mentions_ddp": _mentions_ddp(item),
        })
        if not marks or unmet:
            continue
        # Lift the skips: CUDA on CPU (GPU_TO_CPU) and standalone tests (the runner starts each in its own process).
        for node in item.listchain():
            node.own_markers = [m for m in node.own_markers if not any(m is k for k in marks)]
        if rows[-1]["cuda"] and GPU_TO_CPU:
            item.user_properties.append(("converted_from_cuda", True))
    out = os.environ.get("DDP_PLUGIN_CONFORMANCE_COLLECT")
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))


def _mentions_ddp(item: pytest.Item) -> bool:
    """Whether the test's function, its parameters or the helpers it calls by name in its module say "ddp"."""
    import inspect

    texts = [item.name]
    function = getattr(item, "function", None)
    if function is not None:
        try:
            texts.append(inspect.getsource(function))
        except (OSError, TypeError):
            pass
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        texts.append(repr(callspec.params))
    return bool(re.search(r"ddp", "\n".join(texts), re.IGNORECASE))


# ---------------------------------------------------------------------------------------------- reporting

_results: dict[str, dict[str, Any]] = {}


def _is_child() -> bool:
    # Processes Lightning's launcher started to re-run this command line for ranks > 0 report nothing.
    return os.environ.get("LOCAL_RANK", "0") != "0" and os.environ.get("DDP_PLUGIN_CONFORMANCE_MAIN") != str(os.getpid())


def pytest_sessionstart(session: pytest.Session) -> None:
    if "LOCAL_RANK" not in os.environ:
        os.environ["DDP_PLUGIN_CONFORMANCE_MAIN"] = str(os.getpid())


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A DDPStrategy built at import time as a test parameter (no test was running yet): counted for its test.
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(hasattr(v, "_conformance_ddp_args") for v in callspec.params.values()):
        _swapped.append(item.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _is_child():
        return
    row = _results.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "message": ""})
    if report.failed:
        row["outcome"] = "failed" if report.when == "call" or row["outcome"] != "failed" else row["outcome"]
        if not row["message"]:
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)
            row["message"] = (text.strip().splitlines() or [""])[0][:300]
            row["phase"] = report.when
    elif report.skipped and row["outcome"] == "passed":
        row["outcome"] = "skipped"
        row["message"] = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)[:300]
    if report.when == "teardown":
        row["swapped"] = report.nodeid in _swapped
        row["converted_from_cuda"] = dict(report.user_properties).get("converted_from_cuda", False)
        row["duration_s"] = round(row.get("duration_s", 0) + report.duration, 2)
        path = os.environ.get("DDP_PLUGIN_CONFORMANCE_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
    else:
        row["duration_s"] = round(row.get("duration_s", 0) + report.duration, 2)


def matches(nodeid: str, patterns: dict[str, str]) -> str | None:
    """The reason of the first pattern (``fnmatch``, on the node id) that ``nodeid`` matches."""
    for pattern, reason in patterns.items():
        if fnmatch.fnmatchcase(nodeid, pattern):
            return reason
    return None
