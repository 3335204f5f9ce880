"""Warnings said once per process, whoever says them.

mc2 says some things once rather than at every call: batch overlap turned off for a reason, a
shared MLP run beside the call because an adapter sits on it. Every such warning goes through
:func:`warn_once`, so the process keeps one table of what it has said (by category and text)
instead of one per saying module.
"""

from __future__ import annotations

import warnings

_SAID: set[tuple[type, str]] = set()


def warn_once(message: str, category: type[Warning], stacklevel: int = 2) -> None:
    """``warnings.warn(message, category)`` the first time this text of this category is
    said in this process (``stacklevel``: as ``warnings.warn``'s, counted from the caller)."""
    key = (category, message)
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def forget() -> None:
    """Say everything again (tests that check a warning is said)."""
    _SAID.clear()
