"""Model parallelism: tensor parallelism inside a node and pipeline stages across nodes, beside the data-parallel
plugins.

What is here:

- :mod:`~ddp_plugin.parallel.tensor_parallel`: tensor parallelism's mechanics (checks, ties that
  ``parallelize_module`` broke, norms over split parameters, state dicts of DTensors, module-state sync);
- :mod:`~ddp_plugin.parallel.stages`: cutting a model into pipeline stages, one entry: where it splits
  (``pipeline_split``: by parameters, timed compute, count, type or names, a block cut between two stages, a
  Hugging Face model by its ``base_model_pp_plan``) and the module cut down to a rank's stages;
- :mod:`~ddp_plugin.parallel.pipeline`: the schedule's runner (a step's microbatches, the model's call as a
  placeholder, predict); :mod:`~ddp_plugin.parallel.stage_module`: one stage's module (its forward, the
  activations' dtype across nodes); :mod:`~ddp_plugin.parallel.ties`: parameters several stages hold and their
  gradients' sum; :mod:`~ddp_plugin.parallel.stage_checkpoint`: the stages' state against the unsplit model's;
  :mod:`~ddp_plugin.parallel.state_parts`: each parallelism's part in a checkpoint (the contract the routing asks).

Each parallelism as the strategy sees it is a component of the strategy's (:mod:`ddp_plugin.strategy.components`:
the mechanics here, the process groups and the fit's session there). The contract between a parallelism and the
strategy (:class:`~ddp_plugin.strategy.components.TensorParallel`,
:class:`~ddp_plugin.strategy.components.PipelineParallel`): it asks the mesh (``ddp_plugin.strategy.process_groups``,
built once per layout) for its groups, it prepares the module in ``setup`` before anything is allocated (tensor
parallelism checks what ``configure_model`` did on the meta device; pipeline parallelism keeps this rank's
stages), it starts once the module is materialized (the pipeline's schedule runner), and it wraps the steps it
changes (the forward, the backward, a pipelined ``*_step``). Its say in a checkpoint is a part
(:class:`~ddp_plugin.parallel.state_parts.StatePart`) that the checkpoint routing applies on every save and load.
The strategy's ``setup`` runs them in torchtitan's order: build (meta), split, parallelize, materialize, shard
(the fit's session), optimizers.
"""
