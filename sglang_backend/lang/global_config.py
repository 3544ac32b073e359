"""Process-wide settings of the DSL, under upstream SGLang's name (``sgl.global_config``)."""

from __future__ import annotations


class GlobalConfig:
    def __init__(self):
        # 0: quiet; 2: print each program's final text after ``run``.
        self.verbosity = 0
        # What ``set_default_backend`` sets and ``run`` uses when no backend is passed.
        self.default_backend = None
        # ``run_batch`` traces the program and pre-caches its constant prefix (see SglFunction.cache).
        self.enable_precache_with_tracing = True
        # Upstream's KV-level concatenation for ``join("concate_and_append")``; here joins always append text,
        # so this flag is accepted and has no effect.
        self.enable_parallel_encoding = True
        # Kept for programs that set them; decoding options travel per request (sampling params) here.
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True


global_config = GlobalConfig()
