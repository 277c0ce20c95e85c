"""MLA latent caches: memory per token against an MHA cache of the same model, the accuracy of FP8
rope-aware rows against a bf16 latent cache, and decode time and bytes moved per token.

    PYTHONPATH=. python benchmarks/bench_mla.py [--device cpu] [--batch 4] [--context 2048] [--heads 16,128]
        [--backends reference,cpu] [--sparse 4096,256]

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
import statistics
from collections.abc import Callable

import torch
from harness import check_close, forced_backend, median_us, report, round_robin_ms

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


MATMUL = (1024, 1024, 512)  # m, k, n of the fp32 matmul timed beside each case on CPU


def _matmul_call() -> tuple[Callable[[], object], float]:
    """An fp32 matmul (MKL/oneDNN: near this CPU's FMA peak at torch's thread count) and its flops: the
    rate a compute-bound kernel is judged against, timed in the same rounds as the kernels."""
    m, k, n = MATMUL
    a, b = torch.randn(m, k), torch.randn(k, n)
    return lambda: torch.mm(a, b), 2.0 * m * k * n


def _decode_cache(dtype, batch: int, context: int, latent, rope, gen: torch.Generator, device: torch.device):
    """A one-layer MLA cache of page 64 holding `latent`/`rope` as `batch` sequences of `context`
    rows on shuffled pages, and its decode-step plan (each sequence's last row the new one)."""
    pages = batch * (-(-context // 64))
    table = (torch.randperm(pages, generator=gen) + 1).view(batch, -1).int()
    params = pk.KVCacheParams.mla(dtype, 1, 64, RANK, ROPE)
    c = pk.PagedKVCacheCollection(params, num_pages=pages, max_batch_size=batch, max_seq_len=context, device=device)
    c.lookup_table[:, : pages // batch] = table
    plan = pk.StepPlan.of(c, c.step_tensors(batch))
    c.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32) * context)
    plan.store_latent(latent, rope, 0)
    c.cache_lengths.fill_(context - 1)
    c.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
    return params, c, plan


def decode_rows(
    device: torch.device, batch: int, context: int, heads: int, backends: list[str], sparse: tuple[int, int] | None
) -> list[dict]:
    """Decode rows of each cache layout (and, with `sparse` = (context, k), of bf16 sparse decode over
    the top k listed of that many keys), each backend checked against the reference and timed in
    turn with the others (CPU: `round_robin_ms`, interleaved, medians). flops: both products, each
    query head against each key it reads (2 (rank + rope) + 2 rank per key and head)."""
    gen = torch.Generator().manual_seed(1)
    cases = [("bf16", torch.bfloat16, context, None), ("e4m3 per token, rope bf16", torch.float8_e4m3fn, context, None)]
    if sparse is not None:
        cases.append((f"bf16, sparse top {sparse[1]} of {sparse[0]}", torch.bfloat16, sparse[0], sparse[1]))
    q_nope = torch.randn(batch, heads, RANK, generator=gen).bfloat16().to(device)
    q_rope = torch.randn(batch, heads, ROPE, generator=gen).bfloat16().to(device)
    rows, outputs, contents = [], {}, {}
    for name, dtype, keys, top_k in cases:
        if keys not in contents:  # (the same rows in each layout of a context)
            contents[keys] = (
                torch.randn(batch * keys, RANK, generator=gen).bfloat16().to(device),
                torch.randn(batch * keys, ROPE, generator=gen).bfloat16().to(device),
            )
        latent, rope = contents[keys]
        params, c, plan = _decode_cache(dtype, batch, keys, latent, rope, gen, device)
        positions = None
        if top_k is not None:
            positions = torch.stack([torch.randperm(keys, generator=gen)[:top_k] for _ in range(batch)]).int()
            positions = positions.to(device)
        read = keys if top_k is None else top_k
        args = (q_nope, q_rope, c.blocks, *c.step_tensors(batch), 0, 192**-0.5, True, c.scales, positions)
        expected = reference_mla.mla_attention(*args)
        calls = {}
        for backend in backends:
            with forced_backend(backend):
                outputs[name, backend] = plan.mla_attention(q_nope, q_rope, 0, 192**-0.5, key_positions=positions)
            check_close(outputs[name, backend], expected, f"{backend} mla_attention on {name} rows")

            def call(backend=backend, plan=plan, positions=positions):
                with forced_backend(backend):
                    plan.mla_attention(q_nope, q_rope, 0, 192**-0.5, key_positions=positions)

            calls[backend] = call
        matmul_rate = None
        if device.type == "cpu":
            calls["matmul"], matmul_flops = _matmul_call()
            ms = {b: statistics.median(t) for b, t in round_robin_ms(calls, repeats=15).items()}
            matmul_rate = matmul_flops / ms.pop("matmul") / 1e6
        else:
            ms = {b: median_us(fn, device) / 1e3 for b, fn in calls.items()}
        row_bytes = params.head_dim * c.blocks.element_size() + 4 * params.scales_per_head
        nbytes = batch * read * row_bytes + 2 * q_nope.numel() * 2 + q_rope.numel() * 2
        flops = batch * read * heads * 2 * (2 * RANK + ROPE)
        for backend in backends:
            rate = flops / ms[backend] / 1e6
            rows.append(dict(cache=name, heads=heads, backend=backend, ms=ms[backend], MB_read=nbytes / 1e6,
                             GFLOP=flops / 1e9, GFLOP_per_s=rate,
                             vs_reference=ms["reference"] / ms[backend] if "reference" in ms else None,
                             of_matmul_rate=rate / matmul_rate if matmul_rate else None))  # fmt: skip
    last = backends[-1]
    bf16 = outputs["bf16", last].double()
    rows[2 * len(backends) - 1]["max_abs_err_vs_bf16"] = (
        (outputs["e4m3 per token, rope bf16", last].double() - bf16).abs().max().item()
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument(
        "--heads", default="16,128", help="query heads of the decode rows (DeepSeek: 128; 16 per GPU at TP 8)"
    )
    parser.add_argument(
        "--backends",
        default=None,
        help="backends timed against each other (interleaved on CPU); default "
        "reference,cpu on CPU, reference,triton on CUDA",
    )
    parser.add_argument("--sparse", default="4096,256", help="context,k of the sparse decode row ('' for none)")
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
        backends = (args.backends or ("reference,cpu" if device.type == "cpu" else "reference,triton")).split(",")
        sparse = None
        if args.sparse:
            keys, k = (int(x) for x in args.sparse.split(","))
            sparse = (keys, k)
        rows = [
            r
            for h in args.heads.split(",")
            for r in decode_rows(device, args.batch, args.context, int(h), backends, sparse)
        ]
        setup = dict(batch=args.batch, context=args.context, page_size=64, kv_lora_rank=RANK, rope_dim=ROPE,
                     threads=torch.get_num_threads())  # fmt: skip
        print(report("mla_decode", rows, setup))


if __name__ == "__main__":
    main()
