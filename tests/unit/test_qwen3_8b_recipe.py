"""recipes/qwen3_8b_math composes and validates (it is run on a GPU, never here): Qwen3-8B's shape with random
weights by default, real weights from a folder, one_copy + w8a16 with the KV cache released while training,
8 prompts x 8 samples of up to 1k tokens, and a memory plan that fits one H200 with room to spare."""
from rlfp8.config import compose_dict
from rlfp8.memory_plan import estimate
from rlfp8.models import architecture_config

H200_GIB = 141 * 1e9 / 2**30


def test_recipe_composes_with_the_documented_choices():
    cfg = compose_dict(["recipe=qwen3_8b_math"])
    assert cfg["model"]["path"] == "random:qwen3_8b" and cfg["placement"]["name"] == "one_copy"
    assert cfg["engine"]["precision"] == "w8a16" and cfg["engine"]["release_kv"] == "auto"
    assert cfg["data"]["source"] == "gsm8k" and cfg["algo"]["correction"] == "none"
    assert (cfg["data"]["prompts_per_step"], cfg["algo"]["group_size"], cfg["algo"]["max_response_len"]) == (8, 8, 1024)
    assert cfg["engine"]["max_model_len"] >= cfg["algo"]["max_response_len"] + cfg["data"]["max_prompt_tokens"]


def test_real_weights_from_a_folder_compose(tmp_path):
    cfg = compose_dict(["recipe=qwen3_8b_math", f"model.path={tmp_path}"])
    assert cfg["model"]["path"] == str(tmp_path)


def test_memory_plan_fits_one_h200_and_the_kv_cache_holds_the_batch():
    cfg = compose_dict(["recipe=qwen3_8b_math"])
    plan = estimate(cfg, architecture_config("qwen3_8b"))
    assert 6 < plan["engine_weights"] < 10                      # FP8 projections ~6.5 + bf16 embeddings/lm_head
    assert plan["trainer_base"] == 0                            # one_copy maps the engine's
    assert plan["kv_cache"] >= plan["kv_cache_needed"]          # all 64 sequences at full length at once
    assert plan["peak"] < 0.6 * H200_GIB, plan
    two = estimate(compose_dict(["recipe=qwen3_8b_math", "placement=two_copies"]), architecture_config("qwen3_8b"))
    assert two["peak"] > plan["peak"] + 6                       # a second FP8 base and no KV release
