"""Server-side chat templates: which template runs, and rendering it within a time limit.

Only the model's own template, or one the operator gives at start-up (``--chat-template``, applied by
``model_loader.loader.load_model_assets``), ever runs: a template is code, so requests set template variables
(``chat_template_kwargs``) but never the template itself. transformers
renders it in Jinja's ``ImmutableSandboxedEnvironment`` (no attribute writes, no unsafe calls, ``range`` capped at
100,000 items); on top of that every render here has a time limit (``--chat-template-timeout``), because nested
loops within those caps still run for hours.
"""

from __future__ import annotations

from ...utils import TimeLimitExceeded, time_limit


class TemplateTooSlow(ValueError):
    pass


def render_chat(tokenizer, messages: list[dict], timeout_s: float, **kwargs) -> str:
    """The prompt text for ``messages`` (``apply_chat_template(tokenize=False)``). Raises ``TemplateTooSlow`` when
    rendering takes longer than ``timeout_s``; the template's own errors (messages that do not fit it) pass."""
    try:
        with time_limit(timeout_s):
            return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TimeLimitExceeded:
        raise TemplateTooSlow(f"rendering the chat template took longer than {timeout_s:g}s "
                              f"(--chat-template-timeout)") from None
