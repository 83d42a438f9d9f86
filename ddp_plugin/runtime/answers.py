"""What several plugins answer one hook with, put together (the hook contract's collecting hooks return a list)."""

from __future__ import annotations

from typing import Any


def merged_answers(parts: list[dict[str, Any] | None], what: str) -> dict[str, Any]:
    """The dicts several plugins answered one hook with, merged; a key two plugins used is refused (``what`` they
    answered, for the message)."""
    merged: dict[str, Any] = {}
    for part in parts:
        if not part:
            continue
        clash = merged.keys() & part.keys()
        if clash:
            raise RuntimeError(f"Two plugins {what} under the same key(s) {sorted(clash)}; keys must be unique.")
        merged.update(part)
    return merged
