"""Flags that name module classes, or the classes' names (for YAML): ``auto_wrap_policy`` (ZeRO-3 units) and
``activation_checkpointing_policy``. One reading of such a value, one match rule, one check that every entry
names a module of the model; each flag words its own errors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

Entries = tuple[type | str, ...]


def as_entries(value: Any) -> Entries | None:
    """``value`` as a tuple of module classes and class names (one of them alone included), or ``None`` where it
    is something else (the caller raises, naming its flag)."""
    if isinstance(value, (type, str)):
        value = [value]
    if isinstance(value, Iterable):
        items = tuple(value)
        if items and all(isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)) for c in items):
            return items
    return None


def containers(entries: Entries) -> list[str]:
    """The names of the classes in ``entries`` whose forward is never called (``nn.ModuleList`` and the like:
    their parent calls their children)."""
    return [c.__name__ for c in entries if isinstance(c, type) and c.forward is nn.Module.forward]


def matches(module: nn.Module, entries: Entries) -> bool:
    """Whether ``module`` is an instance of a class of ``entries``, or its class has a name there."""
    return any(type(module).__name__ == entry if isinstance(entry, str) else isinstance(module, entry)
               for entry in entries)


def unmatched(modules: Iterable[nn.Module], entries: Entries) -> list[str]:
    """The labels of the entries that match none of ``modules``."""
    modules = list(modules)
    return [entry if isinstance(entry, str) else entry.__name__
            for entry in entries if not any(matches(m, (entry,)) for m in modules)]


def class_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s module classes, sorted (for an error that says which ones there are)."""
    return sorted({type(m).__name__ for m in model.modules()})
