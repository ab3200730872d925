"""bench/serve.py without a GPU: the ratios it reports (ours / the baseline, same metric) and its refusals before
any engine starts (an --out file of another graph mode, an unknown engine)."""
import json

import pytest

from tests.bench_scripts import load_bench_script



@pytest.fixture()
def serve():
    return load_bench_script("serve")


def test_ratios_are_ours_over_the_baseline(serve):
    engines = {"ours_w8a8": {"tpot_ms": {"lora1": 5.0, "base": 4.0}, "tput_tok_s": {"tenants32": 6000.0},
                             "tput_cold_tok_s": {"tenants32": 2000.0}},
               "vllm_fp8": {"tpot_ms": {"lora1": 7.5, "base": 4.0}, "tput_tok_s": {"tenants32": 5000.0},
                            "tput_cold_tok_s": {"tenants32": 4000.0}},
               "vllm_bf16": {"error": "no engine"}}
    r = serve.ratios(engines)
    assert r["ours_w8a8_lora1_tpot_vs_vllm_fp8_lora1"] == pytest.approx(5.0 / 7.5)
    assert r["ours_w8a8_tenants32_tput_vs_vllm_fp8"] == pytest.approx(1.2)               # steady state
    assert r["ours_w8a8_tenants32_cold_tput_vs_vllm_fp8"] == pytest.approx(0.5)          # first full run
    assert r["ours_w8a8_base_tpot_vs_vllm_fp8"] == pytest.approx(1.0)
    assert not any(k.startswith("ours_w8a16") for k in r)          # an engine that failed gives no ratio


def test_ratios_only_within_one_run(serve):
    one, other = {"command": "serve.py --engines ours_w8a8,vllm_fp8", "date": "d1"}, {"command": "c2", "date": "d2"}
    engines = {"ours_w8a8": {"tpot_ms": {"lora1": 5.0}, "run": one},
               "vllm_fp8": {"tpot_ms": {"lora1": 8.0}, "run": one},
               "ours_w8a16": {"tpot_ms": {"lora1": 6.0}, "run": other},
               "vllm_bf16": {"tpot_ms": {"lora1": 9.0}, "run": other}}
    r = serve.ratios(engines)
    assert r["ours_w8a8_lora1_tpot_vs_vllm_fp8_lora1"] == pytest.approx(5.0 / 8.0)
    assert r["ours_w8a16_lora1_tpot_vs_vllm_bf16_lora1"] == pytest.approx(6.0 / 9.0)
    assert "ours_w8a16_lora1_tpot_vs_ours_w8a8" not in r            # two calls: not one run


def test_one_file_holds_one_graph_mode(serve, tmp_path):
    out = tmp_path / "serve.json"
    out.write_text(json.dumps({"engines": {"vllm_fp8": {}}}))       # written before --graphs existed: compiled
    with pytest.raises(SystemExit, match="--graphs compiled.*another --out"):
        serve.main(["--out", str(out), "--graphs", "decode", "--engines", "vllm_fp8", "--work", str(tmp_path / "w")])
    with pytest.raises(SystemExit, match="not in"):
        serve.main(["--out", str(tmp_path / "new.json"), "--engines", "ours_w4", "--work", str(tmp_path / "w")])
    assert serve.GRAPH_MODES["decode"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert serve.GRAPH_MODES["decode"]["cudagraph_capture_sizes"] == serve.GRAPH_MODES["compiled"]["cudagraph_capture_sizes"]


def test_kernel_summary_groups_gpu_time_per_token(serve):
    kernels = [("_lora_gemm_kernel", 600.0, 10), ("_lora_gemm_rs_kernel", 200.0, 2), ("_lora_shrink_kernel", 100.0, 5),
               ("_quant_rows_kernel", 50.0, 10), ("nvjet_tst_128x64_64x4", 300.0, 4),
               ("flash::flash_fwd_splitkv_kernel", 100.0, 3), ("vllm::rms_norm_kernel", 40.0, 9),
               ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<", 50.0, 2),
               ("Memcpy HtoD (Pageable -> Device)", 10.0, 1)]
    s = serve.kernel_summary(kernels, wall_s=0.002, tokens=10)
    per = s["us_per_token"]
    assert per["gemm+lora epilogue (rlfp8 K2)"] == pytest.approx(80.0)
    assert per["lora shrink (K1 / vLLM's)"] == pytest.approx(10.0) and per["activation quant"] == pytest.approx(5.0)
    assert per["gemm (cuBLAS / CUTLASS)"] == pytest.approx(30.0) and per["attention + KV cache"] == pytest.approx(15.0)
    assert per["norm / activation / rope"] == pytest.approx(4.0) and per["other"] == pytest.approx(1.0)
    assert list(per)[0] == "gemm+lora epilogue (rlfp8 K2)"                     # costliest group first
    assert s["gpu_busy_fraction"] == pytest.approx(1450.0 / 2000.0)
    assert s["top_kernels"][0] == {"name": "_lora_gemm_kernel", "us": 600.0, "calls": 10}
