"""The transformers model-family matrix: which families `PagedCache` serves, in which attention mode.

Each family is a tiny random model built in code from its config class (no downloads), fp32 on CPU.
Each cell is (family, column, mode): `generate` with a `PagedCache`, once under the model's default
attention ("default" column) and once under `attn_implementation="paged_kv"`, compared token for
token with the same `generate` over transformers' `DynamicCache`: under the default attention for
the default column, under `eager` (transformers' definition of the model's attention) for the
`paged_kv` column (transformers 5.17's Gemma2 defaults to `sdpa`, which drops its logit softcap).
A family whose attention picks top-k keys (sparse attention) is compared with transformers'
`StaticCache` instead (`Family.reference`): its top-k flips where fp32 rounding reorders a near-tie,
and a cache of static shapes rounds differently from DynamicCache (StaticCache differs from it too).
The family declares each column's outcome (and, in `older`, what older transformers give where it
refuses by design), and a cell passes only when it happens:

- `EXACT`: every generated token equals DynamicCache's, and every logit is within 1e-4 of its
  (relative to the largest logit; fp32 rounding is ~1e-6);
- a refusal (`Refused(field)`): a `ValueError` whose message starts with `field:` (a config field,
  e.g. `config.attention_chunk_size`) before the first token: the cache holds nothing.

Nothing else passes: not an exception of another type or from inside transformers, not a token
that differs. `docs/transformers.md`'s "Supported models" table is `markdown_table()` of these
declarations (`tests/test_model_families.py` checks that it is up to date and that the cells hold).

    python tests/transformers_matrix.py [--family NAME ...] [--mode MODE ...] [--column COLUMN ...]
    python tests/transformers_matrix.py --markdown   # the docs table
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("default", "paged_kv")
MODES = ("greedy", "batch", "beam", "sample", "long", "continue")
EXACT = "exact"
PAD, BOS, EOS = 0, 1, 2
VOCAB = 256
LOGIT_TOLERANCE = 1e-4
"""Largest logit difference from DynamicCache's, relative to the largest logit, in an exact cell."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """The expected refusal: a `ValueError` starting with `field:`, raised before the first token."""

    field: str

    def __str__(self) -> str:
        return f"refused ({self.field})"


Outcome = str | Refused


@dataclasses.dataclass(frozen=True)
class Before:
    """What a column gives on transformers older than `version` (and from `since`, where given);
    None: as declared for the newest."""

    version: str
    default: Outcome | None = None
    paged_kv: Outcome | None = None
    since: str | None = None

    def applies(self) -> bool:
        import transformers

        installed = Version(transformers.__version__)
        return installed < Version(self.version) and (self.since is None or installed >= Version(self.since))

    def __str__(self) -> str:
        return f"from {self.since}, before {self.version}" if self.since else f"before {self.version}"


@dataclasses.dataclass(frozen=True)
class Family:
    """A transformers family as a tiny random model, and what each column of the matrix must give.

    `config` and `model` name classes exported by `transformers`; `overrides` are given to the config
    on top of `TINY` (None removes a key). `notes`: what the config exercises or why it is refused (docs table).
    `reference`: the transformers cache whose `generate` is the oracle (StaticCache only where no cache
    of static shapes can follow DynamicCache's rounding: top-k sparse attention).
    """

    name: str
    config: str
    model: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    default: Outcome = EXACT
    paged_kv: Outcome = EXACT
    notes: str = ""
    older: tuple[Before, ...] = ()
    reference: str = "DynamicCache"  # the oracle: transformers' "DynamicCache" or "StaticCache"

    def expected(self, column: str) -> Outcome:
        """The column's outcome on the installed transformers: the oldest `older` entry that applies,
        else the newest."""
        for before in sorted(self.older, key=lambda b: Version(b.version)):
            outcome = getattr(before, column)
            if outcome is not None and before.applies():
                return outcome
        return getattr(self, column)

    def available(self) -> bool:
        """Whether the installed transformers has the family (older ones lack the newer families)."""
        import transformers

        return hasattr(transformers, self.config)

    def build(self) -> torch.nn.Module:
        import transformers

        kwargs = {**TINY, **self.overrides}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        config = getattr(transformers, self.config)(**kwargs)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = getattr(transformers, self.model)(config)
        return model.float().eval()


TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)
GPT2_NAMES = dict(
    hidden_size=None,
    intermediate_size=None,
    num_hidden_layers=None,
    num_attention_heads=None,
    num_key_value_heads=None,
    head_dim=None,
    max_position_embeddings=None,
    n_embd=64,
    n_layer=3,
    n_head=4,
    n_positions=256,
)
SLIDING = dict(sliding_window=8)  # crossed by every mode's longer rows
MLA = dict(
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=None,
    num_key_value_heads=4,
)
DEEPSEEK_MOE = dict(MLA, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32)
DEEPSEEK_V3 = dict(DEEPSEEK_MOE, n_group=1, topk_group=1)
DSA = dict(DEEPSEEK_V3, index_topk=3, index_head_dim=16, index_n_heads=4)  # sparse attention: top 3 keys
MLA_HYBRID = dict(DEEPSEEK_V3, layer_types=["linear_attention", "full_attention", "linear_attention"])
WINDOW = "sliding-window layers (window 8, crossed)"
SHARING = "K/V-sharing layers (under `paged_kv` fed only the last prompt position, as transformers trims them)"
MLA_NOTE = "MLA: one latent + rope row per token; absorbed MLA over the pages under `paged_kv`"
SINKS = "attention sinks: learned per-head logits in every softmax (`s_aux`, `flash_attention`'s `sinks`)"
CHUNKED = "chunked local attention (`attention_chunk_size` 8, crossed; `flash_attention`'s `attention_chunk_size`)"
STATES = (
    "linear-attention layers: their conv and recurrent states in transformers' `LinearAttentionLayer`, "
    "the full-attention layers in pages"
)
NOT_ON_INTERFACE = (
    "not on transformers' attention interface: transformers refuses `paged_kv` for it (KeyError at "
    "`from_pretrained`, ignored by `set_attn_implementation`); `PagedCache` refuses a config that names it"
)

STATES_BEFORE_5_15 = (Before("5.15", Refused("config.layer_types"), Refused("config.layer_types")),)
SHARING_BEFORE_5_23 = (Before("5.23", Refused("config"), Refused("config")),)  # no `kv_sharing_modes` yet
MLA_BEFORE_5_24 = (
    Before("5.15", Refused("config.kv_lora_rank"), Refused("config.kv_lora_rank")),  # update gets per-head K/V
    Before("5.24", paged_kv=Refused("attn_implementation")),  # no `Cache.update(kwargs=)` yet
)

