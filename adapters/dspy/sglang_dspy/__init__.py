"""DSPy adapter for sglang_backend: ``dspy.configure(lm=SGLangLM())``.

``SGLangLM`` is a ``dspy.BaseLM`` that compiles DSPy calls into the runtime's primitives:

* the messages every call of a predictor shares (system instructions + few-shot demos) are sent first as a
  prefix hint (``max_new_tokens=0``), once per distinct prefix, so the radix cache holds them before the
  real calls arrive (concurrent calls wait for the one hint in flight instead of all prefilling it);
* ``n > 1`` becomes one shared-prefix batch: the whole prompt is hinted once, then ``n`` branches decode;
* ``response_format`` (JSONAdapter's Pydantic schema or ``json_object``) becomes a ``json_schema``
  constraint, so the output always parses.
"""

from .lm import SGLangLM, hit_rate_from_history

__all__ = ["SGLangLM", "hit_rate_from_history"]
__version__ = "0.1.0"
