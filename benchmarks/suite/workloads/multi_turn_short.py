"""Multi-turn chat, 4 turns, short answers (paper: 256-512 token user turns, 4-8 token answers)."""

from .multi_turn_chat import HF, REUSE, instances, program  # noqa: F401

NAME = "multi_turn_short"
DESCRIPTION = "chat, 4 turns, short outputs (4-8 tokens)"
SIZES = {
    "smoke": dict(n=3, turns=4, user_tokens=(10, 20), output_tokens=(4, 8)),
    "cpu": dict(n=6, turns=4, user_tokens=(48, 96), output_tokens=(4, 8)),
    "gpu": dict(n=48, turns=4, user_tokens=(256, 512), output_tokens=(4, 8)),
}
