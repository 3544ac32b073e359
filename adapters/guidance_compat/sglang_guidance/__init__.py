"""A guidance-compatible layer on sglang_backend.

    from sglang_guidance import models, gen, select, json, user, assistant, guidance

    lm = models.SGLang(engine)              # immutable: lm + x forks
    with user():
        lm += "What is the capital of France?"
    with assistant():
        lm += "The capital is " + gen("city", stop=".", max_tokens=8)
    lm["city"]
"""

from . import models
from ._core import (
    Model,
    Node,
    assistant,
    end_role,
    gen,
    guidance,
    json,
    role,
    select,
    system,
    user,
)

__all__ = ["Model", "Node", "assistant", "end_role", "gen", "guidance", "json", "models", "role", "select",
           "system", "user"]
