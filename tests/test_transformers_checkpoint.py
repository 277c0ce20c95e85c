"""`PagedCache.save` / `PagedCache.load`: generate, save, load in a new process, generate on; the
tokens are those of an uninterrupted run (both attention paths, FP8 included), also for a model of
sliding-window and full layers whose rows cross the window before and after the save."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from hf_models import tiny_llama
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaForCausalLM

import torch_paged_kv as pk
from torch_paged_kv.__main__ import main as cli
from torch_paged_kv.checkpoint import CheckpointError
from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg

HERE = Path(__file__).resolve().parent
LENGTHS = [5, 9, 3, 7]  # uneven prompts, left-padded to 9
FIRST, MORE = 6, 10  # new tokens before and after the save
GREEDY = dict(do_sample=False, pad_token_id=0)
CASES = {  # name -> (attn_implementation, kv_dtype)
    "paged_kv": ("paged_kv", None),
    "sdpa": ("sdpa", None),
    "paged_kv-fp8": ("paged_kv", torch.float8_e4m3fn),
    "sdpa-fp8": ("sdpa", torch.float8_e4m3fn),
}


def tiny_model() -> LlamaForCausalLM:
    """The same weights in every process (seeded)."""
    return tiny_llama()


WINDOW = 6  # the hybrid model's: rows of 3..9 prompt tokens cross it before the save


def hybrid_model() -> Gemma3ForCausalLM:
    """Layers 0 and 1 attend within a window of `WINDOW`, layer 2 fully (seeded, as `tiny_model`)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=3,
        max_position_embeddings=128, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    return Gemma3ForCausalLM(config).eval()


MODELS = {"llama": tiny_model, "hybrid": hybrid_model}


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None] >= width - torch.tensor(LENGTHS)[:, None]).long()
    return torch.randint(1, 512, (len(LENGTHS), width), generator=g) * mask, mask


def generate(model, ids, mask, cache, new_tokens: int) -> torch.Tensor:
    return model.generate(
        ids,
        attention_mask=mask,
        **{cache_kwarg(model): cache},
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        **GREEDY,
    )


def resume(directory: str, model_name: str) -> None:
    """The new process: load each saved cache and generate `MORE` tokens after the saved ones; what the
    loaded cache held before its first step goes to `{name}.held.json`."""
    model, directory = MODELS[model_name](), Path(directory)
    for name, (attn, _) in CASES.items():
        model.set_attn_implementation(attn)
        so_far = torch.load(directory / f"{name}.pt")
        cache = PagedCache.load(directory / f"{name}.safetensors", model.config, max_cache_len=32)
        (directory / f"{name}.held.json").write_text(json.dumps(cache.kv_bytes_in_use()))
        mask = (so_far != 0).long()  # prompt padding is token 0; generated tokens here are never 0
        torch.save(generate(model, so_far, mask, cache, MORE), directory / f"{name}.out.pt")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_model()


def held_by_every_layer_full(cache: PagedCache) -> int:
    """The bytes `cache`'s rows would hold if no layer group dropped a page (every layer full)."""
    lengths = cache.groups.collections[0].cache_lengths[: cache.rows].tolist()
    pages = sum(-(-n // cache.page_size) for n in lengths)
    return pages * sum(p.page_bytes for p in cache.groups.params)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_generation_resumes_in_a_new_process_exactly(model_name, tmp_path):
    model = MODELS[model_name]()
    ids, mask = prompts()
    expected, held = {}, {}
    for name, (attn, kv_dtype) in CASES.items():
        model.set_attn_implementation(attn)
        expected[name] = generate(model, ids, mask, PagedCache(model.config, 4, 32, 4, kv_dtype=kv_dtype), FIRST + MORE)
        cache = PagedCache(model.config, 4, 24, 4, kv_dtype=kv_dtype)
        so_far = generate(model, ids, mask, cache, FIRST)
        assert bool((so_far[:, ids.shape[1] :] != 0).all())  # the child's mask rule holds
        cache.save(tmp_path / f"{name}.safetensors")
        torch.save(so_far, tmp_path / f"{name}.pt")
        held[name] = cache.kv_bytes_in_use()
        if model_name == "hybrid":  # the sliding group dropped pages, and the file stores none of them
            assert len(cache.groups) == 2 and cache.groups.params[0].sliding_window == WINDOW
            assert held[name] < held_by_every_layer_full(cache)
            info = pk.checkpoint.read_info(tmp_path / f"{name}.safetensors")
            firsts = info.first_held_per_row(0)
            assert max(firsts) > 0 and info.groups[0].num_pages < info.groups[1].num_pages
            for row, first in zip(info.groups[0].lookup_table, firsts, strict=True):
                assert not row[:first].any()  # the null page below the window
    model.set_attn_implementation("sdpa")
    dynamic = generate(model, ids, mask, DynamicCache(config=model.config), FIRST + MORE)
    assert torch.equal(expected["paged_kv"], dynamic) and torch.equal(expected["sdpa"], dynamic)
    child = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import {Path(__file__).stem} as t; "
        "t.resume(sys.argv[1], sys.argv[2])"
    )
    done = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path), model_name], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in CASES:
        assert torch.equal(torch.load(tmp_path / f"{name}.out.pt"), expected[name]), name
        assert json.loads((tmp_path / f"{name}.held.json").read_text()) == held[name], name


