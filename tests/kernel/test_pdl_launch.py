"""K1 -> K2 by programmatic dependent launch in the engine projection (fp8_lora_linear), on the CPU: the knob
`pdl` and its resolution, the dispatch record "lora_gemm.launch", the launches it asks for (captured, as the
sm_90a compile test does) and, under the interpreter (plain stream order), outputs equal to the launchers
called without PDL and to the fp64 math."""
import pytest
import torch

from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import dispatch, fp8, knobs
from rlfp8.kernels.gemm_triton import lora_gemm_triton
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.projection import fp8_lora_linear
from rlfp8.kernels.shrink_triton import lora_shrink_triton
from tests.conftest import HAS_CUDA, rel_err
from tests.oracles import gemm_fp64

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="CPU resolution of the knob (tests/gpu covers the GPU)")


@pytest.fixture(autouse=True)
def _restore():
    # K1 in its own launch: these tests are about K2 as K1's programmatic dependent (knob k1_in_k2 puts K1 into K2's
    # grid at decode sizes by default: tests/kernel/test_k1_in_k2.py)
    saved = knobs.set_knobs(k1_in_k2="off")
    dispatch.reset_report()
    dispatch.reset_pdl_cache()          # the tests fake GPUs and patch pdl_unavailable: no answer may outlive one
    yield
    knobs.restore_knobs(saved)
    dispatch.reset_pdl_cache()


