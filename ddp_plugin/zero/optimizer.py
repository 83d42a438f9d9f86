"""The sharded optimizer view: which optimizers may step 1-D pieces of parameters, and re-pointing the user's
optimizer at this rank's pieces while keeping the object (and its ``param_groups`` dicts, for schedulers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ddp_plugin.hookspecs import local_tensor

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.optim import Optimizer

    from ddp_plugin.zero.shards import Shards

# Optimizers whose update of an element depends only on that element's gradient and state: stepping 1-D
# pieces of the parameters computes exactly what stepping whole tensors would.
ELEMENTWISE_OPTIMIZERS: list[type] = [
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.ASGD,
]
_WHY_NOT = {
    "LBFGS": "it re-evaluates the closure and keeps a history over all parameters as one vector",
    "SparseAdam": "it needs sparse gradients, and shards are dense",
    "Adafactor": "it factors the second moment over the rows and columns of each matrix, which a flat shard"
    " does not have",
    "Muon": "it orthogonalizes each whole matrix update, which a flat shard does not have",
}


def allow_optimizer(cls: type) -> type:
    """Declare an optimizer class elementwise (each element's update depends only on its own gradient and
    state), so ZeRO stages accept it. Usable as a class decorator.

    This is also how to vouch for a subclass of an allowed optimizer: the check takes exact classes only,
    because a subclass may change the update (a per-tensor trust ratio, a norm over a whole matrix) and would
    then train to another result sharded than unsharded, silently. Declaring a class does not declare its
    subclasses."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"allow_optimizer takes an optimizer class (a torch.optim.Optimizer subclass), got {cls!r}.")
    if cls not in ELEMENTWISE_OPTIMIZERS:
        ELEMENTWISE_OPTIMIZERS.append(cls)
    return cls


def check_optimizer(optimizer: Optimizer) -> None:
    """Refuse an optimizer whose exact class was not declared elementwise (subclasses included: see
    :func:`allow_optimizer`). Called on every rank, so every rank fails with this message."""
    cls = type(optimizer)
    if cls in ELEMENTWISE_OPTIMIZERS:
        return
    name = cls.__name__
    parent = next((c for c in cls.__mro__[1:] if c in ELEMENTWISE_OPTIMIZERS), None)
    if parent is not None:
        why = (
            f"it subclasses {parent.__name__}, and a subclass may change the update (e.g. a per-tensor trust ratio,"
            " as LARS and LAMB have), which would train to another result on shards than on whole tensors"
        )
    else:
        why = _WHY_NOT.get(name, "ddp_plugin does not know whether its update is elementwise")
    raise ValueError(
        f"ZeRO stages 1-3 cannot shard the optimizer {name}: {why}. Sharded optimizers must update each element"
        f" from its own gradient and state ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}). Use one of"
        f" those, `zero_stage=0`, or, if {name}'s update is elementwise, declare it before `fit` with"
        f" `ddp_plugin.zero.allow_optimizer({name})`."
    )


class ShardedOptimizers:
    """The optimizers re-pointed at this rank's pieces, and the parameters as the user gave them (checkpoints
    keep the layout of the unsharded optimizer)."""

    def __init__(self, shards: Shards, pieces_of: dict[int, list[nn.Parameter]], stage: int) -> None:
        self.shards = shards
        self.pieces_of = pieces_of
        self.stage = stage
        self.original_groups: dict[int, list[list[nn.Parameter]]] = {}
        self.sharded: list[Optimizer] = []
        """The optimizers re-pointed, in the order they were."""

    def __contains__(self, optimizer: Optimizer) -> bool:
        return id(optimizer) in self.original_groups

    def shard(self, optimizer: Optimizer) -> None:
        """Point ``optimizer``'s parameter groups at this rank's pieces (state it already has is sliced)."""
        check_optimizer(optimizer)
        self.original_groups[id(optimizer)] = [list(group["params"]) for group in optimizer.param_groups]
        self.sharded.append(optimizer)
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                pieces = self.pieces_of.get(id(p))
                if pieces is None:
                    params.append(p)  # frozen or not ours: left as it is
                    continue
                state = optimizer.state.pop(p, None)
                if state:
                    self._shard_state(optimizer, p, pieces, state)
                params.extend(pieces)
            group["params"] = params
        self._refuse_unsharded_access(optimizer)

    def _shard_state(self, optimizer: Optimizer, p: nn.Parameter, pieces: list[nn.Parameter], state: dict) -> None:
        """Slice a whole parameter's optimizer state (e.g. Adagrad's initial sums) for its pieces."""
        starts = self.shards.piece_starts()
        for piece in pieces:
            start = starts[id(piece)]
            optimizer.state[piece] = {
                k: (v.detach().reshape(-1)[start : start + piece.numel()].clone()
                    if isinstance(v, Tensor) and v.numel() == local_tensor(p).numel() and v.dim() > 0 else
                    (v.clone() if isinstance(v, Tensor) else v))
                for k, v in state.items()
            }

    def unsharded_numbering(self, optimizer: Optimizer) -> tuple[list[tuple[int, nn.Parameter]], list[dict[str, Any]]]:
        """The user's parameters numbered across groups as an unsharded ``optimizer.state_dict()`` numbers
        them, and its ``param_groups`` (hyperparameters, and those numbers as ``params``)."""
        numbered: list[tuple[int, nn.Parameter]] = []
        groups = []
        for group_dict, params in zip(optimizer.param_groups, self.original_groups[id(optimizer)]):
            ids = list(range(len(numbered), len(numbered) + len(params)))
            numbered.extend(zip(ids, params))
            groups.append({**{k: v for k, v in group_dict.items() if k != "params"}, "params": ids})
        return numbered, groups

    def _refuse_unsharded_access(self, optimizer: Optimizer) -> None:
        """The optimizer holds this rank's pieces from now on, during `fit` and after it: its own ``state_dict()``
        would silently be this rank's part only (and ``load_state_dict`` would pour a whole state into pieces).
        Both raise instead, pointing to the strategy's consolidating save and load."""
        name, stage = type(optimizer).__name__, self.stage

        def refuse(_optimizer: Optimizer, *_args: Any) -> None:
            raise RuntimeError(
                f"This {name}'s parameters and state are sharded over the ranks by ZeRO stage {stage} (each rank"
                " steps 1-D pieces of its shard), so its own state_dict()/load_state_dict() would see this rank's"
                " pieces only. Save and load it through Lightning, on every rank: `trainer.save_checkpoint(path)`"
                " writes its state consolidated (the layout it has unsharded), also after `fit`, and"
                " `trainer.fit(model, ckpt_path=path)` loads it."
            )

        optimizer.register_state_dict_pre_hook(refuse)
        optimizer.register_load_state_dict_pre_hook(refuse)


def step_subset(optimizer: Optimizer, params: Sequence[nn.Parameter]) -> None:
    """One ``step()`` of ``optimizer``'s class over ``params`` only (a subset of its parameters, each in its own
    group), with the groups' hyperparameters as they are now and the optimizer's own ``state``. The optimizer
    object itself is not touched: a shallow copy gets the restricted groups."""
    wanted = {id(p) for p in params}
    view = type(optimizer).__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = [{**group, "params": kept} for group in optimizer.param_groups
                         if (kept := [p for p in group["params"] if id(p) in wanted])]
    type(optimizer).step(view)
