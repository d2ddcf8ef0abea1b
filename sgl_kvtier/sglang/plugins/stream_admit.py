"""Admission side of a streamed tail (issue #13): placeholder until built."""

from __future__ import annotations

from typing import Any

HOOKS: list[tuple[str, Any, str]] = []
