"""Model constructors: ``models.SGLang(engine)`` (in-process) or ``models.SGLang(base_url=...)`` (our server)."""

from __future__ import annotations

from typing import Any

from sglang_backend.lang.backends.base import BaseBackend
from sglang_backend.lang.backends.engine import EngineBackend
from sglang_backend.lang.backends.runtime_endpoint import RuntimeEndpoint

from ._core import Model


def SGLang(engine: Any = None, *, base_url: str | None = None, api_key: str | None = None,
           model_path: str | None = None, chat_template: str | None = None, echo: bool = False,
           **engine_kwargs: Any) -> Model:
    """A guidance-style model over sglang_backend.

    ``engine``: an ``sglang_backend.Engine`` or a DSL backend (``EngineBackend``/``RuntimeEndpoint``);
    ``base_url``: our server; neither: a new in-process Engine for ``model_path`` (None = embedded SmolLM2).
    """
    if isinstance(engine, BaseBackend):
        backend = engine
    elif base_url is not None:
        backend = RuntimeEndpoint(base_url, api_key=api_key, chat_template=chat_template)
    else:
        if engine is None:
            from sglang_backend import Engine  # deferred: the Engine imports torch; only this case needs it

            engine = Engine(model_path=model_path, **engine_kwargs)
        backend = EngineBackend(engine, chat_template=chat_template)
    return Model(backend, echo=echo)


Engine = SGLang  # alias
