"""Multi-turn chat, 4 turns, long answers (paper: 256-512 token user turns and answers)."""

from .multi_turn_chat import HF, REUSE, instances, program  # noqa: F401

NAME = "multi_turn_long"
DESCRIPTION = "chat, 4 turns, long outputs (256-512 tokens; scaled down on CPU)"
SIZES = {
    "smoke": dict(n=2, turns=4, user_tokens=(10, 20), output_tokens=(8, 12)),
    "cpu": dict(n=4, turns=4, user_tokens=(48, 96), output_tokens=(24, 48)),
    "gpu": dict(n=12, turns=4, user_tokens=(256, 512), output_tokens=(256, 512)),
}
