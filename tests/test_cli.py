"""LightningCLI: the strategy and its flags from YAML (`trainer.strategy.class_path` + `init_args`)."""

from __future__ import annotations

import re
import textwrap

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI

import ddp_plugin  # noqa: F401
from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.sync.plugin import build_outer_optimizer


class Model(L.LightningModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, hidden)


def cli_from_yaml(tmp_path, text: str) -> LightningCLI:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    return LightningCLI(Model, run=False, save_config_callback=None, args=["--config", str(config)])


STRATEGY_YAML = """\
trainer:
  accelerator: cpu
  devices: 4
  logger: false
  strategy:
    class_path: ddp_plugin.HierarchicalZeroStrategy
    init_args:
"""


def cli_with_strategy(tmp_path, init_args: str) -> LightningCLI:
    """Our strategy on 4 CPU devices, ``init_args`` the YAML lines under ``trainer.strategy.init_args``."""
    return cli_from_yaml(tmp_path, STRATEGY_YAML + textwrap.indent(textwrap.dedent(init_args).strip(), " " * 6) + "\n")


def test_flags_from_yaml_init_args(tmp_path):
    cli = cli_with_strategy(tmp_path, """
        devices_per_node: 2
        hierarchical: false
        compression: int8
        compression_options: {block_size: 256}
        skip_nonfinite: true
        timeout: 120
    """)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HierarchicalZeroStrategy)
    assert (strategy.devices_per_node, strategy.hierarchical, strategy.compression) == (2, False, "int8")
    assert strategy.compression_options == {"block_size": 256}
    assert strategy.skip_nonfinite and strategy.config.timeout.total_seconds() == 120


def test_registered_name_from_yaml(tmp_path):
    cli = cli_from_yaml(tmp_path, "trainer: {accelerator: cpu, devices: 2, logger: false, strategy: hierarchical_zero}\n")
    assert isinstance(cli.trainer.strategy, HierarchicalZeroStrategy)


def test_bad_flag_in_yaml_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"`compression='zip'`.*allowed values"):
        cli_from_yaml(tmp_path, """
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: ddp_plugin.HierarchicalZeroStrategy
    init_args: {compression: zip}
""")


def test_sync_mode_flags_from_yaml(tmp_path):
    cli = cli_with_strategy(tmp_path, """
        devices_per_node: 2
        sync_every: 16
        outer_optimizer: average
        sync_fragments: 4
        max_staleness: 1
        sync_warmup_steps: 100
    """)
    c = cli.trainer.strategy.config
    assert (c.sync_every, c.outer_optimizer, c.sync_fragments, c.max_staleness, c.sync_warmup_steps) == (
        16, "average", 4, 1, 100)


def test_outer_optimizer_from_yaml_is_a_class_path_with_init_args(tmp_path):
    """As for the model's optimizer in LightningCLI: the class and its arguments, ``params`` left out."""
    cli = cli_with_strategy(tmp_path, """
        devices_per_node: 2
        sync_every: 16
        outer_optimizer:
          class_path: torch.optim.SGD
          init_args: {lr: 0.7, momentum: 0.5, nesterov: true}
    """)
    outer = build_outer_optimizer(cli.trainer.strategy.config.outer_optimizer, [torch.nn.Parameter(torch.zeros(3))])
    assert type(outer) is torch.optim.SGD
    group = outer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.5, True)


def test_pipeline_flags_from_yaml_stage_names_included(tmp_path):
    cli = cli_with_strategy(tmp_path, """
        pipeline_parallel_size: 2
        pipeline_schedule: gpipe
        pipeline_split: [[tok, pos, blocks.0], [blocks.1, ln_f, head]]
    """)
    c = cli.trainer.strategy.config
    assert (c.pipeline_parallel_size, c.pipeline_schedule) == (2, "gpipe")
    assert c.pipeline_split == (("tok", "pos", "blocks.0"), ("blocks.1", "ln_f", "head"))
    cli = cli_with_strategy(tmp_path, "pipeline_parallel_size: 2\npipeline_split: type:^Block$\n")
    assert cli.trainer.strategy.config.pipeline_split == "type:^Block$"


def test_pretrained_from_yaml(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1)}, tmp_path / "model.safetensors")
    cli = cli_with_strategy(tmp_path, f"pretrained: {tmp_path}\n")
    assert cli.trainer.strategy.config.pretrained == str(tmp_path)


def test_help_shows_each_flags_generated_documentation(monkeypatch, capsys):
    """``--help`` is the class docstring as jsonargparse reads it, and its ``Args:`` are generated from the config's
    ``FLAGS`` (tests/test_docs.py checks they are as generated): each flag's text, default and allowed values."""
    import inspect

    from ddp_plugin.strategy import flag_docs

    monkeypatch.setenv("COLUMNS", "100000")  # one line per option: argparse would cut long words (links) apart
    with pytest.raises(SystemExit):
        LightningCLI(Model, run=False, args=["--trainer.strategy.help", "ddp_plugin.HierarchicalZeroStrategy"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "Data-parallel training for clusters whose inter-node links are the bottleneck:" in shown  # (its title)
    parameters = list(inspect.signature(HierarchicalZeroStrategy).parameters)
    missing = [name for name in parameters if name in flag_docs.FLAGS and not re.search(
        # (the option, its metavar and an appending `name+` variant, then the help and jsonargparse's type)
        rf"--trainer\.strategy\.{name}\b.{{0,150}}? {re.escape(' '.join(flag_docs.help_text(name).split()))} \(type:",
        shown)]
    assert not missing, f"--help does not show the generated documentation of {missing}"
    assert len([n for n in parameters if n in flag_docs.FLAGS]) == len(flag_docs.FLAGS)
