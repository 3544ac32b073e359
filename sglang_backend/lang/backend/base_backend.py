"""Alias of upstream's ``sglang.lang.backend.base_backend``."""

from ..backends.base import BaseBackend

__all__ = ["BaseBackend"]
