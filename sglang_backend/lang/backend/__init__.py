"""Alias of upstream's ``sglang.lang.backend`` package (upstream's singular name): its modules re-export the
backends of sglang_backend.lang.backends."""
