"""The peer benchmark's parent: runs each side in its own child process (own session, so a deadline kill takes
vLLM's engine-core process too), in the order ours (cache on), vLLM (cache on), ours (cache off: shared
prefix, then the triton-vs-torch_native check), vLLM (cache off: shared prefix); merges the children's JSON
into DIR/peers_<model>.json (rewritten after every phase) and writes the report (.md, .png) beside it.

    python -m benchmarks.peers --model llama3-8b --peer vllm --out DIR [--sections ...] [--deadline-s 500]
    python -m benchmarks.peers --model tiny --device cpu --smoke --peer none --out DIR     # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import traceback

from benchmarks.gpu.common import MODELS, architecture, make_model_dir
from benchmarks.peers.child import TAG, write_json
from benchmarks.peers.programs import NOT_COVERED
from benchmarks.peers.report import write_report
from benchmarks.peers.sections import CACHE_OFF_SECTIONS, expand
from benchmarks.peers.vllm_side import ENV_DEFAULTS

OURS_ONLY = ("check",)  # sections of our side only (run last in its cache-off phase)
TEXT_SECTIONS = ("json_decoding",)  # sections whose outputs are text: vLLM then starts with a tokenizer
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What vLLM's log says about the engine it built (first match of each kept).
LOG_PATTERNS = {
    "attention_backend": re.compile(r"Using (\S+) attention backend"),
    "flash_attn_version": re.compile(r"Using FlashAttention version (\S+)"),
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "max_concurrency": re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"),
    "torch_compile_s": re.compile(r"torch.compile took ([\d.]+) s"),
    "graph_capture": re.compile(r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)"),
    "model_load": re.compile(r"Model loading took (\S+) GiB"),
}


RUNNING: dict = {"pid": None}  # the child phase now running (its process group is ended with the parent)


def end_running_child(signum, _frame) -> None:
    """SIGTERM/SIGINT of the parent: end the running child's whole session too (vLLM's engine core included),
    so that no process is left holding the GPU."""
    pid = RUNNING["pid"]
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


@dataclasses.dataclass
class Phase:
    side: str  # "ours" or "vllm"
    cache: str  # "on" or "off"
    sections: list[str]


def plan(sections: list[str], peer: str) -> list[Phase]:
    """The phases in run order (interleaved, so that neither side always runs on a warmer GPU)."""
    shared = [s for s in sections if s not in OURS_ONLY]
    off = [s for s in shared if s in CACHE_OFF_SECTIONS]
    peers = ["vllm"] if peer == "vllm" else []
    phases = [Phase("ours", "on", shared)] + [Phase(p, "on", shared) for p in peers]
    ours_off = off + [s for s in sections if s in OURS_ONLY]
    phases += [Phase("ours", "off", ours_off)] + [Phase(p, "off", off) for p in peers]
    return [p for p in phases if p.sections]


def vllm_model_dir(model: str) -> str:
    """A directory with only the model's config.json, written as a plain dict (as the kit's reference run did:
    vLLM reads it with its own transformers, whatever wrote ours)."""
    spec = MODELS[model]
    if architecture(model) != "LlamaForCausalLM":  # written by transformers' own config class, as ours loads it
        with open(os.path.join(make_model_dir(model), "config.json")) as f:
            config = dict(json.load(f), torch_dtype=spec["dtype"])
    else:
        config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, hidden_act="silu",
                      rope_theta=10000.0, rope_scaling=None, attention_bias=False, mlp_bias=False,
                      tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, torch_dtype=spec["dtype"], use_cache=True)
        config.update(spec["config"])  # the shape (and rope_theta where the model sets one)
    d = f"/tmp/peers_vllm_{model}"
    os.makedirs(d, exist_ok=True)
    write_json(os.path.join(d, "config.json"), config)
    return d


def child_command(args, phase: Phase, out: str) -> list[str]:
    common = ["--out", out, "--sections", ",".join(phase.sections), "--cache", phase.cache]
    common += ["--smoke"] if args.smoke else []
    decodes_text = any(s in TEXT_SECTIONS for s in phase.sections)
    if phase.side == "ours":
        common += ["--tokenizer", args.tokenizer] if args.tokenizer and decodes_text else []
        return [sys.executable, "-m", "benchmarks.peers.ours", "--model", args.model, "--device", args.device,
                "--mem-fraction", str(args.ours_mem_fraction), "--attention-backend", args.ours_attention_backend,
                *[f"--server-arg={a}" for a in args.ours_arg], *common]
    spec = MODELS[args.model]
    if decodes_text:  # the same tokenizer as ours: --tokenizer, else the model dir's dummy one
        common += ["--tokenizer", args.tokenizer or make_model_dir(args.model)]
    return [sys.executable, "-m", "benchmarks.peers.vllm_side", "--model-dir", vllm_model_dir(args.model),
            "--dtype", spec["dtype"], "--vocab", str(spec["config"]["vocab_size"]),
            "--mem-fraction", str(args.vllm_mem_fraction), *[f"--llm-arg={a}" for a in args.vllm_arg], *common]


def child_env(args, side: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    if side == "vllm":
        for key, value in ENV_DEFAULTS.items():
            env.setdefault(key, value)
        site = args.vllm_site
        if site and os.path.isdir(site) and site not in env["PYTHONPATH"].split(os.pathsep):
            env["PYTHONPATH"] = site + os.pathsep + env["PYTHONPATH"]
    elif args.ours_attention_backend == "fa3" and args.vllm_site and os.path.isdir(args.vllm_site):
        # FA3 comes from vLLM's wheel; last on the path, so nothing of ours is shadowed by the kit's packages.
        env["PYTHONPATH"] += os.pathsep + args.vllm_site
    return env


def kill_group(pid: int, state: dict) -> None:
    """The deadline: SIGTERM the child's session, SIGKILL it 5 s later if anything is left."""
    state["timed_out"] = True
    print(f"{TAG} parent] deadline reached: stopping process group {pid}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        time.sleep(5)


def run_child(cmd: list[str], env: dict, log_path: str, deadline: float, quiet: bool) -> dict:
    """Runs one phase, its output teed into ``log_path`` (and to stdout; ``quiet``: our lines only); returns
    rc, seconds, whether the deadline ended it, and what vLLM's log said."""
    found: dict = {}
    state = {"timed_out": False}
    t0 = time.time()
    with open(log_path, "w") as lf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             start_new_session=True, cwd=REPO_ROOT, env=env)
        RUNNING["pid"] = p.pid
        timer = threading.Timer(max(0.0, deadline - time.time()), kill_group, (p.pid, state))
        timer.daemon = True
        timer.start()
        try:
            for line in p.stdout:
                lf.write(line)
                if not quiet or line.startswith(TAG) or "Error" in line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                for key, pattern in LOG_PATTERNS.items():
                    m = pattern.search(line)
                    if m:
                        found.setdefault(key, m.groups() if len(m.groups()) > 1 else m.group(1))
            rc = p.wait()
        finally:
            timer.cancel()
            RUNNING["pid"] = None
    return dict(cmd=cmd, rc=rc, seconds=round(time.time() - t0, 1), timed_out=state["timed_out"],
                log=log_path, log_findings=found)


