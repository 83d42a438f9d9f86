"""Cutting a model into pipeline stages: where it splits (``pipeline_split``) and the module cut down to a rank's
stages. This package's names are its one entry: the rest of the library imports from here, never from its modules.

- :mod:`~ddp_plugin.parallel.stages.plan`: the plan (:class:`StagePlan`, :func:`plan_stages`: the blocks found and
  split by parameters, timed compute, count, block type or names) and :func:`split_module`;
- :mod:`~ddp_plugin.parallel.stages.names`: a split given as module names per stage, checked;
- :mod:`~ddp_plugin.parallel.stages.cut`: a block cut between two stages (its ``forward`` traced with ``torch.fx``);
- :mod:`~ddp_plugin.parallel.stages.timing`: the blocks timed for ``"time"``, on the data's first microbatch;
- :mod:`~ddp_plugin.parallel.stages.transformers`: a Hugging Face model's stages from its ``base_model_pp_plan``.
"""

from ddp_plugin.parallel.stages.cut import Cut
from ddp_plugin.parallel.stages.forward import forward_replaced
from ddp_plugin.parallel.stages.plan import (
    SPLIT_METHODS,
    StageBlocks,
    StagePlan,
    Timer,
    check_module,
    check_split,
    get_path,
    left_out,
    plan_stages,
    set_path,
    split_module,
    stage_blocks,
)
from ddp_plugin.parallel.stages.timing import BlockTimes, fit_timer
from ddp_plugin.parallel.stages.transformers import stage_forward, wrap_output

__all__ = [
    "SPLIT_METHODS",
    "BlockTimes",
    "Cut",
    "StageBlocks",
    "StagePlan",
    "Timer",
    "check_module",
    "check_split",
    "fit_timer",
    "forward_replaced",
    "get_path",
    "left_out",
    "plan_stages",
    "set_path",
    "split_module",
    "stage_blocks",
    "stage_forward",
    "wrap_output",
]
