"""What the transformers integration serves exactly, decided from a model's config: the one place
for every refusal.

`check_config(config, paged)` raises `ValueError` naming the config field (`config.<field>: ...`)
for any attention pattern that `PagedCache` (and, with `paged=True`, the `paged_kv` attention
function) cannot reproduce token for token. `PagedCache` calls it at construction and again at the
first step after the attention implementation changes, so a refusal always comes before anything is
stored. `cache_groups(config, ...)` says what the cache's layer groups hold (and refuses a window
that the model's attention does not apply, once a row can outgrow it).

`attention_chunk_size(module)` is the chunk a layer attends within (Llama 4's chunked layers).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import torch
from torch import Tensor

KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""transformers' layer types whose cache is plain K/V per token (what a pool layer holds)."""
NO_CACHE_LAYER_TYPES = ("dummy", "moe", "mlp")
"""transformers' layer types that keep no K/V (besides shared-KV "reuse" layers)."""
STATE_LAYER_TYPES = ("linear_attention", "conv")
"""transformers' layer types that keep a fixed-size state per row (recurrent and convolution states of
linear-attention, Mamba and short-convolution layers), not K/V per token: `PagedCache` holds them in
transformers' own `LinearAttentionLayer`, beside the pages."""
HYBRID_LAYER_TYPES = ("hybrid", "hybrid_sliding")
"""transformers' layer types that keep both: K/V (full or sliding-window attention) and states."""
INDEXED_LAYER_TYPES = ("indexed_attention",)
"""transformers' sparse-attention layer type (DSA: DeepSeek-V3.2, GLM-5): K/V plus an indexer key per
token, from which each query attends only to its top-k keys (`hf_indexed.PagedIndexedLayer`); under
`paged_kv` only for `SPARSE_MLA_MODEL_TYPES`."""
SPARSE_MLA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4")
"""Sparse-attention MLA model types served under `paged_kv` (checked by the family matrix and the sweep):
their attention hands the indexer's top-k columns to the attention function (`indices=`), which
attends to those latent rows only (`mla_attention`'s `key_positions`); their `expand_kv` is the one
`hf_mla` absorbs (HY-V4's with sinks, `s_aux`: `mla_attention`'s `sinks`)."""
INDEXED_LAYERS_SINCE = "5.18"
"""The oldest transformers whose indexed layers `PagedCache` was checked to hold exactly: older ones are
refused."""
INDEXED_SPECULATIVE_SINCE = "5.24"
"""The oldest transformers whose `StaticCache` serves speculative decoding: the oracle for models with
indexed layers (whose top-k DynamicCache's rounding does not reproduce). `PagedCache` refuses it before."""
STATE_LAYERS_SINCE = "5.15"
"""The oldest transformers whose state layers `PagedCache` holds exactly (the matrix's hybrid families
in every mode on 5.15.1 to 5.19.0 and 5.23, the sweep on 5.15.1 to 5.24): older ones are refused.
In 5.14 OLMo-Hybrid and Zamba2 keep their states in caches of their own (a crash under `PagedCache`;
the matrix's families are exact there); before 5.14, transformers' `LinearAttentionLayer` keeps one
conv and one recurrent state per layer (no `number_of_states`), which `hf_state.StateLayer` does not follow."""
MLA_LATENT_UPDATE = "5.15"
"""The oldest transformers checked to hand an MLA cache the latent (not per-head K/V) in `update`."""
MLA_MODEL_TYPES = (
    *("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "sarvam_mla"),
    *("axk1", "bailing_hybrid", "kimi_linear", "longcat_flash", "youtu"),
)
"""MLA model types whose `expand_kv` is the one `hf_mla` absorbs (checked by the family matrix):
per head, keys `[W_UK c; k_rope]` and values `W_UV c` from `kv_b_proj`."""
OWN_CACHE_USE_MODEL_TYPES = {
    "cpmant": "prepends `config.prompt_length` tokens and masks them by the count of keys the cache returns",
    "git": "widens a padded batch's mask over image tokens it never cached, aligned by the count of keys",
    "prophetnet": "builds its n-gram attention bias for as many keys as the cache returns",
    "dory": "copies the cache's layers for its recurrent loops (or reads their `keys` and `values`)",
    "led": "builds no mask for a one-token step, so its decode steps attend to every key column the cache returns",
    "fsmt": "attends with its own code and masks, made for the tokens so far, over every key column the cache returns",
}
"""Model types whose own code assumes transformers' `DynamicCache`: its layers, or keys that are exactly
the tokens so far, where `PagedCache`'s layers are views of one pool returning `max_cache_len` columns."""
UNSERVED_MODEL_TYPES = {
    "minimax": "refuses any cache but its own (`MiniMaxCache`)",
    **dict.fromkeys(
        ("inkling", "inkling_text", "inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text"),
        "reads its short-convolution states back through the cache and sizes its sliding layers by "
        "`swa_head_dim` (other tokens than DynamicCache's, or K/V of another head size)",
    ),
}
"""Model types with state layers whose cache use `PagedCache` does not follow (found by the sweep)."""
_MASK_FROM_TOKENS = "builds its attention mask for the tokens so far, not for the cache's key columns"
OLD_MASK_MODEL_TYPES = {
    "big_bird": ("5.18", _MASK_FROM_TOKENS),
    "megatron-bert": ("5.18", _MASK_FROM_TOKENS),
    "rembert": ("5.18", _MASK_FROM_TOKENS),
    "roformer": ("5.18", _MASK_FROM_TOKENS),
    "bloom": ("5.21", "builds ALiBi from a 2-D mask, where generate hands a compileable cache's model a 4-D one"),
    "doge": ("5.18", "gives other tokens than DynamicCache through its own key selection over the columns"),
    "ctrl": ("5.17", _MASK_FROM_TOKENS),
}
"""Model types whose code in transformers older than the version named does not follow a compileable
cache's `max_cache_len` key columns (wrong tokens or a crash inside transformers; found by the sweep
on 5.5.4, 5.17, 5.18.0, 5.19.0 and 5.20.2; each bound is the oldest version the sweep found exact)."""
PAGED_UNSERVED_MODEL_TYPES = {
    "t5gemma2_decoder": "attends over its self-attention and cross-attention keys in one call (one mask over both)",
    "voxtral_realtime_encoder": "caches its streaming audio encoder's K/V in a DynamicCache of its own, which "
    "paged_kv cannot attend from (set paged_kv on the text model only: "
    "attn_implementation={'text_config': 'paged_kv', 'audio_config': 'sdpa'})",
}
"""Model types (of the config a cache serves) whose attention `paged_kv` cannot apply, though they are on
transformers' attention interface: refused under `paged_kv` only (found by the encoder-decoder sweep)."""
DOUBLE_SLIDING_KV_HEADS_MODEL_TYPES = ("mimo_v2_flash",)
"""Model types whose sliding-window layers have twice `config.num_key_value_heads` K/V heads."""
WINDOW_UNUSED_MODEL_TYPES = ("moshi",)
"""Model types with a `config.sliding_window` that their attention does not apply (a full causal mask)."""


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """What one pool layer of a layer group holds per token: K/V heads of `head_dim`, or (MLA) one
    latent of `kv_lora_rank` and one rope key of `rope_dim`; and the window its layers attend within
    (`sliding_window`; None: every key)."""

    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    sliding_window: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None


def is_mla(config: Any) -> bool:
    """Whether the model caches a compressed latent (MLA: DeepSeek-V2/V3 and their kind)."""
    return getattr(config, "kv_lora_rank", None) is not None and getattr(config, "qk_rope_head_dim", None) is not None


def cache_groups(config: Any, cached_layers: list[int], max_cache_len: int) -> list[tuple[CacheShape, list[int]]]:
    """The cache's layer groups: each distinct per-token shape and window, with the positions in
    `cached_layers` of the layers holding it, in order of first use. A layer's window is transformers'
    rule: with `layer_types`, `sliding_window` (per layer where the config has `per_layer_config`) for
    a "sliding_attention" layer; without, `config.sliding_window` for every layer (Mistral,
    Starcoder2). A window that no row can outgrow (>= `max_cache_len`) keeps every token anyway: no window."""
    if is_mla(config):
        shape = CacheShape(
            1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank, config.qk_rope_head_dim
        )
        return [(shape, list(range(len(cached_layers))))]
    num_heads = config.num_attention_heads
    kv_heads = _per_layer(config, "num_key_value_heads", cached_layers)
    head_dims = _per_layer(config, "head_dim", cached_layers)
    windows = _per_layer(config, "sliding_window", cached_layers)
    types = getattr(config, "layer_types", None)
    model_type = getattr(config, "model_type", None)
    groups: dict[CacheShape, list[int]] = {}
    for j, i in enumerate(cached_layers):
        sliding = types[i] in ("sliding_attention", "hybrid_sliding") if types else True
        window = windows[i] if sliding else None
        if window and window < max_cache_len and model_type in WINDOW_UNUSED_MODEL_TYPES:
            raise ValueError(
                f"config.sliding_window: {model_type!r} attends to every earlier token (a full causal mask) though "
                f"its config names a window of {window}, which transformers' own caches apply as they drop keys; "
                f"PagedCache serves it only where no row outgrows the window (max_cache_len <= {window})"
            )
        heads = kv_heads[i] or num_heads
        if sliding and types and model_type in DOUBLE_SLIDING_KV_HEADS_MODEL_TYPES:
            heads *= 2
        shape = CacheShape(
            heads,
            head_dims[i] or config.hidden_size // num_heads,
            sliding_window=window if window and window < max_cache_len else None,
        )
        groups.setdefault(shape, []).append(j)
    return list(groups.items())


GLOBAL_LAYER_FIELDS = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}
"""Gemma4's fields for its full-attention layers where the config has no `per_layer_config`
(transformers 5.5): `global_head_dim` when set; `num_global_key_value_heads` under `attention_k_eq_v`."""


