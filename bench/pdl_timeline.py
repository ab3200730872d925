#!/usr/bin/env python
"""The decode path of issue 15: K1 -> K2 by programmatic dependent launch, timed and put on a timeline.

Per projection of one Qwen3-8B layer (qkv 4096->6144 in 3 slices, o 4096->4096, gate_up 4096->24576 in 2
slices, down 12288->4096) and for the four together (the layer), one rank-64 adapter on every token,
M in {1, 4, 16, 64}, both engine modes (w8a8, w8a16), three arms of rlfp8.kernels.fp8_lora_linear:
  base   : no adapter (W8A16: K2; W8A8: K2 quantizing x itself at <= 16 tokens (knob k2_quant_x_tokens, the
           default), the activation quantizer + K2 above), our own no-adapter layer
  stream : K1 + K2 in plain stream order (kernel knob pdl=off)
  pdl    : K1 + K2, K2 as K1's programmatic dependent (pdl=on); W8A8 quantizes x in K2 (<= 16 tokens) or in its
           own kernel before K1 (knob pdl_w8a8_quant=separate, the default), so K2 waits for K1 only before its
           epilogue
  k1_in_k2 : K1's programs as the first programs of K2's grid, one launch, K2 waiting on their counter before
           its epilogue (knob k1_in_k2=on; W8A8: the quantizer, then that grid as its dependent)
  pdl_fused (W8A8 only): the same as pdl with K1 quantizing x beside its shrink, K2 waiting before its main loop
           (pdl_w8a8_quant=fused, k2_quant_x_tokens=0: the earlier default), timed in the same paired replays
Times: median µs of --reps CUDA-graph replays, L2 flushed before each, the three graphs replayed in turn
(bench/kernel_bench.py Timer.paired_us). Overhead ratio = (pdl - base) / (stream - base): how much of the
adapter's cost PDL leaves.

Timeline (a child process, since the stamps change the kernels): %globaltimer stamps (rlfp8/kernels/
timeline.py, off in every production path) at K1's start/end (earliest/latest program), K2's start
(earliest), program 0's wait enter/exit and main-loop end, K2's end (latest), median of --timeline-reps
replays. Reported per projection: K1's span, K2's offset from K1's start, program 0's first-wave main loop
(stream arm: no wait inside), its wait under PDL, and the exposed K1 = the PDL pair's span minus K2's span
alone (stream arm). The overlap hides K1 when K2's first-wave main loop outlasts what is left of K1 after
K2 starts (W8A16, and W8A8 with x quantized before K1; with K1 quantizing, W8A8 waits before its main loop,
so only the launch and the L2 prefetch overlap).
The globaltimer's update interval bounds the stamps' resolution: the JSON gives the gcd of the K1-start to
K2-end spans seen (globaltimer_gcd_ns; ~1000 would mean a 1 µs update interval).

    python bench/pdl_timeline.py --out bench/results/pdl_timeline_h200.json      # H200: < 3 min
    python bench/pdl_timeline.py --rank 32 --no-timeline --out ...   # the adapter's cost at half its bytes
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (12288, 12288)),
          "down": (12288, (4096,))}
MS = (1, 4, 16, 64)
MODES = ("w8a8", "w8a16")
RANK = 64                                             # the issue's rank (--rank scans others)
ARMS = ("base", "stream", "pdl", "k1_in_k2")
TIMELINE_ARMS = ("stream", "pdl", "k1_in_k2")         # the arms whose K1 and K2 are stamped
ADAPTER_ARMS = ("pdl", "k1_in_k2")                    # the decode paths held to the issue's lines
W8A8_ARMS = ARMS + ("pdl_fused",)


def arms_of(mode: str) -> tuple:
    return W8A8_ARMS if mode == "w8a8" else ARMS
ACCEPT_RATIO, ACCEPT_EXPOSED_US = 1.06, 2.0          # issue 15: layer <= 1.06x no-adapter, <= 2 us exposed
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--reps", type=int, default=100, help="CUDA-graph replays per timed arm (median)")
    ap.add_argument("--timeline-reps", type=int, default=30, help="stamped replays per timeline case (median)")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 4), help="parallel compile workers")
    ap.add_argument("--rank", type=int, default=RANK,
                    help="the adapters' rank (the issue's lines are at 64; other ranks: how the cost follows the rank)")
    ap.add_argument("--no-timeline", action="store_true", help="timings only, no stamped child")
    ap.add_argument("--timeline-worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------------ problems
def problems(rank: int = RANK):
    """{proj: (x per M, q, w_scale, A slices, B slices, meta per M)} on the GPU, fixed seeds, adapters of `rank`."""
    import torch
    from rlfp8.kernels import fp8
    from rlfp8.kernels.metadata import build_lora_meta
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (K, widths) in SHAPES.items():
        q, sw = fp8.quantize_weight_ref(torch.randn(sum(widths), K, device="cuda", generator=g) * 0.02)
        A = [(torch.randn(1, rank, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in widths]
        B = [(torch.randn(1, n, rank, device="cuda", generator=g) * 0.05).to(torch.bfloat16) for n in widths]
        xs = {M: torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16) for M in MS}
        metas = {M: build_lora_meta(torch.zeros(M, dtype=torch.long, device="cuda"), 1) for M in MS}
        out[name] = (xs, q, sw, A, B, metas)
    return out


def arm_fn(probs, projs, M, mode, arm):
    """fn() running `arm` of the projections `projs` at M tokens (the knob is read while fn is captured)."""
    from rlfp8.kernels.knobs import restore_knobs, set_knobs
    from rlfp8.kernels.projection import fp8_lora_linear

    def fn():
        saved = set_knobs(pdl="off" if arm == "stream" else "on",
                          pdl_w8a8_quant="fused" if arm == "pdl_fused" else "separate",
                          k1_in_k2="on" if arm == "k1_in_k2" else "off",
                          **({"k2_quant_x_tokens": 0} if arm == "pdl_fused" else {}))
        try:
            for p in projs:
                xs, q, sw, A, B, metas = probs[p]
                if arm == "base":
                    fp8_lora_linear(xs[M], q, sw, mode=mode)
                else:
                    fp8_lora_linear(xs[M], q, sw, A, B, metas[M], mode=mode)
        finally:
            restore_knobs(saved)
    return fn


def precompile(probs, jobs, arms=W8A8_ARMS, initializer=None, initargs=()):
    from rlfp8.kernels import _triton_utils as tu
    with tu.collect_launches() as rec:
        for mode in MODES:
            for M in MS:
                for arm in (a for a in arms if a in arms_of(mode)):
                    arm_fn(probs, list(SHAPES), M, mode, arm)()
    info = tu.precompile(rec, jobs=jobs, initializer=initializer, initargs=initargs)
    log(f"precompiled {info['kernels']} kernels in {info['seconds']} s, errors: {info['errors']}")
    return info


# ------------------------------------------------------------------------------------------------ timing
def time_arms(probs, reps):
    """Rows {proj, M, mode, base_us, stream_us, pdl_us, overhead_ratio, pdl_over_base (+ W8A8: pdl_fused_us,
    pdl_fused_over_base)}; proj "layer" = all four."""
    from kernel_bench import Timer                    # paired CUDA-graph replays, L2 flushed
    timer = Timer(reps)
    rows = []
    for mode in MODES:
        for M in MS:
            for proj in list(SHAPES) + ["layer"]:
                projs = list(SHAPES) if proj == "layer" else [proj]
                base, stream, pdl, in_k2, *fused = timer.paired_us([arm_fn(probs, projs, M, mode, a)
                                                                    for a in arms_of(mode)])
                row = dict(proj=proj, M=M, mode=mode, base_us=round(base, 2), stream_us=round(stream, 2),
                           pdl_us=round(pdl, 2), pdl_over_base=round(pdl / base, 4),
                           k1_in_k2_us=round(in_k2, 2), k1_in_k2_over_base=round(in_k2 / base, 4),
                           overhead_ratio=round((pdl - base) / (stream - base), 3) if stream > base else None)
                if fused:
                    row.update(pdl_fused_us=round(fused[0], 2), pdl_fused_over_base=round(fused[0] / base, 4))
                rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ timeline
def _replay_stamps(graph, buf, init, flush, reps):
    """Per replay (L2 flushed first): the stamp buffer as {slot name: ns}."""
    import torch
    from rlfp8.kernels import timeline
    seen = []
    for _ in range(reps):
        buf.copy_(init)
        flush.zero_()
        graph.replay()
        torch.cuda.synchronize()
        vals = buf.tolist()
        seen.append({n: vals[i] for i, n in enumerate(timeline.SLOT_NAMES)})
    return seen


def _durations(s, arm):
    """µs between the stamps of one replay (None where a stamp is missing in this arm)."""
    us = lambda a, b: (s[b] - s[a]) / 1e3 if s[a] not in (0, _UNSET) and s[b] not in (0, _UNSET) else None
    d = dict(k1_us=us("k1_start", "k1_end"), k2_offset_us=us("k1_start", "k2_start"),
             k2_us=us("k2_start", "k2_end"), pair_us=us("k1_start", "k2_end"),
             prog0_mainloop_us=us("k2_start", "k2_mainloop_end"))
    if arm != "stream":
        d.update(prog0_before_wait_us=us("k2_start", "k2_wait_enter"), prog0_wait_us=us("k2_wait_enter", "k2_wait_exit"),
                 k1_end_to_wait_exit_us=us("k1_end", "k2_wait_exit"))
    return d


_UNSET = 2**62


def timeline_worker(out: str, reps: int, jobs: int, rank: int = RANK) -> None:
    """Child process: stamps on (before any compile), one graph per (proj, M, mode, arm), medians of reps."""
    import torch
    from rlfp8.kernels import timeline
    buf = torch.zeros(timeline.SLOTS, dtype=torch.int64, device="cuda")
    timeline.enable(buf.data_ptr())
    init = torch.tensor([0 if n in timeline.MAX_SLOTS else _UNSET for n in timeline.SLOT_NAMES]
                        + [0] * (timeline.SLOTS - len(timeline.SLOT_NAMES)), dtype=torch.int64, device="cuda")
    probs = problems(rank)
    precompile(probs, jobs, arms=TIMELINE_ARMS, initializer=timeline.enable, initargs=(buf.data_ptr(),))
    from kernel_bench import Timer
    timer, rows, steps = Timer(1), [], []
    for mode in MODES:
        for M in MS:
            for proj in SHAPES:
                row = dict(proj=proj, M=M, mode=mode)
                for arm in TIMELINE_ARMS:
                    graph = timer._capture(arm_fn(probs, [proj], M, mode, arm))
                    stamps = _replay_stamps(graph, buf, init, timer.flush, reps)
                    steps += [abs(s["k2_end"] - s["k1_start"]) for s in stamps]
                    per = [_durations(s, arm) for s in stamps]
                    for k in per[0]:
                        vals = [p[k] for p in per if p[k] is not None]
                        row[f"{arm}_{k}"] = round(statistics.median(vals), 3) if vals else None
                rows.append(row)
    quantum = math.gcd(*[int(v) for v in steps if v]) if steps else None
    Path(out).write_text(json.dumps(dict(rows=rows, globaltimer_gcd_ns=quantum)))


def derive(row):
    """The timeline's verdict per projection: exposed K1 and the issue's condition for hiding it (PDL arm); the
    exposed K1 of the k1_in_k2 arm the same way (its grid's span minus K2's span alone)."""
    exposed = None if row["pdl_pair_us"] is None else round(row["pdl_pair_us"] - row["stream_k2_us"], 3)
    left_of_k1 = None if row["pdl_k1_us"] is None else row["pdl_k1_us"] - (row["pdl_k2_offset_us"] or 0)
    first_wave = row["stream_prog0_mainloop_us"]
    in_k2 = row.get("k1_in_k2_pair_us")
    row.update(exposed_k1_us=exposed, first_wave_mainloop_us=first_wave,
               k1_left_after_k2_start_us=None if left_of_k1 is None else round(left_of_k1, 3),
               hidden_condition=None if None in (first_wave, left_of_k1) else bool(first_wave >= left_of_k1),
               k1_in_k2_exposed_k1_us=None if in_k2 is None else round(in_k2 - row["stream_k2_us"], 3))
    return row


# ------------------------------------------------------------------------------------------------ report
def acceptance(times, timeline_rows, rank=RANK):
    """Issue 15's layer-level lines per (adapter arm, mode, M <= 16): the arm's layer <= 1.06x the base layer;
    exposed K1 summed over the four projections <= 2 us. The lines are the issue's at rank 64 only."""
    out = []
    for arm in ADAPTER_ARMS:
        key = "exposed_k1_us" if arm == "pdl" else f"{arm}_exposed_k1_us"
        for mode in MODES:
            for M in (1, 4, 16):
                lay = next(r for r in times if r["proj"] == "layer" and r["M"] == M and r["mode"] == mode)
                exp = [r.get(key) for r in timeline_rows if r["M"] == M and r["mode"] == mode]
                exposed = round(sum(exp), 3) if exp and None not in exp else None
                ratio = lay[f"{arm}_over_base"]
                out.append(dict(arm=arm, mode=mode, M=M, rank=rank, issue_line=rank == RANK, layer_over_base=ratio,
                                ratio_ok=ratio <= ACCEPT_RATIO,
                                exposed_k1_layer_us=exposed,
                                exposed_ok=None if exposed is None else exposed <= ACCEPT_EXPOSED_US))
    return out


