"""vLLM's side of the peer benchmark, run as a child process: the same sections through ``vllm.LLM`` (offline
API, vLLM's defaults: torch.compile + CUDA graphs), as the kit's reference run used it: dummy weights, no
tokenizer (``--tokenizer``: one, for the sections that decode text), ``TokensPrompt`` inputs, greedy
``SamplingParams`` with ignore_eos and no detokenization (JSON decoding: structured outputs, ended by EOS). Outputs
are checked to be well formed only (lengths, id range), never compared to ours (the dummy weights differ).

Named so that it does not shadow the ``vllm`` package. Imports nothing of our engine.

    python -m benchmarks.peers.vllm_side --model-dir DIR --dtype bfloat16 --vocab 128256 --out X.json ...
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from benchmarks.peers.child import child_parser, log, new_result, run_sections, server_arg_overrides, write_json
from benchmarks.peers.workloads import TextOutput

# vLLM's environment on the offline GPU machine (setdefault: a caller's value wins).
ENV_DEFAULTS = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the kit has no FlashInfer: vLLM's PyTorch/Triton sampler
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CACHE_ROOT": "/tmp/vllm_peer_cache",
}


def logprob_of(entry, token: int) -> float | None:
    """The prompt token's logprob from one position's {token id: Logprob} entry (None at the first position;
    NaN, which fails the well-formedness check, if vLLM left the token out)."""
    if entry is None:
        return None
    found = entry.get(token) if hasattr(entry, "get") else entry[token]
    return float("nan") if found is None else float(found.logprob)


class VllmClient:
    """The ``Client`` protocol over ``vllm.LLM``."""

    def __init__(self, llm, cache_on: bool):
        # Deferred optional import: vLLM exists only where the kit is installed (the GPU machine).
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams

        self.llm, self.cache_on = llm, cache_on
        self._params, self._prompt, self._structured = SamplingParams, TokensPrompt, StructuredOutputsParams
        self.structured_backends: set[str] = set()
        self.failed_resets = 0

    def sampling(self, max_tokens: int, **extra):
        return self._params(max_tokens=max_tokens, ignore_eos=True, temperature=0, detokenize=False, **extra)

    def _run(self, prompts: list[list[int]], params) -> list:
        return self.llm.generate([self._prompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
        if isinstance(max_tokens, list):
            params = [self.sampling(m) for m in max_tokens]
        else:
            params = self.sampling(max_tokens)
        return [list(o.outputs[0].token_ids) for o in self._run(prompts, params)]

    def generate_regex(self, prompts: list[list[int]], regex: str, max_tokens: int) -> list[TextOutput]:
        """vLLM's structured outputs (its default backend: xgrammar), detokenized as a user's call is."""
        params = self._params(max_tokens=max_tokens, temperature=0,
                              structured_outputs=self._structured(regex=regex))
        outs = self._run(prompts, params)
        self.structured_backends.add(str(params.structured_outputs._backend))  # what vLLM picked
        return [TextOutput(o.outputs[0].text, len(o.outputs[0].token_ids), str(o.outputs[0].finish_reason))
                for o in outs]

    def prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        """``prompt_logprobs=0`` over the whole prompt (vLLM has no start position, and it computes prompts that
        ask for prompt logprobs without its prefix cache); each position's entry holds that token's logprob."""
        outs = self._run(prompts, self.sampling(1, prompt_logprobs=0))
        return [[logprob_of(out.prompt_logprobs[i], prompt[i]) for i in range(start, len(prompt))]
                for prompt, start, out in zip(prompts, starts, outs)]

    def reset(self) -> None:
        if self.cache_on and self.llm.reset_prefix_cache() is False:
            self.failed_resets += 1


def engine_info(llm) -> dict:
    """vLLM's resolved configuration (what it chose for this GPU and model)."""
    vc = llm.llm_engine.vllm_config
    cc, sc, comp = vc.cache_config, vc.scheduler_config, vc.compilation_config
    return dict(
        num_gpu_blocks=getattr(cc, "num_gpu_blocks", None), block_size=getattr(cc, "block_size", None),
        enable_prefix_caching=getattr(cc, "enable_prefix_caching", None),
        max_num_seqs=getattr(sc, "max_num_seqs", None),
        max_num_batched_tokens=getattr(sc, "max_num_batched_tokens", None),
        async_scheduling=getattr(sc, "async_scheduling", None),
        max_model_len=getattr(vc.model_config, "max_model_len", None),
        compilation_mode=str(getattr(comp, "mode", None)), cudagraph_mode=str(getattr(comp, "cudagraph_mode", None)),
        use_v2_model_runner=getattr(vc, "use_v2_model_runner", None),
        attention_backend_cfg=str(getattr(getattr(vc, "attention_config", None), "backend", None)))


def start_llm(args, result: dict):
    """The ``LLM`` for this phase, its init time and versions recorded in ``result``."""
    # Deferred optional imports: vLLM exists only where the kit is installed; torch only for its version.
    import torch
    import vllm

    result["info"].update(vllm_version=vllm.__version__, vllm_file=vllm.__file__, torch_version=torch.__version__,
                          torch_cuda=torch.version.cuda, python=sys.version.split()[0])
    llm_kwargs = dict(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
                      enable_prefix_caching=args.cache == "on", gpu_memory_utilization=args.mem_fraction, seed=0)
    if args.tokenizer:
        llm_kwargs.update(tokenizer=args.tokenizer, skip_tokenizer_init=False)
    llm_kwargs.update(server_arg_overrides(args.llm_arg))
    result["info"]["llm_kwargs"] = llm_kwargs
    t0 = time.perf_counter()
    llm = vllm.LLM(**llm_kwargs)
    result["info"]["llm_init_s"] = time.perf_counter() - t0
    try:
        result["info"]["engine"] = engine_info(llm)
    except Exception:  # noqa: BLE001 - informational only
        result["errors"]["engine_info"] = traceback.format_exc()
    return llm


def main(argv: list[str] | None = None) -> int:
    ap = child_parser("vLLM's side of the peer benchmark (one phase)")
    ap.add_argument("--model-dir", required=True, help="a directory holding the model's config.json")
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: none, token ids only)")
    ap.add_argument("--llm-arg", action="append", default=[], metavar="KEY=VALUE", help="one more LLM keyword")
    args = ap.parse_args(argv)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    result = new_result("vllm", args)
    write_json(args.out, result)
    try:
        llm = start_llm(args, result)
        client = VllmClient(llm, args.cache == "on")
        log("vllm", f"cache {args.cache}: LLM up in {result['info']['llm_init_s']:.1f} s")
    except Exception:  # noqa: BLE001 - recorded for the parent (vLLM missing, start failed)
        result["errors"]["init"] = traceback.format_exc()
        write_json(args.out, result)
        log("vllm", f"init FAILED\n{result['errors']['init']}")
        return 1
    write_json(args.out, result)
    failed = run_sections("vllm", client, args.vocab, args, result)
    result["info"]["failed_prefix_cache_resets"] = client.failed_resets
    result["info"]["structured_output_backends"] = sorted(client.structured_backends)
    write_json(args.out, result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