def _per_layer(config: Any, name: str, layers: list[int]) -> dict[int, Any]:
    """`name` of each layer in `layers`: from `config.per_layer_config` where the config has one
    (transformers >= 5.2x: a global read of a per-layer field raises there), else the global value,
    or for a full-attention layer its `GLOBAL_LAYER_FIELDS` value where the config has that."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None:
        return {i: getattr(per_layer[i], name, None) for i in layers}
    value = getattr(config, name, None)
    types = getattr(config, "layer_types", None)
    glob = getattr(config, GLOBAL_LAYER_FIELDS.get(name, ""), None)
    if name == "num_key_value_heads" and not getattr(config, "attention_k_eq_v", False):
        glob = None
    if not glob or not types:
        return dict.fromkeys(layers, value)
    return {i: value if types[i] == "sliding_attention" else glob for i in layers}


def decoder_config(config: Any) -> Any:
    """The config of the layers a cache serves: `config.get_text_config(decoder=True)` (a composite
    model's text config; a flat encoder-decoder config's decoder view, `decoder_layers` and
    `decoder_attention_heads` as its `num_hidden_layers` and `num_attention_heads`), with the T5 family's
    `num_decoder_layers` as its layer count, which that view does not map."""
    text = config.get_text_config(decoder=True)
    layers = getattr(config, "num_decoder_layers", None)
    if not isinstance(layers, int) or layers == text.num_hidden_layers:
        return text
    text = copy.copy(text)  # (never the model's own config)
    text.num_hidden_layers = layers
    return text


def has_cross_attention(config: Any) -> bool:
    """Whether the model's decoder layers also attend to an encoder's states (an encoder-decoder model, or
    a decoder given `add_cross_attention`): transformers then caches both in an `EncoderDecoderCache`."""
    return bool(getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False))


def check_cross_attention(config: Any, encoder_decoder: bool) -> None:
    """Refuse an encoder-decoder config for a bare `PagedCache`, and `encoder_decoder` for any other (see
    `PagedCache`'s `encoder_decoder` argument)."""
    if has_cross_attention(config) and not encoder_decoder:
        field = "is_encoder_decoder" if getattr(config, "is_encoder_decoder", False) else "add_cross_attention"
        raise ValueError(
            f"config.{field}: the model's decoder layers also attend to the encoder's states, which transformers "
            "caches beside the self-attention K/V in an EncoderDecoderCache; a bare PagedCache would be handed "
            "both. Use PagedCache.for_encoder_decoder(config, max_batch_size, max_cache_len, ...) (or pass "
            "encoder_decoder=True and wrap the cache in EncoderDecoderCache yourself)"
        )
    if encoder_decoder and not has_cross_attention(config):
        raise ValueError(
            f"encoder_decoder: True, but {type(config).__name__} is not an encoder-decoder config "
            "(config.is_encoder_decoder is False)"
        )


def attention_layers(config: Any) -> tuple[list[int], list[int]]:
    """(layers that keep their own K/V, layers with attention), as model layer indices, by
    transformers' rule: a layer that reuses another's K/V (`kv_sharing_modes[i] == "reuse"`) attends
    but keeps nothing; a layer without attention (type "moe", "mlp") does neither."""
    num_layers = config.num_hidden_layers
    if getattr(config, "num_kv_shared_layers", 0) and not hasattr(config, "kv_sharing_modes"):
        raise ValueError(
            f"config: its last {config.num_kv_shared_layers} layers reuse other layers' K/V the way transformers "
            "before 5.23 does it (through a `shared_layers` dict on the cache), which PagedCache does not "
            "follow; use transformers >= 5.23 (`kv_sharing_modes`) for this model"
        )
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    modes = getattr(config, "kv_sharing_modes", None) or [None] * num_layers
    attending = [i for i, kind in enumerate(types) if kind not in NO_CACHE_LAYER_TYPES + STATE_LAYER_TYPES]
    return [i for i in attending if modes[i] != "reuse"], attending


def state_layers(config: Any) -> list[int]:
    """The model layers that keep fixed-size states per row (`STATE_LAYER_TYPES`, and with K/V
    `HYBRID_LAYER_TYPES`)."""
    kinds = STATE_LAYER_TYPES + HYBRID_LAYER_TYPES
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind in kinds]


