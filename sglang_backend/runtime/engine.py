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
import time
import uuid
from typing import Any, Iterator

from ..utils import iterate_in_thread
from .managers.detokenizer_manager import DetokenizerState, format_logprob_pairs
from .managers.schedule_batch import Req
from .managers.scheduler import PoolNotWholeError, Scheduler
from .managers.validation import (
    MAX_PROMPTS_PER_REQUEST,
    check_grammar,
    check_input_ids,
    check_logprob_args,
    check_total_length,
    parse_sampling_params,
)
from .model_loader.loader import load_model_assets
from .sampling_params import parallel_samples, sample_count
from .server_args import ServerArgs

logger = logging.getLogger(__name__)


class _Handle:
    """One request's mailbox: the loop puts events, the caller takes them."""

    def __init__(self, req: Req, detok: DetokenizerState):
        self.req = req
        self.detok = detok
        self.events: queue.Queue = queue.Queue()
        self.start = time.monotonic()


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
        from .multimodal.processor import MultimodalProcessor

        # In-process callers own their files, so local image paths are allowed here (unlike the server).
        self.mm_processor = MultimodalProcessor.for_model(self.config, self.model_dir, self.tokenizer, True)
        self._handles: dict[str, _Handle] = {}
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
    ):
        """Generates for one prompt (returns a dict) or a list of prompts (returns a list of dicts).

        With ``stream=True`` (single prompt) returns an iterator of dicts whose ``text`` is the new piece.
        ``image_data`` (multimodal models): per prompt an image or a list of images (path, base64, data URL,
        bytes or PIL image), one per image placeholder in the prompt; for a batch, a list with one entry
        per prompt.
        """
        handles, is_batch = self._submit(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                         top_logprobs_num, rid, extra_key, stream, return_text_in_logprobs,
                                         image_data)
        if stream:
            if is_batch:
                raise ValueError("stream=True takes a single prompt")
            return self._stream(handles[0])
        results = [self._wait(h) for h in handles]
        return results if is_batch else results[0]

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, **kwargs):
        """Async twin of ``generate``; with ``stream=True`` returns an async iterator."""
        if stream:
            return self._astream(prompt, sampling_params, input_ids, **kwargs)
        return await asyncio.to_thread(self.generate, prompt, sampling_params, input_ids, **kwargs)

    def _astream(self, prompt, sampling_params, input_ids, **kwargs):
        return iterate_in_thread(self.generate(prompt, sampling_params, input_ids, stream=True, **kwargs))

    def abort_request(self, rid: str) -> None:
        self._post("abort", rid)

    def flush_cache(self) -> bool:
        result: queue.Queue = queue.Queue()
        self._post("flush", result)
        return result.get()

    def get_stats(self) -> dict:
        result: queue.Queue = queue.Queue()
        self._post("stats", result)
        return result.get()

    def check_pool_whole(self) -> None:
        """Raises PoolNotWholeError unless the engine is idle with every KV slot free or evictable."""
        result: queue.Queue = queue.Queue()
        self._post("check", result)
        err = result.get()
        if err is not None:
            raise err

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

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
                rid, extra_key, stream, return_text_in_logprobs, image_data=None):
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            prompts = prompt if is_batch else [prompt]
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids_list = input_ids if is_batch else [input_ids]
            if not all(isinstance(t, int) for ids in ids_list for t in ids):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        n = len(ids_list)

        def per_item(value, name):
            if isinstance(value, list):
                if len(value) != n:
                    raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
                return value
            return [value] * n

        params = per_item(sampling_params, "sampling_params")
        logprob_flags = per_item(return_logprob, "return_logprob")
        starts = per_item(logprob_start_len, "logprob_start_len")
        tops = per_item(top_logprobs_num, "top_logprobs_num")
        rids = per_item(rid, "rid") if rid is not None else [None] * n
        images = per_item(image_data, "image_data") if is_batch else [image_data]
        # sampling_params n (parallel sampling): n samples of each prompt, grouped per prompt; the result is a list.
        counts = {sample_count(p) if p is None or isinstance(p, dict) else 1 for p in params} or {1}
        if len(counts) > 1:
            raise ValueError("sampling_params n must be the same for every prompt of a batch")
        n_samples = counts.pop()
        if n * n_samples > MAX_PROMPTS_PER_REQUEST:  # checked before a single copy is made
            raise ValueError(f"sampling_params n = {n_samples} for {n} prompt(s) asks for {n * n_samples} samples; "
                             f"at most {MAX_PROMPTS_PER_REQUEST} (prompts x n) per call")
        params = [c for p in params for c in (parallel_samples(p) if p is None or isinstance(p, dict) else [p])]
        if n_samples > 1:
            if stream:
                raise ValueError("stream=True takes a single sample (n=1)")
            ids_list, logprob_flags, starts, tops, images = ([v for v in vals for _ in range(n_samples)] for vals in
                                                             (ids_list, logprob_flags, starts, tops, images))
            rids = [None if r is None else f"{r}-{i}" for r in rids for i in range(n_samples)]
            is_batch = True
        if any(im is not None for im in images) and self.mm_processor is None:
            raise ValueError("image_data was given, but this model takes no images")

        reqs = []
        for ids, sp_dict, lp, start, top, r, im in zip(ids_list, params, logprob_flags, starts, tops, rids, images):
            sp = parse_sampling_params(sp_dict, self.limits, self.tokenizer)
            check_input_ids(ids, self.limits)
            mm = None
            if im is not None:
                ids, mm = self.mm_processor.expand(ids, im, self.limits.context_len, self.limits.max_total_num_tokens,
                                                   bool(lp), start)
            check_total_length(len(ids), sp_dict, sp, self.limits)
            check_grammar(sp, self.scheduler.grammar_cache)
            check_logprob_args(len(ids), start, top)
            req_start = start if start is not None else -1
            if lp and start is None:
                req_start = -1  # output logprobs only
            req = Req(r or uuid.uuid4().hex, ids, sp, bool(lp), req_start, int(top or 0), extra_key, stream, mm)
            reqs.append(req)
        handles = []
        for req in reqs:
            detok = DetokenizerState(self.tokenizer, req.sampling_params.skip_special_tokens,
                                     req.sampling_params.spaces_between_special_tokens,
                                     req.sampling_params.stop, req.sampling_params.no_stop_trim)
            h = _Handle(req, detok)
            h.return_text_in_logprobs = return_text_in_logprobs
            handles.append(h)
        with self._cond:
            for h in handles:
                if h.req.rid in self._handles:
                    raise ValueError(f"duplicate request id {h.req.rid!r}")
                self._handles[h.req.rid] = h
                self._inbox.append(("add", h.req))
            self._cond.notify_all()
        return handles, is_batch

    def _post(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._inbox.append((kind, payload))
            self._cond.notify_all()

    # Results ----------------------------------------------------------------------------------------------------
    def _wait(self, h: _Handle) -> dict:
        while True:
            kind, payload = h.events.get()
            if kind == "error":
                raise payload
            if kind == "done":
                return payload

    def _stream(self, h: _Handle) -> Iterator[dict]:
        while True:
            kind, payload = h.events.get()
            if kind == "error":
                raise payload
            yield payload
            if kind == "done":
                return

    def _result(self, h: _Handle, piece: str | None = None) -> dict:
        req = h.req
        finished = req.finished()
        text = h.detok.full_text(req.output_ids) if piece is None else piece
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finished_reason if finished else None,
            "e2e_latency": time.monotonic() - h.start,
        }
        if req.return_logprob:
            with_text = getattr(h, "return_text_in_logprobs", False)
            meta["input_token_logprobs"] = self._fmt(req.input_token_logprobs, with_text)
            meta["output_token_logprobs"] = self._fmt(req.output_token_logprobs, with_text)
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = [None if t is None else self._fmt(t, with_text) for t in req.input_top_logprobs]
                meta["output_top_logprobs"] = [self._fmt(t, with_text) for t in req.output_top_logprobs]
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    def _fmt(self, pairs, with_text: bool) -> list:
        return format_logprob_pairs(pairs, self.tokenizer, with_text)

    def _deliver(self, req: Req) -> None:
        h = self._handles.get(req.rid)
        if h is None:
            return
        if req.finished():
            self._handles.pop(req.rid, None)
            h.events.put(("done", self._result(h, h.detok.step(req.output_ids, True) if req.stream else None)))
        elif req.stream:
            piece = h.detok.step(req.output_ids, False)
            h.events.put(("chunk", self._result(h, piece)))

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
                if sched.has_work():
                    for req in sched.step():
                        self._deliver(req)
                    if not sched.has_work() and self.server_args.check_pool_on_idle:
                        sched.check_pool_whole()
            except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
                logger.exception("scheduler loop failed")
                self._error = e
                for h in list(self._handles.values()):
                    h.events.put(("error", RuntimeError(f"engine loop failed: {e!r}")))
                self._handles.clear()
                return

    def _handle_message(self, kind: str, payload: Any) -> None:
        sched = self.scheduler
        if kind == "add":
            sched.add_request(payload)
        elif kind == "abort":
            req = sched.abort_request(payload)
            if req is not None:
                self._deliver(req)
        elif kind == "flush":
            payload.put(sched.flush_cache())
        elif kind == "stats":
            payload.put(sched.get_stats())
        elif kind == "check":
            try:
                sched.check_pool_whole()
                payload.put(None)
            except PoolNotWholeError as e:
                payload.put(e)
