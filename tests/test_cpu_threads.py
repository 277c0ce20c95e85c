"""The `cpu` kernels' fan-out guard (parallel.h): a parallel loop slower than one thread keeps the
next calls on one thread for a while, instead of every call waiting for a thread the OS runs late."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torch_paged_kv.ops.cpu import kernels

# One CPU for two threads: they cannot run at once, so every parallel loop takes longer than its
# threads' CPU time on the items (a loss) — what a core held by another process does to a thread.
ONE_CPU = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before torch starts OpenMP's threads
import torch
from torch_paged_kv.ops.cpu import kernels
from torch_paged_kv.ops.records import FlashAttentionArgs, StoreKVArgs
from torch_paged_kv.testing import make_paged_batch
torch.set_num_threads(2)
lib = kernels.load()
b = make_paged_batch([511] * 4, [1] * 4, page_size=16, num_kv_heads=8, head_dim=128, group=4)  # 2 threads' work
kernels.store_kv(StoreKVArgs(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx))
attention = FlashAttentionArgs(b.q, b.blocks, *b.step, b.layer_idx, 0.1)
for _ in range(int(sys.argv[1])):
    kernels.flash_attention(attention)
print(lib.pkv_parallel_losses())
"""


def test_calls_stay_on_one_thread_after_fanning_out_lost():
    """20 calls that would each fan out and lose: the first loses, then the calls stay on one thread
    for 10 ms, 20 ms, 40 ms, ... (a retry after each), so only a few of them lose."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs os.sched_setaffinity (Linux)")
    if not kernels.load().pkv_openmp():
        pytest.skip("the kernels were built without OpenMP: one thread always")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    calls = 20
    done = subprocess.run([sys.executable, "-c", ONE_CPU, str(calls)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = int(done.stdout.split()[-1])
    assert 1 <= losses <= calls // 2, losses
