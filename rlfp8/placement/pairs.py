"""ray.num_pairs engine + trainer pairs: what the RL loop drives (rlfp8.train holds one Pairs).

- Each pair is one placement (two_copies | offloaded | one_copy: placement.name, the same for every pair)
  in its own bundle of one placement group (ray_setup.reserve_pairs), the pairs started side by side; pair 0 serves the eval's adapter-free
  probe, the parity probe, the kernel report and writes checkpoints (one writer).
- Rollouts: a step's prompts are cut into contiguous shares, one per pair (a prompt's whole group stays in
  one pair); pair p samples with seed + p, so pair 0 of N samples what one pair would for those prompts.
- Training: the driver computes rewards and group advantages over the whole batch; each trainer gets its
  share's rows (Rollouts.row_offset / total_rows) and the trainers sum their gradients over one
  torch.distributed process group (rlfp8.trainer.data_parallel), joined once at set-up through pair 0's
  trainer's rendezvous address. After every update the pairs' adapter checksums must be equal
  (dp/adapter_checksum_equal); a mismatch stops the run.
With one pair none of this runs: no process group, the same calls as before.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

from . import call, make_placement, placement_class
from .ray_setup import release_pairs, reserve_pairs, start_pairs, stop_actors

log = logging.getLogger("rlfp8.placement")

# train_step metrics that add up over the pairs (the rest are averaged; memory peaks take the max)
SUMMED_METRICS = ("train/loss", "train/tokens", "train/tokens_per_s")


class AdapterMismatchError(RuntimeError):
    """The pairs' adapters differ after an update: the data-parallel step is broken, the run must stop."""


def prompt_shares(num_prompts: int, num_pairs: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) prompt ranges, one per pair, sizes differing by at most one."""
    if num_prompts < num_pairs:
        raise ValueError(f"{num_prompts} prompts cannot be shared by ray.num_pairs={num_pairs} pairs "
                         f"(data.prompts_per_step must be >= ray.num_pairs)")
    base, extra = divmod(num_prompts, num_pairs)
    bounds, start = [], 0
    for p in range(num_pairs):
        end = start + base + (p < extra)
        bounds.append((start, end))
        start = end
    return bounds


def merge_metrics(per_pair: list[dict[str, float]]) -> dict[str, float]:
    """One row of train metrics from the pairs' rows (SUMMED_METRICS summed, memory max, the rest averaged)."""
    out = {}
    for k in dict.fromkeys(k for m in per_pair for k in m):
        vals = [m[k] for m in per_pair if k in m]
        out[k] = sum(vals) if k in SUMMED_METRICS else max(vals) if k.startswith("memory/") else sum(vals) / len(vals)
    return out


def join_process_group(trainers: list) -> None:
    """Every trainer actor joins one process group, rendezvous at trainer 0's (host, free port); their
    adapters must be equal from the start (same seed, same init)."""
    import ray
    host, port = call(trainers[0].rendezvous_address)
    sums = ray.get([t.join_data_parallel.remote(host, port, rank, len(trainers)) for rank, t in enumerate(trainers)])
    check_equal(sums, "at set-up")
    log.info("data parallel: %d pairs joined one process group at %s:%d", len(trainers), host, port)


def check_equal(checksums: list[str], when: str) -> None:
    if len(set(checksums)) != 1:
        raise AdapterMismatchError(f"data parallel: the pairs' adapters differ {when}: checksums {checksums}")


