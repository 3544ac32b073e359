"""Alias of upstream's ``sglang.lang.backend.runtime_endpoint``."""

from ..backends.runtime_endpoint import Runtime, RuntimeEndpoint

__all__ = ["Runtime", "RuntimeEndpoint"]
