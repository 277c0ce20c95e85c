"""What both sides of a page transfer share: its errors and stats, where its messages live, and
posting and waiting for one message with a timeout (every failure a `TransferError`)."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch
import torch.distributed as dist

from ..manager import KVCacheManager

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
"""Longest wait for any one message of a transfer."""
DIRECT_IN_FLIGHT = 256
"""Direct messages posted ahead on each side (gloo moves a message once its receive is posted)."""


class TransferError(RuntimeError):
    """A transfer that did not complete. On the receiver its manager is as before; `pages_written`
    counts the (free) pages it had filled before giving up."""

    def __init__(self, message: str, pages_written: int = 0) -> None:
        super().__init__(message)
        self.pages_written = pages_written


class TransferRejected(TransferError):
    """The receiver refused the transfer before any page moved (incompatible cache, out of pages,
    bad ids); the message carries its reason."""


@dataclasses.dataclass
class TransferStats:
    """What one transfer moved (the same on both sides, but `seq_ids` are each side's own ids)."""

    seq_ids: list
    pages: int  # distinct pages the sequences use
    pages_sent: int  # pages that went over the wire (the rest the receiver had cached)
    bytes_sent: int  # page (and scale) bytes over the wire, checksums excluded
    seconds: float
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes_sent / max(self.seconds, 1e-12) / 1e9


def wire_device(group: dist.ProcessGroup | None, pool_device: torch.device) -> torch.device:
    """Where a group's messages live: the current CUDA device for NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        if pool_device.type != "cuda":
            raise ValueError(f"group: an NCCL group moves CUDA tensors, the pool is on {pool_device}")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pool_scales(manager: KVCacheManager) -> torch.Tensor | None:
    """The collection's per-page scales (a per-granule FP8 cache), if it has them; static per-tensor
    scales are part of the params, which both sides compare."""
    c = manager.collection
    return c.scales if c.params.has_scales_tensor else None


def scales_spec(scales: torch.Tensor | None) -> dict[str, Any] | None:
    if scales is None:
        return None
    return {"dtype": str(scales.dtype).removeprefix("torch."), "shape": list(scales.shape[1:])}


def wait(work: Any, timeout: datetime.timedelta, what: str, peer: int, written: int = 0) -> None:
    try:
        work.wait(timeout)
    except Exception as exc:  # gloo raises RuntimeError for a closed connection and for a timeout
        raise TransferError(f"{what} (rank {peer}): {type(exc).__name__}: {exc}", written) from exc


def post(op: Any, tensor: torch.Tensor, peer: int, group: Any, what: str, written: int = 0) -> Any:
    """`op(tensor, peer)` (isend/irecv); gloo raises right here when the pair is already closed."""
    try:
        return op(tensor, peer, group=group)
    except Exception as exc:
        raise TransferError(f"{what} (rank {peer}): {type(exc).__name__}: {exc}", written) from exc


def exchange(op: Any, tensor: torch.Tensor, peer: int, group: Any, timeout: datetime.timedelta, what: str) -> None:
    wait(post(op, tensor, peer, group, what), timeout, what, peer)
