"""The closing summary table of a run: each figure beside its reference (bandwidth floor, matmul rate, HF,
the default configuration). A figure whose section did not run (no ceilings, no HF) shows as "-"."""

from __future__ import annotations

from benchmarks.common import format_table


def ms(x) -> str:
    return f"{x * 1e3:.2f} ms" if x else "-"


def times_floor(x) -> str:
    return f"{x:.3f}x floor" if x is not None else "-"


def decode_rows(o: dict, hf: dict) -> list[list]:
    rows = []
    for bs in (1, 64):
        d = o.get(f"decode_bs{bs}")
        if d:
            rows.append([f"decode step bs={bs} ctx=1k (graph)", ms(d["step_s"]), f"floor {ms(d['floor_s'])}",
                         times_floor(d.get("ratio_to_floor")),
                         f"eager {ms(d.get('step_eager_s'))}; synced {ms(d['step_synced_s'])}; "
                         f"engine {ms(o.get(f'engine_decode_step_bs{bs}_s'))}; HF {ms(hf.get(f'decode_step_bs{bs}_s'))}"])
    p = o.get("prefill_8x1024")
    if p:
        rows.append(["prefill 8x1024", ms(p["time_s"]), f"{p['achieved_flops'] / 1e12:.0f} TFLOP/s",
                     f"{(p['fraction_of_matmul_rate'] or 0) * 100:.0f}% of matmul",
                     f"matmul {(p['matmul_rate'] or 0) / 1e12:.0f} TFLOP/s"])
    return rows


def workload_rows(o: dict, hf: dict) -> list[list]:
    rows = []
    for key, label in (("shared_prefix", "shared prefix (radix on)"),
                       ("shared_prefix_no_radix", "shared prefix (radix off)")):
        s = o.get(key)
        if s:
            hfr = hf.get("shared_prefix_req_per_s")
            rows.append([label, f"{s['req_per_s']:.1f} req/s", f"HF bs32 {hfr:.1f} req/s" if hfr else "HF -",
                         f"{s['req_per_s'] / hfr:.1f}x HF" if hfr else "-", f"{s['time_s']:.2f} s"])
    rs = o.get("runner_shared")
    if rs:
        rows.append([f"decode bs={rs['bs']} shared 1k prefix (cascade)", ms(rs["shared"]),
                     f"private prefixes {ms(rs['private'])}", f"{rs['private'] / rs['shared']:.2f}x faster",
                     f"floor shared {ms(rs.get('floor_shared_s'))}, private {ms(rs.get('floor_private_s'))}"])
    for key, label in (("offline_1k_1k", "offline 1k in / 1k out"),
                       ("offline_1k_1k_no_overlap", "1k/1k, overlap off"),
                       ("offline_1k_1k_no_pdl", "1k/1k, PDL off")):
        f = o.get(key)
        if f:
            rows.append([label, f"{f['output_tok_per_s']:.0f} tok/s", f"{f['num_requests']} requests",
                         f"{f['time_s']:.1f} s", f"retractions {f['retractions']}"])
    return rows


def variant_rows(o: dict) -> list[list]:
    """The runner's decode variants, then the engine loop with PDL or overlap off beside the default."""
    rows = []
    for key in sorted(k for k in o if k.startswith("decode_bs") and k.count("_") >= 2):
        d = o[key]
        rows.append([f"  variant {key[len('decode_'):]}", ms(d["step_s"]), f"floor {ms(d['floor_s'])}",
                     times_floor(d.get("ratio_to_floor")), f"synced {ms(d['step_synced_s'])}"])
    for suffix, label, ref in (("_no_pdl", "PDL off", "default"), ("_no_overlap", "overlap off", "overlap on")):
        for bs in (1, 64):
            e = o.get(f"engine_decode_step_bs{bs}_s{suffix}")
            if e:
                rows.append([f"engine decode bs={bs}, {label}", ms(e), f"{ref} {ms(o.get(f'engine_decode_step_bs{bs}_s'))}",
                             "-", "whole engine loop per step"])
    return rows


def table(name: str, result: dict) -> str:
    o, hf, c = result.get("ours", {}), result.get("hf", {}), result.get("ceilings", {})
    rows = decode_rows(o, hf) + workload_rows(o, hf) + variant_rows(o)
    head = f"{name} on {result.get('env', {}).get('device')}: copy {c.get('copy_bw_Bps', 0) / 1e12:.2f} TB/s"
    return head + "\n" + format_table(["figure", "ours", "reference", "ratio", "notes"], rows)
