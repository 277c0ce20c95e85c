"""How pages get onto the wire and off it: packed into reused buffers, or sent from the pool itself.

`PackedPipe` gathers a chunk's pages into a wire buffer (and scatters them back), so pages scattered
over a pool travel in few large messages. `DirectPipe` hands out runs of consecutive pool pages as
the messages themselves: no copy on either side, only the checksum's read of the bytes. `transfer.py`
chooses per transfer (wire.py has the two message layouts).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from . import wire


def byte_pages(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous, pages first) as uint8 `[pages, bytes per page]`, no copy."""
    return tensor.view(torch.uint8).view(tensor.shape[0], -1)


_buffers = threading.local()


def _wire_buffers(device: torch.device, pin: bool, size: int) -> list[torch.Tensor]:
    """`PIPELINE_DEPTH` wire buffers of at least `size` bytes, kept for the next transfer of this thread
    (a fresh large allocation page-faults on first touch: 3-10x slower copies on the CPU)."""
    cache = _buffers.__dict__.setdefault("by_device", {})
    held = cache.get((device, pin))
    if held is None or held[0].numel() < size:
        held = [torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(PIPELINE_DEPTH)]
        cache[(device, pin)] = held
    return held


def free_buffers() -> None:
    """Drop this thread's cached wire buffers (kept between transfers, per device)."""
    _buffers.__dict__.pop("by_device", None)


PIPELINE_DEPTH = 3
"""Wire buffers per side: the receiver keeps two chunks in flight while it checks and places a third,
the sender fills one while two are being sent (gloo moves a message only once its receive is posted)."""
LOOP_MIN_PAGE_BYTES = 64 << 10
"""CPU pages at least this large move as one memcpy per run of consecutive pages (about 4x faster here
than `index_select`/`index_copy_` on 2 MiB pages); smaller ones with one indexed copy per chunk."""


