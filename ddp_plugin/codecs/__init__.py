"""Gradient codecs: plugins that answer ``on_cross_node_reduce`` with fewer bytes than a float32 all-reduce,
and the registry of ``compression=`` names (built-in codecs, then codecs installed packages provide).

Select one with ``HierarchicalZeroStrategy(compression=NAME, compression_options={...})``; the options are the
codec's constructor keyword arguments, checked when the strategy is constructed.

| name       | class           | module        | bytes on the wire (fp32 = 1)                 | error feedback |
| ---------- | --------------- | ------------- | -------------------------------------------- | -------------- |
| ``fp16``   | ``Fp16Codec``   | ``cast``      | 1/2, one all-reduce                          | no             |
| ``bf16``   | ``Bf16Codec``   | ``cast``      | 1/2, one all-reduce                          | no             |
| ``int8``   | ``Int8Codec``   | ``int8``      | about 1/4: all-to-all + all-gather of int8   | yes, two-sided |
| ``topk``   | ``TopKCodec``   | ``topk``      | n * ratio: all-gather of values + indices    | yes            |
| ``powersgd`` | ``PowerSGDCodec`` | ``powersgd`` | r(m+n)/(mn) per matrix, two all-reduces  | yes            |
| ``sparse`` | ``SparseCodec`` | ``sparse``    | n * density * (2 + bits/8) / 4: all-gather;  | yes, decayed   |
|            |                 |               | density * (2 + bits/8) / 4: reduce-scatter   |                |

Every codec leaves the same bits on every rank of the group (C1): whatever is decoded is decoded from the same
gathered data in the same order everywhere. All collectives go through the communicator handed to
``on_setup``, so the traffic accounting sees the compressed bytes; several dependent collectives per bucket are
issued and waited for on the engine's communication thread, never from a future's callback (the hook
contract's threading rule), which is why PowerSGD here runs on gloo with any number of buckets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pluggy

from ddp_plugin.codecs.base import BucketState, Codec
from ddp_plugin.codecs.cast import Bf16Codec, Fp16Codec
from ddp_plugin.codecs.int8 import Int8Codec, dequantize_int8, quantize_int8
from ddp_plugin.codecs.powersgd import PowerSGDCodec, matrix_segments, orthogonalize
from ddp_plugin.codecs.sparse import SparseCodec
from ddp_plugin.codecs.topk import TopKCodec
from ddp_plugin.hookspecs import PROJECT_NAME, hooks

__all__ = [
    "BUILTIN_CODECS", "Bf16Codec", "BucketState", "Codec", "Fp16Codec", "Int8Codec", "PowerSGDCodec", "SparseCodec",
    "TopKCodec",
    "available_codecs", "check_compression", "dequantize_int8", "implements", "installed_codecs", "installed_plugins",
    "matrix_segments",
    "orthogonalize", "quantize_int8",
]

BUILTIN_CODECS: dict[str, type[Codec]] = {
    codec.name: codec for codec in (Fp16Codec, Bf16Codec, Int8Codec, TopKCodec, PowerSGDCodec, SparseCodec)
}
"""``compression=`` name -> codec class, in the order the error messages list them."""


def implements(plugin: object, hook: str) -> bool:
    """Whether ``plugin`` (an object or module) has an implementation of ``hook`` marked with our hookimpl."""
    return hasattr(getattr(plugin, hook, None), f"{PROJECT_NAME}_impl")


def installed_plugins() -> dict[str, object]:
    """The plugins installed packages declare in the entry-point group ``ddp_plugin``, by entry-point name, loaded
    by pluggy as a fit's plugin manager loads them (``load_setuptools_entrypoints``) into a manager of their own."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hooks)
    pm.load_setuptools_entrypoints(PROJECT_NAME)
    return dict(pm.list_name_plugin())


def installed_codecs() -> list[str]:
    """Names of the codecs installed packages provide: plugins in the entry-point group ``ddp_plugin`` that
    implement ``on_cross_node_reduce``. The entry point's name is the value to pass as ``compression=``."""
    return sorted(name for name, plugin in installed_plugins().items() if implements(plugin, "on_cross_node_reduce"))


def available_codecs() -> list[str]:
    """Every valid ``compression=`` name: the built-in codecs, then the installed ones (a built-in name wins
    over an installed codec of the same name)."""
    return [*BUILTIN_CODECS, *(name for name in installed_codecs() if name not in BUILTIN_CODECS)]


def check_compression(compression: Any, options: Mapping[str, Any]) -> None:
    """Refuse a ``compression=`` name that no codec has, and bad options of a built-in codec (an installed codec
    checks its own options when it receives them in ``on_setup``)."""
    if compression is None:
        return
    if compression == "auto":
        check_auto_options(options)
        return
    if isinstance(compression, str) and compression in BUILTIN_CODECS:
        BUILTIN_CODECS[compression].check_options(options)
        return
    installed = [name for name in installed_codecs() if name not in BUILTIN_CODECS]
    if compression in installed:
        return
    # Installed codecs first: they are the ones a user most likely meant when a name is not built in.
    allowed = ", ".join(map(repr, [None, "auto", *installed, *BUILTIN_CODECS]))
    raise ValueError(
        f"`compression={compression!r}` is not an available codec; allowed values: {allowed} (built-in:"
        f" {', '.join(BUILTIN_CODECS)}; installed: {', '.join(installed) or 'none'}). More codecs come from"
        " installed packages that declare an entry point in the group `ddp_plugin`."
    )


def check_auto_options(options: Mapping[str, Any]) -> None:
    """``compression="auto"``'s options: ``candidates`` (codec names, ``None`` for no codec; default ``[None,
    "int8"]``) and, keyed by a candidate's name, that codec's own options."""
    from ddp_plugin.gradients.planning import DEFAULT_CANDIDATES

    candidates = options.get("candidates", list(DEFAULT_CANDIDATES))
    names = available_codecs()
    if (isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__")
            or not list(candidates) or any(c is not None and c not in names for c in candidates)):
        allowed = ", ".join(map(repr, [None, *names]))
        raise ValueError(
            f"`compression_options['candidates']={candidates!r}` is not valid for `compression='auto'`; allowed"
            f" values: a non-empty list of {allowed} (None: no codec)."
        )
    listed = {c for c in candidates if c is not None}
    for key, value in options.items():
        if key == "candidates":
            continue
        if key not in listed:
            raise ValueError(
                f"`compression_options[{key!r}]` is not valid for `compression='auto'`; allowed keys: 'candidates'"
                f" and the name of a listed candidate ({', '.join(map(repr, sorted(listed))) or 'none listed'})"
                " whose options it holds."
            )
        if not isinstance(value, Mapping):
            raise ValueError(
                f"`compression_options[{key!r}]={value!r}` is not valid for `compression='auto'`; allowed values: a"
                f" mapping of the {key!r} codec's options."
            )
        if key in BUILTIN_CODECS:
            BUILTIN_CODECS[key].check_options(value)