FAMILIES: tuple[Family, ...] = (
    Family("Llama", "LlamaConfig", "LlamaForCausalLM"),
    Family("Mistral", "MistralConfig", "MistralForCausalLM", SLIDING, notes=WINDOW),
    Family("Mixtral", "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    Family("Ministral", "MinistralConfig", "MinistralForCausalLM", SLIDING, notes=WINDOW),
    Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    Family("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    Family("Gemma", "GemmaConfig", "GemmaForCausalLM"),
    Family(
        "Gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(SLIDING, attn_logit_softcapping=2.0),
        notes=WINDOW + ", attention logit softcap 2",
    ),
    Family("Gemma3 (text)", "Gemma3TextConfig", "Gemma3ForCausalLM", SLIDING, notes=WINDOW),
    Family(
        "Gemma3n (text, K/V sharing)",
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        dict(
            SLIDING,
            num_hidden_layers=6,
            num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 3,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            activation_sparsity_pattern=[0.0] * 6,
        ),
        notes=SHARING + ", " + WINDOW,
        older=SHARING_BEFORE_5_23,
    ),
    Family(
        "Gemma4 (text, K/V sharing)",
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            SLIDING,
            num_hidden_layers=6,
            num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 3,
            global_head_dim=16,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
        ),
        notes=SHARING + ", " + WINDOW,
        older=SHARING_BEFORE_5_23,
    ),
    Family(
        "Gemma4 (text, default head dims)",
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            SLIDING,
            num_hidden_layers=6,
            global_head_dim=32,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
        ),
        notes="per-layer head dims (Gemma4's `global_head_dim` for full-attention layers): a layer group each, "
        + WINDOW,
    ),
    Family(
        "GPT-OSS",
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(SLIDING, num_local_experts=4, num_experts_per_tok=2),
        notes=SINKS,
    ),
    Family(
        "Llama4 (text)",
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            attention_chunk_size=8,
            num_local_experts=2,
            interleave_moe_layer_step=2,
            intermediate_size_mlp=128,
            no_rope_layer_interval=2,
            num_hidden_layers=4,
            floor_scale=4,
            attn_scale=0.5,
        ),
        notes=CHUNKED,
        older=(Before("5.20", Refused("config.layer_types"), Refused("config.layer_types"), since="5.9"),),
    ),
    Family("Cohere", "CohereConfig", "CohereForCausalLM"),
    Family("Cohere2", "Cohere2Config", "Cohere2ForCausalLM", dict(SLIDING, sliding_window_pattern=2), notes=WINDOW),
    Family("Phi", "PhiConfig", "PhiForCausalLM", dict(head_dim=None)),
    Family("Phi3", "Phi3Config", "Phi3ForCausalLM", dict(head_dim=None)),
    Family("Granite", "GraniteConfig", "GraniteForCausalLM"),
    Family("OLMo2", "Olmo2Config", "Olmo2ForCausalLM"),
    Family("OLMo3", "Olmo3Config", "Olmo3ForCausalLM", SLIDING, notes=WINDOW),
    Family("StableLM", "StableLmConfig", "StableLmForCausalLM", dict(head_dim=None)),
    Family("GPT-NeoX", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(head_dim=None, num_key_value_heads=None)),
    Family("GPT-2", "GPT2Config", "GPT2LMHeadModel", GPT2_NAMES, notes="learned absolute positions"),
    Family(
        "GPT-J",
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(GPT2_NAMES, rotary_dim=8),
        older=(Before("5.24", paged_kv=Refused("config.model_type")),),  # on the attention interface from 5.24
    ),
    Family("Starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", dict(SLIDING, head_dim=None), notes=WINDOW),
    Family("SmolLM3", "SmolLM3Config", "SmolLM3ForCausalLM"),
    Family("EXAONE4", "Exaone4Config", "Exaone4ForCausalLM", dict(SLIDING, sliding_window_pattern=2), notes=WINDOW),
    Family("GLM4", "Glm4Config", "Glm4ForCausalLM"),
    Family(
        "MiniCPM3 (MLA)",
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        dict(MLA, q_lora_rank=16, scale_emb=1, dim_model_base=64),
        notes=MLA_NOTE,
        older=MLA_BEFORE_5_24,
    ),
    Family(
        "GLM4-MoE-Lite (MLA)",
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(MLA, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        notes=MLA_NOTE + " (interleaved rope)",
        older=MLA_BEFORE_5_24,
    ),
    Family(
        "DeepSeek-V2 (MLA)",
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        DEEPSEEK_MOE,
        notes=MLA_NOTE,
        older=MLA_BEFORE_5_24,
    ),
    Family(
        "DeepSeek-V3 (MLA)",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        DEEPSEEK_V3,
        notes=MLA_NOTE,
        older=MLA_BEFORE_5_24,
    ),
    Family(
        "DeepSeek-V3.2 (sparse attention)",
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        DSA,
        notes=(
            "indexed attention (DSA): MLA latent in pages, indexer keys beside them, top 3 keys per query; "
            "under `paged_kv` absorbed MLA over each query's top-k latent rows; oracle: transformers' "
            "`StaticCache` (its top-k, like any cache of static shapes, differs from DynamicCache's where fp32 "
            "rounding flips a near-tie)"
        ),
        older=(
            Before("5.18", Refused("config.layer_types"), Refused("config.layer_types")),  # "deepseek_sparse_attention"
            Before("5.24", paged_kv=Refused("attn_implementation")),  # no `Cache.update(kwargs=)` yet
        ),
        reference="StaticCache",
    ),
    Family(
        "HY-V4 (sparse attention, sinks)",
        "HYV4Config",
        "HYV4ForCausalLM",
        DSA,
        notes=(
            "indexed attention (DSA) as DeepSeek-V3.2's, with attention sinks (`s_aux`: `mla_attention`'s `sinks` "
            "under `paged_kv`) and a gated output; oracle: transformers' `StaticCache`"
        ),
        older=(Before("5.24", paged_kv=Refused("attn_implementation")),),  # no `Cache.update(kwargs=)` yet
        reference="StaticCache",
    ),
    Family("AXK1 (MLA)", "AXK1Config", "AXK1ForCausalLM", DEEPSEEK_V3, notes=MLA_NOTE, older=MLA_BEFORE_5_24),
    Family(
        "LongCat-Flash (MLA)",
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        dict(
            DEEPSEEK_V3,
            num_layers=3,  # (two attention sublayers each)
            q_lora_rank=16,
            head_dim=8,
            moe_topk=2,
            ffn_hidden_size=128,
            expert_ffn_hidden_size=32,
            zero_expert_num=2,
        ),
        notes=MLA_NOTE + "; two attention sublayers per layer, a cache slot each",
        older=MLA_BEFORE_5_24,
    ),
    Family("Youtu (MLA)", "YoutuConfig", "YoutuForCausalLM", DEEPSEEK_V3, notes=MLA_NOTE, older=MLA_BEFORE_5_24),
    Family(
        "Kimi-Linear (MLA hybrid)",
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        MLA_HYBRID,
        notes=f"{MLA_NOTE}; {STATES}",
        older=MLA_BEFORE_5_24,
    ),
    Family(
        "Bailing-hybrid (MLA hybrid)",
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        MLA_HYBRID,
        notes=f"{MLA_NOTE}; {STATES}",
        older=MLA_BEFORE_5_24,
    ),
    Family(
        "Falcon",
        "FalconConfig",
        "FalconForCausalLM",
        dict(head_dim=None, num_key_value_heads=None),
        paged_kv=Refused("config.model_type"),
        notes=NOT_ON_INTERFACE,
    ),
    Family(
        "MiMo-V2-Flash",
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        dict(
            SLIDING,
            num_hidden_layers=4,
            layer_types=["full_attention", "sliding_attention"] * 2,
            mlp_layer_types=["dense", "sparse"] * 2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            v_head_dim=16,
        ),
        notes="sliding-window layers with twice `num_key_value_heads` (a layer group each) and sinks, " + WINDOW,
    ),
    Family(
        "HRM (text)",
        "HrmTextConfig",
        "HrmTextForCausalLM",
        notes="recurrent cycles: each layer runs several times per token, each time with a cache slot of its own",
    ),
    Family(
        "GPT-NeoX-Japanese",
        "GPTNeoXJapaneseConfig",
        "GPTNeoXJapaneseForCausalLM",
        dict(head_dim=None, num_key_value_heads=None),
        paged_kv=Refused("config.model_type"),
        notes="views the K/V the cache returns (contiguous, as DynamicCache's); " + NOT_ON_INTERFACE,
    ),
    Family(
        "DiffLlama",
        "DiffLlamaConfig",
        "DiffLlamaForCausalLM",
        paged_kv=Refused("config.model_type"),
        notes="differential attention splits the cached values itself, before the attention interface",
    ),
    Family(
        "Dory (recurrent loops)",
        "DoryConfig",
        "DoryForCausalLM",
        dict(
            SLIDING,
            num_hidden_layers=6,
            n_input_layers=2,
            n_recurrent_layers=2,
            n_output_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 3,
        ),
        default=Refused("config.model_type"),
        paged_kv=Refused("config.model_type"),
        notes="adds cache layers for its recurrent loops by copying DynamicCache's",
    ),
    Family(
        "MPT",
        "MptConfig",
        "MptForCausalLM",
        dict(
            GPT2_NAMES,
            n_embd=None,
            n_layer=None,
            n_head=None,
            n_positions=None,
            d_model=64,
            n_layers=3,
            n_heads=4,
            use_cache=True,
        ),
        paged_kv=Refused("config.model_type"),
        notes="ALiBi; `use_cache=True` given (its config's False is refused: `config.use_cache`); " + NOT_ON_INTERFACE,
    ),
    Family(
        "Qwen3-Next (hybrid)",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_hidden_layers=4,
        ),
        notes=STATES,
        older=STATES_BEFORE_5_15,
    ),
    Family(
        "Jamba (hybrid)",
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_dt_rank=8,
            mamba_expand=2,
        ),
        notes="Mamba layers: " + STATES.split(": ", 1)[1],
        older=STATES_BEFORE_5_15,
    ),
    Family(
        "LFM2 (hybrid)",
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(num_hidden_layers=4, full_attn_idxs=[1, 3], conv_L_cache=3),
        notes="short-convolution layers: their conv states in transformers' `LinearAttentionLayer`, the "
        "full-attention layers in pages",
        older=STATES_BEFORE_5_15,
    ),
    Family(
        "Falcon-H1 (hybrid)",
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8),
        notes="attention and a Mamba mixer in every layer: K/V in pages, the Mamba states beside them",
        older=STATES_BEFORE_5_15,
    ),
)