def _widest(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two uint8 `[rows, bytes]` arrays viewed as the widest integer type their rows allow (fewer
    elements for the indexed copies)."""
    for dtype in (np.int64, np.int32, np.int16):
        if a.shape[1] % np.dtype(dtype).itemsize == 0:
            return a.view(dtype), b.view(dtype)
    return a, b


def _runs(pages: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions in `pages`, first pages and counts of its runs of consecutive ids (int64 arrays)."""
    index = np.asarray(pages, dtype=np.int64)
    starts = np.flatnonzero(np.diff(index, prepend=-2) != 1)  # -2: a page id is never -1
    return starts, index[starts], np.diff(starts, append=len(index))


def _move(pool: torch.Tensor, data: torch.Tensor, pages: list[int], to_wire: bool) -> None:
    """Pool pages `pages` (rows of uint8 `pool`) into the rows of `data` (`to_wire`) or back. On the
    CPU in numpy: one thread (torch's copies split over busy cores can run 10x slower), one memcpy per
    run of consecutive large pages, else one indexed copy."""
    if pool.device.type == data.device.type == "cpu":
        pool_np, data_np = pool.numpy(), data.numpy()
        if pool.shape[1] >= LOOP_MIN_PAGE_BYTES:
            for position, first, count in zip(*_runs(pages), strict=True):
                a, b = data_np[position : position + count], pool_np[first : first + count]
                np.copyto(a, b) if to_wire else np.copyto(b, a)
            return
        pool_np, data_np = _widest(pool_np, data_np)
        rows = np.asarray(pages, dtype=np.int64)
        if to_wire:
            np.take(pool_np, rows, axis=0, out=data_np)
        else:
            pool_np[rows] = data_np
        return
    index = torch.tensor(pages, dtype=torch.long, device=pool.device)
    if not to_wire:  # blocking copy to the pool's device: the buffer is reused for the next chunk
        pool.index_copy_(0, index, data.to(pool.device))
    elif pool.device == data.device:
        torch.index_select(pool, 0, index, out=data)
    else:
        data.copy_(pool.index_select(0, index))


class PackedPipe:
    """Packed messages: pages move between a pool (`blocks`, plus `scales` if any) and the reused wire
    buffers. A CPU pool and wire with the SUM64 checksum copy and checksum in one pass
    (`wire.copy_sum64`); a wire where SUM64 sums stay on the device (`wire.sums_stay_on`: a GPU) has its
    sums computed, written and compared there, and the receiver reads its verdicts back once."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor | None, wire_dev: torch.device, chunk_pages: int):
        self.blocks = byte_pages(blocks)
        self.scales = None if scales is None else byte_pages(scales)
        self.page_bytes = self.blocks.shape[1]
        self.scale_bytes = 0 if self.scales is None else self.scales.shape[1]
        size = chunk_pages * (self.page_bytes + self.scale_bytes) + wire.TRAILER_BYTES
        pin = wire_dev.type == "cpu" and blocks.device.type == "cuda"
        self.buffers = _wire_buffers(wire_dev, pin, size)
        self.on_device = wire.sums_stay_on(wire_dev)
        self.fusable = not self.on_device and blocks.device.type == wire_dev.type == "cpu" and wire.has_copy_sum64()

    def _fuses(self, kind: int) -> bool:
        """Whether messages with checksum `kind` are copied and checked in one pass."""
        return self.fusable and kind == wire.SUM64

    def _stays_on_device(self, kind: int) -> bool:
        """Whether checksums `kind` are computed and compared on the wire's device (no host wait)."""
        return self.on_device and kind == wire.SUM64

    def message(self, k: int, n: int) -> torch.Tensor:
        """Buffer `k % PIPELINE_DEPTH` cut to a chunk of `n` pages (with its trailer)."""
        return self.buffers[k % PIPELINE_DEPTH][: n * (self.page_bytes + self.scale_bytes) + wire.TRAILER_BYTES]

    def _parts(self, message: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(pool pages, the message's part for them): blocks, then scales if any."""
        parts = [(self.blocks, message[: n * self.page_bytes].view(n, self.page_bytes))]
        if self.scales is not None:
            end = n * (self.page_bytes + self.scale_bytes)
            parts.append((self.scales, message[n * self.page_bytes : end].view(n, self.scale_bytes)))
        return parts

    def _segments(self, pages: list[int]) -> np.ndarray:
        """`wire.copy_sum64` segments of a message of `pages`: one per run of consecutive pages,
        blocks then scales (message order)."""
        positions, firsts, counts = _runs(pages)
        pools = [self.blocks] if self.scales is None else [self.blocks, self.scales]
        parts, offset = [], 0
        for pool in pools:
            width = pool.shape[1]
            parts.append(np.stack([offset + positions * width, pool.data_ptr() + firsts * width, counts * width], 1))
            offset += len(pages) * width
        return np.concatenate(parts)

    def gather(self, message: torch.Tensor, pages: list[int], kind: int) -> None:
        """Pages `pages` of the pool into `message`, and the checksum into its trailer."""
        payload = message[: -wire.TRAILER_BYTES]
        if self._fuses(kind):
            wire.put_trailer(message, wire.copy_sum64(self._segments(pages), payload, to_payload=True))
            return
        for pool, data in self._parts(message, len(pages)):
            _move(pool, data, pages, to_wire=True)
        on_device = self._stays_on_device(kind)
        wire.put_trailer(message, wire.sum64_tensor(payload) if on_device else wire.checksum(payload, kind))

    def scatter(self, message: torch.Tensor, pages: list[int], kind: int) -> tuple[bool | torch.Tensor, int]:
        """The pages of `message` into pool pages `pages` if its checksum matches; returns whether it
        matched and how many pages were written. The fused and the on-device paths write the pages
        while they check them: all of them, match or not (the caller's own fresh pages, dropped on a
        mismatch); the on-device path's verdict is a 0-d bool tensor there, for the caller to read
        back with the others at the end."""
        payload = message[: -wire.TRAILER_BYTES]
        if self._stays_on_device(kind):
            matched = wire.sum64_tensor(payload) == wire.trailer_tensor(message)  # before the pages move
            for pool, data in self._parts(message, len(pages)):
                _move(pool, data, pages, to_wire=False)
            return matched, len(pages)
        expected = wire.get_trailer(message)
        if self._fuses(kind):
            return wire.copy_sum64(self._segments(pages), payload, to_payload=False) == expected, len(pages)
        if wire.checksum(payload, kind) != expected:
            return False, 0
        for pool, data in self._parts(message, len(pages)):
            _move(pool, data, pages, to_wire=False)
        return True, len(pages)


class DirectPipe:
    """Direct messages: a run of consecutive pages of the pool's `blocks` is itself the message (sent
    from there, received into there); the wanted pages' `scales`, if any, travel packed in one more."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor | None) -> None:
        self.blocks = byte_pages(blocks)
        self.scales = None if scales is None else byte_pages(scales)

    def message(self, first_page: int, count: int) -> torch.Tensor:
        """Pool pages `first_page .. first_page + count - 1` as one flat uint8 tensor (a view)."""
        return self.blocks[first_page : first_page + count].view(-1)

    def pack_scales(self, pages: list[int]) -> torch.Tensor:
        """The scales of `pages`, in order, as one flat uint8 message."""
        scales = self.scales
        assert scales is not None  # (a cache with scales)
        message = self.scales_message(len(pages))
        _move(scales, message.view(len(pages), -1), pages, to_wire=True)
        return message

    def scales_message(self, num_pages: int) -> torch.Tensor:
        """An empty message for the scales of `num_pages` pages."""
        assert self.scales is not None
        return torch.empty(num_pages * self.scales.shape[1], dtype=torch.uint8, device=self.scales.device)

    def unpack_scales(self, message: torch.Tensor, pages: list[int]) -> None:
        """Write a `pack_scales` message into the scales of `pages`."""
        assert self.scales is not None
        _move(self.scales, message.view(len(pages), -1), pages, to_wire=False)