def test_saved_cache_is_an_ordinary_checkpoint(model, tmp_path, capsys):
    """`inspect` describes and verifies the file; `load_cache` reads it; the cache's state is in the metadata."""
    ids, mask = prompts()
    model.set_attn_implementation("paged_kv")
    cache = PagedCache(model.config, 4, 24, 4)
    generate(model, ids, mask, cache, 3)
    path = tmp_path / "kv.safetensors"
    cache.save(path, metadata={"prompt": "four rows"})
    assert cli(["inspect", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "checksums:  OK" in shown and "'prompt': 'four rows'" in shown
    lines = shown.splitlines()
    table = lines[lines.index("  row  cache_length  pages") + 1 :][: len(LENGTHS)]  # the rows' lengths
    assert [line.split()[1] for line in table] == [str(n + 2) for n in LENGTHS]
    loaded = pk.load_cache(path)
    assert loaded.cache_lengths.tolist() == [n + 2 for n in LENGTHS]
    state = json.loads(pk.checkpoint.read_info(path).user_metadata["torch_paged_kv.transformers"])
    assert state == {"columns": 11, "dtype": "float32", "real_tokens_only": True}


def test_what_cannot_be_saved_or_resumed_is_refused(model, tmp_path):
    ids, mask = prompts()
    model.set_attn_implementation("paged_kv")
    cache = PagedCache(model.config, 4, 24, 4)
    with pytest.raises(ValueError, match="^cache: nothing to save"):
        cache.save(tmp_path / "empty.safetensors")
    generate(model, ids, mask, cache, 3)
    with pytest.raises(ValueError, match="^metadata: the key 'torch_paged_kv.transformers'"):
        cache.save(tmp_path / "x.safetensors", metadata={"torch_paged_kv.transformers": "{}"})
    path = tmp_path / "kv.safetensors"
    cache.save(path)
    with pytest.raises(ValueError, match="^max_cache_len: the file holds rows of 11 columns, more than 10"):
        PagedCache.load(path, model.config, max_cache_len=10)
    with pytest.raises(ValueError, match="^max_batch_size: the file holds 4 rows, more than 2"):
        PagedCache.load(path, model.config, max_batch_size=2)
    with pytest.raises(ValueError, match="^device, dtype: loading allocates the pool now"):
        PagedCache.load(path, model.config, device=None)
    with pytest.raises(CheckpointError, match="page_size=8"):
        PagedCache.load(path, model.config, page_size=8)
    model.set_attn_implementation("sdpa")  # left padding was never stored: columns cannot be rebuilt
    with pytest.raises(ValueError, match="^config: the cache was filled under paged_kv"):
        PagedCache.load(path, model.config)
    model.set_attn_implementation("paged_kv")
    pk.save_cache(cache.collection, tmp_path / "plain.safetensors")
    with pytest.raises(CheckpointError, match="not a saved PagedCache"):
        PagedCache.load(tmp_path / "plain.safetensors", model.config)
