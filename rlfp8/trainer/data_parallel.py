"""Data-parallel adapter gradients across the trainers of N engine + trainer pairs (ray.num_pairs).

Each trainer holds a contiguous share of the step's rows; the driver hands out one rendezvous address
(pair 0's trainer: `rendezvous_address`) and every trainer joins one torch.distributed process group
(gloo on CPU, NCCL on GPU) once, at set-up. Exactness: every loss denominator is a count over the
WHOLE mini-batch (the sum of the shares' counts), every share's loss is its own numerator over that
global count, so the SUM of the shares' gradients is the one-pair gradient of the whole batch; it is
all-reduced (sum, not mean) before clipping, so clip norm, optimizer step and scheduler match too.
No Ray here: the trainer stays Ray-free.
"""
from __future__ import annotations

import hashlib
import socket
from datetime import timedelta

import torch


def rendezvous_address() -> tuple[str, int]:
    """This host's address as the other nodes reach it, and a free TCP port on it (for rank 0)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))          # no packet is sent: picks the outgoing interface
            host = s.getsockname()[0]
    except OSError:
        host = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


class DataParallel:
    """One process group over the pairs' trainers; sums of floats and of gradients."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device):
        import torch.distributed as dist
        if not 0 <= rank < world_size:
            raise ValueError(f"data parallel: rank={rank} outside world_size={world_size}")
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(self.backend, init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=10))
        self.rank, self.world_size, self.device = rank, world_size, device

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64: counts stay exact)."""
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def sum_dict(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        return dict(zip(keys, self.sum_floats([float(values[k]) for k in keys])))

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """p.grad <- sum over ranks (one flat buffer; a share without rows contributes zeros)."""
        import torch.distributed as dist
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def tensor_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """Exact checksum (hash of the bytes, in key order): equal iff every tensor is bit-identical."""
    h = hashlib.blake2b(digest_size=16)
    for k in sorted(tensors):
        t = tensors[k].detach().to("cpu").contiguous().reshape(-1)
        h.update(k.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
