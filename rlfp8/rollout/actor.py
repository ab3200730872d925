"""RolloutActor: the rollout role as a Ray actor, with the typed methods of RolloutEngineInterface.

Bridge until the engine updates its adapter slot in place (issue 13): set_adapter(update) writes the
update as a PEFT folder in the actor's scratch folder and hands its path to RolloutEngine.set_adapter;
older folders are deleted (the engine has loaded them already, or never will).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from rlfp8.peft_format import write_adapter_folder
from rlfp8.process import setup_actor_process

from .interface import RolloutEngineInterface, Sample


class RolloutActor(RolloutEngineInterface):
    def __init__(self, model_path: str, cfg: dict, scratch_dir: str, num_threads: int):
        setup_actor_process(num_threads, quiet_vllm=True)
        from .engine import RolloutEngine
        self.engine = RolloutEngine(model_path, cfg)
        self.scratch = Path(scratch_dir)
        self.scratch.mkdir(parents=True, exist_ok=True)

    def generate(self, prompt_ids, n, temperature, max_tokens, top_p=1.0, top_k=-1, stop_token_ids=None,
                 use_adapter=True, greedy=False, seed=None) -> list[Sample]:
        if seed is not None:
            raise NotImplementedError("generate(seed=...): per-call sampling seeds are not built yet: issue 19")
        return self.engine.generate(prompt_ids, n, temperature, max_tokens, top_p=top_p, top_k=top_k,
                                    stop_token_ids=stop_token_ids, use_adapter=use_adapter, greedy=greedy)

    def set_adapter(self, update: dict) -> int:
        path = write_adapter_folder(self.scratch / f"v{update['version']:06d}", update["tensors"], update["config"])
        version = self.engine.set_adapter(str(path), version=update["version"])
        for old in self.scratch.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return version

    def release_kv(self) -> None:
        raise NotImplementedError("release_kv (KV-only sleep while the trainer runs) is not built yet: issue 14")

    def resume_kv(self) -> None:
        raise NotImplementedError("resume_kv (KV-only sleep while the trainer runs) is not built yet: issue 14")

    def export_weights(self) -> dict:
        raise NotImplementedError("export_weights (CUDA IPC handles for one_copy) is not built yet: issue 14")

    def memory(self) -> dict[str, float]:
        return self.engine.memory()
