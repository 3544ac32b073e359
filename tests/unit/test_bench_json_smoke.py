"""The JSON-decoding benchmark runs end to end (tiny model) and reports well-formed numbers."""

import re


def test_json_decode_bench_smoke(tmp_path):
    from benchmarks.bench_json_decode import REGEX, main

    result = main(["--smoke", "--output", str(tmp_path / "jd.json")])
    jf, nojf = result["results"]["jump_forward"], result["results"]["no_jump_forward"]
    assert jf["all_match"] and nojf["all_match"]
    assert all(re.fullmatch(REGEX, t) for t in jf["texts"])
    # Jump-forward appends forced keys in one step: fewer forward passes per output token.
    assert jf["jump_forwards"] > 0 and nojf["jump_forwards"] == 0
    assert jf["forward_passes_per_output_token"] < nojf["forward_passes_per_output_token"] == 1.0
    assert (tmp_path / "jd.json").exists()
