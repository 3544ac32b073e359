"""The LLaVA benchmark runs end to end in smoke mode (tiny model, CPU) and writes well-formed JSON."""

from __future__ import annotations

import json

from benchmarks import bench_llava as bench


def test_llava_bench_smoke(tmp_path):
    out = tmp_path / "llava_smoke.json"
    bench.main(["--smoke", "--no-progress", "--output", str(out)])
    data = json.loads(out.read_text())
    res = data["results"]
    assert set(res) == {"hf", "ours", "ours_no_radix", "ours_unique_images"}
    n, m = data["config"]["num_questions"], data["config"]["num_images"]
    for name, r in res.items():
        assert r["output_tokens"] == n * data["config"]["max_new_tokens"], name
        assert r["questions_per_s"] > 0 and r["speedup_vs_hf"] > 0
    # Each distinct image is encoded once with the image cache; every question's own image without it.
    assert res["ours"]["vision_encoder_images"] == m and res["ours_unique_images"]["vision_encoder_images"] == n
    assert res["ours"]["cache_hit_rate"] > 0.3 and res["ours_no_radix"]["cache_hit_rate"] == 0
    assert res["ours_unique_images"]["cached_tokens"] < res["ours"]["cached_tokens"]
    assert data["correctness"]["outputs_match"] is True
