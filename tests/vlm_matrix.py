"""The vision-language matrix: `PagedCache` on VLMs fed an image, in both attention columns.

The text-model matrix (tests/transformers_matrix.py) for image-conditioned generation: each family is a
tiny random `...ForConditionalGeneration` built in code (no downloads), fp32 on CPU, whose prompts hold
a synthetic image that goes through the vision tower into the text model. Each cell is (family, column,
mode): `generate` over a `PagedCache` under the model's default attention ("default") or under
`attn_implementation="paged_kv"`, against the same `generate` over transformers' `DynamicCache` (under
the default attention, resp. `eager`; `StaticCache` where a family says why), judged as there
(`transformers_matrix.compare`: the same tokens, every logit within `LOGIT_TOLERANCE`; or a declared
refusal: a `ValueError` naming a config field before anything is stored). Any other outcome fails,
and the script exits non-zero.

Modes: `greedy` (one prompt with an image), `batch` (two left-padded prompts with an image each, other
text lengths), `text` (two left-padded prompts without an image, to the VLM class), `beam` (two prompts
with images, 2 beams), `continue` (a second `generate` from the first one's tokens and cache). Each
family is also checked to see its image (`image_reaches`: the logits after the image change with the
pixels), else every cell of it fails.

    python tests/vlm_matrix.py [--family NAME ...] [--mode MODE ...] [--column COLUMN ...]
    python tests/vlm_matrix.py --markdown   # the docs table
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers_matrix as matrix
from transformers_matrix import EXACT, PAD, CellResult, Generated, Outcome, Refused, compare, refusal, set_attention

COLUMNS = matrix.COLUMNS
MODES = ("greedy", "batch", "text", "beam", "continue")
VOCAB = 256
TEXT_IDS = 240
"""Prompt text ids are drawn from [3, TEXT_IDS); ids from TEXT_IDS up are the families' special tokens
(image, begin/end of image), which generation never emits (`suppress_tokens`)."""
IMAGE, BOI, EOI, IMAGE_2 = 255, 254, 253, 252
IMAGE_EFFECT = 1e-3
"""Smallest change of the last position's logits (relative to the largest) when the pixels change."""


SINCE = "5.23"
"""The oldest transformers the families' outcomes are declared (and checked) for."""


@dataclasses.dataclass(frozen=True)
class Images:
    """How a family's prompts hold images: `block`, the tokens one image takes in the prompt (`odd_block`:
    in odd rows, where their image has another size), and `pixels(rows, generator)`, the processor's
    tensors for `rows` images (one per row), given to `generate` as keyword arguments. `extra(input_ids)`:
    further inputs read off the ids (token types)."""

    block: tuple[int, ...]
    pixels: Callable[[int, torch.Generator], dict[str, torch.Tensor]]
    extra: Callable[[torch.Tensor], dict[str, torch.Tensor]] = lambda ids: {}
    odd_block: tuple[int, ...] | None = None

    def row_block(self, row: int) -> tuple[int, ...]:
        return self.odd_block if row % 2 and self.odd_block is not None else self.block


@dataclasses.dataclass(frozen=True)
class VisionFamily:
    """A VLM family as a tiny random model (`config` and `model` name transformers classes; `kwargs`
    are given to the config), its images, and what each column must give."""

    name: str
    config: str
    model: str
    kwargs: dict[str, Any]
    images: Images
    default: Outcome = EXACT
    paged_kv: Outcome = EXACT
    notes: str = ""
    reference: str = "DynamicCache"  # the oracle: transformers' "DynamicCache", or "StaticCache" (see its notes)
    modality: str = "image"  # what `images` holds, as failures name it (the audio matrix's families: "audio")

    def expected(self, column: str) -> Outcome:
        return getattr(self, column)

    def available(self) -> bool:
        import transformers

        return hasattr(transformers, self.config) and hasattr(transformers, self.model)

    def build(self) -> torch.nn.Module:
        """The model, seeded; weight matrices transformers initialises to zeros (Gemma3's image projection)
        drawn at random too, so that the image reaches the text."""
        import transformers

        config = getattr(transformers, self.config)(**self.kwargs)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = getattr(transformers, self.model)(config).float().eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2 and not p.any():
                    p.normal_(0.0, 0.2)
        return model