def summary_lines(times, timeline_rows):
    tl = {(r["proj"], r["M"], r["mode"]): r for r in timeline_rows}
    for r in times:
        t = tl.get((r["proj"], r["M"], r["mode"]), {})
        extra = ""
        if t:
            extra = (f" | K1 {t['pdl_k1_us']} us, K2 first wave {t['first_wave_mainloop_us']} us, "
                     f"exposed K1 {t['exposed_k1_us']} us, hidden={t['hidden_condition']}")
        fused = f"  (K1 quantizing: {r['pdl_fused_us']:7.2f} us)" if "pdl_fused_us" in r else ""
        if t:
            extra += f" | k1_in_k2 exposed K1 {t['k1_in_k2_exposed_k1_us']} us"
        print(f"{r['mode']:5s} M={r['M']:<3d} {r['proj']:7s} base {r['base_us']:7.2f}  stream {r['stream_us']:7.2f}  "
              f"pdl {r['pdl_us']:7.2f} us{fused}  pdl/base {r['pdl_over_base']:.3f}  k1_in_k2 {r['k1_in_k2_us']:7.2f} us "
              f"({r['k1_in_k2_over_base']:.3f}x base)  overhead pdl/stream {r['overhead_ratio']}{extra}", flush=True)


def _meta(a):
    import torch
    import triton
    from rlfp8.kernels.knobs import ENV_VARS
    # the knobs set from the environment (an A/B's variants differ only there): the arms set the rest themselves
    env = {var: os.environ[var] for var in ENV_VARS if var in os.environ}
    return dict(command=" ".join([*(f"{k}={v}" for k, v in env.items()), sys.executable, *sys.argv]),
                gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat(),
                rank=a.rank, reps=a.reps, timeline_reps=a.timeline_reps,
                git=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip())


