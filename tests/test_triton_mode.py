"""Triton fixes interpreter mode when first imported: a late TRITON_INTERPRET=1 must be refused clearly."""

import os
import subprocess
import sys

SCRIPT = """
import os, torch
import triton  # compiled mode: TRITON_INTERPRET is not set yet
os.environ["TRITON_INTERPRET"] = "1"
os.environ["TORCH_PAGED_KV_BACKEND"] = "triton"
import torch_paged_kv as pk
from torch_paged_kv.testing import make_paged_batch
b = make_paged_batch([3], [1], page_size=4, head_dim=16)
try:
    pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.5)
except pk.BackendUnavailableError as e:
    print("refused:", e)
"""


def test_late_interpreter_flag_is_refused_with_the_reason():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "imported before TRITON_INTERPRET=1" in done.stdout
