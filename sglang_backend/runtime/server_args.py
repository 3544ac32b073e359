"""Every runtime knob in one dataclass. CLI flags are generated from the fields (see ``add_cli_args``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer", "fa3")
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "fp8")
GEMV_MODES = ("auto", "off", "on", "fused", "fused_rope")  # resolved by layers/kernel_options.py
ATTENTION_MERGES = ("auto", "fused", "stage2")
PDL_MODES = ("auto", "on", "off")
CPU_ACTIVATION_QUANTS = ("none", "q8")  # float32 activations, or 8-bit ones as llama.cpp (layers/native/gguf_blocks.c)
KV_HOST_LOADS = ("auto", "async", "sync")
PROGRAM_SCHEDULINGS = ("attained", "off")
EMBEDDING_POOLINGS = ("last", "mean")  # an embedding: the last prompt token's final hidden state, or their mean


@dataclass
class ServerArgs:
    # Model
    model_path: str | None = field(default=None, metadata={"help": "HF model dir, hub id, or .gguf file; default: embedded SmolLM2-135M-Instruct"})
    tokenizer_path: str | None = field(default=None, metadata={"help": "Tokenizer dir (default: the model's)"})
    load_format: str = field(default="auto", metadata={"help": "auto (weights from model_path) or dummy (random weights from its config)", "choices": LOAD_FORMATS})
    dtype: str = field(default="auto", metadata={"help": "auto: float32 on CPU, bfloat16 on GPU when supported", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    quantization: str = field(default="auto", metadata={"help": "auto: weights a checkpoint stores quantized stay quantized where kernels for them run here (a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks on a float32 CPU run when the native kernels build; an FP8 checkpoint on a GPU of compute capability 8.9+), else are dequantized at load; none: always dequantize at load; fp8: FP8 (e4m3) linear weights with per-row scales, quantized at load from a float checkpoint (layers/fp8.py)", "choices": QUANTIZATIONS})
    context_length: int | None = field(default=None, metadata={"help": "Override the model's max context length"})
    served_model_name: str | None = field(default=None, metadata={"help": "Model name(s) reported by /v1/models: comma-separated aliases, the first is the main one (default: the model path). Requests may name any model; the one model answers"})
    random_seed: int = field(default=0, metadata={"help": "Seed for dummy weights and unseeded sampling"})
    embedding_pooling: str = field(default="last", metadata={"help": "Embeddings (/v1/embeddings, Engine.encode): pool the final hidden states (after the final norm) of the last token (as Qwen3-Embedding and other causal-LM embedders) or their mean", "choices": EMBEDDING_POOLINGS})

    # Memory
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens (default: sized from memory)"})
    # 0.9 as vLLM's gpu_memory_utilization: prompt-logprob logits, the one large activation, are bounded by
    # max_prefill_logprob_tokens, so the remaining tenth holds activations, CUDA graphs and workspaces.
    mem_fraction_static: float = field(default=0.9, metadata={"help": "GPU: fraction of memory for weights + KV pool"})
    max_running_requests: int = field(default=256, metadata={"help": "Request slots (running batch size cap)"})
    page_size: int = field(default=1, metadata={"help": "KV page size in tokens"})
    kv_host_size: int = field(default=0, metadata={"help": "Second KV tier: tokens of host memory (pinned on a GPU) that keep the KV the pool evicts, copied back on a prefix hit instead of computed again (0: off; the radix cache only)"})
    kv_host_load: str = field(default="auto", metadata={"help": "How KV comes back from the host tier: async (the request waits for its copy outside the batch while the forwards go on), sync (the copy is made as its batch is formed), auto (async on a GPU, sync on a CPU, where the copy is a memcpy on the compute threads)", "choices": KV_HOST_LOADS})

    # Scheduling
    schedule_policy: str = field(default="lpm", metadata={"help": "Waiting-queue order", "choices": SCHEDULE_POLICIES})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "Max new prompt tokens in one prefill batch"})
    max_prefill_logprob_tokens: int = field(default=0, metadata={"help": "Prompt tokens whose logprobs one prefill batch computes (each a full-vocabulary fp32 logits row); a longer prompt asking for them is chunked. 0: auto, 1 GiB of logits"})
    chunked_prefill_size: int = field(default=8192, metadata={"help": "Split prompts longer than this (<=0 disables)"})
    enable_mixed_chunk: bool = field(default=False, metadata={"help": "Prefill batches carry the running requests' decode tokens too (one extend), so decoding does not stall while prompts are computed"})
    schedule_conservativeness: float = field(default=1.0, metadata={"help": "Scales reserved decode growth"})
    starvation_limit: int = field(default=64, metadata={"help": "A request passed over this many scheduling rounds is admitted first (aging)"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "No prefix reuse (ablation)"})
    table_cache: bool = field(default=False, metadata={"help": "Ablation (no tree): an exact-match table cache that reuses a cached sequence only whole, never part of one"})
    disable_jump_forward: bool = field(default=False, metadata={"help": "Decode grammar-forced text token by token (ablation)"})
    jump_forward_max_batch: int | None = field(default=None, metadata={"help": "Jump forward only while at most this many requests are running; None: auto (no limit on the CPU; 1 on a GPU, where the jump's extend pass runs without a CUDA graph and costs more than the decode steps it saves to a batch)"})
    # Grammar budget (constrained/budget.py): counted in sizes, states and steps, so no request is refused because the
    # machine is busy; the wall-clock limit is an opt-in safety net, off by default.
    grammar_backend: str = field(default="auto", metadata={"help": "Engine for regex / JSON schema grammars: auto (llguidance when installed), llguidance, or fsm (ours: regex -> DFA -> token index)", "choices": ("auto", "llguidance", "fsm")})
    grammar_compile_timeout: float | None = field(default=None, metadata={"help": "Last-resort safety net, off by default: seconds one grammar may take to compile before the request gets 400 (depends on load; never cached)"})
    grammar_max_regex_chars: int = field(default=64 * 1024, metadata={"help": "Largest regex a JSON schema may expand to (bounds $ref expansion); larger schemas get 400 at once"})
    grammar_max_states: int = field(default=250_000, metadata={"help": "Most llguidance lexer states one grammar may build (1-2 kB each)"})
    grammar_lexer_fuel: int = field(default=1_000_000, metadata={"help": "llguidance work units for building one grammar's lexer (deterministic; ~50k per ms); past it the request gets 400"})
    grammar_step_fuel: int = field(default=200_000, metadata={"help": "llguidance work units for one token mask (deterministic; ~14k per ms)"})
    grammar_mask_threads: int = field(default=0, metadata={"help": "Threads computing llguidance's next-token masks (in parallel across a batch, while the forward runs); 0: auto (1 on the CPU, where they share the cores with the forward; up to 8 on a GPU)"})
    session_ttl: float | None = field(default=None, metadata={"help": "Seconds a finished request's KV stays pinned for the next request of its session_id (None: adaptive, twice the 90th percentile of the gaps seen between a session's calls, 1 s to session_ttl_max; 10 s before any gap is seen; 0: no pins)"})
    session_ttl_max: float = field(default=60.0, metadata={"help": "Longest adaptive session pin time to live, seconds"})
    session_pin_max_fraction: float = field(default=0.5, metadata={"help": "Most of the KV pool that session pins may hold together (the oldest pins go first)"})
    program_scheduling: str = field(default="attained", metadata={"help": "Among waiting requests, programs (session_id) served least go first, the schedule policy's order within a level (managers/program_service.py); off: the policy alone", "choices": PROGRAM_SCHEDULINGS})
    program_service_quantum: int = field(default=2048, metadata={"help": "Tokens computed for a program before it drops from priority level 0; each doubling is one level more"})
    enable_in_batch_prefix_dedup: bool = field(default=True, metadata={"help": "Compute a prefix shared by requests of one prefill batch once (see --disable-in-batch-prefix-sharing)"})
    disable_in_batch_prefix_sharing: bool = field(default=False, metadata={"help": "With in-batch prefix dedup, hold a request back a round until the prefix it shares with an admitted request is cached, instead of reading that request's KV in the same forward"})

    # Runtime
    attention_backend: str = field(default="torch_native", metadata={"help": "Attention kernels", "choices": ATTENTION_BACKENDS})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "GPU: no CUDA graphs for decode"})
    disable_overlap_schedule: bool = field(default=False, metadata={"help": "GPU: do not overlap the host work of a decode step with the next step's GPU work"})
    disable_cascade_attention: bool = field(default=False, metadata={"help": "Triton decode: attend each request's whole KV, not the batch's shared prefix once"})
    cascade_min_saved_reads: int = field(default=32768, metadata={"help": "Triton decode: cascade attention (the batch's shared prefix read once) only when it saves at least this many token reads per layer, shared length x (batch - 1): below that its extra prefix and merge kernels cost more than the reads they save; 0: whenever the batch shares a first slot"})
    tp_size: int = field(default=1, metadata={"help": "Tensor parallelism: shard the model over this many GPUs (or CPU processes, gloo)"})
    disable_native_cpu_kernels: bool = field(default=False, metadata={"help": "CPU: torch ops instead of the C kernels compiled on first use (layers/native: decode attention read in place from the KV pool, matmuls over GGUF blocks, which are then dequantized at load; the grammar-mask kernel, masks then go through numpy); ablation"})
    cpu_activation_quant: str = field(default="none", metadata={"help": "CPU, GGUF block weights (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) in the native kernels: none (float32 activations; results equal the float32 matmul with the dequantized weights) or q8 (as llama.cpp: each 32-value block of an activation row rounded to 8 bits with one scale, integer dot products; faster decode, but results no longer equal the float32-dequantized reference to 1e-4)", "choices": CPU_ACTIVATION_QUANTS})
    disable_fused_ops: bool = field(default=False, metadata={"help": "GPU: the plain torch reference modules instead of the fused Triton kernels in the layers (RMSNorm + residual add, rotary + KV store, SiLU-mul, batch-1 GEMV); ablation"})
    gemv_mode: str = field(default="auto", metadata={"help": "GPU, one-token batches: off (cuBLAS), on (Triton GEMV), fused (norm prologue, SiLU-mul / residual-add epilogues), fused_rope (fused + rotary and KV store in the qkv GEMV); auto: fused_rope on Hopper and newer, else off", "choices": GEMV_MODES})
    pdl: str = field(default="auto", metadata={"help": "GPU: programmatic dependent launch (Hopper and newer, when Triton supports it): on, off, or auto: on, except for one-token batches of grouped-query models, whose step measured faster without it (Llama-3-8B on an H200: 4.52 vs 4.79 ms at batch 1, while batch 64 measured 7.28 with it vs 7.43)", "choices": PDL_MODES})
    attention_merge: str = field(default="auto", metadata={"help": "Triton decode attention: merge the sequence splits in stage 1 (fused) or in a separate stage-2 kernel (stage2); auto: stage2 for one-token batches of grouped-query models (4.41-4.49 vs 4.52 ms per Llama-3-8B batch-1 step on an H200, 6.01 vs 6.08 for Qwen3-8B on an H100), fused otherwise (5.28 vs 5.33 ms for Llama-2-7B on an H100)", "choices": ATTENTION_MERGES})
    kernel_config: str | None = field(default=None, metadata={"help": "JSON file of tuned kernel launch configurations (default: the GPU model's file in layers/attention/triton_ops/configs/ if there is one, else the built-in values)"})
    check_pool_on_idle: bool = field(default=False, metadata={"help": "Raise if the KV pool is not whole when idle (tests)"})

    # Server
    host: str = field(default="127.0.0.1", metadata={"help": "Bind address"})
    port: int = field(default=30000, metadata={"help": "HTTP port"})
    api_key: str | None = field(default=None, metadata={"help": "Require 'Authorization: Bearer KEY'"})
    log_level: str = field(default="info", metadata={"help": "Logging level"})
    max_queued_requests: int = field(default=1024, metadata={"help": "Requests waiting beyond the running ones; past it new requests get 503 + Retry-After"})
    graceful_shutdown_timeout: float = field(default=8.0, metadata={"help": "After SIGTERM: seconds the requests in flight get to finish before they are ended with an error (Ctrl-C ends them at once)"})
    request_timeout: float | None = field(default=None, metadata={"help": "Seconds a request may take end to end before it is aborted (504); default: no limit"})
    keep_alive_timeout: float = field(default=30.0, metadata={"help": "Seconds an idle kept-alive HTTP connection stays open"})
    max_request_body_bytes: int = field(default=8 << 20, metadata={"help": "Larger request bodies get 413"})
    prepare_workers: int | None = field(default=None, metadata={"help": "Threads that prepare requests (tokenizing, chat templates, images, grammar compilation); default: the CPU count, 2 to 8"})
    chat_template: str | None = field(default=None, metadata={"help": "Chat template (a Jinja file or the template text) replacing the model's own; requests cannot send templates"})
    chat_template_timeout: float = field(default=2.0, metadata={"help": "Seconds rendering one chat template may take before the request gets 400"})
    tool_call_parser: str = field(default="auto", metadata={"help": "How the model writes tool calls: auto (from its chat template: <tool_call> is hermes, [TOOL_CALLS] mistral, <|python_tag|>/ipython llama3; a template without tools gets a Hermes tool prompt), hermes, llama3 or mistral", "choices": ("auto", "hermes", "llama3", "mistral")})
    reasoning_parser: str = field(default="none", metadata={"help": "Separate <think>...</think> into message.reasoning_content: none, deepseek-r1 (the output starts inside the reasoning) or qwen3 (reasoning when the output opens <think>)", "choices": ("none", "deepseek-r1", "qwen3")})
    responses_store_size: int = field(default=1024, metadata={"help": "/v1/responses: how many stored responses (store: true) the server keeps for GET /v1/responses/{id} and previous_response_id; the least recently used go first (0: none kept)"})
    allow_local_media: bool = field(default=False, metadata={"help": "Let requests name local image/video files by path (off: base64/data URLs only)"})
    header_read_timeout: float = field(default=10.0, metadata={"help": "Seconds a client has to send a request's complete headers, counted from the connection's opening or from the first byte of a next request on a kept-alive connection; then 408 and the connection is closed (slow-header clients)"})
    body_read_timeout: float = field(default=30.0, metadata={"help": "Seconds a request's whole body may take to arrive after its headers; then 408 and the connection is closed (slow-body clients). Replies, streams included, are not limited by it"})
    body_idle_timeout: float = field(default=10.0, metadata={"help": "Seconds a request's body may stall (no bytes received) before the request gets 408 and the connection is closed"})

    def __post_init__(self):
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.gemv_mode not in GEMV_MODES:
            raise ValueError(f"gemv_mode must be one of {GEMV_MODES}, got {self.gemv_mode!r}")
        if self.cpu_activation_quant not in CPU_ACTIVATION_QUANTS:
            raise ValueError(f"cpu_activation_quant must be one of {CPU_ACTIVATION_QUANTS}, got {self.cpu_activation_quant!r}")
        if self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"embedding_pooling must be one of {EMBEDDING_POOLINGS}, got {self.embedding_pooling!r}")
        if self.attention_merge not in ATTENTION_MERGES:
            raise ValueError(f"attention_merge must be one of {ATTENTION_MERGES}, got {self.attention_merge!r}")
        if self.pdl not in PDL_MODES:
            raise ValueError(f"pdl must be one of {PDL_MODES}, got {self.pdl!r}")
        if self.disable_fused_ops and self.gemv_mode not in ("auto", "off"):
            raise ValueError(f"gemv_mode {self.gemv_mode!r} needs the fused kernels: drop disable_fused_ops")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.cascade_min_saved_reads < 0:
            raise ValueError("cascade_min_saved_reads must be >= 0 token reads (0: cascade whenever a first slot is shared)")
        if self.kv_host_size < 0:
            raise ValueError("kv_host_size must be >= 0 tokens (0: no host tier)")
        if self.kv_host_size and (self.disable_radix_cache or self.table_cache):
            raise ValueError("kv_host_size needs the radix cache (not with disable_radix_cache or table_cache)")
        if self.kv_host_size and self.tp_size > 1:
            raise ValueError("kv_host_size is not supported with tp_size > 1 yet")
        if self.max_prefill_logprob_tokens < 0:
            raise ValueError("max_prefill_logprob_tokens must be >= 0 (0: auto)")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("graceful_shutdown_timeout must be >= 0")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be > 0")
        for name in ("header_read_timeout", "body_read_timeout", "body_idle_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be > 0")
        if self.chat_template_timeout <= 0:
            raise ValueError("chat_template_timeout must be > 0")
        if self.responses_store_size < 0:
            raise ValueError("responses_store_size must be >= 0")
        if self.grammar_compile_timeout is not None and not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be > 0 (or unset: no wall-clock limit)")
        if self.session_ttl is not None and not self.session_ttl >= 0:
            raise ValueError("session_ttl must be >= 0 seconds (0: no session pins; unset: adaptive)")
        if not self.session_ttl_max >= 1.0:
            raise ValueError("session_ttl_max must be >= 1 second")
        if self.kv_host_load not in KV_HOST_LOADS:
            raise ValueError(f"kv_host_load must be one of {KV_HOST_LOADS}, got {self.kv_host_load!r}")
        if self.program_scheduling not in PROGRAM_SCHEDULINGS:
            raise ValueError(f"program_scheduling must be one of {PROGRAM_SCHEDULINGS}, got {self.program_scheduling!r}")
        if self.program_service_quantum < 1:
            raise ValueError("program_service_quantum must be >= 1 token")
        if not 0.0 <= self.session_pin_max_fraction <= 1.0:
            raise ValueError("session_pin_max_fraction must be within [0, 1]")
        if self.grammar_backend not in ("auto", "llguidance", "fsm"):
            raise ValueError("grammar_backend must be auto, llguidance or fsm")
        if self.jump_forward_max_batch is not None and self.jump_forward_max_batch < 1:
            raise ValueError("jump_forward_max_batch must be >= 1 (or unset: auto)")
        if self.grammar_mask_threads < 0:
            raise ValueError("grammar_mask_threads must be >= 0 (0: auto)")
        for name in ("grammar_max_regex_chars", "grammar_max_states", "grammar_lexer_fuel", "grammar_step_fuel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prepare_workers is not None and self.prepare_workers < 1:
            raise ValueError("prepare_workers must be >= 1")
        if self.table_cache and (self.disable_radix_cache or self.page_size != 1):
            raise ValueError("table_cache needs the cache on (no disable_radix_cache) and page_size 1")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown engine argument(s) {unknown}; valid ones: {sorted(names)}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            base = str(f.type).split("|")[0].strip()
            typ = {"int": int, "float": float}.get(base, str)
            # Show the default once: not when the help text already says it, nor a bare "None" (unset)
            if f.default is not None and "default" not in help_text.lower():
                help_text = f"{help_text} (default: {f.default})"
            parser.add_argument(flag, type=typ, default=f.default, choices=f.metadata.get("choices"), help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
