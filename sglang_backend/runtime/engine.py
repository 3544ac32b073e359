"""In-process engine: ``Engine(model_path=...).generate(...)``.

A background thread owns the scheduler and steps it while there is work; callers on any thread (or an
asyncio loop) submit requests and wait on their own handle. Validation happens in the caller's thread, so a
bad request raises there and never reaches the loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from ..utils import iterate_in_thread
from .managers.chat_templates import render_chat
from .managers.detokenizer_manager import Detokenizer
from .managers.io_struct import PoolingParams, StrOut
from .managers.request_frontend import (RequestFrontend, RequestState, embedding_result, expand_samples,
                                        format_logprobs)
from .managers.scheduler import PoolNotWholeError, Scheduler
from .managers.scheduler_output import OutputCollector
from .managers.validation import check_session_id
from .model_loader.loader import load_model_assets
from .multimodal.processor import MultimodalProcessor
from .server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class _Request(RequestState):
    """One request's state; its ``queue`` is the caller's mailbox: the loop puts events, the caller takes them."""

    return_text_in_logprobs: bool = False


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        # A library leaves logging to the application (no handlers, root logger untouched); an explicit
        # log_level sets the level of this package's logger only.
        if isinstance(kwargs.get("log_level"), str):
            logging.getLogger("sglang_backend").setLevel(kwargs["log_level"].upper())
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.model_dir, self.config, self.tokenizer = load_model_assets(self.server_args)
        self.scheduler = Scheduler(self.server_args, self.config, self.model_dir, self.tokenizer)
        self.context_len = self.scheduler.context_len
        self.limits = self.scheduler.limits
        # In-process callers own their files, so local image paths are allowed here (unlike the server).
        self.mm_processor = MultimodalProcessor.for_model(self.config, self.model_dir, self.tokenizer, True)
        # The server's front-end pieces, driven in-process: validation, the scheduler's per-step output deltas,
        # detokenization, and each request's accumulated state.
        self.frontend = RequestFrontend(self.tokenizer, self.limits, self.mm_processor,
                                        lambda: self.scheduler.grammar_cache)
        self.outputs = OutputCollector()
        self.detokenizer = Detokenizer(self.tokenizer)
        self._handles: dict[str, _Request] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="sglang-backend-scheduler", daemon=True)
        self._thread.start()

    # Public API -----------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        extra_key: Any = None,
        image_data: Any = None,
        session_id: str | None = None,
    ):
        """Generates for one prompt (returns a dict) or a list of prompts (returns a list of dicts).

        With ``stream=True`` (single prompt) returns an iterator of dicts whose ``text`` is the new piece.
        ``image_data`` (multimodal models): per prompt an image or a list of images (path, base64, data URL,
        bytes or PIL image), one per image placeholder in the prompt; for a batch, a list with one entry
        per prompt. ``session_id``: the program or session these calls belong to; when one finishes, its KV
        stays pinned for the session's next call (``ServerArgs.session_ttl``; ``end_session`` releases it).
        """
        handles, is_batch = self._submit(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                         top_logprobs_num, rid, extra_key, stream, return_text_in_logprobs,
                                         image_data, session_id=session_id)
        if stream:
            if is_batch:
                raise ValueError("stream=True takes a single prompt")
            return self._stream(handles[0])
        results = [self._wait(h) for h in handles]
        return results if is_batch else results[0]

    def encode(self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
               pooling: str | None = None, normalize: bool = True) -> dict | list[dict]:
        """Embeds one prompt (returns a dict) or a list of prompts (a list of dicts, one per prompt, batched by the
        scheduler): {"embedding": [floats], "meta_info": {"prompt_tokens", ...}}. The embedding pools the model's
        final hidden states (after the final norm) over the prompt: ``pooling`` "last" (the last token's state)
        or "mean" (default: ``--embedding-pooling``), normalized to unit length unless ``normalize=False``."""
        spec = PoolingParams(pooling or self.server_args.embedding_pooling, normalize)
        handles, is_batch = self._submit(prompt, None, input_ids, False, None, 0, None, None, False, False,
                                         pooling=spec)
        results = [embedding_result(self._wait(h)) for h in handles]
        return results if is_batch else results[0]

    async def async_encode(self, prompt=None, input_ids=None, **kwargs):
        """Async twin of ``encode``."""
        return await asyncio.to_thread(self.encode, prompt, input_ids, **kwargs)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, **kwargs):
        """Async twin of ``generate``; with ``stream=True`` returns an async iterator."""
        if stream:
            return self._astream(prompt, sampling_params, input_ids, **kwargs)
        return await asyncio.to_thread(self.generate, prompt, sampling_params, input_ids, **kwargs)

    def _astream(self, prompt, sampling_params, input_ids, **kwargs):
        return iterate_in_thread(self.generate(prompt, sampling_params, input_ids, stream=True, **kwargs))

    def abort_request(self, rid: str) -> None:
        self._post("control", ("abort", rid, None))

    def flush_cache(self) -> bool:
        return self._control("flush_cache")

    def end_session(self, session_id: str) -> bool:
        """The program / session is over: its pinned KV becomes evictable now. False if it held no pin."""
        check_session_id(session_id)
        return self._control("end_session", session_id)

    def get_stats(self) -> dict:
        return self._control("get_stats")

    def check_pool_whole(self) -> None:
        """Raises PoolNotWholeError unless the engine is idle with every KV slot free or evictable."""
        problem = self._control("check_pool")
        if problem is not None:
            raise PoolNotWholeError(problem)

    def _control(self, kind: str, payload=None):
        """A control command, run by the loop thread between steps (``Scheduler.handle_control``)."""
        reply: queue.Queue = queue.Queue()
        self._post("control", (kind, payload, reply))
        return reply.get()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt for ``messages``, rendered as the server renders it (the same template, the same time limit)."""
        return render_chat(self.tokenizer, messages, self.server_args.chat_template_timeout,
                           add_generation_prompt=add_generation_prompt, **kwargs)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.scheduler.model_runner.shutdown()  # tensor parallelism: stops the other ranks

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    # Submission -------------------------------------------------------------------------------------------------
    def _submit(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
                rid, extra_key, stream, return_text_in_logprobs, image_data=None, pooling=None, session_id=None):
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        items, is_batch = self._prompts(prompt, input_ids)
        n = len(items)

        def per_item(value, name):
            if isinstance(value, list):
                if len(value) != n:
                    raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
                return value
            return [value] * n

        rids = per_item(rid, "rid") if rid is not None else [None] * n
        images = per_item(image_data, "image_data") if is_batch else [image_data]
        # sampling_params n (parallel sampling): n samples of each prompt, grouped per prompt; the result is a list.
        n_samples, params, (items, flags, starts, tops, images) = expand_samples(
            per_item(sampling_params, "sampling_params"), items, per_item(return_logprob, "return_logprob"),
            per_item(logprob_start_len, "logprob_start_len"), per_item(top_logprobs_num, "top_logprobs_num"), images)
        if n_samples > 1:
            if stream:
                raise ValueError("stream=True takes a single sample (n=1)")
            rids = [None if r is None else f"{r}-{i}" for r in rids for i in range(n_samples)]
            is_batch = True
        parsed: dict = {}  # one SamplingParams per distinct params dict of the batch
        gis = [self.frontend.prepare(r or uuid.uuid4().hex, text=item if isinstance(item, str) else None,
                                     input_ids=None if isinstance(item, str) else item, sampling_params=sp,
                                     stream=stream, return_logprob=bool(lp), logprob_start_len=start,
                                     top_logprobs_num=top, extra_key=extra_key, image_data=im, pooling=pooling,
                                     session_id=session_id, parsed=parsed)
               for item, sp, lp, start, top, r, im in zip(items, params, flags, starts, tops, rids, images)]
        handles = [_Request(gi.rid, queue.Queue(), stream, return_text_in_logprobs=return_text_in_logprobs)
                   for gi in gis]
        with self._cond:
            for h in handles:
                if h.rid in self._handles:
                    raise ValueError(f"duplicate request id {h.rid!r}")
                self._handles[h.rid] = h
            self._inbox += [("add", gi.tokenized()) for gi in gis]
            self._cond.notify_all()
        return handles, is_batch

    @staticmethod
    def _prompts(prompt, input_ids) -> tuple[list, bool]:
        """The prompts (strings or token id lists) and whether the call is a batch."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            prompts = prompt if is_batch else [prompt]
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            return prompts, is_batch
        is_batch = bool(input_ids) and isinstance(input_ids[0], list)
        ids_list = input_ids if is_batch else [input_ids]
        # Each prompt's ids are checked one by one when it is prepared (check_input_ids): here only the shape.
        if not all(hasattr(ids, "__iter__") and not isinstance(ids, (str, bytes)) for ids in ids_list):
            raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        return ids_list, is_batch

    def _post(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._inbox.append((kind, payload))
            self._cond.notify_all()

    # Results ----------------------------------------------------------------------------------------------------
    def _wait(self, h: _Request) -> dict:
        while True:
            kind, payload = h.queue.get()
            if kind == "error":
                raise payload
            if kind == "done":
                return payload

    def _stream(self, h: _Request) -> Iterator[dict]:
        done = False
        try:
            while True:
                kind, payload = h.queue.get()
                if kind == "error":
                    done = True
                    raise payload
                done = kind == "done"
                yield payload
                if done:
                    return
        finally:
            if not done:  # the consumer stopped early (closed the iterator): the request stops too, its KV freed
                self.abort_request(h.rid)

    def _deliver(self, msg: StrOut) -> None:
        h = self._handles.get(msg.rid)
        if h is None:
            return
        finished = msg.finished_reason is not None
        h.merge(msg)
        result = h.result(msg.text if h.stream else h.text, msg.finished_reason)
        format_logprobs(result["meta_info"], self.tokenizer, h.return_text_in_logprobs)
        if finished:
            self._handles.pop(msg.rid, None)
        h.queue.put(("done" if finished else "chunk", result))

    # The loop ---------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            with self._cond:
                while not self._inbox and not sched.has_work() and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
            try:
                for kind, payload in inbox:
                    self._handle_message(kind, payload)
                batch = self.outputs.collect(sched.run_iteration())
                if batch is not None:
                    for out in self.detokenizer.batch(batch).outputs:
                        self._deliver(out)
            except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
                logger.exception("scheduler loop failed")
                self._error = e
                for h in list(self._handles.values()):
                    h.queue.put(("error", RuntimeError(f"engine loop failed: {e!r}")))
                self._handles.clear()
                return

    def _handle_message(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self.scheduler.add_tokenized(payload)
        elif kind == "control":
            command, arg, reply = payload
            result = self.scheduler.handle_control(command, arg)
            if reply is not None:
                reply.put(result)
