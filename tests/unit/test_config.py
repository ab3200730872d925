"""Recipe + Hydra composition and validation: every bad key or value names itself and what is allowed."""
import pytest

import ast
import functools
from pathlib import Path

from omegaconf import OmegaConf

from rlfp8 import config
from rlfp8.config import UNAVAILABLE, ConfigError, compose, to_dict

RLFP8 = Path(config.__file__).resolve().parent


def test_default_recipe_is_quickstart():
    cfg = to_dict(compose([]))
    assert cfg["recipe"] == "quickstart"
    assert cfg["model"]["path"] == "gguf:smollm2-135m-instruct"
    assert cfg["data"]["source"] == "arithmetic" and cfg["data"]["prompts_per_step"] == 12
    assert cfg["placement"]["name"] == "two_copies" and cfg["trainer"]["weights"] == "fp8"


def test_overrides_beat_the_recipe(monkeypatch):
    monkeypatch.setattr(config, "cuda_available", lambda: True)      # w8a8 needs one
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
    ("placement=nowhere", "offloaded"),           # Hydra lists the available options
    ("recipe=nope", "recipe='nope': allowed values are ["),     # the recipes/ listing (more than quickstart)
    ("resume=true", "resume=true needs run_dir"),
    ("algo.max_response_len=500", "engine.max_model_len"),
    ("ray.num_pairs=0", "ray.num_pairs=0: must be an integer >= 1"),
    ("ray.num_pairs=two", "ray.num_pairs='two': must be an integer >= 1"),
    ("ray.num_pairs=13", "ray.num_pairs=13 is more than data.prompts_per_step=12"),
    ("ray.address=nowhere", "ray.address='nowhere': must be null (start a local Ray), auto"),
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


# ------------------------------------------------------------------ combinations that cannot run
@pytest.mark.parametrize("overrides,cuda,needle,reason", [
    (["placement=one_copy"], True, "placement.name=one_copy engine.precision=bf16: (the trainer maps", config.UNSUPPORTED),
    (["placement=one_copy", "engine.precision=w8a8_vllm"], True, "placement.name=one_copy engine.precision=w8a8_vllm",
     config.UNSUPPORTED),
    (["placement=one_copy", "engine.precision=w8a16", "trainer.weights=bf16"], True,
     "placement.name=one_copy trainer.weights=bf16", config.UNSUPPORTED),
    (["adapter.type=dora"], True, "adapter.type=dora engine.precision=bf16: (vLLM's own LoRA kernels", config.UNSUPPORTED),
    (["adapter.type=dora", "engine.precision=w8a8_vllm"], True, "adapter.type=dora engine.precision=w8a8_vllm",
     config.UNSUPPORTED),
    (["engine.precision=w8a8_vllm"], False, "engine.precision=w8a8_vllm: w8a8_vllm", config.NEEDS_CUDA),
    (["trainer.device=cuda"], False, "trainer.device=cuda: trainer.device=cuda needs a CUDA GPU", config.NEEDS_CUDA),
    (["engine.release_weights=true", "engine.precision=w8a16"], True,
     "engine.release_weights=True engine.precision=w8a16: (rlfp8's engines keep", config.UNSUPPORTED),
    (["engine.release_weights=true", "engine.precision=w8a8"], True, "engine.release_weights=True engine.precision=w8a8",
     config.UNSUPPORTED),
    (["engine.release_weights=true", "engine.release_kv=false"], True,
     "engine.release_weights=True engine.release_kv=False: (the weights go after the KV cache", config.UNSUPPORTED),
    (["engine.release_weights=true"], False, "engine.release_weights=True: engine.release_weights (vLLM's sleep mode",
     config.NEEDS_CUDA),
])
def test_each_unavailable_combination_is_rejected_naming_its_keys(monkeypatch, overrides, cuda, needle, reason):
    monkeypatch.setattr(config, "cuda_available", lambda: cuda)
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    msg = str(e.value)
    assert needle in msg and "; use " in msg
    assert reason in msg


