"""What an error says in one line."""

from __future__ import annotations


def first_line(error: BaseException | str) -> str:
    """The first non-empty line of an error's message (its type's name when it has none)."""
    text = str(error).strip()
    if text:
        return text.splitlines()[0]
    return type(error).__name__ if isinstance(error, BaseException) else ""