class Pairs:
    def __init__(self, cfg: dict, model_path: str, scratch_dir: str):
        self.cfg = cfg
        self.num_pairs = int(cfg["ray"]["num_pairs"])
        self.pg = reserve_pairs(cfg)
        self.pairs, actors = [], []
        dirs = [scratch_dir] if self.num_pairs == 1 else [str(Path(scratch_dir) / f"pair{i}")
                                                          for i in range(self.num_pairs)]
        try:
            actors = start_pairs(cfg, model_path, placement_class(cfg).weight_source, dirs, self.pg)
            for d, a in zip(dirs, actors):
                self.pairs.append(make_placement(cfg, model_path, d, a))
            if self.num_pairs > 1:
                join_process_group(self.trainers)
        except BaseException:
            self.pairs = []
            self.shutdown(actors)
            raise

    @property
    def engine(self):
        return self.pairs[0].engine

    @property
    def trainer(self):
        return self.pairs[0].trainer

    @property
    def trainers(self) -> list:
        return [p.trainer for p in self.pairs]


    # ------------------------------------------------------------------ the phases
    @contextmanager
    def _timed_hook(self, hook: str):
        """Seconds in the placements' phase hooks: what each placement moves around a phase (offloaded: the base
        in before_train / out after_sync; one_copy: the KV cache out before_train / back after_train)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            times = self.__dict__.setdefault("hook_times", {})
            times[hook] = times.get(hook, 0.0) + time.perf_counter() - t0

    def take_move_times(self) -> dict[str, float]:
        """time/moves/<hook> since the last call and their sum time/moves (inside time/rollout: before_rollout;
        time/train: before_train, after_train; time/sync: after_sync)."""
        times, self.hook_times = self.__dict__.get("hook_times", {}), {}
        out = {f"time/moves/{hook}": s for hook, s in times.items()}
        return {**out, "time/moves": sum(times.values())}

    def before_rollout(self) -> None:
        with self._timed_hook("before_rollout"):
            for p in self.pairs:
                p.before_rollout()

    def before_train(self) -> None:
        with self._timed_hook("before_train"):
            for p in self.pairs:
                p.before_train()

    def generate(self, prompt_ids: list[list[int]], n: int, *args, seed: int | None = None, **kwargs) -> list:
        """engine.generate over the pairs (contiguous prompt shares, side by side; fewer prompts than pairs, as
        in a small eval set: the first pairs only); prompt_index is global."""
        import ray
        if not prompt_ids:
            return []
        shares = prompt_shares(len(prompt_ids), min(self.num_pairs, len(prompt_ids)))
        refs = [p.engine.generate.remote(prompt_ids[a:b], n, *args, seed=None if seed is None else seed + i, **kwargs)
                for i, (p, (a, b)) in enumerate(zip(self.pairs, shares))]
        samples = []
        for (a, _), share in zip(shares, ray.get(refs)):
            for s in share:
                s.prompt_index += a
                samples.append(s)
        return samples

    def train_step(self, batch) -> dict[str, float]:
        """One update: each trainer its share's rows (a share = its pair's prompts' groups), gradients summed;
        then each placement's after_train."""
        metrics = self._train_step(batch)
        with self._timed_hook("after_train"):
            for p in self.pairs:
                p.after_train()
        return metrics

    def _train_step(self, batch) -> dict[str, float]:
        if self.num_pairs == 1:
            return call(self.trainer.train_step, batch)
        import ray

        from rlfp8.trainer.interface import Rollouts
        group = int(self.cfg["algo"]["group_size"])
        total = len(batch.input_ids)
        refs = []
        for t, (a, b) in zip(self.trainers, prompt_shares(total // group, self.num_pairs)):
            rows = slice(a * group, b * group)
            share = Rollouts(batch.input_ids[rows], batch.prompt_lens[rows], batch.rollout_logprobs[rows],
                             batch.advantages[rows], row_offset=a * group, total_rows=total)
            refs.append(t.train_step.remote(share))
        metrics = merge_metrics(ray.get(refs))
        metrics["dp/adapter_checksum_equal"] = float(self.verify_adapters("after the update"))
        return metrics

    def verify_adapters(self, when: str) -> bool:
        """The pairs' adapter checksums are equal (raises AdapterMismatchError otherwise)."""
        import ray
        check_equal(ray.get([t.adapter_checksum.remote() for t in self.trainers]), when)
        return True

    def sync_adapters(self) -> dict:
        """Each trainer's adapter to its own engine; returns pair 0's update (the parity probe's). The updates go
        from trainer to engine through Ray's object store as references: the driver only reads pair 0's.
        The caller starts the parity probe, then calls after_sync (offloaded moves the base out after the
        trainer has scored: each actor runs its calls in order)."""
        import ray
        updates = [t.export_adapter.remote() for t in self.trainers]
        ray.get([p.engine.set_adapter.remote(u) for p, u in zip(self.pairs, updates)])
        return ray.get(updates[0])

    def after_sync(self) -> None:
        with self._timed_hook("after_sync"):
            for p in self.pairs:
                p.after_sync()

    def settle(self) -> None:
        for p in self.pairs:
            p.settle()

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """Every trainer loads the one checkpoint pair 0 wrote."""
        import ray
        ray.get([t.load_checkpoint.remote(ckpt_dir) for t in self.trainers])
        if self.num_pairs > 1:
            self.verify_adapters(f"after loading {ckpt_dir}")

    def shutdown(self, actors: list | None = None) -> None:
        for a in actors if actors is not None else [p.actors for p in self.pairs]:
            stop_actors(a)
        release_pairs(self.pg)