def test_dora_and_the_plugin_precisions_compose():
    cfg = to_dict(compose(["adapter.type=dora", "engine.precision=w8a16"]))
    assert cfg["adapter"]["type"] == "dora" and cfg["engine"]["precision"] == "w8a16"
    assert to_dict(compose(["engine.precision=w8a8"]))["engine"]["precision"] == "w8a8"


def test_unavailable_table_is_exercised_and_cuda_entries_pass_on_a_gpu(monkeypatch):
    """Every entry of the table has a case above; the NEEDS_CUDA ones compose where CUDA exists."""
    assert len(UNAVAILABLE) == 11
    monkeypatch.setattr(config, "cuda_available", lambda: True)
    for entry in UNAVAILABLE:
        if entry.reason == config.NEEDS_CUDA:
            (key, value), = entry.when.items()
            assert config._get(compose([f"{key}={value}"]), key) == value


def test_choices_come_from_the_registries():
    from rlfp8 import algos
    from rlfp8.kernels.dispatch import BACKENDS
    from rlfp8.placement import STRATEGIES
    c = config.choices()
    assert c["algo.loss_agg"] is algos.AGG_MODES and c["trainer.kernels"] is BACKENDS
    assert c["placement.name"] == tuple(STRATEGIES)
    assert {p.stem for p in (config.CONF_DIR / "placement").glob("*.yaml")} == set(STRATEGIES)


def test_data_values_are_checked_at_composition():
    with pytest.raises(ConfigError, match="data.ops"):
        compose(["data.ops=/"])


# ------------------------------------------------------------------ code reads only keys the schema owns
# How code reads the config (rlfp8/config.py): `cfg[...]` / `self.cfg[...]` from the root, or a section
# alias assigned from exactly its section. Nothing else may be named like these.
SECTION_ALIASES = {"tcfg": "trainer", "ecfg": "engine", "mcfg": "model", "acfg": "adapter", "algo_cfg": "algo",
                   "lcfg": "logger", "rcfg": "ray", "dcfg": "data"}


def _chain(node):
    """The constant key path a subscript chain reads from the config, or None if it is not the config."""
    if isinstance(node, ast.Subscript):
        base = _chain(node.value)
        key = node.slice
        if base is None or not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            return None
        return base + (key.value,)
    if isinstance(node, ast.Name):
        if node.id == "cfg":
            return ()
        return (SECTION_ALIASES[node.id],) if node.id in SECTION_ALIASES else None
    if isinstance(node, ast.Attribute) and node.attr == "cfg":
        return ()
    return None


def _config_reads(tree):
    """(line, key path) of every constant subscript of the config; (line, what) of every misuse."""
    reads, misuse = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            path = _chain(node)
            if path:
                reads.append((node.lineno, path))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if _chain(node.func.value) is not None:
                misuse.append((node.lineno, "config read with .get(): the default belongs in conf/"))
        elif isinstance(node, ast.Assign):
            pairs = (zip(node.targets[0].elts, node.value.elts)
                     if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple)
                     else [(node.targets[0], node.value)])
            for target, value in pairs:
                if isinstance(target, ast.Name) and target.id in SECTION_ALIASES:
                    if _chain(value) != (SECTION_ALIASES[target.id],):
                        misuse.append((node.lineno, f"{target.id} must be assigned cfg[{SECTION_ALIASES[target.id]!r}]"))
    return reads, misuse


@functools.lru_cache(maxsize=1)
def _schema_tree():
    """The union of the base config over every option of every group (and the keys run() adds)."""
    tree = {}
    for group in sorted(p for p in config.CONF_DIR.iterdir() if p.is_dir()):
        for option in sorted(group.glob("*.yaml")):
            if option.stem == "common":
                continue
            cfg = config.base_config({group.name: option.stem})
            OmegaConf.set_struct(cfg, False)
            tree = OmegaConf.to_container(OmegaConf.merge(tree, cfg), resolve=False)
    tree["recipe"] = "set by compose"
    tree["model"]["resolved_path"] = "set by train.setup"
    return tree


