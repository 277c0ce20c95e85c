"""Greedy generation with a transformers Llama and `PagedCache`, attending straight from the pages,
checked token for token against transformers' own `DynamicCache`.

    python examples/hf_generate.py                      # tiny random Llama (seeded, no download)
    python examples/hf_generate.py --model PATH         # a local checkpoint (and its tokenizer)
    python examples/hf_generate.py --attn sdpa --compile

Prompts of uneven length are left-padded into one batch; padding never enters the cache. Both
caches are warmed up first (on a machine's first run that builds the CPU kernels, once), then
timed over the same generation; prints each one's tokens/s and `identical to DynamicCache: yes`,
or exits with status 1 if the tokens differ (exact equality expects float32, the default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import CompileConfig

import torch_paged_kv as pk
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: tiny random Llama)")
    parser.add_argument("--attn", default="paged_kv", help="attn_implementation with PagedCache: paged_kv, sdpa, eager")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="torch.compile the paged decode step (fullgraph)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cache (the median is shown)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype (exact equality expects float32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)

    tokenizer = None
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        inputs = tokenizer([PROMPTS[i % len(PROMPTS)] for i in range(args.batch)], return_tensors="pt", padding=True)
        ids, mask = inputs.input_ids, inputs.attention_mask
    else:
        model = tiny_llama(args.seed).to(device=device, dtype=dtype)
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
    greedy = dict(
        attention_mask=mask,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id or 0,
    )
    paged_kwargs = dict(greedy, **{cache_kwarg(model): cache})
    if args.compile:
        compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
        compile_config._compile_all_devices = True  # generate compiles only on GPUs unless told
        paged_kwargs["compile_config"] = compile_config

    runs = {  # name -> (attention, generate)
        "paged": (args.attn, lambda: model.generate(ids, **paged_kwargs)),
        "dynamic": (
            "sdpa",
            lambda: model.generate(ids, **greedy, **{cache_kwarg(model): DynamicCache(config=model.config)}),
        ),
    }

    def run(key: str) -> tuple[torch.Tensor, float]:
        attn, generate = runs[key]
        model.set_attn_implementation(attn)
        cache.reset()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    print(
        f"warm-up (untimed): loading the {device} kernels (the first run on a machine compiles the CPU "
        "kernels, ~15 s, cached after), one generate per cache" + (" (compiles the decode step)" * args.compile),
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    pk.backend_info(device)  # builds or loads the kernels
    run("paged"), run("dynamic")
    print(f"warm-up done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    seconds: dict[str, list[float]] = {"paged": [], "dynamic": []}
    for _ in range(args.repeats):  # interleaved, so that load changes hit both alike
        out, t = run("paged")
        seconds["paged"].append(t)
        expected, t = run("dynamic")
        seconds["dynamic"].append(t)

    new, expected_new = out[:, ids.shape[1] :], expected[:, ids.shape[1] :]
    if tokenizer is not None:
        for row in new.tolist():
            print(tokenizer.decode(row, skip_special_tokens=True))
    tokens = new.numel()
    paged_name = f"PagedCache ({args.attn}{', compiled' if args.compile else ''})"
    for name, key in ((paged_name, "paged"), ("DynamicCache (sdpa)", "dynamic")):
        median = statistics.median(seconds[key])
        print(f"{name:<34} {tokens} tokens in {median:.3f} s = {tokens / median:8.1f} tokens/s on {device}")
    same = torch.equal(new, expected_new)
    if not same:
        row, col = (new != expected_new).nonzero()[0].tolist()
        print(f"identical to DynamicCache: no (row {row} differs from new token {col} on)")
        return 1
    print(f"identical to DynamicCache: yes ({args.batch} rows x {args.new_tokens} new tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
