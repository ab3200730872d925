"""RolloutActor: the rollout role as a Ray actor, with the typed methods of RolloutEngineInterface; each
delegates to RolloutEngine (engine.py) in the actor's process."""
from __future__ import annotations

from rlfp8.kernels.knobs import apply_config
from rlfp8.process import setup_actor_process

from .interface import RolloutEngineInterface, Sample


class RolloutActor(RolloutEngineInterface):
    def __init__(self, model_path: str, cfg: dict, scratch_dir: str, num_threads: int):
        setup_actor_process(num_threads, quiet_vllm=True)
        apply_config(cfg["kernels"])          # the kernels.* knobs of the config, in this process
        from .engine import RolloutEngine
        self.engine = RolloutEngine(model_path, cfg)
        self.scratch_dir = scratch_dir

    def generate(self, prompt_ids, n, temperature, max_tokens, top_p=1.0, top_k=-1, stop_token_ids=None,
                 use_adapter=True, greedy=False, seed=None) -> list[Sample]:
        return self.engine.generate(prompt_ids, n, temperature, max_tokens, top_p=top_p, top_k=top_k,
                                    stop_token_ids=stop_token_ids, use_adapter=use_adapter, greedy=greedy, seed=seed)

    def set_adapter(self, update: dict) -> int:
        return self.engine.set_adapter(update)

    def score(self, sequences: list[list[int]], prompt_lens: list[int], use_adapter: bool = True) -> list[list[float]]:
        return self.engine.score(sequences, prompt_lens, use_adapter)

    def slot_checksums(self) -> dict[str, float]:
        return self.engine.slot_checksums()

    def lora_dtype(self) -> str:
        return self.engine.lora_dtype()

    def kernel_report(self) -> dict:
        return self.engine.kernel_report()

    def release_kv(self) -> dict:
        return self.engine.release_kv()

    def resume_kv(self) -> None:
        self.engine.resume_kv()

    def release_weights(self) -> dict:
        return self.engine.release_weights()

    def resume_weights(self) -> None:
        self.engine.resume_weights()

    def weights_release_enabled(self) -> bool:
        return self.engine.weights_release

    def export_weights(self) -> dict:
        from pathlib import Path
        return self.engine.export_weights(str(Path(self.scratch_dir) / "weights"))

    def kv_release_enabled(self) -> bool:
        return self.engine.kv_release

    def base_checksums(self) -> dict[str, int]:
        return self.engine.base_checksums()

    def memory(self) -> dict[str, float]:
        return self.engine.memory()
