"""Alias of upstream's older ``sglang.backend`` package (today ``sglang.lang.backend``), which older upstream programs
and tests still import (``from sglang.backend.runtime_endpoint import RuntimeEndpoint``): its modules re-export
sglang_backend.lang.backend's."""