# -- tiny configs ----------------------------------------------------------------------------------
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
GEMMA = dict(TEXT, initializer_range=0.5)  # (Gemma's scaled embeddings: smaller weights repeat the last token)
SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def square_images(size: int) -> Callable[[int, torch.Generator], dict[str, torch.Tensor]]:
    """`pixel_values` `[rows, 3, size, size]`."""
    return lambda rows, g: {"pixel_values": torch.randn(rows, 3, size, size, generator=g)}


def image_token_types(ids: torch.Tensor, name: str = "token_type_ids") -> dict[str, torch.Tensor]:
    """1 at image tokens, else 0 (Gemma3's `token_type_ids`, Qwen-VL's `mm_token_type_ids`)."""
    return {name: (ids == IMAGE).long()}


def qwen_patches(patch: int, grids: tuple[tuple[int, int], ...], temporal: int = 2):
    """Qwen-VL's processor output for one image per row, row i's of `grids[i % len(grids)]` patches of
    `patch` pixels: the flattened patches `[sum of h * w, 3 * temporal * patch**2]` and `image_grid_thw`."""

    def pixels(rows: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        thw = torch.tensor([[1, *grids[i % len(grids)]] for i in range(rows)])
        patches = int(thw.prod(-1).sum())
        return {"pixel_values": torch.randn(patches, 3 * temporal * patch * patch, generator=g), "image_grid_thw": thw}

    return pixels


def molmo_crops(rows: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Molmo2's processor output for one 16-patch crop per row, pooled into 4 image tokens of 4 patches each
    (grids of 1 x 2 low-res and 1 x 2 high-res tokens)."""
    pooling = torch.arange(rows * 16).reshape(rows * 4, 4)
    return {
        "pixel_values": torch.randn(rows, 16, 3 * 4 * 4, generator=g),
        "image_token_pooling": pooling,
        "image_grids": torch.tensor([[1, 2, 1, 2]] * rows),
    }


QWEN_VISION = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2, spatial_merge_size=2)
QWEN_IDS = dict(image_token_id=IMAGE, vision_start_token_id=BOI, vision_end_token_id=EOI, video_token_id=IMAGE_2)
QWEN_TYPES = lambda ids: image_token_types(ids, "mm_token_type_ids")
QWEN_IMAGES = Images(  # images of 4 and 8 tokens (2 x 2 and 2 x 4 merged patches): other rope_deltas per row
    (BOI,) + (IMAGE,) * 4 + (EOI,), qwen_patches(2, ((4, 4), (4, 8))), QWEN_TYPES, (BOI,) + (IMAGE,) * 8 + (EOI,)
)
SIGLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4
)
CLIP = dict(SIGLIP, image_size=8)
OVERLAY = "bidirectional image blocks (`token_type_ids`: a mask overlay)"
MROPE = "M-RoPE: 3-D positions of the image tokens (images of 4 and 8 tokens in a batch: rope_deltas per row)"
QWEN3_VISION = dict(
    QWEN_VISION, depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=16,
    deepstack_visual_indexes=[0],
)  # fmt: skip
QWEN3_ROPE = dict(rope_type="default", mrope_section=[2, 3, 3], mrope_interleaved=True)

GEMMA4 = dict(
    text_config=dict(
        GEMMA,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_hidden_layers=4,
        sliding_window=8,
        global_head_dim=16,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        use_bidirectional_attention="vision",
    ),
    vision_config=dict(SIGLIP, num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2),
    image_token_id=IMAGE,
    boi_token_id=BOI,
    eoi_token_id=EOI,
    video_token_id=IMAGE_2,
    audio_token_id=IMAGE_2 - 1,
    boa_token_id=IMAGE_2 - 2,
    eoa_token_index=IMAGE_2 - 3,
    initializer_range=0.5,
    tie_word_embeddings=False,
)
GEMMA4_IMAGES = Images(
    (BOI,) + (IMAGE,) * 4 + (EOI,),
    lambda rows, g: {
        "pixel_values": torch.randn(rows, 16, 3 * 4 * 4, generator=g),
        "image_position_ids": torch.tensor([[[x, y] for y in range(4) for x in range(4)]] * rows),
    },
    lambda ids: image_token_types(ids, "mm_token_type_ids"),
)
GEMMA4_NOTE = (
    'bidirectional image blocks (`use_bidirectional_attention="vision"`: a mask overlay), sliding-window layers '
    "(window 8, crossed)"
)

FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily(
        "Gemma3",
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        dict(
            text_config=dict(GEMMA, **SLIDING),
            vision_config=dict(SIGLIP, num_hidden_layers=1),
            mm_tokens_per_image=4,
            image_token_index=IMAGE,
            boi_token_index=BOI,
            eoi_token_index=EOI,
            initializer_range=0.5,
            tie_word_embeddings=False,
        ),
        Images((BOI,) + (IMAGE,) * 4 + (EOI,), square_images(16), image_token_types),
        notes=OVERLAY + ", sliding-window layers (window 8, crossed)",
    ),
    VisionFamily(
        "LLaVA",
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        dict(text_config=dict(TEXT, model_type="llama"), vision_config=CLIP, image_token_index=IMAGE),
        Images((IMAGE,) * 4, square_images(8)),
        notes="CLIP tower, features of its second-to-last layer",
    ),
    VisionFamily(
        "Qwen2-VL",
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        dict(
            text_config=dict(TEXT, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3])),
            vision_config=QWEN_VISION,
            **QWEN_IDS,
        ),
        QWEN_IMAGES,
        notes=MROPE,
    ),
    VisionFamily(
        "PaliGemma",
        "PaliGemmaConfig",
        "PaliGemmaForConditionalGeneration",
        dict(
            text_config=dict(GEMMA, model_type="gemma"),
            vision_config=dict(SIGLIP, image_size=8),
            image_token_index=IMAGE,
            projection_dim=64,
            hidden_size=64,
            vocab_size=VOCAB,
            tie_word_embeddings=False,
        ),
        Images((IMAGE,) * 4, square_images(8), lambda ids: {"token_type_ids": torch.zeros_like(ids)}),
        paged_kv=Refused("config.use_bidirectional_attention"),
        notes="prefix-LM: the whole prompt attends bidirectionally (`token_type_ids` 0: a mask overlay; its config "
        "sets the text model's `use_bidirectional_attention`, which `paged_kv` refuses)",
    ),
    VisionFamily(
        "Qwen2.5-VL",
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        dict(
            text_config=dict(TEXT, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3])),
            vision_config=dict(
                QWEN_VISION,
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                out_hidden_size=64,
                window_size=8,
                fullatt_block_indexes=[1],
            ),
            **QWEN_IDS,
        ),
        Images(
            (BOI,) + (IMAGE,) * 8 + (EOI,),
            qwen_patches(2, ((4, 8), (4, 4))),
            QWEN_TYPES,
            (BOI,) + (IMAGE,) * 4 + (EOI,),
        ),
        notes=MROPE + "; windowed vision attention",
    ),
    VisionFamily(
        "Qwen3-VL",
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        dict(
            text_config=dict(TEXT, rope_parameters=QWEN3_ROPE),
            vision_config=QWEN3_VISION,
            **QWEN_IDS,
        ),
        QWEN_IMAGES,
        notes=MROPE + " (interleaved); deepstack features added to the first layers' hidden states",
    ),
    VisionFamily(
        "Qwen3-VL-MoE",
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeForConditionalGeneration",
        dict(
            text_config=dict(
                TEXT,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                rope_parameters=QWEN3_ROPE,
            ),
            vision_config=QWEN3_VISION,
            **QWEN_IDS,
        ),
        QWEN_IMAGES,
        notes=MROPE + " (interleaved); deepstack features added to the first layers' hidden states",
    ),
    VisionFamily(
        "Cohere2-Vision",
        "Cohere2VisionConfig",
        "Cohere2VisionForConditionalGeneration",
        dict(
            text_config=dict(TEXT, **SLIDING, model_type="cohere2"),
            vision_config=dict(SIGLIP, model_type="siglip_vision_model"),
            image_token_id=IMAGE,
            alignment_intermediate_size=64,
        ),
        Images((IMAGE,) * 4, square_images(16)),
        notes="SigLIP tower, pixel shuffle 2; Cohere2 text model with sliding-window layers (window 8, crossed)",
    ),
    VisionFamily(
        "VipLlava",
        "VipLlavaConfig",
        "VipLlavaForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="llama"),
            vision_config=CLIP,
            image_token_index=IMAGE,
            vision_feature_layer=[-2, -1],
        ),
        Images((IMAGE,) * 4, square_images(8)),
        notes="CLIP tower, features of several layers",
    ),
    VisionFamily(
        "DeepSeek-VL",
        "DeepseekVLConfig",
        "DeepseekVLForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="llama"), vision_config=dict(SIGLIP, image_size=8), image_token_id=IMAGE
        ),
        Images((IMAGE,) * 4, square_images(8)),
        notes="SigLIP tower",
    ),
    VisionFamily(
        "Janus",
        "JanusConfig",
        "JanusForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="llama"),
            vision_config=dict(SIGLIP, image_size=8, depth=1, projection_dim=64, num_image_tokens=4),
            vq_config=dict(
                embed_dim=8,
                num_embeddings=16,
                latent_channels=32,
                base_channels=32,
                channel_multiplier=[1, 1],
                num_res_blocks=1,
                num_patches=4,
                projection_dim=64,
                image_token_embed_dim=64,
            ),
            image_token_id=IMAGE,
        ),
        Images((IMAGE,) * 4, square_images(8)),
        notes="SigLIP-like understanding tower (its VQ-VAE, for image generation, unused here)",
    ),
    VisionFamily(
        "Mistral3 (Pixtral)",
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="mistral"),
            vision_config=dict(SIGLIP, head_dim=16, model_type="pixtral"),
            image_token_index=IMAGE,
        ),
        Images(
            (IMAGE,) * 4,
            lambda rows, g: {
                "pixel_values": torch.randn(rows, 3, 16, 16, generator=g),
                "image_sizes": torch.tensor([[16, 16]] * rows),
            },
        ),
        notes="Pixtral tower (2-D rope, block-diagonal mask over images), patches merged 2x2",
    ),
    VisionFamily(
        "InternVL",
        "InternVLConfig",
        "InternVLForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="qwen2"),
            vision_config=dict(SIGLIP, image_size=8, patch_size=2, num_hidden_layers=1),
            image_token_id=IMAGE,
            image_seq_length=4,
        ),
        Images((IMAGE,) * 4, square_images(8)),
        notes="InternViT tower, pixel shuffle 0.5",
    ),
    VisionFamily(
        "Aya-Vision",
        "AyaVisionConfig",
        "AyaVisionForConditionalGeneration",
        dict(
            text_config=dict(TEXT, **SLIDING, model_type="cohere2"),
            vision_config=dict(SIGLIP, model_type="siglip_vision_model"),
            image_token_index=IMAGE,
        ),
        Images((IMAGE,) * 4, square_images(16)),
        notes="SigLIP tower, pixel shuffle 2; Cohere2 text model with sliding-window layers (window 8, crossed)",
    ),
    VisionFamily(
        "LLaVA-NeXT",
        "LlavaNextConfig",
        "LlavaNextForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="llama"),
            vision_config=CLIP,
            image_token_index=IMAGE,
            image_grid_pinpoints=[[8, 16]],
        ),
        Images(
            (IMAGE,) * 14,
            lambda rows, g: {
                "pixel_values": torch.randn(rows, 3, 3, 8, 8, generator=g),
                "image_sizes": torch.tensor([[8, 16]] * rows),
            },
        ),
        notes="any-resolution tiles: a base image and two tiles, with a newline embedding per row of features",
    ),
    VisionFamily(
        "Idefics3",
        "Idefics3Config",
        "Idefics3ForConditionalGeneration",
        dict(text_config=dict(TEXT, model_type="llama"), vision_config=SIGLIP, image_token_id=IMAGE),
        Images((IMAGE,) * 4, lambda rows, g: {"pixel_values": torch.randn(rows, 1, 3, 16, 16, generator=g)}),
        notes="SigLIP tower, pixel shuffle 2",
    ),
    VisionFamily(
        "SmolVLM",
        "SmolVLMConfig",
        "SmolVLMForConditionalGeneration",
        dict(text_config=dict(TEXT, model_type="llama"), vision_config=SIGLIP, image_token_id=IMAGE),
        Images((IMAGE,) * 4, lambda rows, g: {"pixel_values": torch.randn(rows, 1, 3, 16, 16, generator=g)}),
        notes="Idefics3's architecture",
    ),
    VisionFamily(
        "GLM4V",
        "Glm4vConfig",
        "Glm4vForConditionalGeneration",
        dict(
            text_config=dict(TEXT, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3])),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                patch_size=2,
                image_size=8,
                out_hidden_size=64,
            ),
            image_token_id=IMAGE,
            image_start_token_id=BOI,
            image_end_token_id=EOI,
            video_token_id=IMAGE_2,
            video_start_token_id=IMAGE_2 - 1,
            video_end_token_id=IMAGE_2 - 2,
        ),
        QWEN_IMAGES,
        notes=MROPE,
    ),
    VisionFamily(
        "LFM2-VL",
        "Lfm2VlConfig",
        "Lfm2VlForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="lfm2", num_hidden_layers=4, full_attn_idxs=[1, 3], conv_L_cache=3),
            vision_config=dict(SIGLIP, model_type="siglip2_vision_model", num_patches=16),
            image_token_id=IMAGE,
            projector_hidden_size=64,
        ),
        Images(
            (IMAGE,) * 4,
            lambda rows, g: {
                "pixel_values": torch.randn(rows, 16, 3 * 4 * 4, generator=g),
                "spatial_shapes": torch.tensor([[4, 4]] * rows),
                "pixel_attention_mask": torch.ones(rows, 16, dtype=torch.long),
            },
        ),
        notes="SigLIP2 (NaFlex) tower; hybrid text model: short-convolution layers' states beside the pages",
    ),
    VisionFamily(
        "Gemma4",
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        GEMMA4,
        GEMMA4_IMAGES,
        notes=GEMMA4_NOTE,
    ),
    VisionFamily(
        "Gemma4 (K/V sharing)",
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        dict(GEMMA4, text_config=dict(GEMMA4["text_config"], num_kv_shared_layers=2)),
        GEMMA4_IMAGES,
        paged_kv=Refused("attn_implementation"),
        notes=GEMMA4_NOTE + "; its last 2 layers reuse K/V (as Gemma4 E2B / E4B): under `paged_kv` an overlay "
        "with K/V-sharing layers is refused at the first layer",
    ),
    VisionFamily(
        "Molmo2",
        "Molmo2Config",
        "Molmo2ForConditionalGeneration",
        dict(
            text_config=dict(TEXT, additional_vocab_size=8),
            vision_config=dict(SIGLIP, num_key_value_heads=2, head_dim=16, image_size=[16, 16], initializer_range=0.2),
            adapter_config=dict(
                vision_feature_layer=[-1],
                hidden_size=32,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=64,
                text_hidden_size=64,
                initializer_range=0.2,
            ),
            initializer_range=0.2,
            image_start_token_id=BOI,
            image_end_token_id=EOI,
            image_patch_id=IMAGE,
            low_res_image_start_token_id=IMAGE_2,
            frame_start_token_id=IMAGE_2 - 1,
            frame_end_token_id=IMAGE_2 - 2,
        ),
        Images((BOI,) + (IMAGE,) * 4 + (EOI,), molmo_crops, lambda ids: image_token_types(ids, "mm_token_type_ids")),
        notes="bidirectional image tokens (`mm_token_type_ids`: a mask overlay); attention-pooled patches",
    ),
    VisionFamily(
        "Chameleon",
        "ChameleonConfig",
        "ChameleonForConditionalGeneration",
        dict(
            TEXT,
            vq_config=dict(
                embed_dim=8,
                num_embeddings=16,
                latent_channels=32,
                resolution=8,
                base_channels=32,
                channel_multiplier=[1, 1, 1],
                num_res_blocks=1,
                initializer_range=0.2,
            ),
            vocabulary_map={
                "<image>": IMAGE,
                **{f"IMGIMG{chr(ord('A') + i // 10)}{chr(ord('A') + i % 10)}Z": 200 + i for i in range(16)},
            },
        ),
        Images((IMAGE,) * 4, square_images(8)),
        notes="VQ-VAE image tokens (codes embedded as vocabulary entries); logits of image codes masked by the model",
    ),
    VisionFamily(
        "Gemma4-Unified",
        "Gemma4UnifiedConfig",
        "Gemma4UnifiedForConditionalGeneration",
        dict(
            {k: v for k, v in GEMMA4.items() if k != "vision_config"},
            vision_config=dict(
                patch_size=2, pooling_kernel_size=2, mm_embed_dim=64, mm_posemb_size=16, output_proj_dims=64
            ),
        ),
        Images(
            (BOI,) + (IMAGE,) * 4 + (EOI,),
            lambda rows, g: {
                "pixel_values": torch.randn(rows, 4, 3 * 4 * 4, generator=g),
                "image_position_ids": torch.tensor([[[x, y] for y in range(2) for x in range(2)]] * rows),
            },
            lambda ids: image_token_types(ids, "mm_token_type_ids"),
        ),
        notes=GEMMA4_NOTE + "; patches embedded without a vision transformer; oracle: transformers' `StaticCache` "
        "(transformers 5.24's `generate` gives a compileable cache the overlay on sliding-window layers only, its "
        "`create_masks_for_generate`, where the model's forward with `DynamicCache` puts it on every layer)",
        reference="StaticCache",
    ),
)


# -- modes -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VisionMode:
    """Prompts: per row, text tokens before and after its image (left-padded to one width); new tokens."""

    rows: tuple[tuple[int, int], ...]
    new_tokens: int
    image: bool = True
    beams: int = 1
    continue_tokens: int = 0  # a second generate of this many tokens from the first one's output and cache


MODE_SPECS: dict[str, VisionMode] = {
    "greedy": VisionMode(((2, 5),), 10),
    "batch": VisionMode(((1, 3), (4, 6)), 10),
    "text": VisionMode(((5, 0), (9, 0)), 10, image=False),
    "beam": VisionMode(((2, 3), (3, 2)), 8, beams=2),
    "continue": VisionMode(((3, 2), (1, 5)), 6, continue_tokens=6),
}


def prompts(family: VisionFamily, mode: VisionMode, pixel_seed: int = 0) -> dict[str, torch.Tensor]:
    """`generate`'s inputs: left-padded ids (text ids random, the image block between a row's two texts),
    their mask, the images' tensors (drawn from `pixel_seed`) and the family's extra inputs."""
    g = torch.Generator().manual_seed(sum(a * 7 + b for a, b in mode.rows) + len(mode.rows))
    rows = [
        torch.randint(3, TEXT_IDS, (before,), generator=g).tolist()
        + (list(family.images.row_block(i)) if mode.image else [])
        + torch.randint(3, TEXT_IDS, (after,), generator=g).tolist()
        for i, (before, after) in enumerate(mode.rows)
    ]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    inputs = dict(input_ids=ids, attention_mask=mask, **family.images.extra(ids))
    if mode.image:
        inputs.update(family.images.pixels(len(rows), torch.Generator().manual_seed(1000 + pixel_seed)))
    return inputs


def max_cache_len(family: VisionFamily, mode: VisionMode) -> int:
    return prompts(family, mode)["input_ids"].shape[1] + mode.new_tokens + mode.continue_tokens


def run(family: VisionFamily, model: torch.nn.Module, cache: Any, mode: VisionMode) -> list[Generated]:
    """The mode's `generate` call over `cache`; with `continue_tokens`, a second one from the first one's
    tokens (the generated ones real, text in the family's token types; no pixels: the image is cached)."""
    inputs = prompts(family, mode)
    out = [generate(model, cache, inputs, mode.new_tokens, mode.beams)]
    if mode.continue_tokens:
        tokens = out[0].tokens
        width = inputs["input_ids"].shape[1]
        more = dict(
            input_ids=tokens,
            attention_mask=torch.cat([inputs["attention_mask"], torch.ones_like(tokens[:, width:])], 1),
        )
        types = family.images.extra(tokens)
        for name, value in types.items():  # the prompt's token types, the generated tokens' as text (0)
            more[name] = torch.cat([inputs[name], torch.zeros_like(value[:, width:])], 1)
        out.append(generate(model, cache, more, mode.continue_tokens, 1))
    return out


def generate(
    model: torch.nn.Module, cache: Any, inputs: dict[str, torch.Tensor], new_tokens: int, beams: int
) -> Generated:
    """Greedy (or `beams`-beam) `generate` of `new_tokens` over `cache`: tokens and raw logits."""
    from torch_paged_kv.integrations.transformers import cache_kwarg

    kwargs = dict(do_sample=False, pad_token_id=PAD, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    kwargs.update(return_dict_in_generate=True, output_logits=True, num_beams=beams)
    kwargs.update(suppress_tokens=list(range(TEXT_IDS, VOCAB)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(**inputs, **{cache_kwarg(model): cache}, **kwargs)
    return Generated(out.sequences, unmasked(torch.stack(out.logits, 1)))


def unmasked(logits: torch.Tensor) -> torch.Tensor:
    """`logits` with those a model masks by the dtype's lowest value (Chameleon's image codes) as 0, so that
    the comparison's scale (the largest logit) is that of the others."""
    return logits.masked_fill(logits <= torch.finfo(logits.dtype).min / 2, 0.0)


# -- cells -----------------------------------------------------------------------------------------
_models: dict[str, tuple[torch.nn.Module, str]] = {}
_references: dict[tuple[str, str, str], list[Generated]] = {}  # (family, mode, attention) -> DynamicCache's
_image_checks: dict[str, str | None] = {}  # family -> None (the image reaches the text) or what is wrong


def model_of(family: VisionFamily) -> tuple[torch.nn.Module, str]:
    """The family's tiny model (built once per process) and its default attention implementation."""
    if family.name not in _models:
        model = family.build()
        _models[family.name] = (model, model.config._attn_implementation)
    return _models[family.name]


def image_reaches(family: VisionFamily) -> str | None:
    """None if the logits at the last position of the greedy prompt change with the pixels (by more than
    `IMAGE_EFFECT` of the largest), else what is wrong: the image does not reach the text model."""
    if family.name not in _image_checks:
        model, default_attn = model_of(family)
        set_attention(model, default_attn)
        mode = MODE_SPECS["greedy"]
        logits = []
        for seed in (0, 1):
            inputs = prompts(family, mode, pixel_seed=seed)
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    logits.append(unmasked(model(**inputs).logits[:, -1]))
            except Exception as e:  # the family's config or inputs are wrong
                _image_checks[family.name] = f"{family.modality} check failed: {e!r}"[:300]
                return _image_checks[family.name]
        change = (logits[0] - logits[1]).abs().max().item() / logits[0].abs().max().item()
        ignored = f"{family.modality} ignored (logits change {change:.1e})"
        _image_checks[family.name] = None if change > IMAGE_EFFECT else ignored
    return _image_checks[family.name]


def run_cell(family: VisionFamily, column: str, mode_name: str) -> CellResult:
    """One cell: what happened, as `str(outcome)` or a description of the failure."""
    mode = MODE_SPECS[mode_name]
    start = time.perf_counter()
    expected = family.expected(column)
    try:
        model, default_attn = model_of(family)
    except Exception as e:  # the family's config is wrong for this transformers
        return CellResult(family.name, column, mode_name, expected, f"build failed: {e!r}"[:300], 0.0)
    if (wrong := image_reaches(family)) is not None:
        return CellResult(family.name, column, mode_name, expected, wrong, 0.0)
    reference_attn = default_attn if column == "default" else "eager"
    key = (family.name, mode_name, reference_attn)
    if key not in _references:
        try:
            set_attention(model, reference_attn)
            _references[key] = run(family, model, reference_cache(family, model, mode), mode)
        except Exception as e:  # the reference itself fails: the family's config or inputs are wrong
            return CellResult(family.name, column, mode_name, expected, f"reference failed: {e!r}"[:300], 0.0)
        finally:
            set_attention(model, default_attn)
    caches: list[Any] = []
    try:
        got = compare(run_paged(family, model, column, mode, caches), _references[key])
    except ValueError as e:
        got = refusal(e, caches)
    except Exception as e:
        got = f"{type(e).__name__}: {e}"[:300]
    return CellResult(family.name, column, mode_name, expected, got, time.perf_counter() - start)


def reference_cache(family: VisionFamily, model: torch.nn.Module, mode: VisionMode) -> Any:
    """A fresh cache of the family's `reference` kind (a StaticCache as long as the cell's PagedCache)."""
    from transformers import DynamicCache, StaticCache

    if family.reference == "StaticCache":
        return StaticCache(config=model.config, max_cache_len=max_cache_len(family, mode))
    return DynamicCache(config=model.config)


def run_paged(family, model, column: str, mode: VisionMode, caches: list) -> list[Generated]:
    """The mode's `generate` call(s) over a new `PagedCache` (appended to `caches`) under the column's
    attention; the model's attention implementation restored afterwards."""
    from torch_paged_kv.integrations.transformers import PagedCache

    default_attn = model.config._attn_implementation
    rows = len(mode.rows) * mode.beams
    try:
        set_attention(model, default_attn if column == "default" else "paged_kv")
        caches.append(PagedCache(model.config, rows, max_cache_len(family, mode), page_size=4))
        return run(family, model, caches[-1], mode)
    finally:
        set_attention(model, default_attn)


def all_cells(families=None, columns=COLUMNS, modes=MODES, among=None) -> list[tuple[VisionFamily, str, str]]:
    """The cells of `families` (names; None: all) of `among` (default: this matrix's `FAMILIES`)."""
    return matrix.all_cells(families, columns, modes, FAMILIES if among is None else among)


# -- the docs table --------------------------------------------------------------------------------
def markdown_table(families: tuple[VisionFamily, ...] | None = None) -> str:
    """The "Vision-language models" table of docs/transformers.md (of `families`: another matrix's), from the
    declarations."""
    lines = [
        "| family | transformers model | default attention + `PagedCache` | `paged_kv` + `PagedCache` | notes |",
        "|---|---|---|---|---|",
    ]
    for f in FAMILIES if families is None else families:
        cells = [matrix._table_cell(f.expected(c)) for c in COLUMNS]
        lines.append(f"| {f.name} | `{f.model}` | {cells[0]} | {cells[1]} | {f.notes} |")
    return "\n".join(lines) + "\n"


def main(families: tuple[VisionFamily, ...] | None = None, doc: str | None = None) -> int:
    """The command line of this matrix, or of another one's `families` (its module docstring: `doc`)."""
    families = FAMILIES if families is None else families
    return matrix.command_line(
        doc or __doc__ or "",
        MODES,
        lambda: markdown_table(families),
        lambda names, columns, modes: all_cells(names, columns, modes, families),
        run_cell,
    )


if __name__ == "__main__":
    sys.exit(main())