def _owns(tree, path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def test_code_reads_no_config_key_the_schema_does_not_own():
    tree = _schema_tree()          # cached: do not mutate
    unknown, misuse, n_reads = [], [], 0
    for path in sorted(RLFP8.rglob("*.py")):
        if path.name == "config.py" and path.parent == RLFP8:
            continue                                  # the schema itself (dotted keys, checked below)
        reads, bad = _config_reads(ast.parse(path.read_text()))
        n_reads += len(reads)
        unknown += [f"{path.relative_to(RLFP8)}:{line}: {'.'.join(p)}" for line, p in reads if not _owns(tree, p)]
        misuse += [f"{path.relative_to(RLFP8)}:{line}: {what}" for line, what in bad]
    assert n_reads > 50                               # the scan sees the code's reads
    assert not unknown, "config keys no conf/ file defines:\n" + "\n".join(unknown)
    assert not misuse, "\n".join(misuse)
    schema_keys = list(config.choices()) + list(config.POSITIVE_INT + config.NON_NEGATIVE_INT + config.POSITIVE_FLOAT)
    schema_keys += [k for entry in UNAVAILABLE for k in entry.when]
    assert [k for k in schema_keys if not _owns(tree, k.split("."))] == []


def test_the_scan_catches_what_it_forbids():
    reads, misuse = _config_reads(ast.parse(
        "x = cfg['engine']['max_model_len']\ny = self.cfg['trainer'].get('lr', 1)\ntcfg = cfg['engine']\n"))
    assert (1, ("engine", "max_model_len")) in reads and len(misuse) == 2
    assert not _owns(_schema_tree(), ("engine", "gpu_mem"))


def test_readme_config_tour_matches_conf():
    """Every group option the README's tour lists exists in conf/, and every key it names is a key."""
    import re
    tree = _schema_tree()
    readme = (config.REPO / "README.md").read_text()
    tour = readme[readme.index("## Config tour"):readme.index("Math data")]
    rows = [line.split("|")[1:4] for line in tour.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 8
    bad = []
    for group_cell, options_cell, keys_cell in rows:
        group = group_cell.strip().strip("`")
        section = () if group == "top level" else (group,)
        for option in re.findall(r"`([a-z0-9_]+)`", options_cell):
            if not (config.CONF_DIR / group / f"{option}.yaml").exists():
                bad.append(f"{group}={option}")
        keys_cell = re.sub(r"\([^)]*\)", "", keys_cell)          # values in parentheses are not keys
        for key in re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)`", keys_cell):
            path = tuple(key.split("."))
            if not (_owns(tree, path) or _owns(tree, section + path)):
                bad.append(f"{group}: {key}")
        for prefix, inner in re.findall(r"`([a-z_]+)\.\{([^}]*)\}`", keys_cell):
            for key in (k.strip() for k in inner.split(",")):
                if not _owns(tree, (prefix, key)):
                    bad.append(f"{prefix}.{key}")
    assert not bad, bad


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


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_model_dtype_auto_resolves_once_by_the_machine(monkeypatch, native, expected):
    monkeypatch.setattr(config, "native_bf16", lambda: (native, "test machine"))
    cfg = compose(["recipe=quickstart"])
    assert cfg.model.dtype == expected
    assert compose(["recipe=quickstart", "model.dtype=bfloat16"]).model.dtype == "bfloat16"   # explicit wins
    resumed = config.compose_resume(to_dict(cfg), ["steps=3"])
    assert resumed.model.dtype == expected                      # the saved, resolved value is kept


@pytest.mark.parametrize("value, cpu_build, eager", [("auto", True, True), ("auto", False, False),
                                                     (True, False, True), (False, True, False)])
def test_engine_enforce_eager_auto_is_eager_only_on_cpu(monkeypatch, value, cpu_build, eager):
    from rlfp8.rollout import compat, engine
    monkeypatch.setattr(compat, "on_cpu_build", lambda: cpu_build)
    assert engine.eager_mode({"enforce_eager": value}) is eager
    assert compose([f"engine.enforce_eager={str(value).lower()}"]).engine.enforce_eager == value


@pytest.mark.parametrize("eager, compile_, expected", [
    (False, False, {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}),   # graphs without torch.compile
    (False, True, None),                                                 # vLLM's default: compile + graphs
    (True, False, None)])                                                # eager: nothing to capture
def test_engine_compile_false_asks_vllm_for_decode_graphs_only(monkeypatch, eager, compile_, expected):
    from rlfp8.rollout import compat, engine
    monkeypatch.setattr(compat, "on_cpu_build", lambda: False)
    assert engine.compilation_config({"enforce_eager": eager, "compile": compile_}) == expected
    assert compose([f"engine.compile={str(compile_).lower()}"]).engine.compile is compile_
    with pytest.raises(ConfigError, match=r"engine.compile='sometimes': allowed values are \[True, False\]"):
        compose(["engine.compile=sometimes"])


def test_kernel_knobs_are_checked_at_composition():
    with pytest.raises(ConfigError, match=r"kernels.w8a16_widen='foo': allowed values are \('bits', 'cvt'\)"):
        compose(["kernels.w8a16_widen=foo"])
    assert compose(["kernels.k2_dist_red=false"]).kernels.k2_dist_red is False


def test_both_actors_apply_the_kernels_section_in_their_process(monkeypatch):
    """The actors' first act after the process set-up is knobs.apply_config(cfg['kernels'])."""
    from rlfp8.rollout import actor as rollout_actor
    from rlfp8.trainer import actor as trainer_actor
    seen = []
    for mod in (rollout_actor, trainer_actor):
        monkeypatch.setattr(mod, "setup_actor_process", lambda *a, **k: None)
        monkeypatch.setattr(mod, "apply_config", lambda section: (seen.append(section), 1 / 0))
    cfg = {"kernels": {"k2_dist_red": False}}
    with pytest.raises(ZeroDivisionError):
        rollout_actor.RolloutActor("m", cfg, "s", 1)
    with pytest.raises(ZeroDivisionError):
        trainer_actor.TrainerActor("m", cfg, "quantize", 1)
    assert seen == [cfg["kernels"], cfg["kernels"]]


def test_ray_address_forms():
    for address in ("auto", "10.0.0.2:6379", "head-node:6379", "ray://head:10001"):
        assert to_dict(compose([f"ray.address={address}", "ray.num_pairs=2"]))["ray"]["address"] == address


def test_saved_config_gains_new_section_keys():
    saved = to_dict(compose(["model=tiny"]))
    del saved["ray"]["num_pairs"]                     # a run saved before the key existed
    merged = config.with_new_defaults(saved)
    assert merged["ray"]["num_pairs"] == 1 and merged["model"] == saved["model"]


@pytest.mark.parametrize("precision, expected", [("w8a16", "auto"), ("w8a8", "off"), ("bf16", "off")])
def test_trainer_keeps_batch_invariant_schedules_only_for_the_matched_engine(monkeypatch, precision, expected):
    from rlfp8.kernels import knobs
    from rlfp8.trainer import actor as trainer_actor
    saved = knobs.knobs()
    monkeypatch.setattr(trainer_actor, "setup_actor_process", lambda *a, **k: None)
    monkeypatch.setattr(trainer_actor.PolicyTrainer, "__init__", lambda self, *a, **k: None)
    try:
        trainer_actor.TrainerActor("m", {"kernels": {}, "engine": {"precision": precision}}, "quantize", 1)
        assert knobs.knobs().batch_invariant == expected
    finally:
        knobs.restore_knobs(saved)


@pytest.mark.parametrize("cuda, expected", [(False, config.CPU_MICRO_BATCH_TOKENS), (True, config.GPU_MICRO_BATCH_TOKENS)])
def test_quickstart_micro_batch_tokens_auto_follows_the_device(monkeypatch, cuda, expected):
    monkeypatch.setattr(config, "cuda_available", lambda: cuda)
    assert compose(["recipe=quickstart"]).trainer.micro_batch_tokens == expected
    assert compose(["recipe=quickstart", "trainer.micro_batch_tokens=512"]).trainer.micro_batch_tokens == 512
    with pytest.raises(ConfigError, match="trainer.micro_batch_tokens"):
        compose(["trainer.micro_batch_tokens=fast"])
