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
    ("engine.precision=fp4", "engine.precision='fp4': allowed values are ['bf16', 'w8a8', 'w8a16']"),
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


# issue 19: every value that can be checked before the actors start is checked at composition
@pytest.mark.parametrize("override,needle", [
    ("algo.std_eps=0", "algo.std_eps=0: must be a number > 0"),          # NaN advantages on equal-reward groups
    ("algo.std_eps=-1e-3", "algo.std_eps=-0.001"),
    ("algo.clip_eps_low=1", "algo.clip_eps_low=1"),
    ("algo.clip_eps_low=1.5", "must be < 1"),
    ("algo.clip_eps_high=-0.1", "algo.clip_eps_high=-0.1"),
    ("algo.tis_low=3", "algo.tis_low=3: must be null"),                 # above tis_cap=2
    ("algo.tis_low=0", "algo.tis_low=0"),
    ("adapter.rank=1024", "adapter.rank=1024: the engine serves LoRA ranks up to 512"),
    ("algo.group_size=1", "algo.group_size=1: algo.advantage=grpo"),
    ("algo.kl_coef=-1", "algo.kl_coef=-1"),
    ("engine.top_p=0", "engine.top_p=0"),
    ("engine.top_k=0", "engine.top_k=0"),
    ("engine.gpu_memory_utilization=1.5", "engine.gpu_memory_utilization=1.5"),
    ("trainer.betas=[0.9,1.0]", "trainer.betas"),
    ("data.ops=/", "data.ops='/'"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens=0"),
])
def test_values_checked_at_composition(override, needle):
    with pytest.raises(ConfigError) as e:
        compose(["model=tiny", override])
    assert needle in str(e.value)


def test_rank_inside_the_slot_list_is_accepted():
    assert to_dict(compose(["model=tiny", "adapter.rank=500", "algo.tis_low=0.5"]))["adapter"]["rank"] == 500


def test_prompt_token_limit_leaves_room_for_the_response():
    from rlfp8.config import prompt_token_limit
    cfg = to_dict(compose(["model=tiny", "engine.max_model_len=128", "algo.max_response_len=16"]))
    assert cfg["data"]["max_prompt_tokens"] == 256 and prompt_token_limit(cfg) == 112     # capped by the engine
    cfg = to_dict(compose(["model=tiny", "data.max_prompt_tokens=50"]))
    assert prompt_token_limit(cfg) == 50
    cfg = to_dict(compose(["model=tiny", "data.max_prompt_tokens=null", "engine.max_model_len=300",
                           "algo.max_response_len=100"]))
    assert prompt_token_limit(cfg) == 200