def _problem(M=5, K=1024, widths=(32, 16, 16), S=2, r=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = sum(widths)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    q, sw = fp8.quantize_weight_ref(torch.randn(N, K, generator=g) * 0.05)
    A = [(torch.randn(S, r, K, generator=g) * 0.1).to(torch.bfloat16) for _ in widths]
    B = [(torch.randn(S, n, r, generator=g) * 0.1).to(torch.bfloat16) for n in widths]
    slots = torch.tensor([1, -1, 0, 1, 0][:M])
    return x, q, sw, A, B, slots, build_lora_meta(slots, S)


def _fake_gpu(monkeypatch, capability):
    """Make pdl_unavailable see a CUDA device of `capability` outside the interpreter (no GPU needed)."""
    dispatch.reset_pdl_cache()
    monkeypatch.setattr(dispatch, "triton_interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")


def test_knob_values_config_key_and_env():
    assert knobs.knobs().pdl == "auto"
    with pytest.raises(ValueError, match=r"kernels\.pdl='yes'.*\('auto', 'on', 'off'\)"):
        knobs.apply_config({"pdl": "yes"})
    assert knobs._env_overrides({"RLFP8_PDL": "off"}) == {"pdl": "off"}
    with pytest.raises(ValueError, match="RLFP8_PDL='1'"):
        knobs._env_overrides({"RLFP8_PDL": "1"})


def test_resolution_names_why_pdl_cannot_run(monkeypatch):
    assert "interpreter" in dispatch.pdl_unavailable(torch.device("cpu"))     # conftest: TRITON_INTERPRET=1
    monkeypatch.setattr(dispatch, "triton_interpreting", lambda: False)
    assert "not a CUDA GPU" in dispatch.pdl_unavailable(torch.device("cpu"))
    _fake_gpu(monkeypatch, (8, 0))
    assert "FakeGPU is sm_80; PDL needs sm_90+" == dispatch.pdl_unavailable(torch.device("cuda"))
    _fake_gpu(monkeypatch, (9, 0))
    assert dispatch.pdl_unavailable(torch.device("cuda")) is None          # this Triton has gdc_*
    from triton.language.extra import cuda as tl_cuda
    monkeypatch.delattr(tl_cuda, "gdc_launch_dependents")
    assert "no tl.extra.cuda.gdc_wait" in dispatch.pdl_unavailable(torch.device("cuda"))


@pytest.mark.parametrize("capability, mode, expect", [((9, 0), "auto", "pdl"), ((8, 9), "auto", "stream"),
                                                      ((9, 0), "off", "stream"), ((9, 0), "on", "pdl"),
                                                      ((8, 0), "on", RuntimeError)])
def test_choose_launch_follows_the_knob_and_records(monkeypatch, capability, mode, expect):
    _fake_gpu(monkeypatch, capability)
    knobs.set_knobs(pdl=mode)
    if expect is RuntimeError:
        with pytest.raises(RuntimeError, match=r"kernel knob pdl=on \(kernels\.pdl / RLFP8_PDL\) but FakeGPU is sm_80"):
            dispatch.choose_launch("lora_gemm", torch.device("cuda"))
        return
    assert dispatch.choose_launch("lora_gemm", torch.device("cuda")) == (expect == "pdl")
    assert dispatch.report() == {"lora_gemm.launch": {expect: 1}}


@pytest.mark.parametrize("mode, w8a8_quant, in_k2", [("w8a16", "separate", 16), ("w8a8", "separate", 0),
                                                     ("w8a8", "fused", 0), ("w8a8", "fused", 16)])
def test_projection_launches_k2_as_k1s_dependent(monkeypatch, mode, w8a8_quant, in_k2):
    """Where PDL resolves on: K1 triggers its dependent and is itself a plain launch; K2 is launched with
    launch_pdl and waits before its epilogue, except W8A8 with pdl_w8a8_quant=fused, where x_q is K1's: then
    before its main loop, after the L2 prefetch of its weight rows. W8A8 separate quantizes x first, in stream
    order, and K1 only shrinks. W8A8 at <= k2_quant_x_tokens tokens (5 here) overrides both: K2 quantizes x
    itself, K1 only shrinks, K2 waits before its epilogue, and no quantizer runs."""
    x, q, sw, A, B, _, meta = _problem()
    monkeypatch.setattr(dispatch, "pdl_unavailable", lambda device: None)
    knobs.set_knobs(pdl_w8a8_quant=w8a8_quant, k2_quant_x_tokens=in_k2, k1_in_k2="off")   # K1 in its own launch
    with dispatch.use_backend("triton"), tu.collect_launches() as rec:
        fp8_lora_linear(x, q, sw, A, B, meta, mode=mode)
    k2_quant = mode == "w8a8" and in_k2 >= x.shape[0]
    apart = mode == "w8a8" and w8a8_quant == "separate" and not k2_quant
    if apart:
        (kq, _, _, kwq), *rec = rec
        assert kq.fn.__name__ == "_quant_rows_kernel" and "launch_pdl" not in kwq and not kwq.get("USE_PDL")
    (k1, _, _, kw1), (k2, _, _, kw2) = rec
    assert k1.fn.__name__ == "_lora_shrink_kernel" and kw1["USE_PDL"] and "launch_pdl" not in kw1
    k1_quant = mode == "w8a8" and not apart and not k2_quant
    assert kw1["QUANT"] == (1 if k1_quant else 0) and kw1["SPLIT_K"] == 2
    assert k2.fn.__name__ == "_lora_gemm_kernel" and kw2["USE_PDL"] and kw2["launch_pdl"] is True
    assert kw2["PDL_WAIT_EARLY"] == (2 if k1_quant else False) and kw2["QUANT_X"] == (1 if k2_quant else 0)
    assert dispatch.report()["lora_gemm.launch"] == {"pdl": 1}
    assert dispatch.report()["lora_gemm.pdl_wait"] == {"main_loop" if kw2["PDL_WAIT_EARLY"] else "epilogue": 1}
    if mode == "w8a8":
        assert dispatch.report()["lora_gemm.x_quant"] == {"k2" if k2_quant else "k1" if k1_quant else "kernel": 1}


def test_w8a8_codes_from_the_quantizer_equal_k1s():
    """pdl_w8a8_quant=separate feeds K2 the quantizer's x_q / x_scale instead of K1's: they must be the same
    bits (interpreter), or W8A8 outputs would depend on the launch mode."""
    from rlfp8.kernels.fp8 import quantize_activation
    x, _, _, A, _, _, meta = _problem(M=5, K=1024)
    x = x * torch.logspace(-3, 3, x.shape[1]).to(torch.bfloat16)       # a wide range of magnitudes per row
    with dispatch.use_backend("triton"):
        so = lora_shrink_triton(x, A, meta, quant="div")
        x_q, x_scale = quantize_activation(x, "div")
    assert torch.equal(so.x_scale, x_scale)
    assert torch.equal(so.x_q.view(torch.uint8), x_q.view(torch.uint8))


def test_without_a_shrink_k2_follows_in_stream_order(monkeypatch):
    """No adapter, or no token with one (meta.no_lora): K1 launches no shrink that could trigger K2 (W8A8 with the
    knob pdl_quant_k2 off: with it on, the quantizer triggers K2: test_w8a8_without_an_adapter_chains_k2_to_the_quantizer)."""
    x, q, sw, A, B, _, _ = _problem()
    monkeypatch.setattr(dispatch, "pdl_unavailable", lambda device: None)
    knobs.set_knobs(pdl_quant_k2=False)
    none = build_lora_meta(torch.full((x.shape[0],), -1), 2)
    with dispatch.use_backend("triton"), tu.collect_launches() as rec:
        fp8_lora_linear(x, q, sw, mode="w8a8")
        fp8_lora_linear(x, q, sw, A, B, none, mode="w8a16")
    assert not any(kw.get("USE_PDL") or kw.get("launch_pdl") for _, _, _, kw in rec)
    assert dispatch.report()["lora_gemm.launch"] == {"stream": 2}


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_interpreter_runs_stream_order_with_unchanged_outputs(mode):
    """Under the interpreter auto resolves to stream order (recorded) and pdl=on raises; the projection's
    output equals the launchers called without PDL, bit for bit, and the fp64 math."""
    x, q, sw, A, B, slots, meta = _problem()
    with dispatch.use_backend("triton"):
        y_auto = fp8_lora_linear(x, q, sw, A, B, meta, mode=mode, out_dtype=torch.float32)
        knobs.set_knobs(pdl="off")
        y_off = fp8_lora_linear(x, q, sw, A, B, meta, mode=mode, out_dtype=torch.float32)
        knobs.set_knobs(pdl="on")
        with pytest.raises(RuntimeError, match="pdl=on .* interpreter"):
            fp8_lora_linear(x, q, sw, A, B, meta, mode=mode)
    assert dispatch.report()["lora_gemm.launch"] == {"stream": 2}
    so = lora_shrink_triton(x, A, meta, quant="div" if mode == "w8a8" else None)
    assert so.workspace is not None                          # split-K K1: its workspace is handed back
    xk, xs = (so.x_q, so.x_scale) if mode == "w8a8" else (x, None)
    y_direct = lora_gemm_triton(xk, q, sw, x_scale=xs, h=so.h, B=B, meta=meta, out_dtype=torch.float32)
    assert torch.equal(y_auto, y_off) and torch.equal(y_auto, y_direct)
    xr, xsr = fp8.quantize_activation_ref(x) if mode == "w8a8" else (x, None)
    h = torch.stack([torch.einsum("tk,trk->tr", x.double(), a[slots.clamp(min=0)].double()) for a in A])
    ref = gemm_fp64(xr, q, sw, x_scale=xsr, h=h, B=B, slots=slots)
    assert rel_err(y_auto, ref) < 1e-5


def test_timeline_benchmark_imports_and_derives_the_verdict():
    """bench/pdl_timeline.py: --help runs without a GPU; the exposed K1 and the issue's hiding condition come
    out of the stamps as documented."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "bench/pdl_timeline.py", "--help"], cwd=root, capture_output=True, text=True)
    assert p.returncode == 0 and "--out" in p.stdout, p.stderr
    from tests.bench_scripts import load_bench_script
    bench = load_bench_script("pdl_timeline")
    row = bench.derive(dict(pdl_pair_us=12.0, stream_k2_us=10.5, pdl_k1_us=6.0, pdl_k2_offset_us=1.5,
                            stream_prog0_mainloop_us=4.0))
    assert row["exposed_k1_us"] == 1.5 and row["k1_left_after_k2_start_us"] == 4.5
    assert row["hidden_condition"] is False                    # 4 us of main loop < 4.5 us of K1 left
    assert row["k1_in_k2_exposed_k1_us"] is None               # no k1_in_k2 arm stamped
    assert bench.derive(dict(pdl_pair_us=12.0, stream_k2_us=10.5, pdl_k1_us=6.0, pdl_k2_offset_us=1.5,
                             stream_prog0_mainloop_us=4.0, k1_in_k2_pair_us=11.0))["k1_in_k2_exposed_k1_us"] == 0.5
    times = [dict(proj="layer", M=M, mode=mode, pdl_over_base=1.16, k1_in_k2_over_base=1.05)
             for mode in bench.MODES for M in (1, 4, 16)]
    rows = [dict(M=M, mode=mode, exposed_k1_us=2.5, k1_in_k2_exposed_k1_us=0.25)
            for mode in bench.MODES for M in (1, 4, 16) for _ in range(4)]
    acc = bench.acceptance(times, rows)
    assert {(a["arm"], a["ratio_ok"], a["exposed_k1_layer_us"], a["exposed_ok"]) for a in acc} == {
        ("pdl", False, 10.0, False), ("k1_in_k2", True, 1.0, True)}
    from rlfp8.kernels.timeline import SLOT_NAMES
    stamps = {n: 1000 * i for i, n in enumerate(SLOT_NAMES, start=1)}
    d = bench._durations(stamps, "pdl")
    assert d["k1_us"] == 1.0 and d["pair_us"] == 6.0 and d["prog0_wait_us"] == 1.0
    stamps["k2_wait_enter"] = stamps["k2_wait_exit"] = bench._UNSET      # the stream arm: no wait stamped
    assert bench._durations(stamps, "pdl")["prog0_wait_us"] is None


@pytest.mark.parametrize("no_lora", [False, True])
def test_w8a8_without_an_adapter_chains_k2_to_the_quantizer(monkeypatch, no_lora):
    """Knob pdl_quant_k2, PDL resolved on: W8A8 without an adapter (no A, or metadata with no adapter token) runs the
    quantizer, which triggers its dependent, then K2 launched with launch_pdl, prefetching its weight rows and
    waiting before its main loop; without the knob (or with an adapter token) nothing changes."""
    x, q, sw, A, B, _, _ = _problem()
    monkeypatch.setattr(dispatch, "pdl_unavailable", lambda device: None)
    none = build_lora_meta(torch.full((x.shape[0],), -1), 2)
    args = (A, B, none) if no_lora else ()
    for chain in (True, False):
        knobs.set_knobs(pdl_quant_k2=chain)
        dispatch.reset_report()
        with dispatch.use_backend("triton"), tu.collect_launches() as rec:
            fp8_lora_linear(x, q, sw, *args, mode="w8a8")
        (kq, _, _, kwq), (k2, _, _, kw2) = rec
        assert kq.fn.__name__ == "_quant_rows_kernel" and k2.fn.__name__ == "_lora_gemm_kernel"
        assert kwq["USE_PDL"] is chain and "launch_pdl" not in kwq
        assert kw2["USE_PDL"] is chain and kw2.get("launch_pdl", False) is chain and not kw2["HAS_LORA"]
        assert dispatch.report()["lora_gemm.launch"] == {"pdl" if chain else "stream": 1}
        if chain:       # (without USE_PDL the kernel never reads PDL_WAIT_EARLY)
            assert kw2["PDL_WAIT_EARLY"] == 2 and dispatch.report()["lora_gemm.pdl_wait"] == {"main_loop": 1}
    knobs.set_knobs(pdl_quant_k2=True)              # W8A16 has no quantizer: stream order as before
    dispatch.reset_report()
    with dispatch.use_backend("triton"), tu.collect_launches() as rec:
        fp8_lora_linear(x, q, sw, *args, mode="w8a16")
    assert len(rec) == 1 and not rec[0][3]["USE_PDL"]


def test_quantizer_chain_outputs_equal_stream_order():
    """Under the interpreter PDL cannot run, so the knob leaves the path as it was: same outputs, recorded stream."""
    x, q, sw, *_ = _problem()
    knobs.set_knobs(pdl_quant_k2=True)
    with dispatch.use_backend("triton"):
        y = fp8_lora_linear(x, q, sw, mode="w8a8")
    assert dispatch.report()["lora_gemm.launch"] == {"stream": 1}
    xq, xs = fp8.quantize_activation_ref(x)
    assert rel_err(y.float(), gemm_fp64(xq, q, sw, x_scale=xs)) < 1e-2
