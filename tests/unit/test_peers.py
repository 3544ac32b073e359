"""The peer benchmark (benchmarks/peers) on the CPU: its workloads are deterministic and the same for both
sides, its programs issue the request structure their docstrings describe, the report's ratios point the
documented way, and the real ours-only run goes end to end with the tiny model (JSON, Markdown, PNG)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from benchmarks.peers import programs, report, run, sections, workloads
from benchmarks.peers.ours import compare_greedy
from benchmarks.peers.vllm_side import logprob_of
from benchmarks.peers.workloads import FULL, SMOKE, Sizes, specs

VOCAB = 128256


class RecordingClient:
    """Answers every call with well-formed outputs (or, with ``short``, one token too few) and records it."""

    def __init__(self, vocab: int = VOCAB, short: bool = False):
        self.vocab, self.short = vocab, short
        self.calls: list[tuple[str, list[list[int]], object]] = []
        self.outputs: list[list[list[int]]] = []  # per generate call
        self.resets = 0

    def generate(self, prompts, max_tokens):
        self.calls.append(("generate", [list(p) for p in prompts], max_tokens))
        wanted = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        rng = random.Random(len(self.calls))
        self.outputs.append([[rng.randrange(self.vocab) for _ in range(n - self.short)] for n in wanted])
        return self.outputs[-1]

    def generate_regex(self, prompts, regex, max_tokens):
        self.calls.append(("generate_regex", [list(p) for p in prompts], max_tokens))
        text = '{"name": "Paris", "country": "France", "landmark": "the Louvre", "capital": true}'
        return [workloads.TextOutput(text[:-1] if self.short else text, 21, "stop") for _ in prompts]

    def prompt_logprobs(self, prompts, starts):
        self.calls.append(("prompt_logprobs", [list(p) for p in prompts], list(starts)))
        return [[-1.5] * (len(p) - s) for p, s in zip(prompts, starts)]

    def reset(self):
        self.resets += 1


# Workloads -----------------------------------------------------------------------------------------------------
def test_section_prompts_are_deterministic_and_shaped_as_specified():
    for name, spec in specs(FULL).items():
        a, b = spec.prompts(VOCAB), spec.prompts(VOCAB)
        assert a == b, name
        assert spec.prompts(VOCAB, warm=True) != a, name  # the warm-up never pre-fills the timed prompts
        assert len(a) == spec.count and all(len(p) == spec.prompt_len + spec.unique for p in a), name
        assert all(3 <= t < 32000 for p in a for t in p), name
    shared = specs(FULL)["shared_prefix"].prompts(VOCAB)
    assert len({tuple(p[:1024]) for p in shared}) == 1 and len({tuple(p[1024:]) for p in shared}) == 128
    # The same ids as the kit's reference run (random.Random(0), randrange(3, 32000)).
    rng = random.Random(0)
    assert specs(FULL)["offline"].prompts(VOCAB)[0] == [rng.randrange(3, 32000) for _ in range(1024)]


def test_sizes_match_the_brief_and_the_smoke_run_shrinks_them():
    full = specs(FULL)
    assert (full["offline"].count, full["offline"].prompt_len, full["offline"].output_len) == (56, 1024, 1024)
    assert (full["shared_prefix"].count, full["shared_prefix"].unique, full["shared_prefix"].output_len) == (128, 64, 32)
    assert (full["decode_bs64"].count, full["decode_bs64"].output_len) == (64, 256)
    assert (full["cold_prefill"].count, full["cold_prefill"].output_len) == (8, 1)
    assert (full["shared_prefix"].seed, full["shared_prefix"].warm_seed) == (1, 2000)
    small = specs(SMOKE)
    assert all(small[n].count * small[n].prompt_len < full[n].count * full[n].prompt_len for n in full)
    assert all(s.output_len >= 3 for n, s in small.items() if n.startswith("decode"))  # (T(n) - T(1)) / (n - 1)
    assert Sizes(scale=1e-6).n(1024, 8) == 8


def test_small_vocabularies_keep_ids_in_range():
    prompts = specs(SMOKE)["offline"].prompts(1024)
    assert all(3 <= t < 1024 for p in prompts for t in p)


def test_output_checks_catch_bad_outputs():
    assert workloads.outputs_ok([[1, 2], [3, 4]], 2, 2, 10)
    assert not workloads.outputs_ok([[1, 2], [3]], 2, 2, 10)  # short
    assert not workloads.outputs_ok([[1, 2], [3, 10]], 2, 2, 10)  # id out of range
    assert not workloads.outputs_ok([[1, 2]], 2, 2, 10)  # an output missing
    assert workloads.outputs_ok([[1], [3, 4]], 2, [1, 2], 10)
    assert workloads.logprobs_ok([[-0.5, -2.0]], [[5, 6, 7]], [1])
    assert workloads.logprobs_ok([[-2.0]], [[5, 6, 7]], [2])
    assert not workloads.logprobs_ok([[-0.1, -0.5, -2.0]], [[5, 6, 7]], [1])  # one entry too many
    assert not workloads.logprobs_ok([[0.5, -2.0]], [[5, 6, 7]], [1])  # positive
    assert not workloads.logprobs_ok([[float("nan"), -2.0]], [[5, 6, 7]], [1])


def test_sections_expand_groups_in_order():
    assert sections.expand("decode_bs1,programs,decode_bs1") == ["decode_bs1", *programs.PROGRAMS]
    assert sections.expand("all") == [n for n in sections.SECTIONS if n not in programs.PRESSURE_PROGRAMS]
    with pytest.raises(ValueError):
        sections.expand("offline,nope")


def test_a_program_section_reports_its_median_pass():
    """A warm-up pass at a quarter of the size, then program_repeats passes; the median pass is the result and
    one bad pass makes it not well formed."""
    passes = iter([dict(seconds=3.0, well_formed=True), dict(seconds=1.0, well_formed=False),
                   dict(seconds=2.0, well_formed=True)])
    scales = []

    def fake(client, vocab, scale, seed=0):
        scales.append((scale, seed))
        return dict(seconds=9.0, well_formed=True) if seed == 1 else next(passes)

    result = sections.program_section(fake)(None, workloads.Sizes(scale=1.0, program_repeats=3), VOCAB)
    assert scales == [(0.25, 1), (1.0, 0), (1.0, 0), (1.0, 0)]
    assert result["seconds"] == 2.0 and result["times_s"] == [3.0, 1.0, 2.0] and result["well_formed"] is False


# Programs ------------------------------------------------------------------------------------------------------
def generate_calls(client):
    return [(prompts, n) for kind, prompts, n in client.calls if kind == "generate"]


def run_program(name, scale=1.0, seed=0):
    client = RecordingClient()
    result = programs.PROGRAMS[name](client, VOCAB, scale, seed=seed)
    assert client.resets == 1 and result["well_formed"] is True
    assert result["requests"] == sum(len(p) for _, p, _ in client.calls)
    assert result["prompt_tokens"] == sum(len(x) for _, p, _ in client.calls for x in p)
    return client, result


def test_programs_are_deterministic_per_seed():
    for name in programs.PROGRAMS:
        first, second, other = (run_program(name, seed=s)[0].calls for s in (0, 0, 1))
        assert first == second, name
        assert first[0][1] != other[0][1], name


def test_mmlu_is_one_call_behind_one_header():
    client, result = run_program("mmlu")
    (prompts, n), = generate_calls(client)
    assert n == 1 and len(prompts) == result["programs"] == 128
    assert len({tuple(p[:600]) for p in prompts}) == 1 and all(660 <= len(p) <= 700 for p in prompts)


def test_hellaswag_scores_four_endings_per_shared_context():
    client, result = run_program("hellaswag")
    assert [c[0] for c in client.calls] == ["prompt_logprobs"]
    prompts = client.calls[0][1]
    assert len(prompts) == 4 * result["programs"] and result["output_tokens"] == 0
    assert len({tuple(p[:400]) for p in prompts}) == 1
    for i in range(0, len(prompts), 4):
        assert len({tuple(p[:448]) for p in prompts[i:i + 4]}) == 1  # header + the question's context
    assert client.calls[0][2] == [448] * len(prompts)  # only the endings are scored


def test_react_steps_extend_the_previous_prompt_and_output():
    client, result = run_program("react")
    calls = generate_calls(client)
    assert len(calls) == 5 and all(len(p) == 16 and n == 30 for p, n in calls)
    assert result["requests"] == 80 and result["output_tokens"] == 80 * 30
    for k in range(1, 5):
        for prev, prev_out, cur in zip(calls[k - 1][0], client.outputs[k - 1], calls[k][0]):
            assert len(cur) == len(prev) + 30 + 40 and cur[:len(prev) + 30] == prev + prev_out
    assert len({tuple(p[:800]) for p in calls[0][0]}) == 1


def test_tree_of_thought_branches_three_ways_for_three_levels():
    client, result = run_program("tree_of_thought")
    calls = generate_calls(client)
    assert [len(p) for p, _ in calls] == [24, 72, 216] and result["programs"] == 8
    for k, ((parents, n), (children, _)) in enumerate(zip(calls, calls[1:])):
        for i, child in enumerate(children):
            parent, parent_out = parents[i // 3], client.outputs[k][i // 3]
            assert child[:len(parent) + n] == parent + parent_out and len(child) == len(parent) + n + 8
        assert len({tuple(c) for c in children}) == len(children)  # siblings differ


def test_skeleton_of_thought_expands_each_skeleton_five_times():
    client, result = run_program("skeleton_of_thought")
    (skeletons, n1), (expansions, n2) = generate_calls(client)
    assert len(skeletons) == 16 and len(expansions) == 80 and (n1, n2) == (48, 64)
    for i, e in enumerate(expansions):
        s, skeleton = skeletons[i // 5], client.outputs[0][i // 5]
        assert e[:len(s) + 48] == s + skeleton and len(e) == len(s) + 48 + 12


def test_multi_turn_chat_turns_carry_the_history():
    client, result = run_program("multi_turn_chat")
    calls = generate_calls(client)
    assert len(calls) == 4 and all(len(p) == 32 and n == 64 for p, n in calls)
    for k, ((prev, _), (cur, _)) in enumerate(zip(calls, calls[1:])):
        assert all(c[:len(p) + 64] == p + o and len(c) == len(p) + 64 + 60
                   for p, o, c in zip(prev, client.outputs[k], cur))
    assert len({tuple(p[:200]) for p in calls[0][0]}) == 1  # one system prompt


@pytest.mark.parametrize("name, shared, opening, out_len, added", [
    ("agents_under_pressure", 1000, 3000, 32, 60),
    ("chat_under_pressure", 300, 1800, 96, 80),
])
def test_programs_under_pressure_extend_histories_with_other_users_between(name, shared, opening, out_len, added):
    client = RecordingClient()
    result = programs.PRESSURE_PROGRAMS[name](client, VOCAB, 1.0)
    assert client.resets == 1 and result["well_formed"] is True and result["programs"] == 32
    calls = generate_calls(client)
    steps, others = calls[0::2], calls[1::2]
    assert len(steps) == len(others) == 6
    assert all(len(p) == 32 and n == out_len for p, n in steps) and all(len(p) == 8 and n == 1 for p, n in others)
    assert len({tuple(p[:shared]) for p in steps[0][0]}) == 1 and all(len(p) == opening for p in steps[0][0])
    for k in range(1, 6):
        for prev, prev_out, cur in zip(steps[k - 1][0], client.outputs[2 * (k - 1)], steps[k][0]):
            assert cur[:len(prev) + out_len] == prev + prev_out and len(cur) == len(prev) + out_len + added
    assert name in sections.SECTIONS and name not in sections.expand("all")


def test_json_decoding_is_one_constrained_call_behind_one_header():
    client, result = run_program("json_decoding")
    (kind, prompts, max_tokens), = client.calls
    assert kind == "generate_regex" and max_tokens == programs.JSON_MAX_TOKENS and len(prompts) == 64
    assert all(p[:300] == prompts[0][:300] and len(p) == 700 for p in prompts)
    assert len({tuple(p[300:]) for p in prompts}) == 64  # each its own document
    assert result["output_tokens"] == 64 * 21 and result["well_formed"] is True


def test_dspy_rag_is_one_call_behind_the_system_message_and_demos():
    """DSPy's ChatAdapter layout: every prompt starts with the same system message + 4 demo turns (~2k tokens),
    then its own 3 retrieved passages (from one 200-passage corpus) and question; 96 tokens out, one call."""
    client, result = run_program("dspy_rag")
    (prompts, max_tokens), = generate_calls(client)
    assert len(prompts) == 64 and max_tokens == 96 and result["output_tokens"] == 64 * 96
    header = len(prompts[0]) - (4 + 8 + 3 * (3 + 120) + 24 + 45 + 4)  # all but the question's own turn
    assert 1900 < header < 2300 and all(len(p) == len(prompts[0]) for p in prompts)
    assert all(p[:header] == prompts[0][:header] for p in prompts)
    assert len({tuple(p[header:]) for p in prompts}) == 64  # each its own passages and question
    firsts = {tuple(p[header + 15:header + 15 + 120]) for p in prompts}  # the first retrieved passage
    assert len(firsts) < 64  # some questions share it (a 200-passage corpus)


def test_constrained_outputs_must_match_and_be_ended_by_the_grammar():
    regex, ok = programs.JSON_REGEX, '{"name": "A", "country": "B", "landmark": "C", "capital": false}'
    out = workloads.TextOutput
    assert workloads.regex_outputs_ok([out(ok, 9, "stop")] * 2, 2, regex)
    assert not workloads.regex_outputs_ok([out(ok, 9, "stop")], 2, regex)  # one missing
    assert not workloads.regex_outputs_ok([out(ok, 9, "length")], 1, regex)  # cut by max_tokens
    assert not workloads.regex_outputs_ok([out(ok[:-1], 9, "stop")], 1, regex)  # not a full match
    assert programs.PROGRAMS["json_decoding"](RecordingClient(short=True), VOCAB, 1 / 32)["well_formed"] is False


def test_programs_report_bad_outputs():
    result = programs.PROGRAMS["mmlu"](RecordingClient(short=True), VOCAB, 1 / 32)
    assert result["well_formed"] is False


def test_smoke_scale_keeps_every_program_small():
    for name in programs.PROGRAMS:
        _, result = run_program(name, scale=SMOKE.scale)
        assert result["prompt_tokens"] < 5000, name


# Report --------------------------------------------------------------------------------------------------------
def fake_result(ours: dict, peer: dict | None) -> dict:
    runs = {"ours": {"on": {"sections": ours}}}
    if peer is not None:
        runs["vllm"] = {"on": {"sections": peer}}
    return {"meta": {"model": "tiny"}, "runs": runs, "errors": {}}


def test_ratio_above_one_means_ours_is_better_for_rates_and_times():
    assert report.ratio(200.0, 100.0, higher_is_better=True) == 2.0
    assert report.ratio(5.0, 10.0, higher_is_better=False) == 2.0  # ms/step: half the time
    assert report.ratio(None, 10.0, True) is None and report.ratio(3.0, 0.0, True) is None
    result = fake_result({"decode_bs1": {"ms_per_step": 8.0}, "offline": {"output_tok_per_s": 1000.0}},
                         {"decode_bs1": {"ms_per_step": 4.0}, "offline": {"output_tok_per_s": 500.0}})
    by = {r["workload"]: r for r in report.rows(result)}
    assert by["decode_bs1"]["ratio"] == 0.5 and by["offline"]["ratio"] == 2.0
    md = report.markdown(result)
    assert "| decode_bs1 | ms/step | 8.000 | 4.000 | 0.50x |" in md
    assert "| offline | output tok/s | 1,000.0 | 500.0 | 2.00x |" in md


def test_program_suite_geomean_covers_the_programs_both_sides_ran():
    ours = {"mmlu": {"programs_per_s": 4.0}, "react": {"programs_per_s": 1.0}, "offline": {"output_tok_per_s": 9.0},
            "tree_of_thought": {"programs_per_s": 2.0}}
    peer = {"mmlu": {"programs_per_s": 1.0}, "react": {"programs_per_s": 1.0}, "offline": {"output_tok_per_s": 1.0}}
    suite = report.program_geomean(report.rows(fake_result(ours, peer)))
    assert suite == dict(geomean=pytest.approx(2.0), programs=2, of=len(programs.PROGRAMS), lowest="react",
                         lowest_ratio=1.0)
    assert "geometric mean of the ratios 2.00x over 2 of" in report.markdown(fake_result(ours, peer))
    assert report.program_geomean(report.rows(fake_result(ours, None))) is None


def test_rows_without_a_peer_have_no_ratio():
    rows = report.rows(fake_result({"mmlu": {"programs_per_s": 3.0, "well_formed": True}}, None))
    assert rows == [dict(workload="mmlu", cache="on", metric="programs/s", ours=3.0, vllm=None, ratio=None,
                         plot=True, well_formed_ours=True, well_formed_vllm=None)]


# Runner and sides ----------------------------------------------------------------------------------------------
def test_phases_interleave_and_the_check_runs_last_on_our_side():
    order = [(p.side, p.cache, p.sections) for p in run.plan(["offline", "shared_prefix", "check"], "vllm")]
    assert order == [("ours", "on", ["offline", "shared_prefix"]), ("vllm", "on", ["offline", "shared_prefix"]),
                     ("ours", "off", ["shared_prefix", "check"]), ("vllm", "off", ["shared_prefix"])]
    assert [(p.side, p.cache) for p in run.plan(["offline"], "none")] == [("ours", "on")]


def test_only_text_phases_start_vllm_with_a_tokenizer():
    args = run.parse_args(["--model", "tiny", "--out", "x"])
    vllm_ids = run.child_command(args, run.Phase("vllm", "on", ["mmlu"]), "o.json")
    vllm_text = run.child_command(args, run.Phase("vllm", "on", ["mmlu", "json_decoding"]), "o.json")
    ours_text = run.child_command(args, run.Phase("ours", "on", ["json_decoding"]), "o.json")
    assert "--tokenizer" not in vllm_ids and "--tokenizer" not in ours_text  # ours: the model dir's own
    assert vllm_text[vllm_text.index("--tokenizer") + 1] == run.make_model_dir("tiny")
    args.tokenizer = "/tok"
    for side in ("ours", "vllm"):
        cmd = run.child_command(args, run.Phase(side, "on", ["json_decoding"]), "o.json")
        assert cmd[cmd.index("--tokenizer") + 1] == "/tok"


def test_vllm_config_keeps_the_model_shape():
    d = run.vllm_model_dir("llama3-8b")
    cfg = json.loads(open(f"{d}/config.json").read())
    assert cfg["vocab_size"] == 128256 and cfg["rope_theta"] == 500000.0 and cfg["num_key_value_heads"] == 8
    assert cfg["torch_dtype"] == "bfloat16" and cfg["architectures"] == ["LlamaForCausalLM"]


def test_greedy_comparison_allows_partings_only_at_near_ties():
    ref, top = [[1, 2, 3], [4, 5, 6]], [[[[-1.0, 1], [-1.05, 9]]] * 3, [[[-1.0, 4], [-3.0, 9]]] * 3]
    assert compare_greedy(ref, top, [[1, 2, 3], [4, 5, 6]], 0.2) == dict(tokens_equal=True, partings=[], ok=True)
    near = compare_greedy(ref, top, [[1, 9, 9], [4, 5, 6]], 0.2)
    assert near["tokens_equal"] is False and near["ok"] is True and near["partings"][0]["first_diff"] == 1
    far = compare_greedy(ref, top, [[1, 2, 3], [4, 5, 7]], 0.2)
    assert far["ok"] is False and far["partings"][0]["ref_top2_gap"] == pytest.approx(2.0)


def test_vllm_prompt_logprob_entries_are_read_by_token():
    entry = {7: SimpleNamespace(logprob=-0.25), 9: SimpleNamespace(logprob=-3.0)}
    assert logprob_of(None, 7) is None and logprob_of(entry, 9) == -3.0
    assert logprob_of(entry, 8) != logprob_of(entry, 8)  # NaN: flagged by the well-formedness check


def test_ours_only_smoke_run_end_to_end(tmp_path):
    """The real parent and our child processes on the CPU with the tiny model: every section runs, every
    output is well formed, and the JSON, the table and the figure are written (then rewritten by ``report``)."""
    cmd = [sys.executable, "-m", "benchmarks.peers", "--model", "tiny", "--device", "cpu", "--smoke",
           "--peer", "none", "--out", str(tmp_path), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=run.REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "peers_tiny.json").read_text())
    assert result["errors"] == {}
    on, off = result["runs"]["ours"]["on"]["sections"], result["runs"]["ours"]["off"]["sections"]
    assert set(on) == set(sections.SECTIONS) - set(programs.PRESSURE_PROGRAMS) and set(off) == {"shared_prefix", "check"}
    assert all(s["well_formed"] is True for s in [*on.values(), off["shared_prefix"]])
    assert on["decode_bs1"]["ms_per_step"] > 0 and on["offline"]["output_tokens"] == 2 * 32
    assert off["check"]["skipped"].startswith("needs CUDA")
    assert result["runs"]["ours"]["off"]["info"]["disable_radix_cache"] is True
    md = (tmp_path / "peers_tiny.md").read_text()
    assert "| shared_prefix (prefix cache off) | requests/s |" in md and "| react | programs/s |" in md
    png = tmp_path / "peers_tiny.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md_path = tmp_path / "peers_tiny.md"
    md_path.unlink()
    png.unlink()
    again = subprocess.run([sys.executable, "-m", "benchmarks.peers", "report", str(tmp_path / "peers_tiny.json")],
                           capture_output=True, text=True, timeout=60, cwd=run.REPO_ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert md_path.read_text() == md and png.exists()


def test_deadline_ends_the_child_and_its_children(tmp_path):
    """A phase past the deadline is ended with its whole session: the grandchild (as vLLM's engine core) holds
    the output pipe open, so returning at all shows that it was ended too."""
    started = time.monotonic()
    info = run.run_child(["sh", "-c", "sleep 120 & sleep 120"], dict(os.environ), str(tmp_path / "x.log"),
                         deadline=time.time() + 1, quiet=True)
    assert info["timed_out"] is True and info["rc"] != 0
    assert time.monotonic() - started < 30
