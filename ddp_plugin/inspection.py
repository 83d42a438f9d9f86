"""What a user (or a callback, or the precision plugin) asks the strategy about the ``fit`` in progress: its
topology, plugins, engine and plan, the full parameters and gradients where they are sharded, gradient norms,
gradient clipping that sees every shard, memory, and the plugins' metrics. A mixin of ``HierarchicalZeroStrategy``;
outside a ``fit`` each answers as unsharded training would."""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddp_plugin.parallel import tensor_parallel
from ddp_plugin.hookspecs import local_tensor

if TYPE_CHECKING:
    import pluggy
    from torch.amp import GradScaler
    from torch.optim import Optimizer

    from ddp_plugin.engine import GradientEngine
    from ddp_plugin.hookspecs import Topology
    from ddp_plugin.planning import CommPlan
    from ddp_plugin.process_groups import ProcessGroups
    from ddp_plugin.session import FitSession


class FitInspection:
    """The inspection methods of ``HierarchicalZeroStrategy``."""

    _session: FitSession | None
    _groups: ProcessGroups | None

    def _running(self) -> FitSession | None:
        """The session of the ``fit`` in progress, if one is."""
        return self._session if self._session is not None and self._session.active else None

    @property
    def topology(self) -> Topology | None:
        return self._groups.topology if self._groups is not None else None

    @property
    def plugin_manager(self) -> pluggy.PluginManager | None:
        """The pluggy plugin manager of the current or last ``fit`` (``None`` before the first)."""
        return self._session.plugin_manager if self._session is not None else None

    @property
    def engine(self) -> GradientEngine | None:
        """The gradient engine of the current ``fit`` (``None`` outside of it)."""
        return self._session.engine if self._running() else None

    @property
    def comm_plan(self) -> CommPlan | None:
        """What the link probe measured and decided, per bucket (docs/adaptive.md); ``None`` when nothing was left
        to decide (one rank, or every choice set by a flag) or before the first ``fit``."""
        return self._session.comm_plan if self._session is not None else None

    @property
    def uses_hierarchical_reducer(self) -> bool:
        """Whether gradients are reduced in node, cross-node and gather stages (decided once the layout is known;
        during a ``fit`` whose plan chooses per bucket: whether any bucket may be)."""
        if self._session is not None:
            return self._session.hierarchical
        return self._hierarchical_by_flags()

    def _hierarchical_by_flags(self) -> bool:
        if self.config.hierarchical is not None:
            return self.config.hierarchical
        layout = self._layout().data_parallel_layout
        return layout.num_nodes > 1 and layout.ranks_per_node > 1

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps ``skip_nonfinite`` skipped in the current or last ``fit``."""
        return self._session.skipped_steps if self._session is not None else 0

    @property
    def metric_totals(self) -> dict[str, float]:
        """Sums of the plugins' per-step metrics over the current or last ``fit`` (this rank's values)."""
        return dict(self._session.metric_sums) if self._session is not None else {}

    @property
    def metric_means(self) -> dict[str, float]:
        """Per-step means of the plugins' metrics over the current or last ``fit`` (this rank's values)."""
        return self._session.metric_means if self._session is not None else {}

    def clip_grad_norm_sharded(self, optimizer: Optimizer, max_norm: float) -> Tensor | None:
        session = self._running()
        return session.clip_grad_norm(optimizer, max_norm) if session else None

    def after_closure(self, optimizer: Optimizer, scaler: GradScaler | None) -> None:
        if session := self._running():
            session.after_closure(optimizer, scaler)

    def clip_module_grads_by_value(self, clip_val: float) -> None:
        if self._running() and self.config.zero_stage and self.model is not None:
            # Clamping twice is clamping once: the slices the optimizer's pieces share are not clipped twice.
            whole = [p for p in self.model.parameters() if p.grad is not None]
            if whole:  # (none at stages 2-3; torch's clip_grad_value_ fails on an empty list)
                torch.nn.utils.clip_grad_value_(whole, clip_val)

    @contextmanager
    def full_parameters(self) -> Generator[None, None, None]:
        """Inside, every module parameter holds its full value on every rank (at ZeRO stage 3 they are
        all-gathered, and freed again on exit; call it on every rank). Read-only: changes are not kept."""
        with session.lent("on_gather_full_parameters") if (session := self._running()) else nullcontext():
            yield

    @contextmanager
    def full_gradients(self) -> Generator[None, None, None]:
        """Inside, every module parameter's ``.grad`` holds its whole gradient on every rank, as under DDP (the
        global mean after a synchronizing backward, clipped once clipping ran; ``None`` where the optimizer has
        none). At stages 2-3 the shards are all-gathered into a buffer freed on exit; at stages 0-1 nothing
        happens. Call it on every rank. Read-only: changes are not applied. For norms, :meth:`grad_norm`."""
        with session.lent("on_gather_full_gradients") if (session := self._running()) else nullcontext():
            yield

    def grad_norm(self, norm_type: float | int | str = 2, group_separator: str = "/") -> dict[str, Tensor]:
        """``lightning.pytorch.utilities.grad_norm(module, norm_type)`` of the LightningModule at every ZeRO
        stage, ready for ``self.log_dict``; at stages 2-3 from the shards with one small all-reduce (call it on
        every rank)."""
        from lightning.pytorch.utilities import grad_norm

        module = self.lightning_module
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
        per_param = session.grad_norms(module, norm_type) if (session := self._running()) else None
        if per_param is None:
            if not tensor_parallel.has_tensor_parallel_parameters(module):
                return grad_norm(module, norm_type, group_separator)
            groups = getattr(self, "_groups", None)
            per_param = tensor_parallel.grad_norms(
                module, norm_type, groups.topology.tensor_parallel_group if groups is not None else None)
        norms = {f"grad_{norm_type}_norm{group_separator}{name}": value for name, value in per_param.items()}
        if norms:
            norms[f"grad_{norm_type}_norm_total"] = torch.tensor([float(v) for v in norms.values()]).norm(norm_type)
        return norms

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state, measured on the live tensors (each
        storage counted once): module and optimizer parameters, gradient buckets and ``.grad``, optimizer state;
        and what plugins report keeping besides (``on_collect_memory``, e.g. a sync mode's ``outer_state``)."""
        session = self._running()
        buckets = [b.buffer for b in session.engine.buckets] if session else []
        measured = memory_bytes(self.model.parameters() if self.model is not None else [], self.optimizers, buckets)
        if self._session is not None:  # what plugins keep besides (a sync mode's outer state)
            for part in self._session.plugin_manager.hook.on_collect_memory():
                for name, value in (part or {}).items():
                    measured[name] = measured.get(name, 0) + value
                    measured["total"] += value
        return measured


def memory_bytes(module_params: Iterable[Tensor], optimizers: Iterable[Optimizer], buckets: Iterable[Tensor]
                 ) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state, measured on the live tensors (each storage counted
    once, released ones as zero): module parameters and the optimizers' (sharded) ones, gradient buckets and
    every ``.grad``, and every tensor in the optimizers' state."""
    seen: set[int] = set()
    optimizers = list(optimizers)

    def size(tensors: Iterable[Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = local_tensor(t).untyped_storage()  # (a DTensor's: its local shard's)
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    module_params = list(module_params)
    opt_params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    params = size([*module_params, *opt_params])
    grads = size([*buckets, *(p.grad for p in module_params), *(p.grad for p in opt_params)])
    state = size(v for opt in optimizers for st in opt.state.values() for v in st.values() if isinstance(v, Tensor))
    return {"params": params, "grads": grads, "optimizer_state": state, "total": params + grads + state}
