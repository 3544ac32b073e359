"""LangChain integration for sglang_backend: ``ChatSGLang`` over the in-process Engine or our server."""

from .chat_models import ChatSGLang, get_engine, register_engine, unregister_engine

__all__ = ["ChatSGLang", "get_engine", "register_engine", "unregister_engine"]
