"""The checkpoint writer on its own (one process): what it writes is what ``torch.save`` would write, as
``torch.load`` (``weights_only=True``) reads it; deferred tensors are produced once each, in the order they were
made, after everything else is written; a failure leaves the previous file whole and still calls every producer
(the other ranks would be waiting in those collectives), even when the file cannot be created; a full disk is an
``OSError`` naming the path and the free space; a file that is not a checkpoint says so."""

from __future__ import annotations

import collections
import errno
import io
import re
import subprocess
import sys
import zipfile

import pytest
import torch
from torch import nn

from tests.support import ROOT
from tests.filesystems import in_tmpfs, tmpfs_unavailable
from ddp_plugin.checkpoints.checkpoint_io import atomic_torch_save, deferred_storages, materialize, stream_save
from ddp_plugin.hookspecs import DeferredStorage, DeferredTensor


def ordinary_checkpoint() -> dict:
    base = torch.arange(24, dtype=torch.float32)
    lin = nn.Linear(3, 2)
    return {
        "state_dict": collections.OrderedDict(lin.state_dict()),
        "views": [base[:6].view(2, 3), base[6:], base[::2]],  # three tensors, one storage
        "dtypes": {"bf16": torch.randn(5).bfloat16(), "i64": torch.tensor([1, 2, 3]), "b": torch.tensor([True])},
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "param": nn.Parameter(torch.ones(2)),
        "plain": {"epoch": 3, "name": "x", "tuple": (1, 2.5, None)},
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def written(obj) -> bytes:
    buf = io.BytesIO()
    stream_save(obj, buf)
    return buf.getvalue()


def test_ordinary_checkpoint_reads_back_like_torch_save():
    obj = ordinary_checkpoint()
    ours = torch.load(io.BytesIO(written(obj)), weights_only=True)
    ref_buf = io.BytesIO()
    torch.save(obj, ref_buf)
    ref_buf.seek(0)
    assert_same(ours, torch.load(ref_buf, weights_only=True))
    assert_same(ours, obj)
    # Views of one storage stay views of one storage, as with torch.save.
    v = ours["views"]
    assert v[0].untyped_storage().data_ptr() == v[1].untyped_storage().data_ptr() == v[2].untyped_storage().data_ptr()


class Producer:
    """Records the order of calls; returns ``value`` (as rank 0's producer does) or None (as the others')."""

    def __init__(self, log: list, name: str, value: torch.Tensor | None) -> None:
        self.log, self.name, self.value = log, name, value

    def __call__(self):
        self.log.append(self.name)
        return self.value


def deferred_checkpoint(log: list, fail_on: str | None = None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    a = torch.arange(10, dtype=torch.float32)
    b = torch.arange(6, dtype=torch.float32) * -1
    sa = DeferredStorage(dtype=torch.float32, numel=10, produce=Producer(log, "a", a))
    sb = DeferredStorage(dtype=torch.float32, numel=6, produce=Producer(log, "b", b if fail_on != "b" else None))
    obj = {
        # Pickled in another order than they were made: production follows the making.
        "optimizer_states": [{"state": {0: {"exp_avg": DeferredTensor(sb, 0, (2, 3))},
                                        1: {"exp_avg": DeferredTensor(sa, 0, (2, 2)),
                                            "exp_avg_sq": DeferredTensor(sa, 4, (6,)), "step": torch.tensor(7.0)}}}],
        "state_dict": {"w": torch.ones(3)},
    }
    return obj, a, b


def test_deferred_tensors_are_produced_in_order_once_each_and_read_back():
    log: list = []
    obj, a, b = deferred_checkpoint(log)
    data = written(obj)
    assert log == ["a", "b"]
    back = torch.load(io.BytesIO(data), weights_only=True)
    st = back["optimizer_states"][0]["state"]
    assert torch.equal(st[0]["exp_avg"], b.view(2, 3))
    assert torch.equal(st[1]["exp_avg"], a[:4].view(2, 2))
    assert torch.equal(st[1]["exp_avg_sq"], a[4:])
    assert st[1]["exp_avg"].untyped_storage().data_ptr() == st[1]["exp_avg_sq"].untyped_storage().data_ptr()
    assert torch.equal(st[1]["step"], torch.tensor(7.0)) and torch.equal(back["state_dict"]["w"], torch.ones(3))


def test_deferred_storages_are_produced_in_the_order_they_were_made_not_pickled():
    log: list = []
    s = DeferredStorage(dtype=torch.float32, numel=2, produce=Producer(log, "first", torch.ones(2)))
    t = DeferredStorage(dtype=torch.float32, numel=2, produce=Producer(log, "second", torch.ones(2)))
    written({"x": DeferredTensor(t, 0, (2,)), "y": [DeferredTensor(s, 1, (1,))]})  # pickled t first
    assert log == ["first", "second"]
    assert [d.order for d in deferred_storages({"a": [s], "b": DeferredTensor(t, 0, (1,))})] == [s.order, t.order]


def test_materialize_gives_ordinary_tensors_and_runs_every_producer():
    log: list = []
    obj, a, b = deferred_checkpoint(log)
    out = materialize(obj)
    assert log == ["a", "b"]
    st = out["optimizer_states"][0]["state"]
    assert torch.equal(st[1]["exp_avg_sq"], a[4:]) and torch.equal(st[0]["exp_avg"], b.view(2, 3))
    assert isinstance(obj["optimizer_states"][0]["state"][0]["exp_avg"], DeferredTensor)  # the input is untouched


def test_failed_save_keeps_the_previous_file_and_still_calls_every_producer(tmp_path):
    target = tmp_path / "model.ckpt"
    torch.save({"old": torch.ones(2)}, target)
    log: list = []
    obj, _, _ = deferred_checkpoint(log, fail_on="b")  # rank 0's producer of b returns nothing: an error
    extra = DeferredStorage(dtype=torch.float32, numel=1, produce=Producer(log, "after", torch.ones(1)))
    obj["more"] = DeferredTensor(extra, 0, (1,))
    with pytest.raises(RuntimeError, match="came back as None on rank 0, not 6 elements of torch.float32"):
        atomic_torch_save(obj, target)
    assert log == ["a", "b", "after"]  # the producer after the failure ran too
    assert torch.equal(torch.load(target, weights_only=True)["old"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]  # no temporary file left


def test_save_that_cannot_create_its_file_still_calls_every_producer(tmp_path):
    (tmp_path / "a_file").write_text("")
    log: list = []
    obj, _, _ = deferred_checkpoint(log)
    with pytest.raises(OSError):
        atomic_torch_save(obj, tmp_path / "a_file" / "model.ckpt")  # its directory is a file
    assert log == ["a", "b"]


def test_atomic_save_of_deferred_checkpoint_loads_with_torch_load(tmp_path):
    log: list = []
    obj, a, _ = deferred_checkpoint(log)
    atomic_torch_save(obj, tmp_path / "x.ckpt")
    back = torch.load(tmp_path / "x.ckpt", weights_only=True, mmap=True)
    assert torch.equal(back["optimizer_states"][0]["state"][1]["exp_avg_sq"], a[4:])


# ---------------------------------------------------------------------------------------------- a full disk, a bad file

# Writes a small checkpoint that fits, then one of 400 kB that does not; prints what the second save raised,
# the directory's files and what the target holds afterwards.
_SAVE_TOO_MUCH = """
import errno, os, resource, signal, sys, torch
from ddp_plugin.checkpoints.checkpoint_io import atomic_torch_save
target, limit = sys.argv[1], sys.argv[2]
if limit != "none":  # the process's file size limit (ulimit -f): writes beyond it fail with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
atomic_torch_save({"old": torch.ones(2)}, target)
try:
    atomic_torch_save({"w": torch.randn(100_000)}, target)
except BaseException as err:
    print(f"raised {type(err).__name__} errno={getattr(err, 'errno', None)}: {err}")
print("files", sorted(os.listdir(os.path.dirname(target))))
print("target holds", torch.load(target, weights_only=True))
"""


def _save_too_much(argv_prefix: list, target, limit: str) -> str:
    proc = subprocess.run([*argv_prefix, sys.executable, "-c", _SAVE_TOO_MUCH, str(target), limit],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_full_disk_raises_the_oserror_naming_the_path_and_the_free_space(tmp_path):
    reason = tmpfs_unavailable()
    if reason:
        pytest.skip(reason)
    # A 64 kB tmpfs (a real filesystem that runs full: ENOSPC from write(2)) over tmp_path, in a mount
    # namespace of the child's own.
    script = in_tmpfs(tmp_path, "size=64k", [sys.executable, "-c", _SAVE_TOO_MUCH, tmp_path / "model.ckpt", "none"])
    proc = subprocess.run(script, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    first = out.splitlines()[0]
    assert first.startswith(f"raised OSError errno={errno.ENOSPC}: "), out
    assert "inline_container" not in first and "unexpected pos" not in first
    assert str(tmp_path / "model.ckpt") in first and re.search(r"\d+(\.\d+)? [kMG]?B free", first), first
    assert "files ['model.ckpt']" in out  # the temporary file is gone
    assert "target holds {'old': tensor([1., 1.])}" in out  # the previous checkpoint is whole


def test_file_size_limit_raises_the_oserror_naming_the_path(tmp_path):
    # The process's file size limit (RLIMIT_FSIZE, no privileges needed): EFBIG from write(2).
    out = _save_too_much([], tmp_path / "model.ckpt", str(64 * 1024))
    first = out.splitlines()[0]
    assert first.startswith(f"raised OSError errno={errno.EFBIG}: "), out
    assert "unexpected pos" not in first and str(tmp_path / "model.ckpt") in first and "free" in first, first
    assert "files ['model.ckpt']" in out
    assert "target holds {'old': tensor([1., 1.])}" in out


@pytest.mark.parametrize("content", ["empty", "random bytes", "truncated", "text", "a zip of something else"])
def test_a_file_that_is_not_a_checkpoint_is_named_as_such(tmp_path, content):
    from ddp_plugin import HierarchicalZeroStrategy

    path = tmp_path / "model.ckpt"
    if content == "empty":
        path.write_bytes(b"")
    elif content == "random bytes":
        path.write_bytes(torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
                         .numpy().tobytes())
    elif content == "truncated":
        atomic_torch_save({"state_dict": {"w": torch.randn(1000)}}, path)
        path.write_bytes(path.read_bytes()[:2500])
    elif content == "text":
        path.write_text("epoch=3\n")
    else:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes.txt", "hello")
    with pytest.raises(ValueError, match=r"is not a checkpoint, or truncated") as info:
        HierarchicalZeroStrategy().load_checkpoint(path)
    assert f"`{path}`" in str(info.value)
    assert "weights_only=False will likely succeed" not in str(info.value)


def test_a_checkpoint_that_only_needs_weights_only_false_keeps_torchs_error(tmp_path):
    # A real checkpoint holding an object torch.load's weights_only mode refuses: that is not "truncated".
    from ddp_plugin import HierarchicalZeroStrategy

    torch.save({"state_dict": {}, "extra": _Opaque()}, tmp_path / "model.ckpt")
    with pytest.raises(Exception, match="weights_only") as info:
        HierarchicalZeroStrategy().load_checkpoint(tmp_path / "model.ckpt", weights_only=True)
    assert "not a checkpoint" not in str(info.value)


class _Opaque:
    pass
