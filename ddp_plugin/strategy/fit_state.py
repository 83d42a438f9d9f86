"""What the strategy holds between Lightning's calls, in one object: the process groups (once the processes have
connected), the parallelisms' components, the pipeline's runner, and the session of the current or last ``fit``
with the plugin state a checkpoint handed over before the plugins existed. The strategy and its collaborators
(:mod:`ddp_plugin.strategy.checkpointing`, :mod:`ddp_plugin.strategy.stepping`, :mod:`ddp_plugin.strategy.inspection`) ask it, instead of
each checking which of those exist."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from ddp_plugin.parallel import tensor_parallel
from ddp_plugin.strategy.components import TensorParallel
from ddp_plugin.parallel.state_parts import StatePart, TensorParallelState

if TYPE_CHECKING:
    import pluggy
    from torch.nn import Module

    from ddp_plugin.gradients.engine import GradientEngine
    from ddp_plugin.hookspecs import Topology
    from ddp_plugin.strategy.components import PipelineParallel
    from ddp_plugin.parallel.pipeline import PipelineRunner
    from ddp_plugin.gradients.planning import CommPlan
    from ddp_plugin.strategy.process_groups import ProcessGroups
    from ddp_plugin.strategy.session import FitSession


class FitState:
    """The strategy's state; see the module docstring."""

    def __init__(self) -> None:
        self.groups: ProcessGroups | None = None
        """The layout's process groups and meshes, once the processes have connected."""
        self.tensor_parallel = TensorParallel()
        self.stages: PipelineParallel | None = None
        """With pipeline stages: splitting the model, and each step through the schedule."""
        self.pipeline: PipelineRunner | None = None
        """The schedule's runner over this rank's stages, once they are materialized."""
        self.session: FitSession | None = None
        """The current or last ``fit``'s (its plugins answer the checkpoint hooks after it, until the next)."""
        self.pending_plugin_state: tuple[Mapping[str, Any], Mapping[str, Any] | None] | None = None
        self.materialized = False
        """Whether this fit's setup materialized a model built on the meta device."""
        self.units_initialized = 0
        """ZeRO stage 3 units this fit's setup allocated and initialized one by one (a model built on meta)."""
        self.data_groups: list[int] | None = None
        """With the data split by the quorum: the ids of the groups the data is split over (``None``: the launch's;
        see the docs on fault tolerance)."""

    def new_setup(self) -> None:
        """A new ``setup_environment``: the groups are connected again, the model built again."""
        self.groups, self.materialized = None, False

    def running(self) -> FitSession | None:
        """The session of the ``fit`` in progress, if one is."""
        return self.session if self.session is not None and self.session.active else None

    def start(self, session: FitSession) -> None:
        """``session`` is the fit's from now on; a running one (a setup without teardown, as some of Lightning's
        tests do) is closed, and plugin state a checkpoint handed over before is loaded."""
        if self.running():
            self.session.close()
        self.session = session
        if self.pending_plugin_state is not None:
            session.load_plugin_state(*self.pending_plugin_state)
            self.pending_plugin_state = None

    def hand_plugin_state(self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None) -> None:
        """A checkpoint's plugin state: to the running fit's plugins, or kept for the next fit's (Lightning restores
        before ``setup``)."""
        if session := self.running():
            session.load_plugin_state(state, rank_state)
        else:
            self.pending_plugin_state = (state, rank_state)

    def forget(self) -> None:
        """At interpreter exit: drop the fit's plugins and engine and the groups (see ddp_plugin.strategy.process_groups)."""
        if self.session is not None:
            self.session.heartbeat.stop()
        self.session = self.pipeline = self.groups = None

    # ------------------------------------------------------------------ what a user asks

    @property
    def topology(self) -> Topology | None:
        return self.groups.topology if self.groups is not None else None

    @property
    def plugin_manager(self) -> pluggy.PluginManager | None:
        return self.session.plugin_manager if self.session is not None else None

    @property
    def engine(self) -> GradientEngine | None:
        return session.engine if (session := self.running()) else None

    @property
    def comm_plan(self) -> CommPlan | None:
        return self.session.comm_plan if self.session is not None else None

    @property
    def skipped_steps(self) -> int:
        return self.session.skipped_steps if self.session is not None else 0

    @property
    def metric_totals(self) -> dict[str, float]:
        return dict(self.session.metric_sums) if self.session is not None else {}

    @property
    def metric_means(self) -> dict[str, float]:
        return self.session.metric_means if self.session is not None else {}

    def hierarchical(self, by_flags: bool) -> bool:
        """Whether gradients take the hierarchical route: the last fit's decision, else ``by_flags``."""
        return self.session.hierarchical if self.session is not None else by_flags

    @contextmanager
    def lent(self, hook_name: str) -> Generator[None, None, None]:
        """During a ``fit``, the gather hook ``hook_name`` with ``gather=True`` on entry and ``False`` on exit (the
        full parameters or gradients lent); outside of one, nothing."""
        with session.lent(hook_name) if (session := self.running()) else nullcontext():
            yield

    def tensor_parallel_group(self) -> Any:
        return self.groups.topology.tensor_parallel_group if self.groups is not None else None

    def state_parts(self, module: Module | None, sharder: bool) -> list[StatePart]:
        """Every parallelism's part in this fit's checkpoints (:mod:`ddp_plugin.parallel.state_parts`), in the
        order a save applies them; a load applies them in reverse. None: every rank holds the whole model."""
        parts: list[StatePart] = []
        if module is not None and tensor_parallel.has_tensor_parallel_parameters(module):
            parts.append(TensorParallelState(module, sharder=sharder))
        if self.pipeline is not None:
            parts.append(self.pipeline.checkpoint)
        return parts
