"""Aliases for the ``sglang.srt`` module paths that upstream frontend programs import, so that
``import sglang`` -> ``import sglang_backend`` is the only change they need. Each module here re-exports (or
adapts the signature of) an implementation that lives elsewhere in sglang_backend; no logic is kept here."""
