"""Continuous batching with a paged KV cache and a compiled decode step, gpt-fast style.

A small random Llama (RMSNorm, rotary, GQA, SwiGLU) whose attention stores K/V into the pages and
attends straight from them. Requests arrive at different steps; `KVCacheManager` gives each its
pages; every step runs one ragged batch (new prompts and decoding sequences together). Decode-only
steps go through `torch.compile(fullgraph=True)` (plus `mode="reduce-overhead"` on CUDA) and must
not recompile as the batch grows and shrinks. At the end each request is recomputed alone without
any cache and the greedy tokens must match.

    python examples/compiled_decode.py [--device cuda] [--requests 6] [--new-tokens 24]
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
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_dim: int = 688
    rope_base: float = 10000.0
    max_seq_len: int = 256

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` `[tokens, heads, head_dim]` (halves layout)."""
    a, b = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, plan: pk.StepPlan | None):
        cfg = self.cfg
        q, k, v = self.wqkv(x).split(
            [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim], dim=-1
        )
        q = rotate(q.unflatten(-1, (cfg.n_heads, cfg.head_dim)), cos, sin)
        k = rotate(k.unflatten(-1, (cfg.n_kv_heads, cfg.head_dim)), cos, sin)
        v = v.unflatten(-1, (cfg.n_kv_heads, cfg.head_dim))
        if plan is None:  # no cache: one sequence, plain causal SDPA (the check at the end)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
        else:  # the plan checks the step tensors at layer 0 only: they stay as they are up to the last layer
            plan.store_kv(k, v, self.layer_idx)
            o = plan.flash_attention(q, self.layer_idx, cfg.head_dim**-0.5)
        return self.wo(o.flatten(1))


class Block(nn.Module):
    def __init__(self, cfg: Config, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg, layer_idx)
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
        inv_freq = cfg.rope_base ** -(torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def attach_cache(self, collection: pk.PagedKVCacheCollection) -> None:
        """Keep the pool as a buffer: a static address for CUDA graphs."""
        self.register_buffer("blocks", collection.blocks, persistent=False)

    def forward(self, tokens: torch.Tensor, step: pk.StepTensors | None) -> torch.Tensor:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        if step is None:
            positions, last_rows, plan = rows, rows[-1:], None
        else:
            seq = torch.searchsorted(step.input_row_offsets[1:], rows.int(), right=True)
            positions = step.cache_lengths[seq] + rows - step.input_row_offsets[seq]
            last_rows, plan = step.input_row_offsets[1:] - 1, pk.StepPlan(self.blocks, step)
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
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = Config()
    model = Transformer(cfg).to(device).eval()
    params = pk.KVCacheParams(torch.float32, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, args.page_size)
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
        for i, prompt in enumerate(prompts):
            expected = greedy_without_cache(model, prompt, args.new_tokens, device)
            assert generated[i] == expected, f"request {i}: paged {generated[i]} != uncached {expected}"
    for i in range(args.requests):
        print(f"request {i} (arrived at step {arrivals[i]}, prompt {len(prompts[i])}): {generated[i][:12]} ...")
    print(f"prefix cache: {manager.prefix_cache_hits} prompt tokens reused, {manager.prefix_cache_misses} computed")
    print(
        f"all {args.requests} requests match an uncached recomputation; "
        f"compiled decode: {tokens_per_s:.0f} tokens/s on {device}"
    )


if __name__ == "__main__":
    main()