def serves_indexed_speculative() -> bool:
    """Whether this transformers is one on which speculative decoding of indexed layers was checked."""
    return not _older_than(INDEXED_SPECULATIVE_SINCE)


def indexed_layers(config: Any) -> list[int]:
    """The model layers of a sparse-attention type (`INDEXED_LAYER_TYPES`)."""
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind in INDEXED_LAYER_TYPES]


def check_config(config: Any, paged: bool) -> None:
    """Raise `ValueError` naming the config field if the integration cannot serve this model exactly:
    with `PagedCache` under the model's own attention, or (`paged=True`) under `paged_kv` too."""
    types = list(getattr(config, "layer_types", None) or [])
    known: tuple[str, ...] = KV_LAYER_TYPES + NO_CACHE_LAYER_TYPES
    if not _older_than(STATE_LAYERS_SINCE):
        known += STATE_LAYER_TYPES + HYBRID_LAYER_TYPES
    if not _older_than(INDEXED_LAYERS_SINCE):
        known += INDEXED_LAYER_TYPES
    unknown = sorted({t for t in types if t not in known})
    if unknown:
        layers = [i for i, t in enumerate(types) if t in unknown]
        raise ValueError(
            f"config.layer_types: layers {layers} are {unknown}, which keep other state than K/V per token "
            f"(compressed attention; before transformers {INDEXED_LAYERS_SINCE}, indexed attention, and before "
            f"{STATE_LAYERS_SINCE}, recurrent and convolution layers too); PagedCache does not hold it"
        )
    indexed = indexed_layers(config)
    if paged and indexed and getattr(config, "model_type", None) not in SPARSE_MLA_MODEL_TYPES:
        raise ValueError(
            f"config.layer_types: layers {indexed} are 'indexed_attention' (sparse attention: each query attends "
            f"to the top-k keys an indexer picks), which paged_kv applies only for {list(SPARSE_MLA_MODEL_TYPES)}; "
            "use PagedCache with the model's default attention"
        )
    if types and not attention_layers(config)[0]:
        raise ValueError(
            f"config.layer_types: no layer keeps K/V ({sorted(set(types))}), so there is nothing to page; use "
            "transformers' own cache for this model"
        )
    blocks = sorted({b for b in getattr(config, "block_types", None) or [] if b != "attention"})
    if blocks:
        raise ValueError(
            f"config.block_types: {blocks} blocks keep other state than K/V per token (RecurrentGemma before "
            "transformers' layer_types); PagedCache holds only K/V layers"
        )
    model_type = getattr(config, "model_type", None)
    if getattr(config, "use_cache", True) is False:
        raise ValueError(
            "config.use_cache: False, so generate feeds every token again at each step and a cache given to it "
            "would store them again; set model.config.use_cache = True (and model.generation_config.use_cache)"
        )
    if not takes_cache(config):
        raise ValueError(f"config.model_type: {model_type!r} models keep no K/V cache that PagedCache could hold")
    if model_type in OLD_MASK_MODEL_TYPES and _older_than(OLD_MASK_MODEL_TYPES[model_type][0]):
        since, why = OLD_MASK_MODEL_TYPES[model_type]
        raise ValueError(
            f"config.model_type: {model_type!r} in transformers {_transformers_version()} {why}; PagedCache "
            f"serves it from transformers {since} (or use a DynamicCache)"
        )
    if model_type in UNSERVED_MODEL_TYPES:
        raise ValueError(
            f"config.model_type: {model_type!r} {UNSERVED_MODEL_TYPES[model_type]}; PagedCache does not serve it "
            "(use transformers' own cache)"
        )
    if model_type in OWN_CACHE_USE_MODEL_TYPES:
        raise ValueError(
            f"config.model_type: {model_type!r} {OWN_CACHE_USE_MODEL_TYPES[model_type]}, which assumes "
            "DynamicCache; PagedCache's layers are views of one pool returning max_cache_len columns"
        )
    if getattr(config, "cross_attention_layers", None):
        raise ValueError(
            f"config.cross_attention_layers: layers {list(config.cross_attention_layers)} attend to encoder "
            "(image) states that transformers caches with the text's K/V; PagedCache holds self-attention K/V only"
        )
    v_head_dim = getattr(config, "v_head_dim", None)
    if v_head_dim is not None and not is_mla(config) and v_head_dim != _head_dim(config):
        raise ValueError(
            f"config.v_head_dim: values of {v_head_dim} per head next to keys of {_head_dim(config)}; "
            "PagedCache's pages hold K and V of one head_dim"
        )
    if is_mla(config) and _mla_update_gets_decompressed_kv():
        raise ValueError(
            f"config.kv_lora_rank: transformers {_transformers_version()}'s MLA attention hands Cache.update "
            "per-head K/V decompressed from the latent; PagedCache caches the latent itself (verified from "
            f"transformers {MLA_LATENT_UPDATE}); use a newer transformers or a DynamicCache"
        )
    if "chunked_attention" in types and _generate_breaks_chunked_masks():
        raise ValueError(
            f"config.layer_types: chunked_attention layers: transformers {_transformers_version()}'s generate "
            "passes `block_sequence_ids` to `create_chunked_causal_mask`, which does not take it, for every "
            "compileable cache (StaticCache too); use transformers >= 5.20 or a DynamicCache for this model"
        )
    if not paged:
        return
    check_mask_config(config)
    if not types and getattr(config, "attention_chunk_size", None):
        raise ValueError(
            f"config.layer_types: missing, so which layers attend within chunks of {config.attention_chunk_size} "
            "tokens (config.attention_chunk_size) is unknown; paged_kv needs it per layer"
        )
    if is_mla(config) and model_type not in MLA_MODEL_TYPES + SPARSE_MLA_MODEL_TYPES:
        raise ValueError(
            f"config.model_type: {model_type!r} caches an MLA latent, but paged_kv's absorbed MLA is verified "
            f"only for {list(MLA_MODEL_TYPES + SPARSE_MLA_MODEL_TYPES)}; use PagedCache with the model's default "
            "attention"
        )


