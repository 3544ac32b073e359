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
    model_name: str  # the name clients see (--served-model-name, else the model path)

    @classmethod
    def build(cls, tm: TokenizerManager, server_args) -> AppContext:
        prep = PreparationPool(server_args.prepare_workers or default_workers(), tm.check_room,
                               server_args.request_timeout)
        return cls(tm=tm, server_args=server_args, metrics=ServerMetrics(), prep=prep,
                   model_name=served_model_name(server_args))

    def model_known(self, name: str | None) -> bool:
        """Whether a request's ``model`` names this server's model (or none, or "default")."""
        return not name or name in (self.model_name, "default") or name == self.server_args.model_path


def served_model_name(server_args) -> str:
    return server_args.served_model_name or (server_args.model_path or DEFAULT_MODEL_NAME)


def get_context(request: Request) -> AppContext:
    return request.app.state.ctx
