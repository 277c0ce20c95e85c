"""Streams checkpoint pages between a KV pool and files through bounded host memory.

Used by `checkpoint`: never a full host copy of the pool, whatever its size.
"""

from __future__ import annotations

import io
import math
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from .safetensors_stream import SafetensorsWriter, read_into

CHUNK_BYTES = 64 << 20
"""Bytes of pages moved per chunk (two host buffers of this size at most)."""
DIRECT_RUN_BYTES = 1 << 20
"""Average run of consecutive CPU pages above which pages are written in place, not gathered."""


def _write_all(writer: SafetensorsWriter, parts: list[torch.Tensor]) -> None:
    for part in parts:
        writer.write(part)


class PageStream:
    """Moves stored pages between a pool tensor indexed by page (`blocks`, or an FP8 cache's
    `scales`; seen as uint8 `[pages, planes, layers, unit]`, a unit being one page's tokens of one
    layer and plane) and files, in chunks of about `CHUNK_BYTES` through at most two reused host
    buffers (pinned for CUDA) and a device staging buffer. `token_bytes` is one token's bytes of one
    layer and plane; `pool` may be None to only read (and checksum) files."""

    def __init__(self, planes: int, layers: int, token_bytes: int, page_tokens: int, pool: torch.Tensor | None) -> None:
        self.planes, self.layers = planes, layers
        self.unit = page_tokens * token_bytes
        self.page_bytes = planes * layers * self.unit
        self.view = None if pool is None else pool[:, :, :, :page_tokens].flatten(3).view(torch.uint8)
        self.cuda = pool is not None and pool.device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None

    def chunks(self, num_pages: int) -> list[tuple[slice, slice, slice, int, int]]:
        """`(pages, planes, layers, byte offset, bytes)` covering `num_pages` pages in row-major
        order: whole pages when a page fits in a chunk, else layer ranges of one page and plane."""
        out = []
        if self.page_bytes <= CHUNK_BYTES:
            step = max(1, CHUNK_BYTES // max(self.page_bytes, 1))
            for a in range(0, num_pages, step):
                b = min(num_pages, a + step)
                out.append(
                    (
                        slice(a, b),
                        slice(0, self.planes),
                        slice(0, self.layers),
                        a * self.page_bytes,
                        (b - a) * self.page_bytes,
                    )
                )
            return out
        step = max(1, CHUNK_BYTES // self.unit)
        for p in range(num_pages):
            for j in range(self.planes):
                for a in range(0, self.layers, step):
                    b = min(self.layers, a + step)
                    offset = ((p * self.planes + j) * self.layers + a) * self.unit
                    out.append((slice(p, p + 1), slice(j, j + 1), slice(a, b), offset, (b - a) * self.unit))
        return out

    def _host_buffer(self, i: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Host buffer `i` (of two) viewed as `shape`; grown on demand, then reused."""
        nbytes = math.prod(shape)
        while len(self._host) <= i:
            self._host.append(torch.empty(0, dtype=torch.uint8))
        if self._host[i].numel() < nbytes:
            self._host[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        return self._host[i][:nbytes].view(shape)

    def _runs(self, view: torch.Tensor, ids: torch.Tensor) -> list[tuple[int, int]] | None:
        """`(first id, count)` runs of consecutive ids when CPU pages of `view` (the pool's) can be
        written in place (contiguous pages, runs of at least `DIRECT_RUN_BYTES` on average); else None."""
        if self.cuda or not view[:1].is_contiguous() or not ids.numel():
            return None
        starts = torch.ones(ids.numel(), dtype=torch.bool)
        starts[1:] = ids[1:] != ids[:-1] + 1
        first = starts.nonzero().flatten()
        if first.numel() * DIRECT_RUN_BYTES > ids.numel() * self.page_bytes:
            return None
        counts = torch.diff(first, append=torch.tensor([ids.numel()]))
        return list(zip(ids[first].tolist(), counts.tolist(), strict=True))

    def write(self, writer: SafetensorsWriter, ids: torch.Tensor, bar: tqdm) -> None:
        """Write pages `ids` (on the blocks' device) in order: CPU pages in place when they lie in
        long runs, else gathered chunk by chunk, each write overlapping the next gather."""
        view = self.view
        assert view is not None
        with ThreadPoolExecutor(1) as pool:
            pending = None
            for i, (pages, planes, layers, _, nbytes) in enumerate(self.chunks(ids.numel())):
                src = view[:, planes, layers]
                runs = self._runs(view, ids[pages])
                if runs is not None:
                    job = [src[first : first + count] for first, count in runs]
                else:
                    job = [self._gather(i % 2, src, ids[pages])]
                if pending is not None:
                    pending.result()
                pending = pool.submit(_write_all, writer, job)
                bar.update(nbytes)
            if pending is not None:
                pending.result()

    def _gather(self, i: int, src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Pages `ids` of `src`, copied into host buffer `i`."""
        shape = (ids.numel(), *src.shape[1:])
        host = self._host_buffer(i, shape)
        if not self.cuda:
            return torch.index_select(src, 0, ids, out=host)
        return host.copy_(torch.index_select(src, 0, ids, out=self._staging_view(shape, src.device)))

    def _staging_view(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The reused staging buffer on `device` (the pool's, for CUDA pools) viewed as `shape`; grown
        on demand."""
        nbytes = math.prod(shape)
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._staging[:nbytes].view(shape)

    def read(self, file: io.BufferedIOBase, offset: int, dst_ids: torch.Tensor | None, count: int, bar: tqdm) -> int:
        """CRC-32 of `count` stored pages at `offset`, copied to pages `dst_ids` (int64, CPU) unless
        None: straight into the pool where they are consecutive CPU pages, else through a buffer."""
        crc = 0
        view = self.view
        for pages, planes, layers, chunk_offset, nbytes in self.chunks(count):
            shape = (pages.stop - pages.start, planes.stop - planes.start, layers.stop - layers.start, self.unit)
            ids = dst = None
            if dst_ids is not None and view is not None:
                ids = dst_ids[pages]
                if torch.equal(ids, torch.arange(int(ids[0]), int(ids[0]) + ids.numel())):
                    dst = view[int(ids[0]) : int(ids[0]) + ids.numel(), planes, layers]
            direct = dst is not None and not self.cuda and dst.is_contiguous()
            target = dst if dst is not None and direct else self._host_buffer(0, shape)  # (synchronous: one buffer)
            read_into(file, offset + chunk_offset, target)
            crc = zlib.crc32(target.numpy().data.cast("B"), crc)
            if dst is not None and not direct:
                dst.copy_(target)
            elif view is not None and ids is not None and dst is None:
                rows = self._staging_view(shape, view.device).copy_(target) if self.cuda else target
                view[:, planes, layers].index_copy_(0, ids.to(view.device), rows)
            bar.update(nbytes)
        return crc
