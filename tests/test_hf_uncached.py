"""`paged_kv` with no cache (`use_cache=False`: a scoring pass, a vision tower, an encoder) against the
family's own eager attention (the matrix's oracle for `paged_kv`; `sdpa` drops softcaps): logits of a
left-padded batch within the matrix's tolerance on the real rows, sliding windows, softcapping, sinks
and chunks applied as transformers applies them; or a clear refusal. The matrix
(tests/transformers_matrix.py) covers generation with a cache."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers_matrix as matrix

import torch_paged_kv.integrations.transformers  # noqa: F401  (registers paged_kv)

CI_FAMILIES = (
    "Llama",  # plain causal
    "Gemma2",  # sliding window and softcapped scores
    "GPT-OSS",  # sinks and a sliding window
    "Llama4 (text)",  # chunked layers, counted from each row's first real column
    "DeepSeek-V3 (MLA)",
)
NOT_ON_INTERFACE = ("Falcon", "MPT")  # their attention is their own: paged_kv would change only their masks


def _families(names):
    by_name = {f.name: f for f in matrix.FAMILIES}
    return [pytest.param(by_name[n], id=n) for n in names if by_name[n].available()]


def _logits(model, attn: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    matrix.set_attention(model, attn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _check(family: matrix.Family) -> None:
    model, default = matrix.model_of(family)
    ids, mask = matrix.prompts(matrix.Mode((5, 12, 3), 0))  # (rows longer than the windows and chunks of 8)
    try:
        with torch.no_grad():
            expected = _logits(model, "eager", ids, mask)
            got = _logits(model, "paged_kv", ids, mask)
    finally:
        matrix.set_attention(model, default)
    real = mask.bool()
    error = (got - expected)[real].abs().max().item()
    assert error <= matrix.LOGIT_TOLERANCE * max(1.0, expected[real].abs().max().item()), error


@pytest.mark.parametrize("family", _families(CI_FAMILIES))
def test_a_forward_with_no_cache_is_the_models_own_attention(family):
    _check(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", _families([f.name for f in matrix.FAMILIES if f.name not in NOT_ON_INTERFACE]))
def test_every_family_with_no_cache(family):
    _check(family)


@pytest.mark.parametrize("family", _families(NOT_ON_INTERFACE))
def test_a_model_off_the_attention_interface_is_refused_with_no_cache(family):
    model, default = matrix.model_of(family)
    ids, mask = matrix.prompts(matrix.Mode((5, 3), 0))
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="config.model_type"):
            _logits(model, "paged_kv", ids, mask)
    finally:
        matrix.set_attention(model, default)


def test_a_tensor_paged_kv_does_not_apply_is_refused():
    """T5's relative `position_bias` reaches the attention as a keyword; ignoring it would change the
    outputs, so the first attention call refuses it naming `attn_implementation`."""
    from transformers import T5Config, T5EncoderModel

    if not T5EncoderModel._can_set_attn_implementation():
        pytest.skip("this transformers' T5 runs its own attention code, not the attention interface")
    torch.manual_seed(0)
    model = T5EncoderModel(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)).eval()
    ids = torch.randint(0, 100, (1, 7))
    matrix.set_attention(model, "paged_kv")
    with torch.no_grad(), pytest.raises(ValueError, match="attn_implementation: .*position_bias"):
        model(input_ids=ids)
