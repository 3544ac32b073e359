"""Alias of upstream's ``sglang.srt.constrained`` path (see sglang_backend.srt)."""
