"""Without a GPU: the Triton attention backend and the fused layer kernels (every batch-1 GEMV mode) give the
torch_native backend's greedy tokens (fp32, a tiny Llama), decode at batch 1 and at batch 2, with every Triton
kernel run by the Triton interpreter on the CPU. A development check (minutes), not part of CI (no triton there):

    TRITON_INTERPRET=1 python tests/gpu/interpreter_engine_check.py

(triton 3.6's interpreter may need the one-line patch in its interpreter.py that reads a 0-d handle with
``int(self.handle.data.reshape(-1)[0])``.)
"""
import dataclasses
import tempfile
import types

import torch
from transformers import LlamaConfig
from sglang_backend import Engine
from sglang_backend.runtime.model_loader.loader import build_dummy_tokenizer
from sglang_backend.runtime.layers.kernel_options import KernelOptions

torch.cuda.get_device_properties = lambda dev: types.SimpleNamespace(multi_processor_count=4)  # no GPU here
from sglang_backend.runtime.layers.attention.triton_backend import TritonAttnBackend

d = tempfile.mkdtemp()
cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.2)
cfg.architectures = ["LlamaForCausalLM"]
cfg.save_pretrained(d)
build_dummy_tokenizer(cfg.vocab_size).save_pretrained(d)
eng = Engine(model_path=d, load_format="dummy", dtype="float32", device="cpu", log_level="warning",
             max_running_requests=4)
mr = eng.scheduler.model_runner
prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12, 13]]
sp = dict(max_new_tokens=6, temperature=0, ignore_eos=True)
ref = [eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
ref_batch = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
mr.attn_backend = TritonAttnBackend(mr)
ok = True
for mode in ("off", "fused", "fused_rope"):
    eng.flush_cache()
    # Fused kernels on the CPU tensors (KernelOptions.resolve would turn them off on the CPU): the interpreter.
    mr.kernel_options = dataclasses.replace(KernelOptions(fused_ops=True), gemv_mode=mode)
    one = [eng.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    both = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
    print(mode, one == ref, both == ref_batch)
    ok &= one == ref and both == ref_batch
eng.shutdown()
print("OK" if ok else "MISMATCH", ref, ref_batch)
raise SystemExit(0 if ok else 1)
