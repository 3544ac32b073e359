"""DSPy adapter for sglang_backend: ``dspy.configure(lm=SGLangLM())``.

``SGLangLM`` is a ``dspy.LM`` whose engine (DSPy 3.4's ``complete(Request) -> Response`` contract, with an
async twin) runs on the in-process Engine or on an ``sglang-backend serve`` server, and compiles DSPy calls
into the runtime's primitives: prefix hints for the system message + demos every call of a predictor
shares, ``n > 1`` as one fork of the prompt, and structured outputs / ChatAdapter sections as decoding
constraints (see ``lm.py`` and ``constraints.py``).
"""

from .lm import AsyncSGLangEngine, SGLangEngine, SGLangLM, hit_rate_from_history

__all__ = ["SGLangLM", "SGLangEngine", "AsyncSGLangEngine", "hit_rate_from_history"]
__version__ = "0.1.0"
