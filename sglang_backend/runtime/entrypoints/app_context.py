"""The state every route of one app shares, in one explicit object on ``app.state.ctx``."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from ..managers.tokenizer_manager import TokenizerManager
from .metrics import ServerMetrics
from .preparation import PreparationPool, default_workers

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class AppContext:
    tm: TokenizerManager
    server_args: object
    metrics: ServerMetrics
    prep: PreparationPool  # tokenizing, chat templates, images and grammars: off the event loop (preparation.py)
    model_name: str  # the name clients see (--served-model-name's first name, else the model path)
    # Every name /v1/models lists (--served-model-name's aliases). Requests may name any model: the server
    # answers with its one model, as upstream SGLang does, so clients configured for another name still work.
    model_aliases: tuple[str, ...] = ()

    @classmethod
    def build(cls, tm: TokenizerManager, server_args) -> AppContext:
        prep = PreparationPool(server_args.prepare_workers or default_workers(), tm.check_room,
                               server_args.request_timeout)
        names = served_model_names(server_args)
        return cls(tm=tm, server_args=server_args, metrics=ServerMetrics(), prep=prep, model_name=names[0],
                   model_aliases=tuple(names[1:]))

    @property
    def model_names(self) -> list[str]:
        return [self.model_name, *self.model_aliases]

    def response_model(self, requested: str | None) -> str:
        """The ``model`` a response reports: the name the request used (any name is served), else ours."""
        return requested or self.model_name


def served_model_names(server_args) -> list[str]:
    """--served-model-name split at commas (the first is the main name), else the model path."""
    names = [n.strip() for n in (server_args.served_model_name or "").split(",") if n.strip()]
    return names or [server_args.model_path or DEFAULT_MODEL_NAME]


def served_model_name(server_args) -> str:
    return served_model_names(server_args)[0]


def get_context(request: Request) -> AppContext:
    return request.app.state.ctx
