"""DeepSeek-V2-style multi-head latent attention (MLA) serving continuous batching from a latent cache.

A small random model, gpt-fast style: each layer compresses a token's keys and values into one
`kv_lora_rank` latent (plus a shared rotated rope key), and the cache keeps only that row, not K
and V per head. Attention runs in the absorbed form: the no-rope query is multiplied by W_UK, the
latent-space output by W_UV, so cached latents are never decompressed. `KVCacheManager` gives each
request its pages; requests arrive at different steps; decode steps go through
`torch.compile(fullgraph=True)` and must not recompile as the batch grows and shrinks. At the end
every request is recomputed alone, without a cache, with the non-absorbed formula (decompressed
per-head K = [W_UK latent; k_rope] and V = W_UV latent, plain causal SDPA): the greedy tokens must
match (float32 cache), or their agreement is reported (`--kv-dtype float8_e4m3fn`: the FP8 cache
keeps MAX's rope-aware row, FP8 latent then bf16 rope).

    python examples/mla_decode.py [--device cuda] [--requests 6] [--new-tokens 24] [--kv-dtype float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_paged_kv as pk


@dataclasses.dataclass
class Config:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 3
    n_heads: int = 8
    kv_lora_rank: int = 64  # DeepSeek-V2: 512
    qk_nope_head_dim: int = 32  # 128
    qk_rope_head_dim: int = 16  # 64
    v_head_dim: int = 32  # 128
    ffn_dim: int = 512
    rope_base: float = 10000.0
    max_seq_len: int = 256


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` `[tokens, heads, rope_dim]` (halves layout)."""
    a, b = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)