def sh(cmd: str) -> str | None:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except Exception as e:  # noqa: BLE001 - informational
        return f"<{e!r}>"


def new_result(args, sections: list[str]) -> dict:
    return {"meta": dict(model=args.model, model_config=MODELS[args.model], device=args.device, smoke=args.smoke,
                         peer=args.peer, sections=sections, argv=sys.argv, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         python=sys.version.split()[0], platform=platform.platform(),
                         gpu=sh("nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader"),
                         git_head=source_commit(),
                         deadline_s=args.deadline_s, not_covered=NOT_COVERED),
            "runs": {}, "phases": [], "errors": {}}


def source_commit() -> str:
    """The commit the tree was copied from: $SOURCE_COMMIT where the copy's .git (if any) is not that tree's."""
    return os.environ.get("SOURCE_COMMIT") or sh(f"git -C {REPO_ROOT} rev-parse HEAD 2>/dev/null")


def merge_phase(result: dict, phase: Phase, info: dict, phase_out: str) -> None:
    """The child's JSON into ``result["runs"][side][cache]``; its errors, and sections it never finished, into
    ``result["errors"]``; versions and engine facts into the meta."""
    key = f"{phase.side}:{phase.cache}"
    try:
        with open(phase_out) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        result["errors"][key] = (f"no phase JSON ({e!r}); rc={info['rc']} timed_out={info['timed_out']}; "
                                 f"see {info['log']}")
        return
    result["runs"].setdefault(phase.side, {})[phase.cache] = doc
    for name, tb in doc.get("errors", {}).items():
        result["errors"][f"{key}:{name}"] = tb
    for name in phase.sections:
        if name not in doc.get("sections", {}) and name not in doc.get("errors", {}):
            result["errors"][f"{key}:{name}"] = (f"did not finish (rc={info['rc']}, timed_out={info['timed_out']}); "
                                                 f"see {info['log']}")
    meta, child = result["meta"], doc.get("info", {})
    if phase.side == "ours":
        versions = child.get("versions") or {}
        meta.setdefault("ours_version", versions.get("sglang-backend"))
        meta.setdefault("torch_version", versions.get("torch"))
        meta.setdefault("ours_versions", versions)
        meta.setdefault(f"ours_engine_cache_{phase.cache}", {k: v for k, v in child.items() if k != "versions"})
    else:
        for k in ("vllm_version", "torch_version"):
            meta.setdefault(k, child.get(k))
        meta[f"vllm_engine_cache_{phase.cache}"] = dict(child.get("engine") or {}, llm_init_s=child.get("llm_init_s"),
                                                        log=info.get("log_findings"))
        meta.setdefault("vllm_attention_backend", (info.get("log_findings") or {}).get("attention_backend"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--peer", default="vllm", choices=("vllm", "none"))
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--sections", default="all,check",
                    help="comma list of sections and groups (all, programs; check: ours triton vs torch_native)")
    ap.add_argument("--deadline-s", type=float, default=500, help="phases still running then are killed")
    ap.add_argument("--smoke", action="store_true", help="every size shrunk (CPU, tiny model)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="our engine's device")
    ap.add_argument("--ours-mem-fraction", type=float, default=0.9, help="our mem_fraction_static (our default)")
    ap.add_argument("--ours-attention-backend", default="triton", choices=("triton", "fa3", "flashinfer"),
                    help="our engine's attention backend on the GPU (fa3: FlashAttention 3 from --vllm-site)")
    ap.add_argument("--ours-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="one more ServerArgs field for our engine (repeatable), e.g. disable_cuda_graph=true")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer directory for both sides in the phases that decode text (json_decoding); "
                         "default: the model dir's dummy byte-level BPE")
    ap.add_argument("--vllm-mem-fraction", type=float, default=0.9, help="vLLM's gpu_memory_utilization")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="one more vllm.LLM keyword (repeatable), e.g. quantization=fp8")
    ap.add_argument("--vllm-site", default="/tmp/site", help="put first on the vLLM children's PYTHONPATH if present")
    ap.add_argument("--quiet", action="store_true", help="print only the benchmark's own lines (logs keep all)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer:
        args.tokenizer = os.path.abspath(args.tokenizer)  # the children run from the repo root
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, end_running_child)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    sections = expand(",".join(n for n in names if n not in OURS_ONLY)) + [n for n in OURS_ONLY if n in names]
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"peers_{args.model}.json")
    deadline = time.time() + args.deadline_s
    result = new_result(args, sections)
    write_json(json_path, result)
    for phase in plan(sections, args.peer):
        stem = os.path.join(out_dir, f"peers_{args.model}.{phase.side}_cache_{phase.cache}")
        if deadline - time.time() < 10:
            result["errors"][f"{phase.side}:{phase.cache}"] = "skipped: --deadline-s reached"
            continue
        print(f"{TAG} parent] === {phase.side}, prefix cache {phase.cache}: {','.join(phase.sections)}", flush=True)
        try:
            if os.path.exists(stem + ".json"):
                os.remove(stem + ".json")
            info = run_child(child_command(args, phase, stem + ".json"), child_env(args, phase.side),
                             stem + ".log", deadline, args.quiet)
            result["phases"].append(dict(side=phase.side, cache=phase.cache, sections=phase.sections, **info))
            merge_phase(result, phase, info, stem + ".json")
        except Exception:  # noqa: BLE001 - the other phases still run
            result["errors"][f"{phase.side}:{phase.cache}"] = traceback.format_exc()
        result["meta"]["elapsed_s"] = round(time.time() - deadline + args.deadline_s, 1)
        write_json(json_path, result)
        time.sleep(0 if args.device == "cpu" else 3)  # the finished engine's GPU memory goes back first
    md, png = write_report(result, json_path)
    with open(md) as f:
        print(f.read())
    print(f"{TAG} parent] wrote {json_path}, {md}, {png}", flush=True)
    return 0 if not result["errors"] else 1
