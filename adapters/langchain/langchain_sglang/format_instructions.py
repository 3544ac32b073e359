"""An output parser downstream of the model, compiled into its generation constraint (no user code changes).

A chain such as ``prompt | ChatSGLang() | PydanticOutputParser(pydantic_object=Joke)`` puts the parser's
``get_format_instructions()`` into the prompt. The model never sees the parser object, but it sees that text,
which ends with the JSON schema in a code block (``PydanticOutputParser``, and ``JsonOutputParser`` given a
pydantic model), or is "Return a JSON object." (``JsonOutputParser()`` without one). ``schema_in_format_instructions``
finds it, so decoding is constrained to the schema (any JSON object for the latter) and the parser always parses,
as if the chain had used ``with_structured_output``.

Only the system turns and the last human turn are read: a format asked for earlier in a conversation is not
imposed on a later free-text answer."""

from __future__ import annotations

import json
import re
from typing import Sequence

from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage

# langchain-core's JSON format instructions: the lead sentence, then (after an example) the schema in a fence.
_SCHEMA_BLOCK = re.compile(
    r"The output should be formatted as a JSON instance that conforms to the JSON schema below\."
    r".*?Here is the output schema[^\n]*:\n```\n(.*?)\n```", re.S)
_ANY_OBJECT = "Return a JSON object."  # JsonOutputParser().get_format_instructions()


def schema_in_format_instructions(messages: Sequence[BaseMessage], text_of) -> dict | None:
    """The JSON schema of the last LangChain format instructions in the system turns or the last human turn
    (``text_of``: a message content's text), or None."""
    humans = [m for m in messages if isinstance(m, HumanMessage)]
    turns = [m for m in messages if isinstance(m, SystemMessage)] + humans[-1:]
    for message in reversed(turns):
        text = text_of(message.content)
        found = _SCHEMA_BLOCK.findall(text)
        if found:
            return _object_schema(found[-1])
        if _ANY_OBJECT in text:
            return {"type": "object"}
    return None


def _object_schema(text: str) -> dict | None:
    """The fenced schema; langchain drops a pydantic schema's top-level ``title`` and ``type``, so an object's
    ``type`` is put back. None for text that is not a JSON schema object (never a constraint then)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return None
    if not isinstance(schema, dict) or not schema:
        return None
    if "properties" in schema and "type" not in schema:
        schema = {"type": "object", **schema}
    return schema
