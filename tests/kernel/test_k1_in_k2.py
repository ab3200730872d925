"""Knob k1_in_k2: K1's shrink programs as the first programs of K2's grid (one launch), under the CPU
interpreter: outputs bit-identical to K1 and K2 in their own launches (W8A16 and W8A8, with and without metadata,
K1 with and without split-K), the dispatch records, one launch instead of two, the counters reset for the next
launch, and clear errors for shrink programs that do not fit the call."""
import dataclasses

import pytest
import torch

from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import dispatch, knobs
from rlfp8.kernels.gemm_configs import GemmConfig
from rlfp8.kernels import gemm_triton
from rlfp8.kernels.gemm_triton import K1_IN_K2_REGS, _one_wave_config, lora_gemm_triton
from rlfp8.kernels.metadata import build_lora_meta
from rlfp8.kernels.projection import fp8_lora_linear
from rlfp8.kernels.shrink_triton import shrink_programs
from tests.conftest import HAS_CUDA
from tests.kernel.test_pdl_launch import _problem

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the interpreter's launches (tests/gpu covers the GPU)")


@pytest.fixture(autouse=True)
def _restore():
    saved = knobs.set_knobs()
    dispatch.reset_report()
    yield
    knobs.restore_knobs(saved)


def _run(x, q, sw, A, B, meta, mode, tokens):
    """tokens: the knob k1_in_k2_tokens with k1_in_k2=on, 0 = k1_in_k2=off."""
    knobs.set_knobs(k1_in_k2="on" if tokens else "off", k1_in_k2_tokens=max(tokens, 1))
    with dispatch.use_backend("triton"):
        return fp8_lora_linear(x, q, sw, A, B, meta, mode=mode, out_dtype=torch.float32)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("with_meta", [True, False])
@pytest.mark.parametrize("K", [256, 1024])          # K1 without split-K, and with it (split 2)
def test_outputs_equal_k1_in_its_own_launch(mode, with_meta, K):
    x, q, sw, A, B, slots, meta = _problem(K=K)
    if not with_meta:
        A, B, meta = [a[:1] for a in A], [b[:1] for b in B], None
    y_own = _run(x, q, sw, A, B, meta, mode, 0)
    assert "lora_gemm.k1" not in dispatch.report()
    dispatch.reset_report()
    y_in = _run(x, q, sw, A, B, meta, mode, 16)
    rep = dispatch.report()
    assert rep["lora_gemm.k1"] == {"in_k2": 1} and rep["lora_shrink"] == {"triton": 1}
    assert torch.equal(y_in, y_own)
    sync = tu.split_counters("lora_gemm.k1_sync", 2, x.device)
    assert sync[:2].tolist() == [0, 0]                  # reset by the last GEMM program past the wait
    assert torch.equal(_run(x, q, sw, A, B, meta, mode, 16), y_own)      # the next launch waits again


