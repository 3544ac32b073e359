"""Alias of upstream's ``sglang.srt.constrained.outlines_backend``: ``build_regex_from_object`` is
sglang_backend.runtime.constrained.json_schema.build_regex_from_schema under upstream's name and argument names."""

from __future__ import annotations

from ...runtime.constrained.json_schema import WHITESPACE_DEFAULT, build_regex_from_schema


def build_regex_from_object(object, whitespace_pattern: str | None = None) -> str:  # noqa: A002 - upstream's name
    """Regex of the JSON documents valid under ``object``: a pydantic model class, a schema dict or a JSON
    string. ``whitespace_pattern`` None: the default whitespace between tokens."""
    return build_regex_from_schema(object, whitespace_pattern or WHITESPACE_DEFAULT)
