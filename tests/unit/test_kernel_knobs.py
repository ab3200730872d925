"""The kernel knobs (rlfp8.kernels.knobs): one place, validated, read at call time, config then env."""
import pytest
import torch

from rlfp8.kernels import dispatch, knobs


@pytest.fixture(autouse=True)
def _restore():
    saved = knobs.set_knobs()
    yield
    knobs.restore_knobs(saved)


def test_set_knobs_validates_names_and_values():
    with pytest.raises(ValueError, match="unknown kernel knob 'k2_sync'.*k2_sync_a"):
        knobs.set_knobs(k2_sync=False)
    with pytest.raises(ValueError, match=r"w8a16_widen='prmt'.*\('bits', 'cvt'\)"):
        knobs.set_knobs(w8a16_widen="prmt")
    with pytest.raises(ValueError, match="gemm_rs=0.*true, false"):
        knobs.set_knobs(gemm_rs=0)
    with pytest.raises(ValueError, match="fp8_precise_acc=-4"):
        knobs.set_knobs(fp8_precise_acc=-4)
    with pytest.raises(ValueError, match=r"k2_quant_x_tokens=-1.*int >= 0"):
        knobs.set_knobs(k2_quant_x_tokens=-1)
    with pytest.raises(ValueError, match=r"k2_quant_x_tokens=True"):
        knobs.set_knobs(k2_quant_x_tokens=True)
    assert knobs.knobs() == knobs.KernelKnobs()          # nothing changed by the rejected calls


def test_apply_config_names_the_config_key_and_env_overrides_win(monkeypatch):
    with pytest.raises(ValueError, match=r"kernels\.backend='cuda'.*\('auto', 'triton', 'torch'\)"):
        knobs.apply_config({"backend": "cuda"})
    k = knobs.apply_config({"k2_dist_red": False, "fp8_precise_acc": 64})
    assert k.k2_dist_red is False and k.fp8_precise_acc == 64 and knobs.knobs() is k
    assert knobs.apply_config({}).k2_dist_red is True                # missing keys take the defaults
    monkeypatch.setattr(knobs, "_ENV", knobs._env_overrides({"RLFP8_K2_DIST_RED": "0", "RLFP8_FP8_PRECISE_ACC": "32"}))
    k = knobs.apply_config({"k2_dist_red": True, "fp8_precise_acc": 64})
    assert k.k2_dist_red is False and k.fp8_precise_acc == 32


def test_env_parsing_names_the_variable():
    assert knobs._env_overrides({"RLFP8_GEMM_RS": "0", "RLFP8_TUNED_GPU": "NVIDIA H200"}) == \
        {"gemm_rs": False, "tuned_gpu": "NVIDIA H200"}
    with pytest.raises(ValueError, match="RLFP8_W8A16_WIDEN='fast'"):
        knobs._env_overrides({"RLFP8_W8A16_WIDEN": "fast"})
    with pytest.raises(ValueError, match="RLFP8_FP8_PRECISE_ACC='many'"):
        knobs._env_overrides({"RLFP8_FP8_PRECISE_ACC": "many"})
    assert knobs._env_overrides({"RLFP8_K2_QUANT_X_TOKENS": "0"}) == {"k2_quant_x_tokens": 0}
    with pytest.raises(ValueError, match="RLFP8_K2_QUANT_X_TOKENS='all'"):
        knobs._env_overrides({"RLFP8_K2_QUANT_X_TOKENS": "all"})
    assert set(knobs.ENV_VARS.values()) == {f for f in knobs._NAMES}    # every knob has its variable


def test_the_default_yaml_lists_every_knob_but_the_backend():
    from pathlib import Path

    import yaml
    conf = yaml.safe_load((Path(__file__).parents[2] / "conf" / "kernels" / "default.yaml").read_text())
    assert set(conf) == set(knobs._NAMES) - {"backend"}         # the backend is trainer.kernels
    assert knobs.apply_config(conf) == knobs.KernelKnobs()        # the YAML's values are the defaults


def test_kernels_read_the_knobs_at_call_time():
    """A knob changed after import changes the next launch: the backend, and K2's constexprs."""
    from rlfp8.kernels import _triton_utils as tu
    from rlfp8.kernels.gemm_configs import GemmConfig
    from rlfp8.kernels.gemm_triton import lora_gemm_triton
    from rlfp8.kernels.fp8 import quantize_weight
    knobs.set_knobs(backend="torch")
    dispatch.reset_report()
    quantize_weight(torch.randn(4, 8))
    assert dispatch.report()["quantize_weight"] == {"torch": 1} and dispatch.get_backend() == "torch"
    x, q = torch.zeros(64, 256, dtype=torch.float8_e4m3fn), torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    launches = []
    for acc in (None, 32):
        knobs.set_knobs(fp8_precise_acc=acc)
        with tu.collect_launches() as rec:
            lora_gemm_triton(x, q, torch.ones(128), x_scale=torch.ones(64, 1), config=GemmConfig(64, 64, 64))
        launches.append(rec[0][3]["FP8_ACC"])
    assert launches == [None, 32]
