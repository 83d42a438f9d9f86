"""Weights from a Hugging Face style ``safetensors`` checkpoint (``pretrained=``), read into the model each rank
holds once ``setup`` has split, parallelized and materialized it.

Each rank reads only its own part: the tensors of its pipeline stages, and of a tensor-parallel parameter (a
DTensor) only its shard's slice of the file. The reading is torch's own: ``torch.distributed.checkpoint`` with its
``HuggingFaceStorageReader``, which reads each slice through ``safetensors``' memory-mapped ``get_slice`` (the
file's other bytes are never read). The file's dtype may differ from the model's (bf16 files into fp32 training).

The file's names may carry another prefix than the module's (``model.layers.0...`` in the file, ``model.model.
layers.0...`` in a LightningModule holding a ``LlamaForCausalLM`` as ``self.model``): the prefix pair that matches
the most names is found once, from the whole model, before it is split (:func:`plan`). Names of the model the file
lacks keep their initialization, and names of the file the model lacks are left unread; both are listed in a
warning, as ``from_pretrained`` does. Shapes that differ, or a file none of whose names match, fail on every rank
before anything is read.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("ddp_plugin")

SUFFIX = ".safetensors"
PREFIX_DEPTH = 3  # module-name components a prefix may have, on either side ("base_model.model.model.")
LISTED = 10  # names listed in a warning or an error


def check_pretrained(value: object) -> str | None:
    """The ``pretrained`` flag: ``None``, or a ``.safetensors`` file or a folder holding some (a Hugging Face
    model folder: ``model.safetensors``, or ``model-00001-of-00002.safetensors`` ...)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"`pretrained={value!r}`: allowed values are None or the path of a `.safetensors` file or "
                         "of a folder holding them.")
    path = os.fspath(value)
    if not os.path.exists(path):
        raise ValueError(f"`pretrained={path!r}`: no such file or folder (a `.safetensors` file or a folder "
                         "holding them).")
    if not safetensors_files(path):
        raise ValueError(f"`pretrained={path!r}` is not a `.safetensors` file and holds none: pass a Hugging Face "
                         "style checkpoint (`model.safetensors`, or its folder).")
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ImportError("`pretrained` reads `.safetensors` files with the `safetensors` package: "
                          "pip install 'ddp_plugin[hf]'") from None
    return path


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX))
    return [path] if path.name.endswith(SUFFIX) else []


@dataclass(frozen=True)
class KeyMap:
    """A file name ``strip + rest`` is the module's ``add + rest``."""

    strip: str = ""
    add: str = ""

    def to_module(self, key: str) -> str | None:
        return self.add + key[len(self.strip):] if key.startswith(self.strip) else None

    def to_file(self, name: str) -> str | None:
        return self.strip + name[len(self.add):] if name.startswith(self.add) else None

    def __str__(self) -> str:
        return f"`{self.strip}*` read as `{self.add}*`" if self.strip or self.add else "names as they are"


def _prefixes(name: str) -> Iterator[tuple[str, str]]:
    """``(prefix, rest)`` for the prefixes of up to :data:`PREFIX_DEPTH` components: ``("", "a.b.c")``,
    ``("a.", "b.c")``, ..."""
    parts = name.split(".")
    for i in range(min(PREFIX_DEPTH, len(parts) - 1) + 1):
        yield "".join(p + "." for p in parts[:i]), ".".join(parts[i:])


def find_key_map(file_keys: Iterable[str], module_names: Iterable[str]) -> tuple[KeyMap, int]:
    """The prefix pair under which most of the file's names are the module's, and how many are; ties go to the
    shortest prefixes (the names as they are first)."""
    by_rest: dict[str, set[str]] = defaultdict(set)
    for name in module_names:
        for prefix, rest in _prefixes(name):
            by_rest[rest].add(prefix)
    counts: Counter[tuple[str, str]] = Counter()
    for key in file_keys:
        for strip, rest in _prefixes(key):
            for add in by_rest.get(rest, ()):
                counts[strip, add] += 1
    if not counts:
        return KeyMap(), 0
    (strip, add), n = min(counts.items(), key=lambda item: (-item[1], len(item[0][0]) + len(item[0][1]), item[0]))
    return KeyMap(strip, add), n


@dataclass
class Plan:
    """What :func:`load` reads: decided from the whole model, the same on every rank."""

    path: str
    key_map: KeyMap
    file_keys: frozenset[str]
    missing: list[str]
    unexpected: list[str]


