"""Mask overlays under `paged_kv`: transformers' masks that add to causality (Gemma3's bidirectional
image blocks, or a 4-D bool mask given to the model) are applied, not dropped, against transformers'
own `DynamicCache` under `sdpa`; what `paged_kv` cannot apply with them is refused before anything is
stored."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_llama
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration
from transformers.masking_utils import (
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_causal_mask_function,
    or_masks,
    packed_sequence_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
    sliding_window_overlay,
)
from transformers_matrix import stored

from torch_paged_kv.integrations import hf_attention
from torch_paged_kv.integrations.transformers import PagedCache

LOGIT_TOLERANCE = 1e-4
IMAGE, BOI, EOI = 299, 297, 298


def test_overlaid_tells_plain_causal_masks_from_overlays():
    plain = [None, causal_mask_function, sliding_window_causal_mask_function(4), chunked_causal_mask_function(4, None)]
    assert not any(hf_attention.overlaid(f) for f in plain)
    overlays = [
        or_masks(causal_mask_function, bidirectional_mask_function),
        bidirectional_mask_function,
        and_masks(sliding_window_overlay(3)),  # a window without causality
        and_masks(causal_mask_function, packed_sequence_mask_function(torch.zeros(1, 4, dtype=torch.long))),
        lambda batch_idx, head_idx, q_idx, kv_idx: kv_idx <= q_idx,  # a model's own function: not trusted
    ]
    assert all(hf_attention.overlaid(f) for f in overlays)


def test_a_mask_with_no_causal_part_is_transformers_own():
    """A bidirectional mask (a vision tower's, an encoder's, BART's decoder asks one for its encoder) is
    for a layer with no cache, which runs transformers' SDPA: it gets sdpa's own mask, over its columns."""
    padding = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    for attention_mask in (padding, None):
        args = (2, 4, 4, 0, 0, bidirectional_mask_function, attention_mask)
        got = hf_attention.paged_kv_mask(*args, allow_is_bidirectional_skip=True)
        expected = sdpa_mask(*args, allow_is_bidirectional_skip=True)
        assert (got is None and expected is None) or torch.equal(got, expected)


def test_overlay_mask_moves_columns_to_page_positions():
    """Page position p of a row is its p-th real column (padding is never stored)."""
    g = torch.Generator().manual_seed(0)
    batch, new, columns = 3, 4, 11
    padding = torch.rand(batch, 7, generator=g) > 0.3  # 7 columns so far, some padding anywhere
    full = (torch.rand(batch, 1, new, columns, generator=g) > 0.4) & torch.nn.functional.pad(padding, (0, 4))[
        :, None, None, :
    ]
    got = hf_attention.overlay_mask(full, padding.long())
    for b in range(batch):
        real = padding[b].nonzero().squeeze(1).tolist()
        expected = torch.zeros(new, columns, dtype=torch.bool)
        expected[:, : len(real)] = full[b, 0][:, real]
        assert torch.equal(got[b, 0], expected)


def _gemma3() -> tuple[Gemma3ForConditionalGeneration, dict]:
    """A tiny random Gemma3 with a vision tower, and a left-padded batch of two prompts with an image
    each (4 image tokens, at different offsets) and its `token_type_ids`."""
    torch.manual_seed(0)
    text = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.05, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16)
    config = Gemma3Config(
        text_config=text, vision_config=dict(vision, patch_size=4), mm_tokens_per_image=4,
        image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI, initializer_range=0.05,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).eval()
    model.model.multi_modal_projector.mm_input_projection_weight.data.normal_(std=0.5)  # (initialised to zeros)
    ids = torch.randint(3, 290, (2, 12))
    ids[0, 2:8] = torch.tensor([BOI, IMAGE, IMAGE, IMAGE, IMAGE, EOI])
    ids[1, 3:9] = torch.tensor([BOI, IMAGE, IMAGE, IMAGE, IMAGE, EOI])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    pixels = torch.randn(2, 3, 16, 16)
    return model, dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=(ids == IMAGE).long())


def _generate(model, attn: str, cache, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    model.set_attn_implementation(attn)
    out = model.generate(
        **inputs, past_key_values=cache, max_new_tokens=8, do_sample=False, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits, 1)


@torch.no_grad()
def test_gemma3_images_attend_bidirectionally_under_paged_kv():
    """Gemma3's image tokens see each other both ways (an `or` overlay of image blocks), and its vision
    tower attends bidirectionally with no cache; `paged_kv` gives DynamicCache's tokens and logits, with
    a cache and without."""
    model, inputs = _gemma3()
    expected, expected_logits = _generate(model, "sdpa", DynamicCache(config=model.config), inputs)
    causal_only = model(**{**inputs, "token_type_ids": None}).logits
    with_blocks = model(**inputs).logits
    other_pixels = model(**{**inputs, "pixel_values": torch.randn(2, 3, 16, 16)}).logits
    assert (causal_only - with_blocks).abs().max() > 1e-2  # the overlay matters to this model
    assert (other_pixels - with_blocks).abs().max() > 1e-2  # so do the pixels
    cache = PagedCache(model.config, max_batch_size=2, max_cache_len=32, page_size=4)
    got, logits = _generate(model, "paged_kv", cache, inputs)
    assert torch.equal(got, expected)
    assert (logits - expected_logits).abs().max() < LOGIT_TOLERANCE
    uncached = model(**inputs).logits  # (paged_kv still set) no cache: the overlay on the step's columns
    real = inputs["attention_mask"].bool()
    assert (uncached - with_blocks)[real].abs().max() < LOGIT_TOLERANCE


@torch.no_grad()
def test_a_4d_bool_mask_is_applied_and_a_float_one_refused():
    """A 4-D mask given to the model goes around the mask function: a bool one is applied over the
    pages' positions (here a key hidden from the last query), a float one is refused naming
    `attention_mask` before anything is stored."""
    model = tiny_llama()
    ids = torch.randint(3, 500, (1, 6))
    allowed = torch.zeros(1, 1, 6, 16, dtype=torch.bool)
    allowed[..., :6] = torch.ones(6, 6, dtype=torch.bool).tril()
    allowed[0, 0, 5, 2] = False
    model.set_attn_implementation("sdpa")
    expected = model(input_ids=ids, attention_mask=allowed[..., :6], past_key_values=DynamicCache(config=model.config))
    expected = expected.logits
    model.set_attn_implementation("paged_kv")
    cache = PagedCache(model.config, max_batch_size=1, max_cache_len=16, page_size=4)
    got = model(input_ids=ids, attention_mask=allowed, past_key_values=cache).logits
    assert (got - expected).abs().max() < LOGIT_TOLERANCE
    narrow = model(
        input_ids=ids, attention_mask=allowed[..., :6], past_key_values=PagedCache(model.config, 1, 16)
    ).logits
    assert (narrow - expected).abs().max() < LOGIT_TOLERANCE  # (columns past the mask's: unwritten)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    cache = PagedCache(model.config, max_batch_size=1, max_cache_len=16, page_size=4)
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=ids, attention_mask=additive, past_key_values=cache)
    assert not stored([cache])


@torch.no_grad()
def test_an_overlay_on_softcapped_scores_is_refused_before_anything_is_stored():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0, sliding_window=8,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    model.set_attn_implementation("paged_kv")
    allowed = torch.ones(1, 1, 5, 16, dtype=torch.bool)  # (an overlay: every key both ways)
    cache = PagedCache(config, max_batch_size=1, max_cache_len=16, page_size=4)
    with pytest.raises(ValueError, match="attn_implementation: .*softcapped"):
        model(input_ids=torch.randint(3, 250, (1, 5)), attention_mask=allowed, past_key_values=cache)
    assert not stored([cache])
