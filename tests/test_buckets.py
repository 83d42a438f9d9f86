"""Bucket layout: reverse registration order, capacity, no mixed dtypes, gradients as views of the buffer."""

from __future__ import annotations

import torch
from torch import nn

from ddp_plugin.gradients.engine import build_buckets


def named(module: nn.Module):
    return list(reversed([(n, p) for n, p in module.named_parameters() if p.requires_grad]))


def test_buckets_follow_reverse_registration_order_and_respect_the_cap():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10))  # 110 floats = 440 B per layer
    buckets = build_buckets(named(model), cap_bytes=450)
    assert [b.names for b in buckets] == [("2.bias", "2.weight"), ("1.bias", "1.weight"), ("0.bias", "0.weight")]
    assert all(b.nbytes <= 450 for b in buckets)
    assert [b.index for b in buckets] == [0, 1, 2]


def test_a_parameter_larger_than_the_cap_gets_a_bucket_of_its_own():
    model = nn.Linear(100, 100)
    buckets = build_buckets(named(model), cap_bytes=1024)
    assert [b.names for b in buckets] == [("bias",), ("weight",)]


def test_dtypes_are_never_mixed_in_a_bucket():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Linear(4, 4))
    buckets = build_buckets(named(model), cap_bytes=2**20)
    assert [b.buffer.dtype for b in buckets] == [torch.float32, torch.float64, torch.float32]


def test_gradients_become_views_of_the_bucket_buffer():
    model = nn.Linear(3, 2)
    model.weight.grad = torch.ones(2, 3)
    (bucket,) = build_buckets(named(model), cap_bytes=2**20)
    assert model.weight.grad.data_ptr() == bucket.grad_view(1).data_ptr()
    assert model.bias.grad is None  # no gradient yet: optimizers must still see None
    model.weight.grad.mul_(3)
    assert bucket.buffer[bucket.offsets[1] :].tolist() == [3.0] * 6


def test_first_bucket_can_be_capped_smaller_to_start_communication_early():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    buckets = build_buckets(named(model), cap_bytes=2**20, first_cap_bytes=450)
    assert [b.names for b in buckets] == [("2.bias", "2.weight"), ("1.bias", "1.weight", "0.bias", "0.weight")]
