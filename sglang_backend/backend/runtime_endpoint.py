"""Alias of upstream's older ``sglang.backend.runtime_endpoint`` (today ``sglang.lang.backend.runtime_endpoint``)."""

from ..lang.backend.runtime_endpoint import Runtime, RuntimeEndpoint

__all__ = ["Runtime", "RuntimeEndpoint"]
