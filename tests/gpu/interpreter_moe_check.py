"""Without a GPU: the Triton fused-MoE kernels (triton_ops/fused_moe.py) against the torch reference (the CPU
path's arithmetic, layers.moe.torch_moe), run by the Triton interpreter on CPU tensors. A development check (a
minute or two), not part of CI (no triton there):

    TRITON_INTERPRET=1 python tests/gpu/interpreter_moe_check.py

Covers the alignment on its own (every slot once, in a block of its own expert, padding sentinels, the padded
length, empty experts, one expert taking everything) and the whole layer: k=2 of 8 and k=8 of 128 experts,
uneven loads, sizes that are not multiples of the tiles (masks on N and K, partial row blocks), 1 to 70
tokens, fp32, bf16 and fp16, several launch configs (GROUP_M > 1 with a ragged last group).

triton 3.6's interpreter reads a 0-d handle with ``int(self.handle.data)``, which fails on the 1-element
arrays it gives loop bounds; this script swaps in ``int(self.handle.data.reshape(-1)[0])`` in-process (the
one-line patch the other interpreter check asks for, without editing triton). Its fp32 -> bf16 cast also
truncates (the GPU rounds to nearest even): swapped for torch's rounding here, else bf16 errors triple.
"""
import os
import random
import sys

import numpy as np
import torch
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root

from triton.runtime import interpreter as _interpreter  # noqa: E402

from benchmarks.bench_moe import TOL, check_align, moe_inputs, moe_reference, rel_err  # noqa: E402
from sglang_backend.runtime.layers.attention.triton_ops.fused_moe import fused_moe  # noqa: E402

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (no GPU here)"
_patch_tensor = _interpreter._patch_lang_tensor


def _patch_tensor_with_index(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interpreter._patch_lang_tensor = _patch_tensor_with_index
_cast = _interpreter.InterpreterBuilder.cast_impl


def _cast_rounding_to_nearest(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = torch.from_numpy(src.data.astype(np.float32)).to(torch.bfloat16).view(torch.int16)
        return _interpreter.TensorHandle(bits.numpy().view(np.uint16), dst_type.scalar)
    return _cast(self, src, dst_type)


_interpreter.InterpreterBuilder.cast_impl = _cast_rounding_to_nearest


def check_layer(T, H, I, E, k, dtype, config, seed, skew):
    x, w13, w2, experts, w = moe_inputs(T, H, I, E, k, dtype, "cpu", seed, skew=skew)
    out = fused_moe(x, w13, w2, experts, w, config=config)
    assert out.dtype == dtype and out.shape == (T, H)
    err = rel_err(out, moe_reference(x, w13, w2, experts, w))
    # The torch path in the same low precision, for scale (the kernel should be about as close).
    err_torch = rel_err(moe_reference(x, w13, w2, experts, w, dtype), moe_reference(x, w13, w2, experts, w))
    return err, err_torch


def main() -> int:
    rng = random.Random()
    seed0 = rng.randint(0, 1 << 30)
    print("seed", seed0)
    torch.manual_seed(seed0)
    # Alignment: random, empty experts, all on one expert, one token, many experts.
    check_align(torch.randint(0, 8, (37, 2)), 8, 16)
    check_align(torch.randint(0, 3, (20, 2)) * 3, 8, 4)  # experts 1, 2, 4, 5, 7 empty
    check_align(torch.full((50, 1), 5), 8, 16)
    check_align(torch.tensor([[3, 9, 0, 127, 64, 1, 2, 8]]), 128, 16)
    check_align(torch.stack([torch.randperm(128)[:8] for _ in range(300)]), 128, 64)
    check_align(torch.zeros((0, 2), dtype=torch.long), 8, 16)
    check_align(torch.randint(0, 60, (40, 4)), 60, 32)  # E not a power of two
    print("align OK")

    cases = [  # (T, H, I, E, k, dtype, config (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages), skew)
        (1, 40, 24, 8, 2, torch.float32, (16, 16, 16, 1, 4, 1), False),
        (3, 40, 24, 8, 2, torch.float32, (16, 16, 16, 1, 4, 1), True),
        (37, 72, 40, 8, 2, torch.float32, (16, 32, 32, 4, 4, 1), True),  # GROUP_M 4, ragged group
        (70, 64, 48, 8, 2, torch.float32, (32, 16, 64, 2, 4, 1), True),  # K < BLOCK_K on down
        (5, 48, 20, 128, 8, torch.float32, (16, 16, 16, 1, 4, 1), False),
        (20, 48, 20, 128, 8, torch.float32, (16, 32, 16, 8, 4, 1), True),
        (1, 40, 24, 8, 2, torch.bfloat16, (16, 16, 16, 1, 4, 1), False),
        (29, 72, 40, 8, 2, torch.bfloat16, (16, 32, 32, 4, 4, 1), True),
        (9, 48, 20, 128, 8, torch.bfloat16, (16, 16, 32, 1, 4, 1), True),
        (13, 40, 24, 8, 2, torch.float16, (16, 16, 16, 2, 4, 1), True),
        (0, 40, 24, 8, 2, torch.float32, (16, 16, 16, 1, 4, 1), False),
        (11, 64, 32, 8, 2, torch.float32, None, True),  # the built-in config (moe_config)
    ]
    ok = True
    for i, (T, H, I, E, k, dtype, config, skew) in enumerate(cases):
        if T == 0:
            x, w13, w2, experts, w = moe_inputs(0, H, I, E, k, dtype, "cpu", seed0)
            good = fused_moe(x, w13, w2, experts, w).shape == (0, H)
            print(f"T=0: {'ok' if good else 'BAD'}")
            ok &= good
            continue
        err, err_torch = check_layer(T, H, I, E, k, dtype, config, seed0 + i, skew)
        # As close as the torch path in the same dtype (the kernel rounds where it does; only sums differ).
        good = err < TOL[dtype] and err <= max(1.5 * err_torch, TOL[dtype] / 4)
        ok &= good
        print(f"T={T} H={H} I={I} E={E} k={k} {str(dtype)[6:]} {config} skew={skew}: rel err {err:.2e} "
              f"(torch {str(dtype)[6:]} path {err_torch:.2e}) {'ok' if good else 'FAIL'}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
