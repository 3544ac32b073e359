"""Sliding-window attention in the Triton kernels, checked without a GPU: every Triton kernel run by the Triton
interpreter on the CPU. A development check (minutes), not part of CI (no triton there):

    PYTHONPATH=/tmp/triton_site TRITON_INTERPRET=1 .venv/bin/python tests/gpu/interpreter_gemma3_check.py

1. Kernels: ``check_extend_window`` / ``check_decode_window`` (windowed extend and decode vs a float64 torch
   reference with HF's window rule, key > query - W) on random inputs, fp32 (IEEE dots) with small blocks so that
   windows start inside blocks, skip whole blocks, and cover prefixes longer than the window. The same functions run
   on the GPU in fp16/bf16 from tests/gpu/test_triton_kernels.py.
2. Engine: a tiny Gemma 3 (window 8, local and global layers) through the Triton attention backend and the fused
   layer kernels (every batch-1 GEMV mode) gives torch_native's greedy tokens: one request at a time, a batch,
   over a cached prefix longer than the window, and a decode batch of 9 requests sharing a cached prefix (cascade
   decode for the global layers, the plain windowed kernel for the local ones).

(triton 3.6's interpreter may need the one-line patch in its interpreter.py that reads a 0-d handle with
``int(self.handle.data.reshape(-1)[0])``.)

On a GPU, ``python tests/gpu/interpreter_gemma3_check.py --cuda`` runs the same kernel cases on the device and
the engine check with real backends: triton (CUDA graphs, cascade decode) against torch_native, both fp32 on the
GPU (same tokens, logprobs within 1e-3), and, where flashinfer is installed, flashinfer against torch_native in
bf16 (prompt logprobs within 0.1: a window off by one token moves them by ~1).
"""

from __future__ import annotations

import importlib

import torch