def test_one_launch_the_token_limits_and_the_modes():
    """The default (k1_in_k2=on): calls with an adapter run one K2 launch holding K1's programs (W8A8 after the
    quantizer), W8A8 up to k1_in_k2_tokens, W8A16 up to k1_in_k2_w8a16_tokens; above them, with k1_in_k2=w8a8
    for W8A16, or with k1_in_k2=off, K1 launches alone."""
    x, q, sw, A, B, slots, meta = _problem(K=1024)
    kn = knobs.knobs()
    assert (kn.k1_in_k2, kn.k1_in_k2_tokens, kn.k1_in_k2_w8a16_tokens, kn.k1_in_k2_one_wave) == ("on", 64, 16, "on")

    def kernels(mode):
        with dispatch.use_backend("triton"), tu.collect_launches() as launches:
            fp8_lora_linear(x, q, sw, A, B, meta, mode=mode)
        return [k.fn.__name__ for k, *_ in launches], launches[-1]

    names, (_, grid, _, kw) = kernels("w8a8")
    assert names == ["_quant_rows_kernel", "_lora_gemm_kernel"] and kw["K1_PROGRAMS"]
    k1 = shrink_programs(x, A, meta)
    assert grid[0] > k1.programs and kw["K1_SPLIT_K"] == k1.config.split_k
    assert kernels("w8a16")[0] == ["_lora_gemm_kernel"]
    knobs.set_knobs(k1_in_k2_w8a16_tokens=x.shape[0] - 1)          # W8A16's own limit: two launches, W8A8 one
    assert kernels("w8a16")[0] == ["_lora_shrink_kernel", "_lora_gemm_kernel"]
    assert kernels("w8a8")[1][3]["K1_PROGRAMS"]
    knobs.set_knobs(k1_in_k2_w8a16_tokens=16, k1_in_k2="w8a8")
    assert kernels("w8a16")[0] == ["_lora_shrink_kernel", "_lora_gemm_kernel"]
    knobs.set_knobs(k1_in_k2="on", k1_in_k2_tokens=x.shape[0] - 1)  # more tokens than the limit: two launches again
    names, (_, _, _, kw) = kernels("w8a16")
    assert names == ["_lora_shrink_kernel", "_lora_gemm_kernel"] and not kw["K1_PROGRAMS"]
    knobs.set_knobs(k1_in_k2="off", k1_in_k2_tokens=64)      # (no PDL in the interpreter: K1 quantizes x)
    assert kernels("w8a8")[0] == ["_lora_shrink_kernel", "_lora_gemm_kernel"]
    with pytest.raises(ValueError, match=r"kernels\.k1_in_k2='yes'"):
        knobs.apply_config({"k1_in_k2": "yes"})
    with pytest.raises(ValueError, match=r"kernels\.k1_in_k2_one_wave=True"):
        knobs.apply_config({"k1_in_k2_one_wave": True})


def test_w8a8_takes_its_decode_schedule_in_both_launches():
    """W8A8 at decode sizes on a 12288-wide K (the down projection): K1 splits 16 ways (knob k1_decode_split_max)
    whether it runs in K2's grid or in its own launch, so both give the same bits; W8A16 keeps the trainer's
    8-way batch-invariant schedule in both."""
    x, q, sw, A, B, slots, meta = _problem(M=3, K=12288, widths=(32,), r=16)
    for mode, split in (("w8a8", 16), ("w8a16", 8)):
        assert shrink_programs(x, A, meta, mode=mode).config.split_k == split
        knobs.set_knobs(k1_in_k2="off")
        with dispatch.use_backend("triton"), tu.collect_launches() as launches:
            fp8_lora_linear(x, q, sw, A, B, meta, mode=mode)
        assert [kw["SPLIT_K"] for k, _, _, kw in launches if k.fn.__name__ == "_lora_shrink_kernel"] == [split]
        assert torch.equal(_run(x, q, sw, A, B, meta, mode, 16), _run(x, q, sw, A, B, meta, mode, 0))


# the tuned W8A8 decode configs (<= 16 tokens) of the Qwen3-8B down and gate_up projections on the H200
DOWN_DECODE = GemmConfig(block_n=64, block_m=16, block_k=256, split_k=2, group_m=8, num_warps=4, num_stages=6,
                         w_tma=True, widen="bits", swap_ab=True, x_tma=False)
GATE_UP_DECODE = GemmConfig(block_n=64, block_m=16, block_k=128, split_k=1, group_m=8, num_warps=4, num_stages=6,
                            w_tma=False, widen="bits", swap_ab=True, x_tma=False)


