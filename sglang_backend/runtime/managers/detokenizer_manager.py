"""Incremental, UTF-8-safe detokenization with stop-string trimming.

Text is always the decode of all output ids so far (so streamed pieces concatenate to exactly the final
text). A piece is held back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD) or in what
could still become a stop string, so a client never sees text that is later retracted.
"""

from __future__ import annotations

import logging
import os

import zmq

from ...utils import die_with_parent
from ..model_loader.loader import load_tokenizer
from .io_struct import BatchStrOut, BatchTokenOut, ControlOut, StrOut, TokenOut

logger = logging.getLogger(__name__)


def trim_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cuts ``text`` at the earliest occurrence of any stop string. Returns (text, found)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def partial_stop_suffix_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class DetokenizerState:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: list[str] | None = None, no_stop_trim: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.no_stop_trim = no_stop_trim
        self.sent = ""  # text already handed out

    def decode(self, ids: list[int]) -> str:
        kwargs = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        return self.tokenizer.decode(ids, **kwargs)

    def full_text(self, ids: list[int]) -> str:
        text = self.decode(ids)
        if self.stop and not self.no_stop_trim:
            text, _ = trim_stop(text, self.stop)
        return text

    def step(self, ids: list[int], finished: bool) -> str:
        """The new piece of text to hand out after ``ids`` (all output ids so far)."""
        text = self.full_text(ids)
        if not finished:
            if text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")
            if self.stop and not self.no_stop_trim:
                text = text[: len(text) - partial_stop_suffix_len(text, self.stop)]
        if not text.startswith(self.sent):
            return ""  # a tokenizer re-rendered earlier text (rare): never retract what was sent
        piece = text[len(self.sent):]
        self.sent = text
        return piece


class Detokenizer:
    """Token ids -> text, per request, from each step's ``BatchTokenOut``: the detokenizer process runs one, and so
    does the offline Engine (in its loop thread). Ids accumulate here; a stream gets its new piece of text, a
    finished request the full text. A request whose decoding fails is failed alone (a 500 abort)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, tuple[DetokenizerState, list[int]]] = {}
        self.failed: set[str] = set()  # requests failed here while the scheduler may still be running them

    def batch(self, batch: BatchTokenOut) -> BatchStrOut:
        return BatchStrOut([out for out in map(self.convert, batch.outputs) if out is not None])

    def convert(self, msg: TokenOut) -> StrOut | None:
        finished = msg.finished_reason is not None
        if msg.rid in self.failed:  # already answered with an error; drop the rest of its output
            if finished:
                self.failed.discard(msg.rid)
            return None
        try:
            if msg.rid not in self.states:
                self.states[msg.rid] = (DetokenizerState(self.tokenizer, **(msg.detok_options or {})), [])
            state, ids = self.states[msg.rid]
            if msg.keep_len is not None:
                del ids[msg.keep_len:]
            ids.extend(msg.new_ids)
            text = state.step(ids, finished) if msg.stream else state.full_text(ids)
        except Exception as e:  # noqa: BLE001 - one request's decoding problem fails that request only
            logger.exception("detokenizing request %s failed", msg.rid)
            self.states.pop(msg.rid, None)
            if not finished:
                self.failed.add(msg.rid)
            error = {"type": "abort", "message": f"detokenization failed ({type(e).__name__})", "status_code": 500}
            return StrOut(msg.rid, "", [], None, error, {})
        if finished:
            del self.states[msg.rid]
        return StrOut(msg.rid, text, msg.new_ids, msg.keep_len, msg.finished_reason, msg.meta)


def run_detokenizer_process(server_args, ipc: dict, tokenizer_path: str) -> None:
    """BatchTokenOut (token ids) from the scheduler -> BatchStrOut (text pieces) to the tokenizer manager."""
    die_with_parent()  # SIGKILL with the server process; SIGINT ignored (see utils.die_with_parent)
    logging.basicConfig(level=server_args.log_level.upper(), format="[detokenizer] %(levelname)s %(message)s")
    detokenizer = Detokenizer(load_tokenizer(tokenizer_path))
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(ipc["detokenizer_input"])
    send = ctx.socket(zmq.PUSH)
    send.connect(ipc["tokenizer_input"])
    parent = os.getppid()
    while True:
        if not recv.poll(1000):
            if os.getppid() != parent:
                return
            continue
        msg = recv.recv_pyobj()
        if isinstance(msg, ControlOut):
            send.send_pyobj(msg)
        elif isinstance(msg, BatchTokenOut):
            out = detokenizer.batch(msg)
            if out.outputs:
                send.send_pyobj(out)


def format_logprob_pairs(pairs, tokenizer, with_text: bool) -> list:
    """(logprob, token_id) pairs -> [logprob, token_id, token_text | None] as the native API returns them."""
    return [[lp, tid, tokenizer.decode([tid]) if with_text else None] for lp, tid in pairs]