def window_reference(q, keys, values, q_positions, scale, window):
    """q: [M, H, D]; keys/values: [L, Hkv, D] at positions 0..L-1: query i sees q_pos - W < key <= q_pos."""
    g = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(g, dim=1)
    v = values.double().repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,lhd->hml", q.double(), k) * scale
    pos = torch.arange(keys.shape[0], device=q.device)[None, :]
    qp = q_positions.to(q.device)[:, None]
    s = s.masked_fill(~((pos <= qp) & (pos > qp - window))[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(s, dim=-1), v)


def check_extend_window(device, dtype, num_heads, num_kv_heads, head_dim, prefix_lens, extend_lens, window,
                        seed=0, config=None) -> float:
    """Windowed paged extend vs the float64 reference; the worst relative error (NaN or unwritten rows raise)."""
    # Need triton: deferred so that this module imports without it.
    from benchmarks.gpu.kernel_checks import make_pool, rel_err, scattered_rows
    from sglang_backend.runtime.layers.attention.triton_ops.extend_attention import extend_attention_fwd

    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 64
    k_buf, v_buf = make_pool(num_slots, num_kv_heads, head_dim, dtype, device, gen)
    req_to_token, rows = scattered_rows(seq_lens, num_slots, max(seq_lens) + 8, bs + 2, device, gen)
    T = sum(extend_lens)
    q = torch.randn(T, num_heads, head_dim, generator=gen).to(device, dtype)
    o = torch.full((T, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    starts = [sum(extend_lens[:i]) for i in range(bs)]
    meta = torch.tensor([prefix_lens, extend_lens, starts], dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    extend_attention_fwd(q, o, k_buf, v_buf, req_to_token, rows, meta[0], meta[1], meta[2], max(extend_lens), scale,
                         config=config, sliding_window=window)
    worst = 0.0
    for i in range(bs):
        slots = req_to_token[rows[i], : seq_lens[i]]
        pos = torch.arange(prefix_lens[i], seq_lens[i])
        ref = window_reference(q[starts[i] : starts[i] + extend_lens[i]], k_buf[slots], v_buf[slots], pos, scale,
                               window)
        worst = max(worst, rel_err(o[starts[i] : starts[i] + extend_lens[i]], ref))
    return worst


def check_decode_window(device, dtype, num_heads, num_kv_heads, head_dim, seq_lens, num_splits, window, seed=0,
                        fused_merge=False, config=None) -> float:
    """Windowed split-KV decode vs the float64 reference; ``fused_merge``: the merge inside stage 1 (counters left
    zero)."""
    # Need triton: deferred so that this module imports without it.
    from benchmarks.gpu.kernel_checks import make_pool, rel_err, scattered_rows
    from sglang_backend.runtime.layers.attention.triton_ops.decode_attention import decode_attention_fwd

    gen = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 64
    k_buf, v_buf = make_pool(num_slots, num_kv_heads, head_dim, dtype, device, gen)
    req_to_token, rows = scattered_rows(seq_lens, num_slots, max(seq_lens) + 8, bs + 3, device, gen)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    q = torch.randn(bs, num_heads, head_dim, generator=gen).to(device, dtype)
    o = torch.full((bs, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    mid_o = torch.full((bs, num_heads, num_splits, head_dim), float("nan"), dtype=torch.float32, device=device)
    mid_lse = torch.full((bs, num_heads, num_splits), float("nan"), dtype=torch.float32, device=device)
    counters = torch.zeros(bs * num_heads, dtype=torch.int32, device=device) if fused_merge else None
    scale = head_dim ** -0.5
    decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rows, seq, mid_o, mid_lse, num_splits, scale,
                         config=config, merge_counters=counters, sliding_window=window)
    if counters is not None:
        assert int(counters.abs().sum()) == 0, "split counters not left zero"
    worst = 0.0
    for i, n in enumerate(seq_lens):
        slots = req_to_token[rows[i], :n]
        ref = window_reference(q[i : i + 1], k_buf[slots], v_buf[slots], torch.tensor([n - 1]), scale, window)
        worst = max(worst, rel_err(o[i : i + 1], ref))
    return worst


def kernel_checks(device: str = "cpu") -> bool:
    """fp32 on the CPU: windows inside one block, across blocks (with whole blocks seen by every query of a
    block, run unmasked), longer than every sequence, of one token."""
    ok = True
    cases = [([0, 0, 40], [5, 30, 17], 8, (16, 16, 1, 1)), ([37, 3], [20, 9], 8, (16, 16, 1, 1)),
             ([0, 70], [33, 40], 16, (16, 16, 1, 1)), ([10], [12], 1, (16, 16, 1, 1)),
             ([0, 5], [9, 4], 100, (16, 16, 1, 1)), ([50, 0], [30, 45], 20, None),
             ([50, 3], [40, 60], 40, (16, 16, 1, 1)), ([100], [64], 48, (16, 16, 1, 1))]  # unmasked blocks too
    for prefix, extend, window, config in cases:
        err = check_extend_window(device, torch.float32, 4, 2, 32, prefix, extend, window, seed=1, config=config)
        print(f"extend prefix={prefix} extend={extend} window={window} config={config}: rel err {err:.2e}")
        ok &= err < 1e-5
    for seq_lens, splits, window, fused in [([1, 7, 8, 9, 40], 1, 8, False), ([3, 60, 33], 4, 8, True),
                                            ([100, 17], 3, 16, False), ([5, 12], 2, 1, True),
                                            ([20, 9], 2, 64, True)]:
        err = check_decode_window(device, torch.float32, 4, 2, 32, seq_lens, splits, window, seed=2,
                                  fused_merge=fused, config=(16, 1, 1, False))
        print(f"decode seq_lens={seq_lens} splits={splits} window={window} fused_merge={fused}: rel err {err:.2e}")
        ok &= err < 1e-5
    return ok


def engine_checks() -> bool:
    """The tiny Gemma 3 through TritonAttnBackend (+ fused layer kernels) vs torch_native greedy tokens."""
    import dataclasses  # only the engine check needs these
    import types

    # No GPU here: the backend asks for the SM count only to size its splits.
    torch.cuda.get_device_properties = lambda dev: types.SimpleNamespace(multi_processor_count=4)
    # Imported after the patch above (and need triton): deferred.
    from sglang_backend import Engine
    from sglang_backend.runtime.layers.attention.triton_backend import TritonAttnBackend
    from sglang_backend.runtime.layers.kernel_options import KernelOptions

    d = _tiny_gemma3()  # untied embeddings: less repetitive greedy tokens than tied ones in a random model
    eng = Engine(model_path=d, dtype="float32", device="cpu", log_level="warning", max_running_requests=12,
                 cascade_min_saved_reads=0)  # cascade over the 20 shared tokens
    mr = eng.scheduler.model_runner
    prefix = [(i * 37) % 290 + 5 for i in range(20)]  # shared by every prompt below: longer than the window
    prompts = [prefix + [7 + i, 9 + 2 * i, 11 + 3 * i][: 1 + i % 3] for i in range(9)]
    sp = dict(max_new_tokens=5, temperature=0, ignore_eos=True)

    def run() -> tuple[list, list, list]:
        eng.flush_cache()
        singles = [eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts[:2]]
        out = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)  # cascade decode
        logprobs = [lp for o in out for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        return singles, [o["output_ids"] for o in out], logprobs

    ref = run()
    mr.attn_backend = TritonAttnBackend(mr)
    ok = True
    for mode in ("off", "fused", "fused_rope"):
        # Fused kernels on the CPU tensors (KernelOptions.resolve would turn them off on the CPU): the interpreter.
        mr.kernel_options = dataclasses.replace(KernelOptions(fused_ops=True), gemv_mode=mode)
        got = run()
        lp_err = max(abs(a - b) for a, b in zip(got[2], ref[2]))
        print(f"engine gemv_mode={mode}: singles {got[0] == ref[0]}, batch of 9 {got[1] == ref[1]}, batch "
              f"logprobs max diff {lp_err:.1e}, cascade decode steps so far {mr.attn_backend.num_cascade_steps}")
        ok &= got[:2] == ref[:2] and lp_err < 1e-4
    ok &= mr.attn_backend.num_cascade_steps > 0
    eng.shutdown()
    print("torch_native tokens:", ref[:2])
    return ok


def _tiny_gemma3(head_dim: int = 32) -> str:
    import tempfile  # only the engine checks need a model directory

    from sglang_backend.runtime.model_loader.loader import dummy_config, save_dummy_hf_model  # deferred: heavy

    d = tempfile.mkdtemp()
    save_dummy_hf_model(dummy_config(model_type="gemma3_text", num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=head_dim, query_pre_attn_scalar=24,
                                     sliding_window=8, vocab_size=300, tie_word_embeddings=False,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"]), d)
    return d


def _generate(d: str, prompts: list, **engine_kwargs) -> tuple[list, list, list]:
    """(greedy tokens, their logprobs, prompt logprobs) of a batch, on a fresh engine."""
    from sglang_backend import Engine  # deferred: heavy

    eng = Engine(model_path=d, log_level="warning", max_running_requests=12, cascade_min_saved_reads=0, **engine_kwargs)
    try:
        sp = dict(max_new_tokens=6, temperature=0, ignore_eos=True)
        eng.generate(input_ids=prompts[0][:20], sampling_params=sp)  # the shared prefix, cached
        out = eng.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)  # over the cached prefix
        tokens = [o["output_ids"] for o in out]
        logprobs = [lp for o in out for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        out = eng.generate(input_ids=prompts, sampling_params=dict(sp, max_new_tokens=1), return_logprob=True,
                           logprob_start_len=0)  # every prompt position scored: recomputed from the start
        prompt_lps = [lp for o in out for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]
        return tokens, logprobs, prompt_lps
    finally:
        eng.shutdown()


def gpu_engine_checks() -> bool:
    prefix = [(i * 37) % 290 + 5 for i in range(20)]
    prompts = [prefix + [7 + i, 9 + 2 * i, 11 + 3 * i][: 1 + i % 3] for i in range(9)]
    d = _tiny_gemma3(head_dim=64)  # a head size flashinfer has kernels for
    ref = _generate(d, prompts, device="cuda", dtype="float32", attention_backend="torch_native")
    got = _generate(d, prompts, device="cuda", dtype="float32", attention_backend="triton")
    lp = max(abs(a - b) for a, b in zip(got[1] + got[2], ref[1] + ref[2]))
    ok = got[0] == ref[0] and lp < 1e-3
    print(f"cuda triton fp32 vs torch_native: tokens {got[0] == ref[0]}, logprobs max diff {lp:.1e}")
    ref = None
    for backend, module in (("flashinfer", "flashinfer"), ("fa3", "vllm.vllm_flash_attn")):
        try:  # optional: each bf16 backend check only where its package is installed
            importlib.import_module(module)
        except ImportError:
            print(f"{module} not installed: {backend} skipped")
            continue
        ref = ref or _generate(d, prompts, device="cuda", dtype="bfloat16", attention_backend="torch_native")
        got = _generate(d, prompts, device="cuda", dtype="bfloat16", attention_backend=backend)
        lp = max(abs(a - b) for a, b in zip(got[2], ref[2]))
        print(f"cuda {backend} bf16 vs torch_native bf16: prompt logprobs max diff {lp:.2e}, tokens equal "
              f"{got[0] == ref[0]} (bf16: informative only)")
        ok = ok and lp < 0.1
    return ok


def main(argv: list[str]) -> int:
    if "--cuda" in argv:
        ok = kernel_checks("cuda")
        ok &= gpu_engine_checks()
    else:
        ok = kernel_checks()
        ok &= engine_checks()
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    import pathlib  # run as a script: only then is the repo root missing from sys.path
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.gpu helpers
    raise SystemExit(main(sys.argv[1:]))
