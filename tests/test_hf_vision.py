"""Vision-language models through `PagedCache`: a subset of the VLM matrix (tests/vlm_matrix.py).

Each kind of mask overlay (Gemma3's bidirectional image blocks, PaliGemma's prefix-LM, Gemma4's
`use_bidirectional_attention="vision"`, Molmo2's bidirectional image tokens), M-RoPE (Qwen2-VL) and a
plain LLaVA, in both columns, greedy and as a left-padded batch (Qwen2-VL also continued from its cache).
The whole matrix: `python tests/vlm_matrix.py`.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers
import vlm_matrix as vm
from packaging.version import Version

if Version(transformers.__version__) < Version(vm.SINCE):
    pytest.skip(
        f"the VLM matrix is declared for transformers >= {vm.SINCE} (on 5.17 transformers' own StaticCache "
        "gives Gemma4 with an image other tokens than DynamicCache, and Molmo2 does not exist)",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[1]
TABLE_START, TABLE_END = "<!-- vision-models: start -->\n", "<!-- vision-models: end -->"
OVERLAYS = ("Gemma3", "PaliGemma", "Gemma4", "Gemma4 (K/V sharing)", "Molmo2")
CI_FAMILIES = (*OVERLAYS, "Qwen2-VL", "LLaVA")
CELLS = vm.all_cells(CI_FAMILIES, modes=("greedy", "batch")) + vm.all_cells(("Qwen2-VL",), modes=("continue",))


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models


def family(name: str) -> vm.VisionFamily:
    return next(f for f in vm.FAMILIES if f.name == name)


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
def test_the_image_reaches_the_text(name):
    """Each family's image goes through its vision tower into the prompt: other pixels, other logits."""
    assert vm.image_reaches(family(name)) is None


def test_an_ignored_image_is_caught():
    """The image check fails where the pixels do not matter (here: the same pixels for both draws)."""
    llava = family("LLaVA")
    same = dataclasses.replace(llava.images, pixels=lambda rows, g: llava.images.pixels(rows, torch.Generator()))
    blind = dataclasses.replace(llava, name="LLaVA (same pixels)", images=same)
    assert vm.image_reaches(blind).startswith("image ignored")
    assert vm.run_cell(blind, "default", "greedy").got.startswith("image ignored")


def logits(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(**inputs).logits


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlays_change_the_logits(name):
    """The overlay families' cells are not vacuous: without their token types (no overlay) the eager logits
    of a padded batch differ."""
    f = family(name)
    model, default_attn = vm.model_of(f)
    inputs = vm.prompts(f, vm.MODE_SPECS["batch"])
    types = set(f.images.extra(inputs["input_ids"]))
    vm.set_attention(model, "eager")
    try:
        change = logits(model, inputs) - logits(model, {k: v for k, v in inputs.items() if k not in types})
    finally:
        vm.set_attention(model, default_attn)
    assert change.abs().max() > 0.1


def test_mrope_positions_change_the_logits():
    """Qwen2-VL's cells are not vacuous: plain 1-D positions instead of its 3-D ones give other logits."""
    f = family("Qwen2-VL")
    model, _ = vm.model_of(f)
    inputs = vm.prompts(f, vm.MODE_SPECS["batch"])
    mask = inputs["attention_mask"]
    flat = ((mask.cumsum(-1) - 1).clamp(min=0))[None].expand(3, -1, -1)
    change = logits(model, inputs) - logits(model, {**inputs, "position_ids": flat})
    assert change.abs().max() > 0.1


@pytest.mark.parametrize("name", ["LLaVA", "Gemma3"])
def test_paged_kv_for_the_text_model_only_is_exact(name):
    """`paged_kv` for the text model only, `sdpa` for the vision tower (a dict of implementations): a
    padded batch with images gives eager DynamicCache's tokens and logits."""
    from transformers import DynamicCache

    import torch_paged_kv.integrations.transformers as paged

    f = family(name)
    model, default_attn = vm.model_of(f)
    mode = vm.MODE_SPECS["batch"]
    vm.set_attention(model, "eager")
    try:
        expected = vm.run(f, model, DynamicCache(config=model.config), mode)
        model.set_attn_implementation({"text_config": "paged_kv", "vision_config": "sdpa"})
        cache = paged.PagedCache(model.config, len(mode.rows), vm.max_cache_len(f, mode), page_size=4)
        assert vm.compare(vm.run(f, model, cache, mode), expected) == vm.EXACT
        assert cache.attends_from_pages
    finally:
        vm.set_attention(model, default_attn)


def test_docs_table_is_the_matrix_declarations():
    """docs/transformers.md's "Vision-language models" table is `python tests/vlm_matrix.py --markdown`."""
    docs = (ROOT / "docs" / "transformers.md").read_text()
    start, end = docs.index(TABLE_START) + len(TABLE_START), docs.index(TABLE_END)
    assert docs[start:end] == vm.markdown_table(), "regenerate it: python tests/vlm_matrix.py --markdown"
