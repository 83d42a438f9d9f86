"""A pipelined model's checkpoint state: every stage's module and optimizer state merged on global rank 0 under the
unsplit model's names and numbering, and a consolidated state cut back to one stage's part (docs/pipeline.md,
"Checkpoints")."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugin.checkpoints.checkpoint_io import materialize
from ddp_plugin.parallel.state_parts import StatePart

if TYPE_CHECKING:
    import torch

    from ddp_plugin.parallel.ties import Tie


class StageCheckpoint(StatePart):
    """The state of this rank's stages against the unsplit model's: ``module`` (the LightningModule, holding this
    rank's stages only), ``group`` (this rank's pipeline group of ``size`` ranks, in which it is ``rank``),
    ``ties`` and ``order`` (the unsplit model's parameter names in ``named_parameters()`` order, a tied parameter
    once). Pipeline parallelism's part in a checkpoint (:class:`~ddp_plugin.parallel.state_parts.StatePart`)."""

    what = "the pipeline stages"

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, size: int, rank: int, ties: list[Tie],
                 order: Sequence[str]) -> None:
        self.module = module
        self.group, self.size, self.rank = group, size, rank
        self.ties = ties
        self.order = list(order)
        self._optimizer_params: dict[int, list[list[nn.Parameter]]] = {}

    def _gather_to_first(self, value: Any) -> list[Any] | None:
        """``value`` of every stage, in stage order, on global rank 0 (``None`` elsewhere). Only the stages in
        global rank 0's data-parallel and tensor-parallel position take part; the others return at once."""
        if dist.get_global_rank(self.group, 0) != 0:
            return None
        every: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, every, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return every

    def gather_module_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The unsplit model's state dict on global rank 0 from every stage's ``state`` (whole tensors, on CPU to
        travel); this rank's own ``state`` elsewhere. Collective over the pipeline group of global rank 0."""
        every = self._gather_to_first({k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in state.items()})
        if every is None or dist.get_rank() != 0:
            return state
        merged: dict[str, Any] = {}
        for part in every:
            merged.update(part)
        for tie in self.ties:  # one tensor under every name, as the unsplit model's state dict has it
            first = next((merged[n] for n in tie.names if n in merged), None)
            for name in tie.names:
                if name in merged:
                    merged[name] = first
        return merged

    def note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep the module parameters ``optimizer`` was made with, group by group: its state dict numbers them so
        (a ZeRO sharder's consolidated one too, whose optimizer then holds pieces)."""
        self._optimizer_params[id(optimizer)] = [list(group["params"]) for group in optimizer.param_groups]

    def _optimizer_groups(self, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
        return self._optimizer_params.get(id(optimizer)) or [list(g["params"]) for g in optimizer.param_groups]

    def _canonical_names(self) -> dict[int, str]:
        """id(parameter) -> its name in the unsplit model (a tied parameter's first name), for this rank's."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        names.update({id(t.param): t.names[0] for t in self.ties if t.param is not None})
        return names

    def gather_optimizer_state(self, state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The unsplit model's optimizer state on global rank 0 from every stage's (``state``: this stage's
        ``optimizer.state_dict()`` with whole tensors): parameters numbered across groups in the unsplit model's
        order, as its optimizer would number them, and their names under ``"param_names"`` (for a resume on
        another layout); each stage's group ``g`` is the unsplit optimizer's group ``g``. This rank's own state
        elsewhere. Collective over the pipeline group of global rank 0."""
        names = self._canonical_names()
        params = [p for group in self._optimizer_groups(optimizer) for p in group]
        groups = []
        start = 0
        for group in state["param_groups"]:
            count = len(group["params"])
            groups.append(({k: v for k, v in group.items() if k != "params"},
                           [names[id(p)] for p in params[start:start + count]]))
            start += count
        entries = {names[id(params[i])]: {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in entry.items()}
                   for i, entry in state["state"].items()}
        every = self._gather_to_first((groups, entries))
        if every is None or dist.get_rank() != 0:
            return dict(state)
        rank_of = {name: i for i, name in enumerate(self.order)}
        merged_groups: list[tuple[dict[str, Any], list[str]]] = []
        merged_entries: dict[str, Any] = {}
        for stage_groups, stage_entries in every:
            for g, (hyper, group_names) in enumerate(stage_groups):
                if g == len(merged_groups):
                    merged_groups.append((hyper, []))
                merged_groups[g][1].extend(n for n in group_names if n not in merged_groups[g][1])
            for name, entry in stage_entries.items():
                merged_entries.setdefault(name, entry)
        param_names: list[str] = []
        out_groups = []
        for hyper, group_names in merged_groups:
            group_names.sort(key=lambda n: rank_of.get(n, len(rank_of)))
            out_groups.append({**hyper, "params": list(range(len(param_names), len(param_names) + len(group_names)))})
            param_names.extend(group_names)
        out_state = {i: merged_entries[name] for i, name in enumerate(param_names) if name in merged_entries}
        return {"state": out_state, "param_groups": out_groups, "param_names": param_names}

    def named_sharded_optimizer_state(self, local: Mapping[str, Any], optimizer: torch.optim.Optimizer
                                      ) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state for ``checkpoint="sharded"`` (flat keys ``<index>/<key>...``
        and shapes ``<index>...``, numbered as this stage's unsharded optimizer) under the unsplit model's
        parameter names instead of this stage's numbers, so the stages' keys never collide; on global rank 0 also
        every stage's groups, numbered as :meth:`gather_optimizer_state` numbers them (``param_names``).
        Collective over the pipeline group of global rank 0."""
        names = self._canonical_names()
        params = [p for group in self._optimizer_groups(optimizer) for p in group]

        def named(key: str) -> str:
            index, rest = re.match(r"(\d+)(.*)", key).groups()
            return names[id(params[int(index)])] + rest

        merged = self.gather_optimizer_state({"state": {}, "param_groups": local["param_groups"]}, optimizer)
        return {**local, "state": {named(k): v for k, v in local["state"].items()},
                "shapes": {named(k): v for k, v in local.get("shapes", {}).items()},
                "param_groups": merged["param_groups"], "param_names": merged.get("param_names")}

    def gather_nested(self, value: Mapping[str, Any]) -> dict[str, Any]:
        """Every stage's ``value`` (nested dicts whose leaves are keyed by the unsplit model's names, or the same on
        every stage) merged on global rank 0, tensors on CPU; this rank's own ``value`` elsewhere. Collective over
        the pipeline group of global rank 0."""
        every = self._gather_to_first(_to_cpu(value))
        if every is None or dist.get_rank() != 0:
            return dict(value)
        merged: dict[str, Any] = {}
        for part in every:
            _merge_into(merged, part)
        return merged

    def gather_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Every stage's ``shapes`` on global rank 0 (for the sharded checkpoint's metadata, which it writes)."""
        every = self._gather_to_first(shapes)
        merged: dict[str, tuple[int, ...]] = {}
        for part in every or [shapes]:
            merged.update(part)
        return merged

    def local_optimizer_state(self, state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This stage's part of a consolidated optimizer state (:meth:`gather_optimizer_state`'s, or an unsplit
        run's with one group per group here), numbered as this stage's ``optimizer`` numbers its parameters."""
        saved_names = state.get("param_names")
        if saved_names is None:  # an unsplit run's: its parameters in the unsplit model's order, group after group
            saved_names = self.order
        index_of = {name: i for i, name in enumerate(saved_names)}
        names = self._canonical_names()
        saved_groups = state["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups):
            raise ValueError(
                f"The checkpoint's optimizer has {len(saved_groups)} parameter groups and this stage's"
                f" {len(optimizer.param_groups)}: with pipeline stages, `configure_optimizers` must make the same"
                " groups on every stage (the unsplit model's, each holding the stage's share)."
            )
        out_state: dict[int, Any] = {}
        out_groups = []
        local = 0
        for saved, group in zip(saved_groups, self._optimizer_groups(optimizer)):
            indices = []
            for p in group:
                entry = state["state"].get(index_of.get(names[id(p)], -1))
                if entry is not None:
                    out_state[local] = entry
                indices.append(local)
                local += 1
            out_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": indices})
        return {"state": out_state, "param_groups": out_groups}


    # ------------------------------------------------------------------ the part in a checkpoint (StatePart)

    def whole_module(self, state: dict[str, Any]) -> dict[str, Any]:
        return self.gather_module_state(state)

    def whole_optimizer(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.gather_optimizer_state(state, optimizer)

    def local_optimizer(self, local: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.named_sharded_optimizer_state(local, optimizer)

    def shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return self.gather_shapes(shapes)

    def plugin_state(self, state: dict[str, Any]) -> dict[str, Any]:
        # Each stage's plugins hold their stage's parameters' state (under the unsplit names): rank 0 writes every
        # stage's.
        return self.gather_nested(materialize(state))

    def module_to_load(self, state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
        mine = module.state_dict().keys()  # the unsplit model's: this stage takes its own entries
        return {k: v for k, v in state.items() if k in mine}

    def optimizer_to_load(self, state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.local_optimizer_state(state, optimizer)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _merge_into(merged: dict[str, Any], part: Mapping[str, Any]) -> None:
    """``part``'s entries into ``merged``: nested dicts merged key by key, any other value kept from the first."""
    for key, value in part.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            _merge_into(merged[key], value)
        elif key not in merged:
            merged[key] = dict(value) if isinstance(value, Mapping) else value
