"""Recipe + Hydra composition and validation: every bad key or value names itself and what is allowed."""
import pytest

from rlfp8.config import ConfigError, compose, to_dict


def test_default_recipe_is_quickstart():
    cfg = to_dict(compose([]))
    assert cfg["recipe"] == "quickstart"
    assert cfg["model"]["path"] == "gguf:smollm2-135m-instruct"
    assert cfg["data"]["source"] == "arithmetic" and cfg["data"]["prompts_per_step"] == 12
    assert cfg["placement"]["name"] == "two_copies" and cfg["trainer"]["weights"] == "fp8"


def test_overrides_beat_the_recipe():
    cfg = to_dict(compose(["recipe=quickstart", "model=tiny", "steps=3", "placement=offloaded",
                           "engine.precision=w8a8", "trainer.weights=bf16", "algo.correction=tis"]))
    assert cfg["model"]["path"] == "tiny" and cfg["steps"] == 3 and cfg["placement"]["name"] == "offloaded"
    assert (cfg["engine"]["precision"], cfg["trainer"]["weights"], cfg["algo"]["correction"]) == ("w8a8", "bf16", "tis")


@pytest.mark.parametrize("override,needle", [
    ("engine.precision=fp4", "engine.precision='fp4': allowed values are ['bf16', 'w8a16', 'w8a8', 'w8a8_vllm']"),
    ("algo.loss_agg=mean", "algo.loss_agg='mean': allowed values"),
    ("trainer.weights=int8", "trainer.weights='int8'"),
    ("steps=0", "steps=0: must be an integer >= 1"),
    ("trainer.lr=-1", "trainer.lr=-1"),
    ("trainer.nonsense=1", "nonsense"),
    ("placement=one_copy", "offloaded"),          # Hydra lists the available options
    ("recipe=nope", "allowed values are ['quickstart'"),
    ("resume=true", "resume=true needs run_dir"),
    ("algo.max_response_len=500", "engine.max_model_len"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert needle in str(e.value)


def test_user_recipe_file_and_typo_detection(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("defaults:\n  - config\n  - override model: tiny\n  - _self_\nsteps: 7\nalgo:\n  group_size: 4\n")
    cfg = to_dict(compose([f"recipe={good}"]))
    assert cfg["steps"] == 7 and cfg["algo"]["group_size"] == 4 and cfg["recipe"] == "mine"
    typo = tmp_path / "typo.yaml"
    typo.write_text("defaults:\n  - config\n  - _self_\nalgo:\n  grup_size: 4\n")
    with pytest.raises(ConfigError, match="grup_size"):
        compose([f"recipe={typo}"])
