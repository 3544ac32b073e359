"""Alias of upstream's older ``sglang.backend.base_backend`` (today ``sglang.lang.backend.base_backend``)."""

from ..lang.backend.base_backend import BaseBackend

__all__ = ["BaseBackend"]
