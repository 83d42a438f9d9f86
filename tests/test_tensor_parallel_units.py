"""The strategy's tensor-parallel helpers on 2 real gloo ranks forming one tensor-parallel group: the global
gradient norm of a model that mixes split and replicated parameters, the refusal of FSDP, ties broken by
``parallelize_module`` restored (or refused when split differently), and whole-tensor state dicts."""

from __future__ import annotations

import pytest
import torch

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.ranks import RankPool

WORLD = 2


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, timeout=120) as ranks:
        yield ranks


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("data_parallel", "tensor_parallel"))


def _gpt(tie: str = "replicated", retie: bool = True):
    from torch.distributed.tensor.parallel import parallelize_module

    from ddp_plugin.testing.gpt import GPT, tensor_parallel_plan

    torch.manual_seed(0)
    whole = GPT()
    torch.manual_seed(0)
    split = GPT()
    mesh = _mesh()
    parallelize_module(split, mesh["tensor_parallel"], tensor_parallel_plan(split, tie))
    if retie:
        split.head.weight = split.tok.weight
    return whole, split, mesh


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


def _loss(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _grad_norms(rank, world, tie):
    import torch.distributed as dist

    from ddp_plugin.parallel.tensor_parallel import global_grad_norm

    whole, split, mesh = _gpt(tie)
    x, y = _batch()
    _loss(whole, x, y).backward()
    _loss(split, x, y).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in whole.parameters()]))
    ours = global_grad_norm(list(split.parameters()), mesh.get_group("tensor_parallel"), torch.device("cpu"))
    # Counting every rank's local gradients (a replicated parameter twice): what a per-rank sum would give.
    local_sq = torch.stack([p.grad.to_local().double().pow(2).sum() if hasattr(p.grad, "to_local")
                            else p.grad.double().pow(2).sum() for p in split.parameters()]).sum()
    dist.all_reduce(local_sq)
    return float(expected), float(ours), float(local_sq.sqrt())


@pytest.mark.parametrize("tie", ["replicated", "vocab"])
def test_global_grad_norm_counts_each_parameter_once(pool, tie):
    for expected, ours, naive in pool.run(_grad_norms, tie):
        assert ours == pytest.approx(expected, rel=1e-5)
        assert naive > expected * 1.01  # the replicated parameters counted twice would be caught


def _refuse_fsdp(rank, world):
    from torch.distributed.fsdp import fully_shard

    from ddp_plugin.parallel.tensor_parallel import check_module

    _, split, mesh = _gpt()
    fully_shard(split.blocks[0], mesh=mesh["data_parallel"])
    try:
        check_module(split, mesh["tensor_parallel"])
    except TypeError as err:
        return str(err)
    return None


def test_fully_shard_in_configure_model_is_refused(pool):
    for message in pool.run(_refuse_fsdp):
        assert message is not None
        assert "fully_shard" in message and "zero_stage" in message and "blocks.0" in message


def _refuse_other_mesh(rank, world):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from ddp_plugin.parallel.tensor_parallel import check_module
    from ddp_plugin.testing.gpt import GPT

    mesh = _mesh()
    model = GPT()
    parallelize_module(model.blocks[0].mlp, mesh["tensor_parallel"], {"fc": ColwiseParallel()})
    check_module(model, mesh["tensor_parallel"])  # the tensor-parallel mesh: fine
    try:
        check_module(model, None)  # no tensor-parallel mesh at all
    except TypeError as err:
        return str(err)
    return None


def test_dtensor_parameters_off_the_tensor_parallel_mesh_are_refused(pool):
    for message in pool.run(_refuse_other_mesh):
        assert message is not None and "blocks.0.mlp.fc.weight" in message


def _ties(rank, world, tie_split):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from ddp_plugin.parallel.tensor_parallel import restore_ties, shared_parameters
    from ddp_plugin.testing.gpt import GPT, tensor_parallel_plan

    model = GPT()
    ties = shared_parameters(model)
    mesh = _mesh()
    if tie_split == "vocab":
        parallelize_module(model, mesh["tensor_parallel"], tensor_parallel_plan(model, "vocab"))
    else:  # only the head split: the embedding stays whole
        parallelize_module(model, mesh["tensor_parallel"], {"head": ColwiseParallel()})
    broken = model.head.weight is not model.tok.weight
    try:
        restored = restore_ties(model, ties)
    except TypeError as err:
        return ties, broken, None, str(err)
    return ties, broken, restored, model.head.weight is model.tok.weight


def test_a_tie_parallelize_module_broke_is_restored(pool):
    for ties, broken, restored, tied in pool.run(_ties, "vocab"):
        assert ties == [("tok.weight", "head.weight")]
        assert broken and restored == ties and tied is True


def test_a_tie_split_two_ways_is_refused_naming_both(pool):
    for _, broken, restored, message in pool.run(_ties, "head only"):
        assert broken and restored is None
        assert "'tok.weight'" in message and "'head.weight'" in message and "Shard(0)" in message


def _state_dicts(rank, world):
    from ddp_plugin.parallel.tensor_parallel import distribute_state_dict, full_state_dict

    whole, split, _ = _gpt("vocab")
    full = full_state_dict(split.state_dict())
    plain = all(type(v) is torch.Tensor for v in full.values())
    equal = full.keys() == whole.state_dict().keys() and all(
        torch.equal(full[k], v) for k, v in whole.state_dict().items())
    # Back into a split model whose values differ: loading restores every local shard.
    torch.manual_seed(5)
    _, other, _ = _gpt("vocab")
    for p in other.parameters():
        p.data.add_(1.0)
    other.load_state_dict(distribute_state_dict(full, other), strict=True)
    same = all(torch.equal(a.to_local() if hasattr(a, "to_local") else a, b.to_local() if hasattr(b, "to_local") else b)
               for a, b in zip(other.state_dict().values(), split.state_dict().values()))
    return plain, equal, same


def test_full_state_dict_is_the_unsplit_models_and_loads_back(pool):
    for plain, equal, same in pool.run(_state_dicts):
        assert plain and equal and same


def test_a_codec_that_codes_a_stage_3_unit_as_a_whole_is_refused_with_tensor_parallelism():
    from ddp_plugin.parallel.tensor_parallel import check_flags

    for codec in ("int8", "topk", "powersgd"):
        with pytest.raises(ValueError, match=rf"`compression='{codec}'` with `zero_stage=3` and `tensor_parallel_size=2`"):
            check_flags(2, 3, codec)
    for ok in [(2, 3, None), (2, 3, "bf16"), (2, 2, "int8"), (1, 3, "int8")]:
        check_flags(*ok)


def test_a_codec_refused_at_stage_3_with_tensor_parallelism_is_refused_at_construction():
    # (it was refused at setup only: the launch started every rank, then each failed; the default-paths matrix,
    # which runs every codec at every stage with tensor parallelism, found it)
    for codec in ("int8", "topk", "powersgd", "sparse", "auto"):
        with pytest.raises(ValueError, match=rf"`compression='{codec}'` with `zero_stage=3` and `tensor_parallel_size=2`"):
            HierarchicalZeroStrategy(tensor_parallel_size=2, zero_stage=3, compression=codec)
    HierarchicalZeroStrategy(tensor_parallel_size=2, zero_stage=3, compression="bf16")
    HierarchicalZeroStrategy(tensor_parallel_size="auto", zero_stage=3, compression="int8")  # (known at setup)
