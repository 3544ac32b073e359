"""One module per workload. Each defines:

* ``NAME``, ``DESCRIPTION``; ``REUSE`` (the workload has KV reuse to find; the 96%-of-optimal check applies)
  and ``HF`` (the HF transformers peer can run it: no regex constraints, no DSPy);
* ``SIZES``: instance counts and token lengths for the ``smoke``, ``cpu`` and ``gpu`` presets;
* ``instances(tg, **size) -> list[dict]``: the keyword arguments of each program instance, generated with
  ``data.TextGen`` (the model's real tokenizer measures every length);
* ``program``: the DSL ``@function`` run once per instance, or ``run_one(kwargs, backend)`` for workloads
  that are not a single DSL program (the DSPy pipeline).
"""

from __future__ import annotations

import importlib

NAMES = ("mmlu", "hellaswag", "react", "gen_agents", "tree_of_thought", "skeleton_of_thought", "bsm_judge",
         "json_decode", "multi_turn_short", "multi_turn_long", "dspy_rag", "shared_prefix")


def load(name: str):
    if name not in NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)} or 'all'")
    return importlib.import_module(f"{__name__}.{name}")


def describe() -> str:
    return "\n".join(f"  {n:<20} {load(n).DESCRIPTION}" for n in NAMES)