# -- the six modes ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mode:
    """A `generate` call (or two): prompts (row lengths; shorter rows left-padded), new tokens, extra args."""

    lengths: tuple[int, ...]
    new_tokens: int
    page_size: int = 4
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    beams: int = 1
    seed: int | None = None
    continue_tokens: int = 0  # a second generate of this many tokens from the first one's output and cache


MODE_SPECS: dict[str, Mode] = {
    "greedy": Mode((7, 7), 10),
    "batch": Mode((5, 9, 3), 10),
    "beam": Mode((6, 4), 8, beams=3, args=dict(num_beams=3)),
    "sample": Mode((7, 5), 10, seed=7, args=dict(do_sample=True)),
    "long": Mode((6,), 48),
    "continue": Mode((6, 6), 6, continue_tokens=6),
}


def prompts(mode: Mode) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts `[rows, width]` (ids >= 3: no special tokens) and their mask."""
    g = torch.Generator().manual_seed(sum(mode.lengths) * 31 + len(mode.lengths))
    width = max(mode.lengths)
    mask = (torch.arange(width)[None] >= width - torch.tensor(mode.lengths)[:, None]).long()
    return torch.randint(3, VOCAB, (len(mode.lengths), width), generator=g) * mask, mask


class Generated(NamedTuple):
    tokens: torch.Tensor  # [rows, prompt + new]
    logits: torch.Tensor  # [rows (beams included), new, vocab]: the model's raw logits at each step


def _generate(model, cache, ids, mask, mode: Mode, new_tokens: int) -> Generated:
    from torch_paged_kv.integrations.transformers import cache_kwarg

    if mode.seed is not None:
        torch.manual_seed(mode.seed)
    kwargs = dict(do_sample=False, pad_token_id=PAD, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    kwargs.update(return_dict_in_generate=True, output_logits=True, **mode.args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=mask, **{cache_kwarg(model): cache}, **kwargs)
    return Generated(out.sequences, torch.stack(out.logits, 1))


def run(model, cache_factory: Callable[[], Any], mode: Mode) -> list[Generated]:
    """The mode's generate call(s) with a fresh cache from `cache_factory`."""
    ids, mask = prompts(mode)
    cache = cache_factory()
    out = [_generate(model, cache, ids, mask, mode, mode.new_tokens)]
    if mode.continue_tokens:
        first = out[0].tokens
        longer = torch.cat([mask, torch.ones_like(first[:, mask.shape[1] :])], 1)
        out.append(_generate(model, cache, first, longer, mode, mode.continue_tokens))
    return out


