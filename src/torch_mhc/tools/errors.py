"""The error a command raises for bad input: the `mhc` command prints it as one line,
`mhc <command>: error: <message>`, and exits with status 2."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input found by a command; the message says what was expected and what came."""
