"""The training linear's host fast paths (kernel knob host_fast): the per-parameter adapter casts cache
(FP8LoRALinear.adapter_casts) invalidates on every in-place update, and the fast path gives the same bits
(outputs and gradients) as the plain one; the backward's side-stream rule."""
import copy

import pytest
import torch

from rlfp8.kernels import dispatch, linear_triton
from rlfp8.kernels.knobs import restore_knobs, set_knobs
from rlfp8.trainer.fp8_lora import FP8LoRALinear
from tests.conftest import rel_err


def _module(K=96, N=80, r=8, device="cpu", seed=0):
    torch.manual_seed(seed)
    mod = FP8LoRALinear.from_linear(torch.nn.Linear(K, N, bias=True), r, alpha=2.0 * r, device=device)
    with torch.no_grad():
        mod.lora_B.normal_(0, 0.1)                    # B = 0 at init would hide a wrong B_c
    return mod


def _fresh_casts(mod, dtype):
    return mod.lora_A.detach().to(dtype), (mod.lora_B.detach() * mod.scaling).to(dtype)


def _assert_casts(got, want):
    assert all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want))


def test_adapter_casts_cached_then_invalidated_by_optimizer_step_and_load_state_dict():
    mod = _module()
    c1 = mod.adapter_casts(torch.bfloat16)
    _assert_casts(c1, _fresh_casts(mod, torch.bfloat16))
    assert mod.adapter_casts(torch.bfloat16)[0] is c1[0]                   # reused while nothing changed
    opt = torch.optim.AdamW([mod.lora_A, mod.lora_B], lr=1e-2)
    mod.lora_A.grad = torch.randn_like(mod.lora_A)
    mod.lora_B.grad = torch.randn_like(mod.lora_B)
    opt.step()
    c2 = mod.adapter_casts(torch.bfloat16)
    assert c2[0] is not c1[0] and not torch.equal(c2[0], c1[0]) and not torch.equal(c2[1], c1[1])
    _assert_casts(c2, _fresh_casts(mod, torch.bfloat16))
    state = {k: torch.randn_like(v) if k.startswith("lora_") else v for k, v in mod.state_dict().items()}
    mod.load_state_dict(state)
    c3 = mod.adapter_casts(torch.bfloat16)
    _assert_casts(c3, _fresh_casts(mod, torch.bfloat16))
    assert torch.equal(c3[0], state["lora_A"].to(torch.bfloat16))
    _assert_casts(mod.adapter_casts(torch.float16), _fresh_casts(mod, torch.float16))   # dtype is in the key
    mod.scaling = 0.25                                                                  # so is the scaling
    _assert_casts(mod.adapter_casts(torch.float16), _fresh_casts(mod, torch.float16))
    with torch.inference_mode():                      # inference tensors are never cached (backward could not save them)
        inf = mod.adapter_casts(torch.bfloat16)
    assert mod.adapter_casts(torch.bfloat16)[0] is not inf[0]


def _train_two_micro_batches(mod, x_batches, dys):
    """Probe (no grad), forward/backward, optimizer step, again: outputs and gradients of each step."""
    opt = torch.optim.SGD([mod.lora_A, mod.lora_B], lr=0.5)
    out = []
    for x, dy in zip(x_batches, dys):
        with torch.no_grad():
            probe = mod(x)
        x = x.detach().requires_grad_()
        y = mod(x)
        y.backward(dy)
        out.append([probe, y.detach(), x.grad, mod.lora_A.grad.clone(), mod.lora_B.grad.clone()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def test_fast_path_gives_the_plain_paths_bits_and_the_references_gradients(device):
    base = _module(device=device)
    xs = [torch.randn(2, 21, 96, dtype=torch.bfloat16, device=device) for _ in range(2)]
    dys = [torch.randn(2, 21, 80, dtype=torch.bfloat16, device=device) for _ in range(2)]
    arms = {}
    for arm, fast in (("fast", True), ("plain", False), ("reference", True)):
        saved = set_knobs(host_fast=fast)
        try:
            with dispatch.use_backend("torch" if arm == "reference" else "triton"):
                arms[arm] = _train_two_micro_batches(copy.deepcopy(base), xs, dys)
        finally:
            restore_knobs(saved)
    names = ("probe", "y", "dx", "dA", "dB")
    for step in range(2):
        for name, a, b, ref in zip(names, arms["fast"][step], arms["plain"][step], arms["reference"][step]):
            assert torch.equal(a, b), (step, name)                  # same kernels, same operands: same bits
            assert rel_err(a, ref) < 1e-2, (step, name)             # and the torch reference's values


def test_side_stream_only_for_long_dx_gemms(monkeypatch):
    class FakeCuda:                                   # what _side_stream_for reads of dy2
        is_cuda = True
        device = torch.device("cuda", 0)

        def __init__(self, T, N):
            self.shape = (T, N)

    monkeypatch.setattr(linear_triton, "_side_stream", lambda device: "side")
    K = 4096
    big = FakeCuda(8192, 4096)                        # 2·T·N·K = 2^38 flop: a Qwen3-8B projection
    small = FakeCuda(8192, 1536)                      # the quickstart's largest at K = 576 ...
    assert 2 * 8192 * 4096 * K >= linear_triton.SIDE_STREAM_MIN_FLOP
    assert linear_triton._side_stream_for(big, K) == "side"
    assert linear_triton._side_stream_for(small, 576) is None
    saved = set_knobs(host_fast=False)                # the plain path: every CUDA call on the side stream
    try:
        assert linear_triton._side_stream_for(small, 576) == "side"
    finally:
        restore_knobs(saved)
    assert linear_triton._side_stream_for(torch.zeros(8192, 4096), K) is None      # CPU / interpreter


def test_bad_casts_name_the_tensors():
    A, B = torch.zeros(4, 16), torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"casts\(torch.bfloat16\) returned A_c torch.float32"):
        linear_triton._adapter_operands(A, B, 1.0, torch.bfloat16, lambda dtype: (A, B))


def test_cached_launch_configs_equal_the_fresh_choice_and_follow_the_knobs():
    from rlfp8.kernels import gemm_triton
    q = torch.zeros(4096, 1024, dtype=torch.float8_e4m3fn)
    dev = torch.device("cpu")
    for batch_inv in ("auto", "off"):
        for M in (1, 16, 17, 100, 512, 513, 8192):
            for w in (q, q.t()):                          # the forward's codes and the backward's qᵀ view
                N, K = w.shape
                saved = set_knobs(host_fast=False, batch_invariant=batch_inv)
                try:
                    fresh = gemm_triton._pick_config(None, "w8a16", M, N, K, w, dev)
                    set_knobs(host_fast=True)
                    cached = [gemm_triton._pick_config(None, "w8a16", M, N, K, w, dev) for _ in range(2)]
                finally:
                    restore_knobs(saved)
                assert cached[0] == cached[1] == fresh, (batch_inv, M, tuple(w.shape))