def compare(got: list[Generated], expected: list[Generated]) -> str:
    """`EXACT` when every token is DynamicCache's and every logit within `LOGIT_TOLERANCE` of its
    (fp32 rounding: a different summation order); else what differs."""
    for g, e in zip(got, expected, strict=True):
        if not torch.equal(g.tokens, e.tokens):
            return "wrong tokens"
        error = (g.logits - e.logits).abs().max().item()
        if not error <= LOGIT_TOLERANCE * max(1.0, e.logits.abs().max().item()):
            return f"logits differ by {error:.2e}"
    return EXACT


def max_cache_len(mode: Mode) -> int:
    return max(mode.lengths) + mode.new_tokens + mode.continue_tokens


@dataclasses.dataclass
class CellResult:
    family: str
    column: str
    mode: str
    expected: Outcome
    got: str  # "exact", "refused (field)", or what went wrong
    seconds: float

    @property
    def ok(self) -> bool:
        return self.got == str(self.expected)


_models: dict[str, tuple[torch.nn.Module, str]] = {}
_references: dict[tuple[str, str, str], list[Generated]] = {}  # (family, mode, attention) -> the oracle's


def model_of(family: Family) -> tuple[torch.nn.Module, str]:
    """The family's tiny model (built once per process) and its default attention implementation."""
    if family.name not in _models:
        model = family.build()
        _models[family.name] = (model, model.config._attn_implementation)
    return _models[family.name]