def test_one_wave_takes_stages_off_where_k1_programs_overflow_the_first_wave():
    """Knob k1_in_k2_one_wave on sm_90's numbers (227 KiB per block, 132 SMs): down's 128 GEMM programs and K1's
    16 hold 121 KiB each, one per SM: 144 on 132 slots; with 5 stages two fit per SM. gate_up's 384 + 16 at 61 KiB,
    three per SM: 400 on 396; with 5 stages four fit. A grid that already fits keeps its config; one that no stage
    count brings to one wave keeps it too."""
    smem, sms, regs = 232448, 132, K1_IN_K2_REGS["w8a8", 0]
    for cfg, programs in ((DOWN_DECODE, 128 + 16), (GATE_UP_DECODE, 384 + 16)):
        fitted, verdict = _one_wave_config(cfg, "w8a8", 64, programs, smem, sms, regs)
        assert (fitted.num_stages, verdict) == (5, "fewer_stages")
        assert dataclasses.replace(fitted, num_stages=6) == cfg           # only the pipeline's depth changes
        assert _one_wave_config(cfg, "w8a8", 64, programs - 16, smem, sms, regs) == (cfg, "one")   # K1 alone
    assert _one_wave_config(DOWN_DECODE, "w8a8", 64, 4 * 132 + 1, smem, sms, regs) == (DOWN_DECODE, "two")
    # with the epilogue's B tile held across the main loop (k2_prefetch_epilogue) registers allow 3 per SM: gate_up
    # stays in two waves, down (2 per SM) still fits one
    regs = K1_IN_K2_REGS["w8a8", 1]
    assert _one_wave_config(GATE_UP_DECODE, "w8a8", 64, 400, smem, sms, regs) == (GATE_UP_DECODE, "two")
    assert _one_wave_config(DOWN_DECODE, "w8a8", 64, 144, smem, sms, regs)[1] == "fewer_stages"
    assert tu.programs_per_sm(122928, 4, smem, 128) == 1 and tu.programs_per_sm(102448, 4, smem, 128) == 2
    assert tu.programs_per_sm(51200, 4, smem, 128) == 4 and tu.programs_per_sm(51200, 4, smem, 168) == 3


def test_one_wave_in_the_launch_and_the_knob_off(monkeypatch):
    """On a 7-SM stand-in the W8A8 grid (20 programs, 2 per SM by shared memory at its 5 stages) fits one wave
    with 3 stages (3 per SM): the launch with K1 in its grid takes them and records it; knob off: the config's
    stages. Same bits."""
    x, q, sw, A, B, slots, meta = _problem(K=1024)
    monkeypatch.setattr(gemm_triton, "device_sms", lambda device, stand_in: 7)

    def launch(one_wave):
        knobs.set_knobs(k1_in_k2_one_wave="on" if one_wave else "off")
        dispatch.reset_report()
        y = _run(x, q, sw, A, B, meta, "w8a8", 16)
        wave = dispatch.report().get("lora_gemm.k1_wave")
        with tu.collect_launches() as launches:                 # (captured, not run)
            _run(x, q, sw, A, B, meta, "w8a8", 16)
        (kw,) = [kw for k, _, _, kw in launches if k.fn.__name__ == "_lora_gemm_kernel"]
        return y, kw["num_stages"], wave

    y_on, stages_on, wave_on = launch(True)
    y_off, stages_off, wave_off = launch(False)
    assert wave_off is None and wave_on == {"fewer_stages": 1}
    assert (stages_on, stages_off) == (3, 5)
    assert torch.equal(y_on, y_off)


def test_bad_shrink_programs_are_refused():
    x, q, sw, A, B, slots, meta = _problem(K=256)
    progs = shrink_programs(x, A, meta)
    with pytest.raises(ValueError, match="h = their h"):
        lora_gemm_triton(x, q, sw, h=torch.zeros_like(progs.out.h), B=B, meta=meta, shrink=progs)
    with pytest.raises(ValueError, match=r"quantize_x='div' with shrink programs"):
        lora_gemm_triton(x, q, sw, h=progs.out.h, B=B, meta=meta, shrink=progs, quantize_x="div")
    none = build_lora_meta(torch.full((x.shape[0],), -1), 2)
    with pytest.raises(ValueError, match="needs tokens with an adapter"):
        shrink_programs(x, A, none)
