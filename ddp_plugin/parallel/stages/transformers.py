"""Hugging Face ``transformers`` models as pipeline stages, through the stage description the model ships.

A model whose config has a ``base_model_pp_plan`` (the Llama family, Qwen, Mistral, ...) names, in order, the base
model's modules a pipeline runs: the embedding (``input_ids`` -> ``inputs_embeds``), the decoder layers (a
``ModuleList``) and the final norm; the model class's ``_pp_plan`` adds its head (``lm_head``: ``hidden_states``
-> ``logits``). The modules the plan does not name (the rotary embedding: buffers only) run on every stage.

A stage runs the model's own ``forward``, unchanged: the first stage from ``input_ids`` (or whatever the user's
call passed), a later one from the activations as ``inputs_embeds``; the decoder layers are this stage's only
(the model slices ``self.layers[: num_hidden_layers]``, which a :class:`~ddp_plugin.parallel.stages.plan.StageBlocks` allows),
and the norm and the head of an earlier stage are ``nn.Identity``, so its "logits" are the hidden states it sends
on. The key-value cache is off (``use_cache=False``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

KIND = "transformers"


@dataclass(frozen=True)
class TransformersLayout:
    """Where the plan's modules are, relative to the model (``owner``, a module path of the LightningModule):
    ``blocks`` the decoder layers, ``before`` and ``after`` the modules of the first and last stage, ``output``
    the output's attribute (``"logits"`` with a head, else ``"last_hidden_state"``)."""

    owner: str
    blocks: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    output: str


def find(module: nn.Module) -> TransformersLayout | None:
    """The outermost ``transformers`` model in ``module`` whose config has a ``base_model_pp_plan``, or ``None``
    (also when ``transformers``' model classes were never imported: then no model of theirs exists, and they are not
    imported here. Lightning imports ``transformers`` itself wherever it is installed (through torchmetrics), and
    asking that lazy module for ``PreTrainedModel`` imports its models' base, 0.1-0.3 s of CPU a rank.)"""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return None
    for name, model in module.named_modules():
        if not isinstance(model, modeling.PreTrainedModel):
            continue
        plan = getattr(model.config, "base_model_pp_plan", None)
        if not plan:
            return None  # (the outermost model has none: an inner one's plan would leave its head out)
        base = model.base_model
        prefix = "" if base is model else f"{model.base_model_prefix}."
        keys = list(plan)
        lists = [k for k in keys if isinstance(base.get_submodule(k), (nn.ModuleList, nn.ModuleDict))]
        if len(lists) != 1:
            raise TypeError(f"{type(model).__name__}'s `base_model_pp_plan` names {len(lists)} module lists"
                            f" ({', '.join(lists) or 'none'}); a pipeline splits exactly one.")
        i = keys.index(lists[0])
        # (the head: the model's own `_pp_plan` entries; an instance's also holds its base model's, prefixed)
        head = tuple(k for k in (getattr(model, "_pp_plan", None) or {})
                     if prefix and not k.startswith(prefix)) if base is not model else ()
        return TransformersLayout(
            owner=name, blocks=prefix + lists[0], before=tuple(prefix + k for k in keys[:i]),
            after=tuple(prefix + k for k in keys[i + 1:]) + head, output="logits" if head else "last_hidden_state")
    return None


def stage_forward(model: nn.Module, first: bool, output: str, *args: Any, **kwargs: Any) -> Any:
    """One stage of ``model`` (its modules already this stage's): the model's own ``forward``, from the user's
    inputs on the first stage and from the activations (``inputs_embeds``) on a later one; returns the tensor the
    stage sends on (the last stage's: its ``output``)."""
    if not first:
        (hidden,) = args
        args, kwargs = (), {"inputs_embeds": hidden}
    out = type(model).forward(model, *args, **{"use_cache": False, **kwargs})
    return getattr(out, output)


def wrap_output(output: str, value: Any) -> Any:
    """The whole batch's output, as the model returns it (``out.logits`` works in a ``predict_step``)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=value) if output == "logits" else BaseModelOutputWithPast(
        last_hidden_state=value)