def _reader(path: str) -> tuple[torch.distributed.checkpoint.HuggingFaceStorageReader, str | None]:
    """torch's reader over the folder, or over a folder of one link for a single file (the reader reads every
    ``.safetensors`` file of its folder)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if os.path.isdir(path):
        return HuggingFaceStorageReader(path), None
    folder = tempfile.mkdtemp(prefix="ddp_plugin_pretrained_")
    os.symlink(os.path.abspath(path), os.path.join(folder, os.path.basename(path)))
    return HuggingFaceStorageReader(folder), folder


def plan(module: nn.Module, path: str) -> Plan:
    """Match the file's names to the whole ``module``'s (before a split; meta tensors are fine) and check the
    shapes. Raises ``ValueError`` when no name matches or a shape differs (every rank alike: nothing is read yet)."""
    reader, folder = _reader(path)
    try:
        stored = reader.read_metadata().state_dict_metadata
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    state = module.state_dict(keep_vars=True)
    key_map, matched = find_key_map(stored, state)
    if matched == 0:
        raise ValueError(
            f"`pretrained={path!r}`: none of its {len(stored)} names is a name of the model's, with or without a "
            f"prefix. The file's: {', '.join(sorted(stored)[:5])}, ...; the model's: {', '.join(list(state)[:5])}, ...")
    wrong = []
    aliases: dict[int, list[str]] = defaultdict(list)  # a tied parameter's names
    for name, tensor in state.items():
        aliases[id(tensor)].append(name)
        key = key_map.to_file(name)
        if key in stored and tuple(stored[key].size) != tuple(tensor.shape):
            wrong.append(f"`{key}` is {tuple(stored[key].size)} in the file, `{name}` {tuple(tensor.shape)}")
    if wrong:
        raise ValueError(f"`pretrained={path!r}`: shapes differ ({key_map}): " + "; ".join(wrong[:LISTED]))
    missing = [names[0] for names in aliases.values() if not any(key_map.to_file(n) in stored for n in names)]
    used = {key_map.to_file(name) for name in state}
    unexpected = sorted(k for k in stored if k not in used)
    return Plan(path, key_map, frozenset(stored), missing, unexpected)


def first_plan(module: nn.Module, path: str | None, ckpt_path: object = None) -> Plan | None:
    """``pretrained``'s plan for ``module`` (whole: before a split), at its first setup only (a later one would
    overwrite its training), and unless a checkpoint restores it (``ckpt_path``; a model built on meta is restored
    after setup, when Lightning has not named the path yet, and the restore overwrites what is read). Warns
    :func:`warn`'s lists on global rank 0."""
    if path is None or getattr(module, "_ddp_plugin_pretrained", None) == path:
        return None
    module._ddp_plugin_pretrained = path
    if ckpt_path is not None:
        log.info("ddp_plugin: `pretrained` not read: the model is restored from %s", ckpt_path)
        return None
    p = plan(module, path)
    warn(p)
    return p


def warn(p: Plan) -> None:
    """``from_pretrained``'s two lists, on global rank 0."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    def listed(names: list[str]) -> str:
        return ", ".join(names[:LISTED]) + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")

    rank_zero_info(f"ddp_plugin: pretrained weights from {p.path} ({p.key_map})")
    if p.missing:
        rank_zero_warn(f"{len(p.missing)} tensors of the model are not in `pretrained={p.path!r}` and keep their "
                       f"initialization: {listed(p.missing)}")
    if p.unexpected:
        rank_zero_warn(f"{len(p.unexpected)} tensors of `pretrained={p.path!r}` are not in the model and were not "
                       f"read: {listed(p.unexpected)}")


def load(module: nn.Module, p: Plan, group: dist.ProcessGroup | None = None) -> int:
    """Read into ``module`` (this rank's part, materialized) what the file holds of it; collective over ``group``
    (every rank, its own tensors). Returns how many tensors this rank read."""
    import torch.distributed.checkpoint as dcp

    wanted = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = p.key_map.to_file(name)
        if key in p.file_keys and key not in wanted:
            wanted[key] = tensor.detach()  # (read in place: a parameter's storage, a DTensor's local shard)
    reader, folder = _reader(p.path)
    try:
        with torch.no_grad():
            dcp.load(wanted, storage_reader=reader, process_group=group)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return len(wanted)