def set_attention(model: torch.nn.Module, attn: str) -> None:
    """`model.set_attn_implementation(attn)`, and where transformers ignores the request (a model not
    on its attention interface), the config set by hand: what a config naming it looks like."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.set_attn_implementation(attn)
    if model.config._attn_implementation != attn:
        model.config._attn_implementation_internal = attn


def reference_cache(family: Family, model: torch.nn.Module, mode: Mode) -> Any:
    """A fresh cache of the family's `reference` kind for the mode (a StaticCache as long as the cell's
    PagedCache: the same key columns)."""
    from transformers import DynamicCache, StaticCache

    if family.reference == "StaticCache":
        return StaticCache(config=model.config, max_cache_len=max_cache_len(mode))
    return DynamicCache(config=model.config)


def run_cell(family: Family, column: str, mode_name: str) -> CellResult:
    """Runs one cell and reports what happened, as `str(outcome)` or a description of the failure."""
    mode = MODE_SPECS[mode_name]
    start = time.perf_counter()
    model, default_attn = model_of(family)
    expected = family.expected(column)
    reference_attn = default_attn if column == "default" else "eager"
    key = (family.name, mode_name, reference_attn)
    if key not in _references:
        try:
            set_attention(model, reference_attn)
            _references[key] = run(model, lambda: reference_cache(family, model, mode), mode)
        except Exception as e:  # the reference itself fails: the family's config is wrong here
            return CellResult(family.name, column, mode_name, expected, f"reference failed: {e!r}"[:300], 0.0)
        finally:
            set_attention(model, default_attn)
    caches: list[Any] = []
    try:
        got = compare(run_paged(model, column, mode, caches), _references[key])
    except ValueError as e:
        got = refusal(e, caches)
    except Exception as e:
        got = f"{type(e).__name__}: {e}"[:300]
    return CellResult(family.name, column, mode_name, expected, got, time.perf_counter() - start)


def run_paged(model, column: str, mode: Mode, caches: list) -> list[Generated]:
    """The mode's generate call(s) over a `PagedCache` (each one built is appended to `caches`) under
    the column's attention; the model's attention implementation is restored afterwards."""
    from torch_paged_kv.integrations.transformers import PagedCache

    default_attn = model.config._attn_implementation
    rows = len(mode.lengths) * mode.beams

    def paged_cache():
        caches.append(PagedCache(model.config, rows, max_cache_len(mode), page_size=mode.page_size))
        return caches[-1]

    try:
        set_attention(model, default_attn if column == "default" else "paged_kv")
        return run(model, paged_cache, mode)
    finally:
        set_attention(model, default_attn)


def refusal(error: ValueError, caches: list) -> str:
    """`str(Refused(field))` for a refusal naming `field:` before the first token (no step of the cache
    began); else what it was."""
    message = str(error)
    if stored(caches):
        return f"ValueError after tokens were stored: {message}"[:300]
    field = message.split(":", 1)[0]
    if " " in field or not (field.startswith("config") or field == "attn_implementation"):
        return f"ValueError naming no config field: {message}"[:300]
    return str(Refused(field))


def stored(caches: list) -> bool:
    """Whether a step of any of `caches` began (offsets written) or ended (lengths, column count advanced)."""
    for cache in caches:
        if cache.groups is None:
            continue
        if any(bool(c.cache_lengths.any() or c.input_row_offsets.any()) for c in cache.groups.collections):
            return True
        if int(cache.get_seq_length()):
            return True
    return False


# -- selections ------------------------------------------------------------------------------------
ALL_MODES_FAMILIES = ("Llama", "Gemma4 (text, K/V sharing)", "DeepSeek-V3 (MLA)", "Qwen3-Next (hybrid)")
"""Families run in every mode by the default test run: a plain model, K/V sharing, MLA, state layers."""


def ci_cells() -> list[tuple[Family, str, str]]:
    """The default test run: every family in greedy in both columns, every mode for `ALL_MODES_FAMILIES`."""
    return all_cells(modes=("greedy",)) + all_cells(ALL_MODES_FAMILIES, modes=MODES[1:])


def all_cells(families=None, columns=COLUMNS, modes=MODES, among=None) -> list[tuple[Any, str, str]]:
    """The cells of `families` (names; None: all) of `among` (default: `FAMILIES`; the VLM and audio
    matrices pass theirs)."""
    chosen = [f for f in (FAMILIES if among is None else among) if families is None or f.name in families]
    return [(f, c, m) for f in chosen for c in columns for m in modes]


# -- the docs table ----------------------------------------------------------------------------------
def markdown_table() -> str:
    """The "Supported models" table of docs/transformers.md, from the declarations above."""
    lines = [
        "| family | transformers config | default attention + `PagedCache` | `paged_kv` + `PagedCache` | notes |",
        "|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        cells = [
            _table_cell(getattr(f, c), [(str(b), getattr(b, c)) for b in f.older if getattr(b, c) is not None])
            for c in COLUMNS
        ]
        lines.append(f"| {f.name} | `{f.config}` | {cells[0]} | {cells[1]} | {f.notes} |")
    return "\n".join(lines) + "\n"


def _table_cell(outcome: Outcome, older: Sequence[tuple[str, Outcome]] = ()) -> str:
    """The newest outcome, then what older transformers give where that differs."""
    text = "exact" if outcome == EXACT else f"refused: `{outcome.field}`"
    return text + "".join(f"; {when}: {_table_cell(o)}" for when, o in older)


def command_line(
    doc: str,
    modes: Sequence[str],
    table: Callable[[], str],
    cells: Callable[[Any, Sequence[str], Sequence[str]], list[tuple[Any, str, str]]],
    run: Callable[[Any, str, str], CellResult],
) -> int:
    """A matrix's command line (`--family`, `--mode`, `--column`, `--markdown`): `table()` printed, or the
    chosen `cells(families, columns, modes)` run (`run`) and judged; exit status 1 on any undeclared."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--family", action="append", help="family name (repeatable); default: all")
    parser.add_argument("--mode", action="append", choices=modes)
    parser.add_argument("--column", action="append", choices=COLUMNS)
    parser.add_argument("--markdown", action="store_true", help="print the docs table and exit")
    args = parser.parse_args()
    if args.markdown:
        print(table(), end="")
        return 0
    import torch_paged_kv.integrations.transformers  # noqa: F401  (registers paged_kv)

    torch.set_num_threads(1)  # tiny models: threads only add synchronisation (and spin on a busy machine)
    chosen = [cell for cell in cells(args.family, args.column or COLUMNS, args.mode or modes) if cell[0].available()]
    width = max((len(f.name) for f, _, _ in chosen), default=0)
    failures = 0
    for family, column, mode in chosen:
        result = run(family, column, mode)
        failures += not result.ok
        flag = "ok  " if result.ok else "FAIL"
        print(f"{flag} {family.name:{width}} {column:8} {mode:8} {result.got} ({result.seconds:.1f}s)", flush=True)
    print(f"{len(chosen) - failures} of {len(chosen)} cells as declared")
    return 1 if failures else 0


def main() -> int:
    return command_line(__doc__ or "", MODES, markdown_table, all_cells, run_cell)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
