"""Pydantic models for the OpenAI-compatible API (requests validated with bounds; unknown fields ignored,
as other OpenAI-compatible servers do, so newer clients keep working)."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 64
MAX_STOP = 16


class _Base(BaseModel):
    # strict: "8", true or "yes" are not numbers or booleans (no coercion; an int is still a valid float)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Base):
    include_usage: bool = False


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions (standard + our extra-body ones)."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extra body (SGLang-compatible).
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: Union[str, dict, None] = None
    ebnf: str | None = None
    rid: str | None = None
    session_id: str | None = None  # the program / session: its KV stays pinned between its calls


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: score the prompt only (with echo and logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_where_openai_requires_it(self):
        # Only an assistant message may leave it out (it may carry tool_calls instead), as in OpenAI's API.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None  # each checked by tool_calls.validate_tools (clear 400s, not pydantic's)
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    separate_reasoning: bool = True  # with --reasoning-parser: reasoning_content apart (False: all in content)
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class EmbeddingRequest(_Base):
    """/v1/embeddings: one input or a batch (strings, or token ids), as OpenAI's API takes them."""

    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's hidden size: a causal LM's embedding cannot be shortened
    user: str | None = None


class GenerateRequest(_Base):
    """Native /generate (SGLang's shape)."""

    model_config = ConfigDict(extra="forbid")

    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict, list[dict], None] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int], None] = None
    top_logprobs_num: Union[int, list[int], None] = None
    return_text_in_logprobs: bool = False
    image_data: Any = None
    rid: Union[str, list[str], None] = None
    extra_key: str | None = None
    session_id: str | None = None  # the program / session: its KV stays pinned between its calls
    # Fields sglang-router puts into every /generate it forwards (its request type's defaults): accepted;
    # the features behind the last four must stay off (checked in the handler).
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    background: bool = False
    return_hidden_states: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