def _head_dim(config: Any) -> int:
    """The keys' head size: `config.head_dim`, or hidden size over heads where the config has none."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim or config.hidden_size // config.num_attention_heads


def _model_class(config: Any) -> Any:
    """transformers' causal-LM class of `config.model_type`, or None (a custom model)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    return getattr(transformers, name, None) if name else None


def on_attention_interface(config: Any) -> bool:
    """Whether the model class of `config.model_type` calls transformers' attention interface (its own
    test, `_can_set_attn_implementation`, which reads the class's source: kept per model type); True
    where the class cannot be found (a custom model)."""
    model_type = getattr(config, "model_type", None)
    known = _ON_INTERFACE.get(model_type)
    if known is None:
        can_set = getattr(_model_class(config), "_can_set_attn_implementation", None)
        known = _ON_INTERFACE[model_type] = True if can_set is None else bool(can_set())
    return known


_ON_INTERFACE: dict[Any, bool] = {}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _older_than(version: str) -> bool:
    """Whether the installed transformers is older than `version`."""
    from packaging.version import Version

    return Version(_transformers_version()) < Version(version)


def _mla_update_gets_decompressed_kv() -> bool:
    """Whether this transformers predates `MLA_LATENT_UPDATE`, the first version seen to hand an MLA
    cache's `update` the latent and the rope key (5.5 to 5.14 hand it per-head K/V)."""
    return _older_than(MLA_LATENT_UPDATE)