class MLA(nn.Module):
    def __init__(self, cfg: Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, nope, rope, rank = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        self.wq = nn.Linear(cfg.dim, h * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(cfg.dim, rank + rope, bias=False)  # the latent and the shared rope key
        self.kv_norm = nn.RMSNorm(rank)
        self.wkv_b = nn.Linear(rank, h * (nope + cfg.v_head_dim), bias=False)  # W_UK and W_UV, per head
        self.wo = nn.Linear(h * cfg.v_head_dim, cfg.dim, bias=False)
        self.softmax_scale = (nope + rope) ** -0.5

    def forward(self, x, cos, sin, plan: pk.StepPlan | None):
        cfg = self.cfg
        h, nope, rank = cfg.n_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_nope, q_rope = self.wq(x).unflatten(-1, (h, -1)).split([nope, cfg.qk_rope_head_dim], dim=-1)
        q_rope = rotate(q_rope, cos, sin)
        latent, k_rope = self.wkv_a(x).split([rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = rotate(k_rope[:, None], cos, sin)[:, 0]
        w_uk, w_uv = self.wkv_b.weight.unflatten(0, (h, -1)).split([nope, cfg.v_head_dim], dim=1)
        if plan is None:  # no cache, one sequence: decompress K and V per head (the check at the end)
            k_nope, v = self.wkv_b(latent).unflatten(-1, (h, -1)).split([nope, cfg.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_rope[:, None].expand(-1, h, -1)], dim=-1)
            q = torch.cat([q_nope, q_rope], dim=-1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=self.softmax_scale
            ).transpose(0, 1)
        else:  # absorbed: attend over the cached latents, never decompressing them
            plan.store_latent(latent, k_rope, self.layer_idx)
            q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
            o_latent = plan.mla_attention(q_latent, q_rope, self.layer_idx, self.softmax_scale)
            o = torch.einsum("thr,hvr->thv", o_latent.type_as(w_uv), w_uv)
        return self.wo(o.flatten(1))


class Block(nn.Module):
    def __init__(self, cfg: Config, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn = MLA(cfg, layer_idx)
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, plan):
        x = x + self.attn(self.attn_norm(x), cos, sin, plan)
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    """Takes a ragged batch of new tokens `[total]` and returns each sequence's last logits."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        rope = cfg.qk_rope_head_dim
        inv_freq = cfg.rope_base ** -(torch.arange(0, rope, 2).float() / rope)
        angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def attach_cache(self, collection: pk.PagedKVCacheCollection) -> None:
        """Keep the pool (and an FP8 cache's scales) as buffers: static addresses for CUDA graphs."""
        self.register_buffer("blocks", collection.blocks, persistent=False)
        self.register_buffer("scales", collection.scales, persistent=False)

    def forward(self, tokens: torch.Tensor, step: pk.StepTensors | None) -> torch.Tensor:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        if step is None:
            positions, last_rows, plan = rows, rows[-1:], None
        else:
            seq = torch.searchsorted(step.input_row_offsets[1:], rows.int(), right=True)
            positions = step.cache_lengths[seq] + rows - step.input_row_offsets[seq]
            last_rows, plan = step.input_row_offsets[1:] - 1, pk.StepPlan(self.blocks, step, self.scales)
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, plan)
        return self.output(self.norm(x[last_rows]))


def serve(model, manager, prompts, arrivals, new_tokens, device):
    """Runs every request to `new_tokens` generated tokens; returns them and decode tokens/s."""
    compile_mode = "reduce-overhead" if device.type == "cuda" else None
    decode = torch.compile(model, fullgraph=True, dynamic=True, mode=compile_mode)
    pending = {i: p for i, p in enumerate(prompts)}  # request -> tokens not yet in the cache
    generated = {i: [] for i in range(len(prompts))}
    running, step_no, decode_tokens, decode_time, compiled_once = [], 0, 0, 0.0, False
    while running or any(a >= step_no for a in arrivals.values()):
        for i in [i for i, a in arrivals.items() if a == step_no]:
            reused = manager.claim(i, prompts[i])
            pending[i] = prompts[i][reused:]
            running.append(i)
        rows = [pending[i] if not generated[i] else generated[i][-1:] for i in running]
        step = manager.prepare_step(running, [len(r) for r in rows], rows)
        tokens = torch.tensor([t for r in rows for t in r], device=device)
        is_decode = all(generated[i] for i in running)
        if is_decode:
            pk.mark_step_dynamic(step, tokens)  # one graph for every batch size, 1 included
        start = time.perf_counter()
        logits = (decode if is_decode else model)(tokens, step)
        next_tokens = logits.argmax(-1).tolist()
        if is_decode:
            if compiled_once:
                decode_time += time.perf_counter() - start
                decode_tokens += len(running)
            else:  # first compiled call: from now on a recompile is an error
                torch.compiler.set_stance("fail_on_recompile")
                compiled_once = True
        manager.commit_step()
        for i, t in zip(list(running), next_tokens, strict=True):
            generated[i].append(t)
            if len(generated[i]) == new_tokens:
                manager.release(i)
                running.remove(i)
        step_no += 1
    torch.compiler.set_stance("default")
    return generated, decode_tokens / max(decode_time, 1e-9)


def greedy_without_cache(model, prompt, new_tokens, device):
    """The non-absorbed formula over the whole sequence at every step: no cache, nothing absorbed."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        tokens.append(int(model(torch.tensor(tokens, device=device), None).argmax(-1)))
    return tokens[len(prompt) :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-dtype", default="float32", choices=["float32", "float8_e4m3fn"])
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = Config()
    model = Transformer(cfg).to(device).eval()
    kv_dtype = getattr(torch, args.kv_dtype)
    params = pk.KVCacheParams.mla(kv_dtype, cfg.n_layers, args.page_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    collection = pk.PagedKVCacheCollection(
        params, num_pages=128, max_batch_size=args.requests, max_seq_len=cfg.max_seq_len, device=device
    )
    model.attach_cache(collection)
    manager = pk.KVCacheManager(collection)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(cfg.vocab_size, (40,), generator=gen).tolist()  # a common system prompt
    prompts = [
        shared + torch.randint(cfg.vocab_size, (int(n),), generator=gen).tolist()
        for n in torch.randint(3, 30, (args.requests,), generator=gen)
    ]
    arrivals = {i: 3 * i for i in range(args.requests)}  # a new request every 3 steps

    with torch.no_grad():
        generated, tokens_per_s = serve(model, manager, prompts, arrivals, args.new_tokens, device)
        expected = {i: greedy_without_cache(model, p, args.new_tokens, device) for i, p in enumerate(prompts)}
    agree = sum(g == e for i in generated for g, e in zip(generated[i], expected[i], strict=True))
    total = args.requests * args.new_tokens
    for i in range(args.requests):
        print(f"request {i} (arrived at step {arrivals[i]}, prompt {len(prompts[i])}): {generated[i][:12]} ...")
    mha = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)  # K and V, every head
    mla_bytes = (params.bytes_per_token + params.scale_bytes_per_token) // cfg.n_layers
    print(
        f"cache per token and layer: {mla_bytes} bytes ({args.kv_dtype} MLA row) vs {mha * 4} bytes for "
        f"the decompressed K and V heads in float32"
    )
    print(f"prefix cache: {manager.prefix_cache_hits} prompt tokens reused, {manager.prefix_cache_misses} computed")
    if kv_dtype == torch.float32:
        for i in generated:
            assert generated[i] == expected[i], f"request {i}: absorbed {generated[i]} != uncached {expected[i]}"
        print(
            f"all {args.requests} requests match an uncached non-absorbed recomputation; "
            f"compiled decode: {tokens_per_s:.0f} tokens/s on {device}"
        )
    else:
        print(
            f"{agree} of {total} greedy tokens match the uncached non-absorbed float32 recomputation "
            f"({args.kv_dtype} cache); compiled decode: {tokens_per_s:.0f} tokens/s on {device}"
        )


if __name__ == "__main__":
    main()
