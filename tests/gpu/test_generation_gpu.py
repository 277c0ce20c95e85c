"""`PagedCache` generation on the GPU, token for token against transformers' `DynamicCache` (SDPA):
a seeded tiny Llama in fp32, uneven left-padded prompts, greedy. The `cpu` variant runs the same body
at a smaller size on the reference backend (see conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg

DEVICES = ["cuda", "cpu"]
# device: (layers, hidden, q heads, kv heads, new tokens, page size, backend)
SIZES = {"cuda": (4, 256, 8, 2, 40, 16, None), "cpu": (2, 64, 4, 2, 12, 4, "reference")}
LENGTHS = [5, 9, 3, 7, 12, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_paged_cache_generates_the_dynamic_cache_tokens(device, force_backend):
    layers, hidden, heads, kv_heads, new_tokens, page, backend = SIZES[device]
    force_backend(backend)  # None: the default order (Triton on a GPU without the CuTe kit)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         pad_token_id=0, initializer_range=0.1)  # fmt: skip
    model = LlamaForCausalLM(config).eval().to(device)
    gen = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None] >= width - torch.tensor(LENGTHS)[:, None]).long()
    ids = (torch.randint(1, 512, mask.shape, generator=gen) * mask).to(device)
    mask = mask.to(device)
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    model.set_attn_implementation("sdpa")
    expected = model.generate(ids, attention_mask=mask, **{cache_kwarg(model): DynamicCache(config=config)}, **greedy)
    model.set_attn_implementation("paged_kv")
    cache = PagedCache(config, max_batch_size=len(LENGTHS), max_cache_len=width + new_tokens, page_size=page)
    got = model.generate(ids, attention_mask=mask, **{cache_kwarg(model): cache}, **greedy)

    assert cache.collection.blocks.device.type == device
    assert torch.equal(got, expected), (got != expected).nonzero()[:5].tolist()
    stored = [n + new_tokens - 1 for n in LENGTHS]  # the prompt and every token but the last; no padding
    assert cache.collection.cache_lengths.tolist() == stored
