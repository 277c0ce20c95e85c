"""MLA latent caches: memory per token against an MHA cache of the same model, the accuracy of FP8
rope-aware rows against a bf16 latent cache, and decode time and bytes moved per token.

    PYTHONPATH=. python benchmarks/bench_mla.py [--device cpu] [--batch 4] [--context 2048] [--heads 16]

Memory: bytes per token, all layers, of DeepSeek-V2 (60 layers, 128 heads, qk_nope 128, rope 64,
v 128, kv_lora_rank 512) stored as decompressed per-head K and V (an MHA cache) or as one MLA row.
Accuracy: decode output (the latent-space output of `mla_attention`) of each FP8 layout against the
same rows in a bf16 cache, one query per head over `--accuracy-tokens` keys, on random rows, rows
with a few 30x latent channels, and rope keys 10x the latent (the rope is not RMS-normalised in
DeepSeek-V2, the latent is). "rope in FP8 too" quantizes the whole 576-wide row per token (what a
rope-unaware FP8 row does). Decode: the default backend of the device, bf16 vs the FP8 rope-aware
row, checked against each other; bytes = every cached row (and scale) once, plus q and out.
"""

from __future__ import annotations

import argparse

import torch
from harness import check_close, median_us, report

import torch_paged_kv as pk
from torch_paged_kv.ops import reference_mla

RANK, ROPE = 512, 64
DEEPSEEK_V2 = dict(layers=60, heads=128, qk_nope=128, rope=64, v=128)

LAYOUTS = {  # name: (dtype, quantization, rope kept apart)
    "bf16 (reference)": (torch.bfloat16, {}, True),
    "e4m3, scale per token, rope bf16": (torch.float8_e4m3fn, {}, True),
    "e4m3, 4 scales per token (128), rope bf16": (torch.float8_e4m3fn, dict(quantization_granularity=128), True),
    "e5m2, scale per token, rope bf16": (torch.float8_e5m2, {}, True),
    "e4m3, static scale, rope bf16": (torch.float8_e4m3fn, "static", True),
    "e4m3, scale per token, rope in FP8 too": (torch.float8_e4m3fn, {}, False),
}


def memory_rows() -> list[dict]:
    m = DEEPSEEK_V2
    k_v = m["heads"] * (m["qk_nope"] + m["rope"] + m["v"])  # K and V elements of every head, per token and layer
    mha_bf16 = m["layers"] * k_v * 2
    rows = [dict(cache="MHA bf16 (decompressed K and V)", bytes_per_token=mha_bf16)]
    rows.append(
        dict(cache="MHA FP8, scale per token and head", bytes_per_token=m["layers"] * (k_v + 2 * m["heads"] * 4))
    )
    for name, (dtype, quantization, _) in list(LAYOUTS.items())[:-1]:
        if quantization == "static":
            quantization = dict(static_scales=(1.0,))
        p = pk.KVCacheParams.mla(dtype, m["layers"], 64, RANK, ROPE, **quantization)
        rows.append(
            dict(
                cache=f"MLA {name.removesuffix(' (reference)')}",
                bytes_per_token=p.bytes_per_token + p.scale_bytes_per_token,
            )
        )
    for row in rows:
        row["KiB_per_token"] = row["bytes_per_token"] / 1024
        row["vs_MHA_bf16"] = mha_bf16 / row["bytes_per_token"]
    return rows


