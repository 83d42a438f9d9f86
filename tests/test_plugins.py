"""The plugin manager: installed plugins found through entry points, user plugins, misspelled hooks, the
ordering guarantee for codecs with several collectives, and plugin state through a checkpoint."""

from __future__ import annotations

import json
import textwrap

import pluggy
import pytest

from tests.support import WORKERS, run_python
from ddp_plugin import HierarchicalZeroStrategy, hookimpl
from ddp_plugin.strategy.plugin_manager import build_plugin_manager, installed_codecs

PLUGIN_SOURCE = '''
import torch.distributed as dist
from ddp_plugin.hookspecs import completed_future, hookimpl


class Fp64Mean:
    """A codec that averages in float64: a real reduction with its own arithmetic."""

    def __init__(self):
        self.calls = 0

    @hookimpl
    def on_cross_node_reduce(self, tensor, group):
        self.calls += 1
        wide = tensor.double() / dist.get_world_size(group)
        dist.all_reduce(wide, group=group)
        tensor.copy_(wide)
        return completed_future(tensor)


class BucketObserver:
    """Not a codec: always active, wraps every reducer call."""

    def __init__(self):
        self.buckets_seen = 0
        self.bucket_indices = set()

    @hookimpl(wrapper=True)
    def on_bucket_ready(self, bucket):
        future = yield
        self.buckets_seen += 1
        self.bucket_indices.add(bucket.index)
        return future


codec = Fp64Mean()
observer = BucketObserver()
'''


@pytest.fixture
def installed_plugin_dir(tmp_path, monkeypatch):
    """A real distribution on sys.path: a module plus a dist-info with entry points in the `ddp_plugin` group."""
    (tmp_path / "ddp_test_plugins.py").write_text(PLUGIN_SOURCE)
    info = tmp_path / "ddp_test_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ddp-test-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [ddp_plugin]
            fp64_mean = ddp_test_plugins:codec
            bucket_observer = ddp_test_plugins:observer
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_installed_codec_becomes_a_compression_name(installed_plugin_dir):
    assert installed_codecs() == ["fp64_mean"]
    assert HierarchicalZeroStrategy(compression="fp64_mean").compression == "fp64_mean"


def test_unknown_codec_message_lists_installed_codecs(installed_plugin_dir):
    with pytest.raises(ValueError, match=r"`compression='fp8'`.*allowed values: None, 'auto', 'fp64_mean'"):
        HierarchicalZeroStrategy(compression="fp8")


def test_unselected_codec_stays_out_and_other_plugins_stay_in(installed_plugin_dir):
    pm = build_plugin_manager(None, [])
    assert pm.get_plugin("fp64_mean") is None
    assert pm.get_plugin("bucket_observer") is not None


def test_entry_point_codec_and_observer_run_in_training(installed_plugin_dir, tmp_path):
    out = tmp_path / "result.json"
    run_python(WORKERS / "plugins_run.py", "--mode", "entrypoint", "--out", out, pythonpath=[installed_plugin_dir])
    result = json.loads(out.read_text())
    assert result["identical"]
    assert result["num_buckets"] > 1
    # 10 steps, every bucket once per step, through the observer and the selected codec.
    assert result["observed_buckets"] == 10 * result["num_buckets"]
    assert result["codec_calls"] == 10 * result["num_buckets"]


def test_misspelled_hook_fails_at_construction():
    class Typo:
        @hookimpl
        def on_bucket_redy(self, bucket):
            return None

    with pytest.raises(pluggy.PluginValidationError, match="on_bucket_redy"):
        HierarchicalZeroStrategy(plugins=[Typo()])


def test_codec_with_dependent_collectives_keeps_rank_order_over_many_buckets(tmp_path):
    out = tmp_path / "result.json"
    run_python(WORKERS / "plugins_run.py", "--mode", "two_stage", "--out", out)
    result = json.loads(out.read_text())
    assert result["identical"]
    assert result["codec_calls"] == 30 * 12  # 30 steps x 12 buckets (the 1 KiB cap packs the head with a bias)


def test_plugin_state_survives_a_checkpoint(tmp_path):
    out = tmp_path / "result.json"
    run_python(WORKERS / "plugins_run.py", "--mode", "state", "--out", out)
    result = json.loads(out.read_text())
    assert result["saved"] == {"step_counter": {"steps": 5}}
    assert result["loaded"] == {"steps": 5}
    assert result["steps_after_resume"] == 8


def test_a_plugin_gates_each_step_and_wraps_the_transport(tmp_path):
    """The hooks of members that come and go, implemented by a user's plugin without torchft: a gated step whose
    ``on_commit_step`` says no leaves the parameters as they were on every rank; the transport it answers carries
    the fit's collectives."""
    out = tmp_path / "result.json"
    run_python(WORKERS / "plugins_run.py", "--mode", "members", "--out", out)
    result = json.loads(out.read_text())
    assert result["changed"] == [False, True] * 3
    assert result["started"] == 6 and result["asked"] == 6
    assert result["wrapped_calls"] >= 6  # (at least the buckets' reductions, every step)
    assert result["identical"]
