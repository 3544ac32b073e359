"""The "what people use instead" peer: the same DSL programs on HF transformers ``generate``.

``HFBackend`` is a DSL backend. Every call (generation or select scoring) goes through one worker thread
that owns the model: with ``max_batch=1`` calls run one at a time (``hf_sequential``); with ``max_batch>1``
the worker takes every call waiting (up to ``max_batch``) and runs them as one left-padded ``generate``
batch (``hf_batched``). Greedy; no KV reuse across calls (each call prefills its whole prompt).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch

from sglang_backend.lang.backends.base import BaseBackend
from sglang_backend.lang.chat_template import guess_chat_template
from sglang_backend.lang.choices import normalized_logprob, token_length_normalized


class HFBackend(BaseBackend):
    supports_stream = False
    fork_hints = False  # nothing to hint: HF keeps no cache between calls

    def __init__(self, model_dir: str, tokenizer, max_batch: int = 1, device: str = "cpu", dtype=None,
                 dummy: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.tokenizer = tokenizer
        self.device = device
        self.max_batch = max(1, max_batch)
        dtype = dtype or torch.float32
        if dummy:  # random weights at the config's shape (throughput does not depend on their values)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        self.model = model.eval()
        self.chat_template = guess_chat_template(getattr(tokenizer, "chat_template", None), model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._loop, daemon=True, name="hf-peer")
        self._worker.start()

    # DSL backend interface ---------------------------------------------------------------------------------
    def generate(self, s, sampling_params):
        if sampling_params.regex or sampling_params.json_schema or sampling_params.dtype is not None:
            raise NotImplementedError("the HF peer has no constrained decoding")
        ids = self.tokenizer.encode(s.text_)
        n = sampling_params.max_new_tokens if sampling_params.max_new_tokens is not None else 128
        out = self._submit(("gen", ids, n, bool(sampling_params.ignore_eos)))
        return self.tokenizer.decode(out, skip_special_tokens=True), {"prompt_tokens": len(ids),
                                                                       "completion_tokens": len(out)}

    def select(self, s, choices, temperature, choices_method):
        prefix = self.tokenizer.encode(s.text_)
        scored = [self._submit(("score", prefix, self.tokenizer.encode(s.text_ + c))) for c in choices]
        return (choices_method or token_length_normalized)(
            choices=choices, normalized_prompt_logprobs=[normalized_logprob(e) for e in scored],
            input_token_logprobs=scored, output_token_logprobs=[[] for _ in choices], unconditional_token_logprobs=None)

    def shutdown(self) -> None:
        self._jobs.put(None)

    # The worker ----------------------------------------------------------------------------------------------
    def _submit(self, job):
        fut: Future = Future()
        self._jobs.put((job, fut))
        return fut.result()

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._jobs.put(None)
                    break
                batch.append(nxt)
            gens = [(j, f) for j, f in batch if j[0] == "gen"]
            try:
                for j, f in batch:
                    if j[0] == "score":
                        f.set_result(self._score(j[1], j[2]))
                if gens:
                    for (_, f), out in zip(gens, self._generate([j for j, _ in gens])):
                        f.set_result(out)
            except BaseException as e:  # noqa: BLE001 - the caller raises it
                for _, f in batch:
                    if not f.done():
                        f.set_exception(e)

    @torch.inference_mode()
    def _generate(self, jobs) -> list[list[int]]:
        width = max(len(j[1]) for j in jobs)
        n = max(j[2] for j in jobs)
        forced = all(j[3] for j in jobs)
        ids = torch.tensor([[self.pad_id] * (width - len(j[1])) + j[1] for j in jobs], device=self.device)
        mask = torch.tensor([[0] * (width - len(j[1])) + [1] * len(j[1]) for j in jobs], device=self.device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                  min_new_tokens=n if forced else 0, do_sample=False, pad_token_id=self.pad_id)
        results = []
        for j, row in zip(jobs, out[:, width:].tolist()):
            row = row[: j[2]]
            if not j[3]:
                for k, t in enumerate(row):
                    if t in self.eos_ids:
                        row = row[:k]
                        break
            results.append(row)
            self.num_prompt_tokens += len(j[1])
            self.num_generated_tokens += len(row)
        return results

    @torch.inference_mode()
    def _score(self, prefix: list[int], full: list[int]) -> list[tuple[float, int]]:
        """(logprob, token id) of each token of ``full`` after the part shared with ``prefix``."""
        start = 0
        while start < min(len(prefix), len(full)) and prefix[start] == full[start]:
            start += 1
        start = max(start, 1)
        logits = self.model(input_ids=torch.tensor([full], device=self.device)).logits[0].float()
        logprobs = torch.log_softmax(logits[start - 1 : len(full) - 1], dim=-1)
        targets = full[start:]
        self.num_prompt_tokens += len(full)
        return [(float(logprobs[i, t]), t) for i, t in enumerate(targets)]