def _generate_breaks_chunked_masks() -> bool:
    """Whether this transformers' `create_masks_for_generate` hands `create_chunked_causal_mask` an
    argument it does not take (`block_sequence_ids`; so in 5.9 to 5.19, not in 5.5 to 5.8 nor from
    5.20): a `TypeError` in `generate` before the first token, for every compileable cache."""
    from transformers import masking_utils

    passed = inspect.signature(masking_utils.create_masks_for_generate).parameters
    taken = inspect.signature(masking_utils.create_chunked_causal_mask).parameters
    return "block_sequence_ids" in passed and "block_sequence_ids" not in taken


def takes_cache(config: Any) -> bool:
    """Whether the model class of `config.model_type` takes a cache (`cache` or `past_key_values`) in its
    forward; True where the class cannot be found (a custom model)."""
    model_class = _model_class(config)
    if model_class is None:
        return True
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" in parameters or "past_key_values" in parameters


def check_attention_call(module: Any, kwargs: dict[str, Any]) -> None:
    """At a `paged_kv` attention call, before anything is stored: refuse what the call itself shows
    that `paged_kv` would not apply (for models whose config does not say it)."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise ValueError(
            f"config.model_type: {model_type!r} layer {getattr(module, 'layer_idx', '?')} attends non-causally "
            "(is_causal=False); paged_kv attends causally only"
        )


IGNORED_TENSOR_KWARGS = frozenset(("position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k"))
"""Tensors a model may pass the attention that `paged_kv` need not read: positions (the pages hold
them), and the packed-sequence bounds of FlashAttention (the mask carries the packing)."""


def check_unapplied_kwargs(module: Any, kwargs: dict[str, Any]) -> None:
    """Refuse, before anything is stored, a tensor the model passes the attention that `paged_kv` does
    not apply (T5's `position_bias`, a layer's own `sinks` or block indices): ignoring it would change
    the outputs."""
    unapplied = [k for k, v in kwargs.items() if isinstance(v, Tensor) and k not in IGNORED_TENSOR_KWARGS]
    if unapplied:
        raise ValueError(
            f"attn_implementation: {type(module).__name__} passes the attention {unapplied}, which paged_kv does "
            "not apply; use the model's default attention"
        )


def check_mask_config(config: Any) -> None:
    """When a mask is made under `paged_kv` (before the step's first layer): refuse a model whose attention
    `paged_kv` would not reach or apply (a config that named `paged_kv` after the cache was built included)."""
    if not torch.compiler.is_compiling() and not on_attention_interface(config):
        raise ValueError(
            f"config.model_type: {config.model_type!r} models do not call transformers' attention interface, "
            "so attn_implementation='paged_kv' would change their masks but not their attention; use the model's "
            "default attention"
        )
    model_type = getattr(config, "model_type", None)
    if model_type in PAGED_UNSERVED_MODEL_TYPES:
        raise ValueError(
            f"config.model_type: {model_type!r} {PAGED_UNSERVED_MODEL_TYPES[model_type]}; use PagedCache with the "
            "model's default attention"
        )
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    if bidirectional and bidirectional != "vision":
        raise ValueError(
            f"config.use_bidirectional_attention: {bidirectional!r} makes the attention non-causal; paged_kv "
            "attends causally only"
        )


def attention_chunk_size(module: Any) -> int:
    """The chunk of positions layer `module` attends within (its `layer_types` entry "chunked_attention":
    `config.attention_chunk_size`), or -1 (no chunks)."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if config is None or not types or layer_idx is None or types[layer_idx] != "chunked_attention":
        return -1
    return int(config.attention_chunk_size)
