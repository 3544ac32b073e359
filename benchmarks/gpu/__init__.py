"""The GPU benchmark (``python -m benchmarks.bench_gpu``), one module per family of sections: ceilings.py,
kernels.py (no engine), hf.py (HF transformers), runner.py (ModelRunner.forward on hand-made batches),
engine.py (the whole engine, and the ablations); common.py (model shapes, results, timing, the engine),
registry.py (the sections in run order and what each needs), table.py (the summary), cli.py (the flags);
kernel_checks.py (kernel errors vs float64, shared with tests/gpu)."""
