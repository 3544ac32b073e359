"""Pydantic models of Ollama's API requests (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/show), as
the ``ollama`` Python client sends them. Unknown fields are ignored, as Ollama's server does; ``stream`` defaults
to true, as in Ollama."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Base(BaseModel):
    # strict: "8", true or "yes" are not numbers or booleans (no coercion; an int is still a valid float)
    model_config = ConfigDict(extra="ignore", strict=True)


class OllamaMessage(_Base):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict] | None = None  # [{"function": {"name": ..., "arguments": {...}}}] (an "id" too, optional)
    tool_name: str | None = None  # a tool message: the tool that answered
    tool_call_id: str | None = None  # a tool message: the call it answers (langchain-ollama sends it)
    thinking: str | None = None


class _GenerationFields(_Base):
    """What /api/chat and /api/generate share."""

    model: str = ""
    stream: bool = True
    format: Union[str, dict, None] = None  # "json", or a JSON schema the output must match
    options: dict[str, Any] | None = None  # temperature, num_predict, stop, seed, top_k, top_p, ...; others ignored
    keep_alive: Union[float, int, str, None] = None  # ignored: the one model stays loaded
    think: Union[bool, str, None] = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaChatRequest(_GenerationFields):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Any] | None = None  # OpenAI-shaped function tools, each checked by tool_calls.validate_tools


class OllamaGenerateRequest(_GenerationFields):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None  # the ``context`` of an earlier reply: the conversation so far, as token ids
    raw: bool = False
    images: list[str] | None = None


class OllamaEmbedRequest(_Base):
    model: str = ""
    input: Union[str, list[str]] = ""
    truncate: bool = True  # cut inputs to the context length (false: too long is an error)
    options: dict[str, Any] | None = None
    keep_alive: Union[float, int, str, None] = None
    dimensions: int | None = None


class OllamaEmbeddingsRequest(_Base):
    """The legacy /api/embeddings."""

    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: Union[float, int, str, None] = None


class OllamaShowRequest(_Base):
    model: str = ""
    name: str | None = None  # older clients' name for ``model``
    verbose: bool | None = None
