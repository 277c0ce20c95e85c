"""Audio-language models through `PagedCache`: a subset of the audio matrix (tests/audio_matrix.py).

Qwen2-Audio, Voxtral, Granite-Speech and AudioFlamingo3 in both columns, greedy and as a left-padded batch
(Qwen2-Audio also continued from its cache), and the hybrid Nemotron-3.5-Transcribe greedy. The whole
matrix: `python tests/audio_matrix.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import audio_matrix as am
import transformers
import vlm_matrix as vm
from packaging.version import Version

if Version(transformers.__version__) < Version(am.SINCE):
    pytest.skip(
        f"the audio matrix is declared for transformers >= {am.SINCE}, the only version it was run on (Granite-"
        "Speech-Plus, Nemotron-3.5-Transcribe and others are new in it)",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[1]
TABLE_START, TABLE_END = "<!-- audio-models: start -->\n", "<!-- audio-models: end -->"
CI_FAMILIES = ("Qwen2-Audio", "Voxtral", "Granite-Speech", "AudioFlamingo3")
SHORTER_AUDIO = ("Qwen2-Audio", "AudioFlamingo3")  # a feature mask: the batch's second audio is padded
CELLS = (
    vm.all_cells(CI_FAMILIES, modes=("greedy", "batch"), among=am.FAMILIES)
    + vm.all_cells(("Qwen2-Audio",), modes=("continue",), among=am.FAMILIES)
    + vm.all_cells(("Nemotron-3.5-Transcribe",), modes=("greedy",), among=am.FAMILIES)
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models


def family(name: str) -> vm.VisionFamily:
    return next(f for f in am.FAMILIES if f.name == name)


@pytest.mark.parametrize(
    "f, column, mode",
    [pytest.param(f, c, m) for f, c, m in CELLS],
    ids=[f"{f.name}-{c}-{m}" for f, c, m in CELLS],
)
def test_matrix_cell(f, column, mode):
    """DynamicCache's tokens and logits, or the declared refusal before anything is stored."""
    if not f.available():
        pytest.skip(f"this transformers has no {f.model}")
    import torch_paged_kv.integrations.transformers  # noqa: F401  (registers paged_kv)

    result = vm.run_cell(f, column, mode)
    assert result.ok, f"expected {result.expected}, got {result.got}"


@pytest.mark.parametrize("name", CI_FAMILIES)
def test_the_audio_reaches_the_text(name):
    """Each family's audio goes through its encoder into the prompt: other features, other logits."""
    assert vm.image_reaches(family(name)) is None


def test_an_ignored_audio_is_caught():
    """The audio check fails where the features do not matter (here: the same features for both draws)."""
    voxtral = family("Voxtral")
    same = dataclasses.replace(voxtral.images, pixels=lambda rows, g: voxtral.images.pixels(rows, torch.Generator()))
    deaf = dataclasses.replace(voxtral, name="Voxtral (same features)", images=same)
    assert vm.image_reaches(deaf).startswith("audio ignored")
    assert vm.run_cell(deaf, "paged_kv", "greedy").got.startswith("audio ignored")


@pytest.mark.parametrize("name", CI_FAMILIES)
def test_paged_kv_attends_from_the_pages(name):
    """The paged_kv cells run paged_kv in the text model (Granite-Speech's encoder is off transformers'
    attention interface: the attention is set on its config, as a config naming it is)."""
    import torch_paged_kv.integrations.transformers  # noqa: F401  (registers paged_kv)

    f = family(name)
    model, _ = vm.model_of(f)
    caches: list = []
    vm.run_paged(f, model, "paged_kv", vm.MODE_SPECS["greedy"], caches)
    assert caches[0].attends_from_pages


@pytest.mark.parametrize("name", SHORTER_AUDIO)
def test_an_unmasked_encoder_is_caught(name):
    """The batch cells are not vacuous: were paged_kv's mask function to drop the encoder's padding mask (of
    the shorter audio), the paged_kv batch cell would give other tokens."""
    from transformers.masking_utils import AttentionMaskInterface

    import torch_paged_kv.integrations.transformers as paged
    from torch_paged_kv.integrations.hf_attention import mask_parts

    def unmasked_encoders(*args, mask_function=None, **kwargs):
        if mask_function is not None and "causal_mask_function" not in mask_parts(mask_function):
            return None  # (an encoder's bidirectional padding mask, dropped)
        return paged.paged_kv_mask(*args, mask_function=mask_function, **kwargs)

    AttentionMaskInterface.register(paged.ATTN_IMPLEMENTATION, unmasked_encoders)
    try:
        assert vm.run_cell(family(name), "paged_kv", "batch").got == "wrong tokens"
    finally:
        AttentionMaskInterface.register(paged.ATTN_IMPLEMENTATION, paged.paged_kv_mask)


def test_paged_kv_for_the_text_model_only_is_exact():
    """`paged_kv` for the text model only, `sdpa` for the audio encoder (a dict of implementations): a padded
    batch with audio gives eager DynamicCache's tokens and logits."""
    from transformers import DynamicCache

    import torch_paged_kv.integrations.transformers as paged

    f = family("Qwen2-Audio")
    model, default_attn = vm.model_of(f)
    mode = vm.MODE_SPECS["batch"]
    vm.set_attention(model, "eager")
    try:
        expected = vm.run(f, model, DynamicCache(config=model.config), mode)
        model.set_attn_implementation({"text_config": "paged_kv", "audio_config": "sdpa"})
        cache = paged.PagedCache(model.config, len(mode.rows), vm.max_cache_len(f, mode), page_size=4)
        assert vm.compare(vm.run(f, model, cache, mode), expected) == vm.EXACT
        assert cache.attends_from_pages
    finally:
        vm.set_attention(model, default_attn)


def test_docs_table_is_the_matrix_declarations():
    """docs/transformers.md's "Audio-language models" table is `python tests/audio_matrix.py --markdown`."""
    docs = (ROOT / "docs" / "transformers.md").read_text()
    start, end = docs.index(TABLE_START) + len(TABLE_START), docs.index(TABLE_END)
    assert docs[start:end] == vm.markdown_table(am.FAMILIES), "regenerate it: python tests/audio_matrix.py --markdown"
