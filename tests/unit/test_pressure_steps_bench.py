"""benchmarks/peers/pressure_steps.py on the CPU (tiny model, small scale): the steps are timed and classified, the
host tier's calls are counted, and the JSON says what ran."""

from __future__ import annotations

import json

from benchmarks.peers import pressure_steps


def test_pressure_steps_smoke(tmp_path):
    out = tmp_path / "steps.json"
    result = pressure_steps.main(["--smoke", "--programs", "chat_under_pressure",
                                  "--engine-arg", "max_total_tokens=512", "--engine-arg", "kv_host_size=8192",
                                  "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    chat = result["programs"]["chat_under_pressure"]
    assert chat["well_formed"] and chat["seconds"] > 0
    steps = chat["steps"]
    assert steps["prefill"]["n"] == chat["stats"]["num_prefill_batches"]
    assert steps["decode"]["n"] == chat["stats"]["num_decode_batches"] > 0
    assert sum(chat["decode_steps_by_batch_size_bucket_of_4"].values()) == steps["decode"]["n"]
    # The pool is too small for the histories: the tier was written and its copies timed.
    assert chat["stats"]["kv_host_written_tokens"] > 0 and chat["host_seconds"]["host.backup"] > 0
