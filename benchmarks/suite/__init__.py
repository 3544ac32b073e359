"""The paper's benchmark suite: LM-program workloads (DSL programs over locally generated data), throughput
and latency modes, cache hit rate vs the optimum, baselines and ablations, plots.

    sglang-backend bench all --smoke                     # every workload, tiny dummy model, CI-sized
    sglang-backend bench mmlu react --preset cpu         # SmolLM2 on CPU
    sglang-backend bench all --preset gpu                # dummy Llama-2-7B shape on one GPU

See ``benchmarks/suite/main.py`` (``--help``) for every option.
"""
