"""Peer benchmark: the same token-id workloads (offline throughput, shared prefix, decode, cold prefill and
the paper's LM programs) through our engine and through vLLM's offline ``LLM`` API, in one GPU run, side by
side in one JSON, a Markdown table and a PNG. ``python -m benchmarks.peers --help``."""