def _rows(tokens: int, data: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    latent = torch.randn(tokens, RANK, generator=gen)
    rope = torch.randn(tokens, ROPE, generator=gen)
    if data == "latent outliers":
        latent[:, [7, 100, 333]] *= 30
    if data == "rope 10x":
        rope *= 10
    return latent.bfloat16(), rope.bfloat16()


def _decode(
    layout: str, latent: torch.Tensor, rope: torch.Tensor, q: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """One decode query `q` `[heads, rank + rope]` over the rows, stored in `layout`, on `device`."""
    dtype, quantization, rope_apart = LAYOUTS[layout]
    tokens = latent.shape[0]
    if not rope_apart:  # the whole row as one latent: the rope quantized with it
        latent, rope = torch.cat((latent, rope), dim=1), rope[:, :0]
    if quantization == "static":
        quantization = dict(static_scales=(latent.float().abs().max().item() / torch.finfo(dtype).max,))
    params = pk.KVCacheParams.mla(dtype, 1, 16, latent.shape[1], rope.shape[1], **quantization)
    pages = -(-tokens // 16)
    c = pk.PagedKVCacheCollection(params, num_pages=pages, max_batch_size=1, max_seq_len=pages * 16, device=device)
    c.lookup_table[0, :pages] = torch.arange(1, pages + 1, dtype=torch.int32)
    plan = pk.StepPlan.of(c, c.step_tensors(1))
    c.input_row_offsets[1] = tokens
    plan.store_latent(latent.to(device), rope.to(device), 0)
    c.cache_lengths[0], c.input_row_offsets[1] = tokens - 1, 1
    q = q.to(device)[None]
    out = plan.mla_attention(q[..., : latent.shape[1]], q[..., latent.shape[1] :], 0, (128 + ROPE) ** -0.5)
    return out[0, :, :RANK].double().cpu()


def accuracy_rows(tokens: int, heads: int, device: torch.device) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(heads, RANK + ROPE, generator=gen).bfloat16()
    rows = []
    for data in ("random", "latent outliers", "rope 10x"):
        latent, rope = _rows(tokens, data, gen)
        exact = _decode("bf16 (reference)", latent, rope, q, device)
        for layout in list(LAYOUTS)[1:]:
            diff = _decode(layout, latent, rope, q, device) - exact
            rel = (diff.norm() / exact.norm()).item()
            rows.append(dict(data=data, fp8_row=layout, max_abs_err=diff.abs().max().item(), rel_rms_err=rel))
    return rows


def decode_rows(device: torch.device, batch: int, context: int, heads: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    pages = batch * (-(-context // 64))
    table = (torch.randperm(pages, generator=gen) + 1).view(batch, -1).int()
    latent = torch.randn(batch * context, RANK, generator=gen).bfloat16().to(device)
    rope = torch.randn(batch * context, ROPE, generator=gen).bfloat16().to(device)
    q_nope = torch.randn(batch, heads, RANK, generator=gen).bfloat16().to(device)
    q_rope = torch.randn(batch, heads, ROPE, generator=gen).bfloat16().to(device)
    rows, outputs = [], {}
    for name, dtype in [("bf16", torch.bfloat16), ("e4m3 per token, rope bf16", torch.float8_e4m3fn)]:
        params = pk.KVCacheParams.mla(dtype, 1, 64, RANK, ROPE)
        c = pk.PagedKVCacheCollection(params, num_pages=pages, max_batch_size=batch, max_seq_len=context, device=device)
        c.lookup_table[:, : pages // batch] = table
        plan = pk.StepPlan.of(c, c.step_tensors(batch))
        c.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32) * context)
        plan.store_latent(latent, rope, 0)
        c.cache_lengths.fill_(context - 1)
        c.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
        outputs[name] = plan.mla_attention(q_nope, q_rope, 0, 192**-0.5)
        args = (q_nope, q_rope, c.blocks, *c.step_tensors(batch), 0, 192**-0.5, True, c.scales)
        check_close(outputs[name], reference_mla.mla_attention(*args), f"mla_attention on {name} rows")
        us = median_us(lambda plan=plan: plan.mla_attention(q_nope, q_rope, 0, 192**-0.5), device)
        row_bytes = params.head_dim * c.blocks.element_size() + 4 * params.scales_per_head
        nbytes = batch * context * row_bytes + 2 * q_nope.numel() * 2 + q_rope.numel() * 2
        rows.append(dict(cache=name, backend=pk.backend_info(device, params)["mla_attention"], heads=heads, us=us,
                         bytes_per_token=row_bytes, MB_read=nbytes / 1e6, GB_per_s=nbytes / us / 1e3))  # fmt: skip
    bf16 = outputs["bf16"].double()
    rows[-1]["max_abs_err_vs_bf16"] = (outputs["e4m3 per token, rope bf16"].double() - bf16).abs().max().item()
    rows[-1]["time_vs_bf16"] = rows[-1]["us"] / rows[0]["us"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument(
        "--heads", default="16,128", help="query heads of the decode rows (DeepSeek: 128; 16 per GPU at TP 8)"
    )
    parser.add_argument("--accuracy-tokens", type=int, default=2048)
    parser.add_argument("--accuracy-heads", type=int, default=16)
    args = parser.parse_args()
    device = torch.device(args.device)
    with torch.no_grad():
        print(report("mla_memory", memory_rows(), dict(model="DeepSeek-V2", **DEEPSEEK_V2, kv_lora_rank=RANK)))
        print()
        setup = dict(tokens=args.accuracy_tokens, heads=args.accuracy_heads, kv_lora_rank=RANK, rope_dim=ROPE)
        print(report("mla_fp8_accuracy", accuracy_rows(args.accuracy_tokens, args.accuracy_heads, device), setup))
        print()
        rows = [r for h in args.heads.split(",") for r in decode_rows(device, args.batch, args.context, int(h))]
        setup = dict(batch=args.batch, context=args.context, page_size=64, kv_lora_rank=RANK, rope_dim=ROPE)
        print(report("mla_decode", rows, setup))


if __name__ == "__main__":
    main()
