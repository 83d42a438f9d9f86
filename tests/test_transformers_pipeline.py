"""A Hugging Face model pipelined without rewriting its ``forward``: ``LlamaForCausalLM`` (tiny, from its config)
split by its config's ``base_model_pp_plan`` (embedding, decoder layers, norm; the head from the class's
``_pp_plan``), the training step written as for any model (``self.model(input_ids=x).logits``). At P 2 x D 2 it
trains as at D 4 (the same 16 samples a step), predicts as the whole model, builds on meta (initialized by the
model's own ``init_weights``, rotary tables included) and reads ``save_pretrained`` weights stage by stage
(``pretrained=``). 4 gloo ranks, tests/workers/transformers_run.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.support import WORKERS, run_python

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.workers.transformers_run import config

    weights = tmp_path_factory.mktemp("llama")
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))  # (not the initialization: norms too)
    model.save_pretrained(weights)
    out = weights / "result.jsonl"
    run_python(WORKERS / "transformers_run.py", "--weights", weights, "--out", out, timeout=600)
    return {r["case"]: r["ranks"] for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("case, reference", [("pp2_dp2", "dp"), ("tied_pp2_dp2", "tied_dp")])
def test_pipelined_by_its_own_stage_description_it_trains_as_data_parallel(runs, case, reference):
    reference = [sum(step) / 4 for step in zip(*(r["losses"] for r in runs[reference]))]
    # one loss per data-parallel position (ranks 0 and 1 run the first stage, 2 and 3 the last: the same losses)
    pipelined = [sum(step) / 2 for step in zip(*(r["losses"] for r in runs[case][:2]))]
    assert len(reference) == len(pipelined) == 6
    assert max(abs(a - b) for a, b in zip(reference, pipelined)) < 1e-4, (reference, pipelined)
    assert reference[-1] < reference[0] - 0.1, reference


@pytest.mark.parametrize("case", ["pp2_dp2", "pretrained_meta_pp2_dp2"])
def test_predictions_equal_the_whole_model(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["predict_error"] < 1e-5, (case, rank, r)


@pytest.mark.parametrize("case", ["tied_pp2_dp2", "tied_meta_pp2_dp2"])
def test_a_tied_embedding_and_head_on_two_stages_stay_one_value(runs, case):
    # (as in Llama 3.2 1B: the first stage holds the embedding, the last the head, one copy of the weight each)
    names = [r["tie_names"] for r in runs[case]]
    assert names == [["model.model.embed_tokens.weight"]] * 2 + [["model.lm_head.weight"]] * 2, names
    assert all(r["tie_equal"] for r in runs[case]), runs[case]


@pytest.mark.parametrize("case", ["meta_pp2_dp2", "tied_meta_pp2_dp2"])
def test_built_on_meta_it_starts_from_the_models_own_initialization_and_trains(runs, case):
    for rank, r in enumerate(runs[case]):
        losses = r["losses"]
        assert all(math.isfinite(x) for x in losses), (rank, losses)
        assert abs(losses[0] - math.log(64)) < 0.3, (rank, losses)  # (uniform predictions from a small init)
        assert min(losses[-2:]) < losses[0], (rank, losses)


FIND_WITHOUT_MODELS = """
import sys
import transformers  # (as Lightning's own import does, through torchmetrics, where transformers is installed)
from torch import nn
from ddp_plugin.parallel.stages.transformers import find
before = "transformers" in sys.modules, "transformers.modeling_utils" in sys.modules
print(before, find(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))), "transformers.modeling_utils" in sys.modules)
"""


def test_finding_a_stage_description_imports_no_transformers_models_where_none_was_built(tmp_path):
    # Lightning imports `transformers` (torchmetrics does) wherever it is installed, a lazy module; a pipeline split of
    # a model that holds none of its models must not import their base (`transformers.PreTrainedModel` on it did).
    pytest.importorskip("transformers")
    script = tmp_path / "find.py"
    script.write_text(FIND_WITHOUT_MODELS)
    out = run_python(script).stdout.splitlines()[-1]
    assert out == "(True, False) None False", out
