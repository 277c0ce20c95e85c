"""Tiny seeded transformers models the tests share (the same weights in every process)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama() -> LlamaForCausalLM:
    """A 2-layer random Llama (GQA 4:2, vocab 512), seeded: equal weights in every process."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        initializer_range=0.1,
    )
    return LlamaForCausalLM(config).eval()
