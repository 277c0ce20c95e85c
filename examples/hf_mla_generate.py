"""A transformers DeepSeek-V3 (multi-head latent attention) generating through `PagedCache`.

A tiny random DeepSeek-V3 (seeded, no download) generates greedily for a left-padded batch three
ways: over transformers' `DynamicCache`, and over a `PagedCache` under the model's own attention
(`sdpa`: the pages hold one latent + rope row per token, decompressed by the model) and under
`attn_implementation="paged_kv"` (absorbed MLA straight from the pages: W_UK into the query, W_UV
onto the output, cached latents never decompressed). The tokens must be equal (fp32); the memory per
token of each cache is printed, and that of an FP8 `PagedCache` (e4m3 latent, bf16 rope) with the
fraction of the float32 greedy tokens it predicts when fed them.

    python examples/hf_mla_generate.py [--batch 3] [--new-tokens 24] [--page-size 16]
"""

from __future__ import annotations

import argparse

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg


def tiny_deepseek_v3(seed: int) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,  # layer 0 dense, then mixture-of-experts layers
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=64,  # DeepSeek-V3: 512
        q_lora_rank=48,  # 1536
        qk_nope_head_dim=32,  # 128
        qk_rope_head_dim=16,  # 64
        v_head_dim=32,  # 128
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    )
    return DeepseekV3ForCausalLM(config).eval()


def random_prompts(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random token ids of lengths 5, 9, 13, ... and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5 + 4 * (i % 4) for i in range(batch)]
    width = max(lengths)
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    return torch.randint(3, 1024, (batch, width), generator=g) * mask, mask


def dynamic_cache_bytes_per_token(cache: DynamicCache, tokens: int) -> float:
    """What a `DynamicCache` holds per token and row, from its tensors (every layer)."""
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return held / tokens


def teacher_forced_agreement(model, cache: PagedCache, tokens: torch.Tensor, prompt_mask: torch.Tensor) -> float:
    """Fraction of the generated positions of `tokens` that the model with `cache` predicts when fed
    `tokens` in one forward (under `paged_kv` even a prefill attends from the pages: the FP8 rows)."""
    mask = torch.cat([prompt_mask, torch.ones_like(tokens[:, prompt_mask.shape[1] :])], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    model.set_attn_implementation("paged_kv")
    logits = model(tokens, attention_mask=mask, position_ids=positions, **{cache_kwarg(model): cache}).logits
    start = prompt_mask.shape[1]
    return (logits[:, start - 1 : -1].argmax(-1) == tokens[:, start:]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    model = tiny_deepseek_v3(0)
    cfg = model.config
    ids, mask = random_prompts(args.batch, 1)
    max_len = ids.shape[1] + args.new_tokens
    greedy = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)

    def generate(attn: str, cache) -> torch.Tensor:
        model.set_attn_implementation(attn)
        return model.generate(ids, **{cache_kwarg(model): cache}, **greedy)

    dynamic = DynamicCache(config=cfg)
    expected = generate("sdpa", dynamic)
    caches = {}
    for attn in ("sdpa", "paged_kv"):
        caches[attn] = PagedCache(cfg, args.batch, max_len, page_size=args.page_size)
        out = generate(attn, caches[attn])
        assert torch.equal(out, expected), f"{attn}: PagedCache tokens differ from DynamicCache's"
        print(f"PagedCache + {attn:8}: {args.batch} rows x {args.new_tokens} tokens, identical to DynamicCache")
    fp8 = PagedCache(cfg, args.batch, max_len, page_size=args.page_size, kv_dtype=torch.float8_e4m3fn)
    agree = teacher_forced_agreement(model, fp8, expected, mask)
    print(f"first row: {expected[0, ids.shape[1] :].tolist()[:12]} ...")

    layers = cfg.num_hidden_layers
    paged = caches["paged_kv"].collection.params
    per_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim  # a decompressed K and V head
    rows = [
        ("DynamicCache (measured)", dynamic_cache_bytes_per_token(dynamic, args.batch * (expected.shape[1] - 1))),
        ("PagedCache float32 (latent + rope row)", paged.bytes_per_token),
        (
            "PagedCache float8_e4m3fn (FP8 latent, bf16 rope, scale)",
            fp8.collection.params.bytes_per_token + fp8.collection.params.scale_bytes_per_token,
        ),
        ("decompressed K and V per head, float32 (an MHA cache)", cfg.num_attention_heads * per_head * 4 * layers),
    ]
    print(f"cache bytes per token ({layers} layers, kv_lora_rank {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}):")
    for name, size in rows:
        print(f"  {name:58} {size:8.0f}")
    print(f"FP8 PagedCache under paged_kv predicts {agree:.0%} of the float32 greedy tokens (fed them)")


if __name__ == "__main__":
    with torch.no_grad():
        main()