def _run_timeline_child(a):
    with tempfile.TemporaryDirectory() as d:
        tmp = os.path.join(d, "timeline.json")
        cmd = [sys.executable, __file__, "--timeline-worker", "--out", tmp, "--timeline-reps",
               str(a.timeline_reps), "--jobs", str(a.jobs), "--rank", str(a.rank)]
        p = subprocess.run(cmd, cwd=ROOT)
        if p.returncode != 0:                # keep the timings; the JSON says the timeline is missing and why
            log(f"timeline child failed (rc {p.returncode}): {' '.join(cmd)}")
            return dict(rows=[], globaltimer_gcd_ns=None, error=f"rc {p.returncode}: {' '.join(cmd)}")
        return json.loads(Path(tmp).read_text())


def main(argv=None):
    a = _args(argv)
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench/pdl_timeline.py needs an sm_90+ GPU (programmatic dependent launch)")
    sys.path.insert(0, str(ROOT / "bench"))
    if a.timeline_worker:
        return timeline_worker(a.out, a.timeline_reps, a.jobs, a.rank)
    from rlfp8.kernels import dispatch
    probs = problems(a.rank)
    precompile(probs, a.jobs)
    dispatch.reset_report()
    times = time_arms(probs, a.reps)
    if a.no_timeline:
        tl = dict(rows=[], globaltimer_gcd_ns=None, error="not run (--no-timeline)")
    else:
        log("timed; timeline child ...")
        tl = _run_timeline_child(a)
    timeline_rows = [derive(r) for r in tl["rows"]]
    summary_lines(times, timeline_rows)
    acc = acceptance(times, timeline_rows, a.rank)
    for r in acc:
        print(f"acceptance {r}")
    result = dict(meta=_meta(a), dispatch=dispatch.report(), times=times, timeline=timeline_rows,
                  globaltimer_gcd_ns=tl["globaltimer_gcd_ns"], timeline_error=tl.get("error"), acceptance=acc)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
