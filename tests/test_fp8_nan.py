"""One rule for NaN and infinity in FP8 caches (`ops/quant.py`), kept bit for bit by every backend.

Per-granule scales: a granule holding a NaN or an infinity stores scale NaN and zero codes, so every
element of it reads back NaN. A static scale: a NaN stores code 0x7F whatever its sign and reads back
NaN; an infinity saturates to the largest finite code. Before this rule Triton's `tl.max` skipped
the NaN (a finite scale) and its clamp made the NaN a finite ±448 code, while the reference stored a
NaN scale. The Triton kernels run in the interpreter, whose `tl.max` and `tl.maximum` skip NaNs as
the GPU's do (numpy's fmax).
"""

from __future__ import annotations

import os

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv.ops import cpu as cpu_backend
from torch_paged_kv.ops import quant
from torch_paged_kv.ops.triton import unavailable_reason
from torch_paged_kv.testing import make_fp8_batch, make_mla_batch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("a GPU is visible: the Triton kernels here run in the interpreter", allow_module_level=True)

NAN, INF = float("nan"), float("inf")
NEG_NAN = -torch.tensor(NAN)  # sign bit set: its code must still be 0x7F


def test_the_rule_in_plain_torch():
    x = torch.tensor([[1.0, NAN, 2.0, 3.0], [1.0, INF, 2.0, 3.0], [-INF, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, scales = quant.quantize(x, dtype, 4)
        assert scales[:3].isnan().all() and scales[3] == 4.0 / torch.finfo(dtype).max
        assert not q[:3].view(torch.uint8).any()
        assert quant.dequantize(q, scales)[:3].isnan().all() and quant.dequantize(q, scales)[3].isfinite().all()
        static = quant.quantize_static(torch.tensor([NAN, NEG_NAN, INF, -INF, 1.0]), dtype, 0.5).view(torch.uint8)
        top = torch.tensor(torch.finfo(dtype).max).to(dtype).view(torch.uint8).item()
        assert static[:4].tolist() == [0x7F, 0x7F, top, top | 0x80]
        assert quant.dequantize(static.view(dtype)[:2], 0.5).isnan().all()


def _poison(rows: torch.Tensor) -> torch.Tensor:
    """`rows [total, heads, d]` (bf16) with a NaN, a negative NaN, +inf and -inf in separate rows and heads."""
    rows = rows.clone()
    rows[0, 0, 3], rows[2, 0, -1], rows[-1, -1, 9] = NAN, INF, -INF
    rows.view(torch.int16)[1, -1, 0] = -64  # 0xFFC0: bf16's NaN with the sign bit set
    assert rows[1, -1, 0].isnan()
    return rows


def _backends() -> list[str]:
    found = ["reference"]
    if cpu_backend.unavailable_reason(torch.device("cpu")) is None:
        found.append("cpu")
    if unavailable_reason(torch.device("cpu")) is None:
        found.append("triton")
    return found


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit for every element that is not NaN, NaN where `want` is NaN."""
    return bool((got.isnan() == want.isnan()).all()) and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


KV_CASES = {  # name: (dtype, granularity; None: a static pair)
    "e4m3-granule8": (torch.float8_e4m3fn, 8),
    "e5m2-per-token": (torch.float8_e5m2, 32),
    "e4m3-static": (torch.float8_e4m3fn, None),
    "e5m2-static": (torch.float8_e5m2, None),
}


@pytest.mark.parametrize("case", KV_CASES)
def test_store_kv_and_gather_kv_follow_the_rule_on_every_backend(case, force_backend):
    dtype, granularity = KV_CASES[case]
    b, keys, values = make_fp8_batch([3, 0, 9], [2, 4, 1], dtype=dtype, granularity=granularity, head_dim=32)
    keys, values = _poison(keys), _poison(values.flip(0))
    stored, read = {}, {}
    for backend in _backends():
        force_backend(backend)
        blocks, scales = b.blocks.clone(), b.scales.clone()
        pk.store_kv(keys, values, blocks, *b.step, b.layer_idx, scales)
        stored[backend] = blocks.view(torch.uint8), scales
        read[backend] = pk.gather_kv(blocks, *b.step, b.layer_idx, 10, scales, torch.float32)
    want_blocks, want_scales = stored["reference"]
    for backend, (blocks, scales) in stored.items():
        assert torch.equal(blocks, want_blocks), backend
        assert _same(scales, want_scales), backend
        assert all(_same(g, w) for g, w in zip(read[backend], read["reference"], strict=True)), backend
    key, _ = read["reference"]  # sequence 0's new rows sit at positions 3, 4; sequence 1's at 0..3
    granule = slice(0, granularity or 1) if granularity else slice(3, 4)
    assert key[0, 3, 0, granule].isnan().all() and key[0, 4, -1, 0].isnan()
    assert key[1, 0, 0, -1].isnan() if granularity else key[1, 0, 0, -1] == torch.finfo(dtype).max * 0.02
    finite = key.clone()
    finite[0, 3:5], finite[1, 0], finite[2, 9] = 0.0, 0.0, 0.0  # the new rows holding a NaN or inf
    assert finite.isfinite().all()  # nothing beyond them


MLA_CASES = {
    "e4m3-granule128": (torch.float8_e4m3fn, dict(quantization_granularity=128)),
    "e4m3-per-token": (torch.float8_e4m3fn, {}),
    "e5m2-static": (torch.float8_e5m2, dict(static_scales=(0.01,))),
}


@pytest.mark.parametrize("case", MLA_CASES)
def test_store_latent_and_mla_attention_follow_the_rule_on_every_backend(case, force_backend):
    dtype, quantization = MLA_CASES[case]
    b = make_mla_batch([3, 0, 9], [2, 4, 1], page_size=4, kv_lora_rank=256, dtype=dtype, **quantization)
    latent = b.new_latent.clone()
    latent[0, 7], latent[5, 0], latent[6, -1] = NAN, INF, -INF
    latent.view(torch.int16)[2, 200] = -64  # 0xFFC0: bf16's NaN with the sign bit set
    results = {}
    for backend in ("reference", "triton"):
        if backend == "triton" and unavailable_reason(torch.device("cpu")) is not None:
            continue
        force_backend(backend)
        blocks = b.blocks.clone()
        scales = None if b.scales is None else b.scales.clone()
        pk.store_latent(latent, b.new_rope, blocks, *b.step, b.layer_idx, scales)
        out = pk.mla_attention(b.q_nope, b.q_rope, blocks, *b.step, b.layer_idx, 0.06, True, scales)
        results[backend] = blocks.view(torch.uint8), scales, out
    want_blocks, want_scales, want_out = results["reference"]
    # rows 0-1 (sequence 0) see the NaN at position 3, rows 2-5 (sequence 1) the one at position 0;
    # row 6's -inf makes its granule's scale NaN, or saturates under a static scale
    assert want_out[:6].isnan().all() and want_out[6].isnan().all() == (b.scales is not None and b.scales.dim() > 1)
    assert want_out[6].isnan().all() or want_out[6].isfinite().all()
    for backend, (blocks, scales, out) in results.items():
        assert torch.equal(blocks, want_blocks), backend
        assert want_scales is None or _same(scales, want_scales), backend
        assert torch.equal(out.isnan(), want_out.isnan()), backend
