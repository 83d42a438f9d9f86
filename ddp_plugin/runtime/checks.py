"""Validation of user-given values, one helper per kind of value, used for every flag: the strategy's
(:mod:`ddp_plugin.strategy.config`), the codecs' ``compression_options`` and the DeepSpeed config mapping.

Every error names the flag, the value and what is allowed, in one of two forms:

- ``\\`bucket_size_mb=0\\` must be a positive number, finite and at most 1048576 MiB (1 TiB).``
- with a ``context`` (an option of something else): ``\\`compression_options['rank']=0\\` is not valid for
  \\`compression='powersgd'\\`; allowed values: a positive integer.``

``bool`` is never taken for a number (``True`` is an ``int`` to Python), and numbers must be finite. Pure: no
torch, so the checks run at construction time, before anything distributed exists.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def invalid(flag: str, value: Any, expected: str, context: str | None = None) -> ValueError:
    """The error for ``flag=value``: it ``must be {expected}`` (or, with ``context``, is not valid there)."""
    if context is not None:
        return ValueError(f"`{flag}={value!r}` is not valid for {context}; allowed values: {expected}.")
    return ValueError(f"`{flag}={value!r}` must be {expected}.")


def check_choice(flag: str, value: Any, allowed: Iterable[Any]) -> Any:
    """``value`` if it is one of ``allowed`` (compared with ``==``, so ``1`` is not ``True``'s stand-in for
    choices of strings)."""
    allowed = tuple(allowed)
    if isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed) or value not in allowed:
        raise ValueError(f"`{flag}={value!r}` is not supported; allowed values: {', '.join(map(repr, allowed))}.")
    return value


def check_bool(flag: str, value: Any, none: bool = False, context: str | None = None, spelled: str = "True, False"
               ) -> bool | None:
    """A real ``bool`` (``bool("no")`` is True: strings and numbers are refused); ``None`` too with ``none``."""
    if value is None and none:
        return None
    if not isinstance(value, bool):
        allowed = f"None, {spelled}" if none else spelled
        if context is not None:
            raise invalid(flag, value, allowed, context)
        raise ValueError(f"`{flag}={value!r}` must be a {'bool' if spelled == 'True, False' else 'boolean'};"
                         f" allowed values: {allowed}.")
    return value


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_int(flag: str, value: Any, minimum: int | None = None, maximum: int | None = None,
              expected: str | None = None, context: str | None = None) -> int:
    """An ``int`` (not a ``bool``, not ``2.0``) within ``[minimum, maximum]``."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        if expected is None:
            expected = {0: "an integer >= 0", 1: "a positive integer"}.get(minimum, "an integer")  # type: ignore[arg-type]
        raise invalid(flag, value, expected, context)
    return value


def check_number(flag: str, value: Any, minimum: float = -math.inf, maximum: float = math.inf,
                 strict: bool = True, expected: str = "a number", context: str | None = None) -> float:
    """A finite ``int``/``float`` (not a ``bool``) above ``minimum`` (or equal to it, unless ``strict``) and at
    most ``maximum``. ``not value > minimum`` also refuses NaN."""
    ok = is_number(value) and math.isfinite(value) and value <= maximum
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        raise invalid(flag, value, expected, context)
    return value


def check_positive_number(flag: str, value: Any, maximum: float | None = None, unit: str = "") -> float:
    """A finite number > 0 (and at most ``maximum``, written with ``unit``)."""
    limit = f" and at most {maximum}{unit}" if maximum is not None else ""
    return check_number(flag, value, minimum=0, maximum=math.inf if maximum is None else maximum,
                        expected=f"a positive number, finite{limit}")


def check_mapping(flag: str, value: Any) -> dict[str, Any]:
    """A ``dict`` of names to values (``None`` is an empty one), copied."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"`{flag}` must be a dict of option names to values, got {type(value).__name__}.")
    return dict(value)


def check_options(owner: str, options: Mapping[str, Any], accepted: Iterable[str], flag: str = "compression_options"
                  ) -> None:
    """Refuse option names that ``owner`` (e.g. "`compression='int8'`") does not accept."""
    accepted = tuple(accepted)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        names = ", ".join(repr(k) for k in accepted) or "none"
        raise ValueError(f"`{flag}[{unknown[0]!r}]` is not an option of {owner}; accepted options: {names}.")
