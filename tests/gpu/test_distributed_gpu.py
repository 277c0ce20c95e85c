"""Page transfer with GPU pools: sum64 in torch on the GPU, packed chunks checked on the device, and
transfers over NCCL (two GPUs) bit-exact, direct and packed, a corrupted chunk refused.

The CPU tests (tests/test_distributed_transfer.py) run the same code paths on CPU tensors; these
run them where they are meant to run. Skipped, with the reason, without the GPUs they need.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_ranks import Ranks, assert_same, check_contents, snapshot
from test_distributed_transfer import PARAMS, PS, corrupted_chunk, direct_counted, receiver_state, sender_state

from torch_paged_kv.distributed import TransferError, pipes, receive_sequences, send_sequences, wire

two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs two CUDA GPUs for NCCL; {torch.cuda.device_count()} visible"
)


@pytest.mark.parametrize("size", [8, 4096, 4096 * 3 + 40, (1 << 20) + 8])
def test_sum64_on_the_gpu_equals_the_cpu_sum(size):
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8)
    on_gpu = payload.cuda()
    want = wire.sum64(payload)
    assert wire.sum64(on_gpu) == want
    assert int(wire.sum64_tensor(on_gpu).cpu()) & (2**64 - 1) == want
    on_gpu[size // 2] ^= 1
    assert wire.sum64(on_gpu) != want


def test_packed_chunks_of_gpu_pages_are_checked_on_the_device():
    """gather and scatter on a CUDA pool and wire: the trailer's sum is written on the GPU, the verdict
    is a device tensor, the pages land bit-exact, and a flipped byte gives a False verdict."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(40, 2, 2, 16, 4, 8, generator=gen).to(torch.bfloat16).cuda()
    dst = torch.zeros_like(src)
    wire_dev = torch.device("cuda", torch.cuda.current_device())
    sender, receiver = pipes.PackedPipe(src, None, wire_dev, 8), pipes.PackedPipe(dst, None, wire_dev, 8)
    pages, into = [3, 4, 5, 17, 30, 2], [1, 9, 10, 11, 20, 39]
    message = sender.message(0, len(pages))
    sender.gather(message, pages, wire.SUM64)
    assert wire.get_trailer(message) == wire.sum64(message[: -wire.TRAILER_BYTES].cpu())
    matched, written = receiver.scatter(message, into, wire.SUM64)
    assert isinstance(matched, torch.Tensor) and matched.device.type == "cuda" and bool(matched)
    assert written == len(pages) and torch.equal(dst[into].view(torch.int16), src[pages].view(torch.int16))
    message[5] ^= 0x10
    assert not bool(receiver.scatter(message, into, wire.SUM64)[0])


def _to_gpu(manager) -> None:
    """Move the manager's pool to this rank's GPU (the pages travel from and into there)."""
    manager.collection.blocks = manager.collection.blocks.cuda()


def _to_cpu(manager) -> None:
    manager.collection.blocks = manager.collection.blocks.cpu()


def _nccl_transfers(rank: int, world: int, seeds: list[int], direct: bool) -> tuple[int, int]:
    """Random ragged sequences built on the CPU, moved to GPU 0's pool, sent over NCCL into GPU 1's
    pool (packed, or forced direct); the receiver checks every page against the tokens' K/V. Returns
    the pages sent and the direct messages."""
    sent = 0
    with direct_counted() if direct else contextlib.nullcontext([0]) as count:
        for seed in seeds:
            src, model, ids, shared = sender_state(seed)
            chunk_bytes = random.Random(seed).randint(1, 5) * PS * PARAMS.bytes_per_token
            if rank == 0:
                _to_gpu(src)
                sent += send_sequences(src, ids, 1, chunk_bytes=chunk_bytes).pages_sent
                continue
            dst, dst_model = receiver_state(seed, shared)
            _to_gpu(dst)
            stats = receive_sequences(dst, 0)
            _to_cpu(dst)
            sent += stats.pages_sent
            check_contents(dst, {**dst_model, **{i: model[i] for i in ids}}, [*dst_model, *ids])
    return sent, count[0]


@two_gpus
@pytest.mark.parametrize("direct", [False, True])
def test_transfers_over_nccl_between_gpu_pools_are_bit_exact(direct):
    ranks = Ranks(2, backend="nccl")
    try:
        (sent, sender_messages), (received, _) = ranks.run(_nccl_transfers, [1, 2, 3, 4], direct)
    finally:
        ranks.close()
    assert sent == received > 0
    assert (sender_messages > 0) == direct  # forced direct: runs of pool pages were the messages


def _nccl_corrupted(rank: int, world: int) -> str:
    """A byte flipped in packed chunk 2 after its checksum: refused after the last chunk (the verdicts
    are read back once), the receiver's manager as before, the next transfer works."""
    src, model, ids, _ = sender_state(5)
    one_page = PS * PARAMS.bytes_per_token
    if rank == 0:
        _to_gpu(src)
        with corrupted_chunk(2, byte=3, bit=0x40), pytest.raises(TransferError) as info:
            send_sequences(src, ids, 1, chunk_bytes=one_page)
        send_sequences(src, ids, 1, chunk_bytes=one_page)
        return str(info.value)
    dst, dst_model = receiver_state(5, [1, 2, 3, 4])
    _to_gpu(dst)
    before, free = snapshot(dst), list(dst.page_pool.free)
    with pytest.raises(TransferError, match="checksum") as info:
        receive_sequences(dst, 0)
    assert_same(before, snapshot(dst))
    assert list(dst.page_pool.free) == free
    receive_sequences(dst, 0)
    _to_cpu(dst)
    check_contents(dst, {**dst_model, **{i: model[i] for i in ids}}, [*dst_model, *ids])
    return str(info.value)


@two_gpus
def test_a_corrupted_chunk_over_nccl_is_refused_and_the_channel_stays_usable():
    ranks = Ranks(2, backend="nccl")
    try:
        sender, receiver = ranks.run(_nccl_corrupted)
    finally:
        ranks.close()
    assert receiver.startswith("checksum (sum64) mismatch in chunk 2 of")
    assert "did not take the sequences: checksum (sum64) mismatch in chunk 2" in sender


@two_gpus
def test_the_disaggregated_example_over_nccl_gives_the_single_process_tokens():
    script = Path(__file__).resolve().parents[2] / "examples" / "disaggregated.py"
    args = [sys.executable, str(script), "--requests", "4", "--new-tokens", "6", "--device", "cuda", "--eager"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nccl" in done.stdout
