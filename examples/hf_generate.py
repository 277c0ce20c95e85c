"""Greedy generation with a transformers Llama and `PagedCache`, attending straight from the pages.

    python examples/hf_generate.py                      # tiny random Llama (seeded, no download)
    python examples/hf_generate.py --model PATH         # a local checkpoint (and its tokenizer)
    python examples/hf_generate.py --attn sdpa --compile

Prompts of uneven length are left-padded into one batch; padding never enters the cache.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import CompileConfig

from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg

PROMPTS = [
    "The capital of France is",
    "Paged attention stores keys and values in",
    "Once upon a time",
    "def fibonacci(n):",
]


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    )
    return LlamaForCausalLM(config)


def random_prompts(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random token ids of lengths 4, 7, 10, ... and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = [4 + 3 * (i % 4) for i in range(batch)]
    width = max(lengths)
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    return torch.randint(3, 1024, (batch, width), generator=g) * mask, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: tiny random Llama)")
    parser.add_argument("--attn", default="paged_kv", help="attn_implementation: paged_kv, sdpa, eager")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step (fullgraph)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    tokenizer = None
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn).to(device)
        tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        inputs = tokenizer([PROMPTS[i % len(PROMPTS)] for i in range(args.batch)], return_tensors="pt", padding=True)
        ids, mask = inputs.input_ids, inputs.attention_mask
    else:
        model = tiny_llama(args.seed).to(device)
        model.set_attn_implementation(args.attn)
        ids, mask = random_prompts(args.batch, args.seed)
    model.eval()
    ids, mask = ids.to(device), mask.to(device)

    cache = PagedCache(
        model.config,
        max_batch_size=args.batch,
        max_cache_len=ids.shape[1] + args.new_tokens,
        page_size=args.page_size,
        device=device,
        dtype=model.dtype,
    )
    kwargs = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id or 0,
        **{cache_kwarg(model): cache},
    )
    if args.compile:
        compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
        compile_config._compile_all_devices = True  # generate compiles only on GPUs unless told
        kwargs["compile_config"] = compile_config
        model.generate(ids, attention_mask=mask, **kwargs)  # warm-up: compile
        cache.reset()

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    new = out[:, ids.shape[1] :]
    for row in new.tolist():
        print(tokenizer.decode(row, skip_special_tokens=True) if tokenizer else row)
    print(f"{args.attn} on {device}: {new.numel()} tokens in {seconds:.3f} s = {new.numel() / seconds:.1f} tokens/s")


if __name__ == "__main__":
    main()
