"""`PagedCache.save` / `PagedCache.load` of hybrid models: the state layers' conv and recurrent states
travel as extra tensors of the checkpoint, so `generate` resumes exactly; the oracle is one
uninterrupted `generate` over transformers' `DynamicCache`. Damaged or mismatched files are refused
before anything is loaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import crafted_files
import pytest
import torch

pytest.importorskip("transformers")
from test_hf_states import FALCON_H1, QWEN3_NEXT, dynamic, family_model, generate, go_on

from torch_paged_kv import __main__ as cli
from torch_paged_kv.checkpoint import CheckpointError, read_extra_tensors, read_info
from torch_paged_kv.integrations import hf_checkpoint, hf_support
from torch_paged_kv.integrations.hf_checkpoint import METADATA_KEY
from torch_paged_kv.integrations.transformers import PagedCache

pytestmark = pytest.mark.skipif(
    hf_support._older_than(hf_support.STATE_LAYERS_SINCE),
    reason=f"state layers are refused before transformers {hf_support.STATE_LAYERS_SINCE} (test_model_families)",
)
LENGTHS = (5, 7)  # two left-padded prompts
FIRST, MORE = 4, 5  # new tokens before and after the save


def saved(model, path: Path) -> tuple[PagedCache, torch.Tensor]:
    """A cache after `FIRST` new tokens of `LENGTHS`, saved to `path`, and the tokens so far."""
    cache = PagedCache(model.config, max_batch_size=2, max_cache_len=24, page_size=4)
    so_far = generate(model, cache, LENGTHS, FIRST)
    cache.save(path)
    return cache, so_far


def states(cache: PagedCache) -> dict[tuple[int, int, str], torch.Tensor]:
    """Every initialized state of the cache's state layers."""
    held = {}
    for i in cache.state_layers:
        layer = cache.layers[i]
        for s in range(layer.number_of_states):
            conv, recurrent = layer.saved_states(s)
            held.update({(i, s, k): t.clone() for k, t in (("conv", conv), ("recurrent", recurrent)) if t is not None})
    return held


@pytest.mark.parametrize("attn", ["sdpa", "paged_kv"])
@pytest.mark.parametrize("family", [QWEN3_NEXT, FALCON_H1])
def test_generation_resumes_exactly_after_save_and_load(family, attn, tmp_path):
    """Generate, save, load into a fresh cache, generate on: the tokens of one uninterrupted
    `generate` over DynamicCache, with every state restored bit for bit (flags included)."""
    model = family_model(family, attn)
    expected = dynamic(model, LENGTHS, FIRST + MORE)
    cache, so_far = saved(model, tmp_path / "kv.safetensors")
    before = states(cache)
    assert before and all(t.shape[0] == len(LENGTHS) for t in before.values())
    loaded = PagedCache.load(tmp_path / "kv.safetensors", model.config)
    assert loaded.state_layers == cache.state_layers
    after = states(loaded)
    assert after.keys() == before.keys()
    for key, t in before.items():
        assert after[key].dtype == t.dtype and torch.equal(after[key], t), key
    for i in cache.state_layers:
        old, new = cache.layers[i], loaded.layers[i]
        assert new.has_previous_state == old.has_previous_state and new.conv_kernel_size == old.conv_kernel_size
        assert all(new.has_previous_state.values())
    assert torch.equal(go_on(model, loaded, so_far, LENGTHS, MORE), expected)


def test_the_file_lists_the_states_as_extra_tensors(tmp_path, capsys):
    """An ordinary checkpoint (format version 5): `inspect` lists the states, `verify` checks them, and
    the cache's metadata says what restores them."""
    model = family_model(QWEN3_NEXT, "paged_kv")
    cache, _ = saved(model, tmp_path / "kv.safetensors")
    info = read_info(tmp_path / "kv.safetensors")
    assert info.metadata["format_version"] == "5"
    names = {f"extra.states.{i}.0.{k}" for i in cache.state_layers for k in ("conv", "recurrent")}
    assert set(info.extra_tensors) == names
    held = read_extra_tensors(info)
    for i in cache.state_layers:
        conv, recurrent = cache.layers[i].saved_states(0)
        assert torch.equal(held[f"extra.states.{i}.0.conv"], conv)
        assert torch.equal(held[f"extra.states.{i}.0.recurrent"], recurrent)
    state = json.loads(info.user_metadata[METADATA_KEY])
    assert state["state_layers"] == [[i, 1] for i in cache.state_layers]
    kernel = cache.layers[0].conv_kernel_size[0]
    assert state["states"][0] == {
        "layer": 0, "state": 0, "conv": True, "recurrent": True, "conv_kernel_size": kernel, "has_previous_state": True
    }  # fmt: skip
    assert cli.main(["inspect", str(tmp_path / "kv.safetensors")]) == 0
    shown = capsys.readouterr().out
    assert "extra:      6 tensor(s) in the main file" in shown
    assert "checksums:  OK (9 tensors" in shown  # lengths, table, pages, 6 states
    conv = cache.layers[0].saved_states(0)[0]
    assert f"  extra.states.0.0.conv float32{list(conv.shape)}" in shown


