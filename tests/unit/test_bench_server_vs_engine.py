"""benchmarks/bench_server_vs_engine.py runs end to end in smoke mode (tiny model: a real server and an Engine)."""

from __future__ import annotations

import json
import math

from benchmarks import bench_server_vs_engine as bench


def test_smoke_run_measures_both_sides_in_both_phases(tmp_path):
    out = tmp_path / "server_vs_engine_smoke.json"
    bench.main(["--smoke", "--output", str(out)])
    data = json.loads(out.read_text())
    assert data["rounds"] == 2 and data["output_len"] == 8
    assert set(data["phases"]) == {"quiet", "loaded"}
    for phase in data["phases"].values():
        for who in ("server", "engine"):
            runs = phase[who]["runs"]
            assert len(runs) == 2
            assert all(math.isfinite(r["decode_tok_s"]) and r["decode_tok_s"] > 0 for r in runs)
            assert all(r["request_s"] > 0 for r in runs)
        assert math.isclose(phase["ratio_server_over_engine"],
                            phase["server"]["decode_tok_s_median"] / phase["engine"]["decode_tok_s_median"])
        assert len(phase["ratio_per_round"]) == 2