@pytest.fixture
def no_pages_loaded(monkeypatch):
    """`load_pages` fails the test: a refusal must come before any page is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("pages were loaded before the refusal")

    monkeypatch.setattr(hf_checkpoint, "load_pages", refuse)


def _data_offset(path: Path, name: str) -> int:
    header, _ = crafted_files.split(path.read_bytes())
    return 8 + int.from_bytes(path.read_bytes()[:8], "little") + header[name]["data_offsets"][0]


def _reshape(name: str):
    """An edit giving extra tensor `name` one row and the rest in its last dim, in the header and the
    metadata alike (the same bytes: only the cache's own check can tell)."""

    def edit(header):
        shape = header[name]["shape"]
        shape[:] = [1, *shape[1:-1], shape[-1] * shape[0]]
        meta = header["__metadata__"]
        extras = json.loads(meta["extra_tensors"])
        extras[name]["shape"] = shape
        meta["extra_tensors"] = json.dumps(extras)

    return edit


def _drop_from_metadata(name: str):
    def edit(header):
        meta = header["__metadata__"]
        state = json.loads(json.loads(meta["user_metadata"])[METADATA_KEY])
        state["states"] = [e for e in state["states"] if f"extra.states.{e['layer']}.{e['state']}.conv" != name]
        meta["user_metadata"] = json.dumps({METADATA_KEY: json.dumps(state)})

    return edit


def _rename(name: str):
    def edit(header):
        header[name + "x"] = header.pop(name)

    return edit


def _retype(name: str):
    def edit(header):
        header[name]["dtype"] = "I32"

    return edit


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", "checksum mismatch in tensor 'extra.states.1.0.recurrent'"),
        ("reshape", "extra.states.1.0.recurrent is \\[1, .*expected \\[2 rows"),
        ("retype", "extra tensor 'extra.states.1.0.recurrent' is I32.*says F32"),
        ("rename", "extra tensor 'extra.states.1.0.recurrent' listed in metadata field 'extra_tensors' is missing"),
        ("unlisted", "lists the extra tensors .* the file holds"),
    ],
)
def test_damaged_states_are_refused_before_anything_is_loaded(tmp_path, no_pages_loaded, damage, message):
    model = family_model(QWEN3_NEXT, "sdpa")
    path = tmp_path / "kv.safetensors"
    saved(model, path)
    name = "extra.states.1.0.recurrent"
    if damage == "flip":  # the bytes, not the header: its checksum still holds
        raw = bytearray(path.read_bytes())
        raw[_data_offset(path, name) + 5] ^= 0x10
        path.write_bytes(bytes(raw))
    elif damage == "reshape":
        crafted_files.rewrite(path, _reshape(name))
    elif damage == "retype":
        crafted_files.rewrite(path, _retype(name))
    elif damage == "rename":
        crafted_files.rewrite(path, _rename(name))
    else:  # the states of layer 1 left out of the cache's metadata: their tensors belong to nothing
        crafted_files.rewrite(path, _drop_from_metadata("extra.states.1.0.conv"))
    with pytest.raises(CheckpointError, match=message) as error:
        PagedCache.load(path, model.config)
    assert str(path) in str(error.value)


def test_a_config_with_other_state_layers_is_refused(tmp_path, no_pages_loaded):
    """The same pool (one full-attention layer), but the linear-attention layers elsewhere: refused
    naming both lists; a file without state layers into a model with them too."""
    model = family_model(QWEN3_NEXT, "sdpa")
    path = tmp_path / "kv.safetensors"
    saved(model, path)
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.layer_types = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]
    both = re.escape("[[0, 1], [1, 1], [2, 1]], but this config makes [[1, 1], [2, 1], [3, 1]]")
    with pytest.raises(CheckpointError, match=f"state layers .* {both}"):
        PagedCache.load(path, config)

    attention_only = config.__class__.from_dict(
        {**config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]}
    )  # the same pool, no state layers
    torch.manual_seed(0)
    small = type(model)(attention_only).eval()
    small.set_attn_implementation("sdpa")
    saved(small, tmp_path / "attention_only.safetensors")
    assert "extra_tensors" not in read_info(tmp_path / "attention_only.safetensors").metadata
    with pytest.raises(CheckpointError, match="state layers .* \\[\\], but this config makes \\[\\[0, 1\\]"):
        PagedCache.load(tmp_path / "attention_only.safetensors", model.config)


def test_a_file_of_more_states_per_layer_is_refused(tmp_path, no_pages_loaded):
    model = family_model(QWEN3_NEXT, "sdpa")
    path = tmp_path / "kv.safetensors"
    saved(model, path)

    def two_states(header):
        meta = header["__metadata__"]
        state = json.loads(json.loads(meta["user_metadata"])[METADATA_KEY])
        state["state_layers"] = [[i, 2] for i, _ in state["state_layers"]]
        meta["user_metadata"] = json.dumps({METADATA_KEY: json.dumps(state)})

    crafted_files.rewrite(path, two_states)
    with pytest.raises(CheckpointError, match="\\[\\[0, 2\\], \\[1, 2\\], \\[2, 2\\]\\], but this config makes"):
        PagedCache.load(path, model.config)
