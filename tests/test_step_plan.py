"""`StepPlan`: the first layer checks the step in full (eager: the ops' checks without the
dispatcher); later eager layers call the kernel the first layer ran, after the checks of what
changes per layer, unless something watches the ops."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_paged_kv as pk
from torch_paged_kv.step import _eager_plain
from torch_paged_kv.testing import attention_fp64, make_paged_batch

LAYERS = 3


def _step_over_layers(plan: pk.StepPlan, batches) -> list[torch.Tensor]:
    outs = []
    for layer, b in enumerate(batches):
        plan.store_kv(b.new_keys, b.new_values, layer)
        outs.append(plan.flash_attention(b.q, layer, 0.3, True, 9, 0.0))
    return outs


def _batches(backend_dtype=torch.float32):
    """One batch per layer sharing one pool and one set of step tensors (only K/V/q differ)."""
    shared = make_paged_batch([5, 0, 17], [1, 4, 1], page_size=4, num_layers=LAYERS, layer_idx=0, seed=0)
    batches = [shared]
    for layer in range(1, LAYERS):
        b = make_paged_batch([5, 0, 17], [1, 4, 1], page_size=4, num_layers=LAYERS, layer_idx=layer, seed=layer)
        # the same pages and step tensors as layer 0, this layer's cached tokens written in
        pages = shared.blocks[:, :, layer]
        pages.zero_()
        for s, cached in enumerate([5, 0, 17]):
            pos = torch.arange(cached)
            slots = shared.lookup_table[s, pos // 4].long()
            pages[slots, 0, pos % 4] = b.keys[s][:cached]
            pages[slots, 1, pos % 4] = b.values[s][:cached]
        batches.append(b)
    return shared, batches


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_later_layers_call_the_first_layers_kernel(force_backend, backend):
    force_backend(backend)
    shared, batches = _batches()
    plan = pk.StepPlan(shared.blocks, pk.StepTensors(*shared.step))
    outs = _step_over_layers(plan, batches)
    assert sorted(variant[0] for variant in plan.kernels) == ["flash_attention", "store_kv"]  # one kept each
    for b, out in zip(batches, outs, strict=True):
        ref = attention_fp64(b.q, b.keys, b.values, [5, 0, 17], 0.3, True, 9)
        assert (out.double() - ref).abs().max() < 2e-5


class Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "paged_kv":
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_every_layers_ops():
    shared, batches = _batches()
    plan = pk.StepPlan(shared.blocks, pk.StepTensors(*shared.step))
    with Seen() as seen:
        _step_over_layers(plan, batches)
    assert seen.ops == ["paged_kv.store_kv.default", "paged_kv.flash_attention.default"] + [
        "paged_kv.store_kv.unchecked",
        "paged_kv.flash_attention.unchecked",
    ] * (LAYERS - 1)


class Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Subclass(torch.Tensor):
    pass


def test_the_private_torch_apis_of_the_eager_fast_path_still_answer():
    """`step._eager_plain` reads three private torch APIs (see its comment): each must still exist
    and say whether a torch function mode, a dispatch mode or a profiler is active."""
    assert isinstance(torch._C._is_torch_function_mode_enabled(), bool)
    assert isinstance(torch._C._len_torch_dispatch_stack(), int)
    assert torch.autograd.profiler._is_profiler_enabled is False
    t = torch.zeros(2)
    assert _eager_plain(t)
    with Passing():
        assert torch._C._is_torch_function_mode_enabled() and not _eager_plain(t)
    with Seen():
        assert torch._C._len_torch_dispatch_stack() == 1 and not _eager_plain(t)
    with torch.profiler.profile():
        assert torch.autograd.profiler._is_profiler_enabled and not _eager_plain(t)
    assert _eager_plain(t) and not _eager_plain(t, t.as_subclass(Subclass))


def test_later_layers_keep_their_shape_checks():
    shared, batches = _batches()
    plan = pk.StepPlan(shared.blocks, pk.StepTensors(*shared.step))
    _step_over_layers(plan, batches[:1])
    b = batches[1]
    with pytest.raises(ValueError, match="^key:"):
        plan.store_kv(b.new_keys[..., :8], b.new_values, 1)
    with pytest.raises(ValueError, match="^value:"):
        plan.store_kv(b.new_keys, b.new_values[:-1], 1)
    with pytest.raises(ValueError, match="^q:"):
        plan.flash_attention(b.q.double(), 1, 0.3)
    with pytest.raises(ValueError, match="^softmax_scale:"):
        plan.flash_attention(b.q, 1, float("inf"))
    with pytest.raises(ValueError, match="^layer_idx:"):
        plan.store_kv(b.new_keys, b.new_values, LAYERS)


def test_the_first_layer_checks_the_step_values_and_changes_nothing():
    """The first layer's eager call skips the dispatcher, not the value checks: a bad step raises
    naming the argument, before anything is written."""
    shared, batches = _batches()
    shared.lookup_table[2, 4] = shared.blocks.shape[0]  # past the pool: the page of sequence 2's new token
    plan = pk.StepPlan(shared.blocks, pk.StepTensors(*shared.step))
    before = shared.blocks.clone()
    with pytest.raises(ValueError, match="^lookup_table:"):
        plan.store_kv(batches[0].new_keys, batches[0].new_values, 0)
    with pytest.raises(ValueError, match="^lookup_table:"):
        plan.flash_attention(batches[0].q, 0, 0.3)
    assert torch.equal(shared.blocks, before) and not plan.kernels  # nothing kept from a failed step


def test_a_plan_over_fp8_blocks_without_scales_points_to_step_plan_of():
    """StepPlan(blocks, step) over an FP8 pool forgets its scales: refused at construction, naming
    `scales` and the constructor that passes them; StepPlan.of(collection, step) is accepted."""
    params = pk.KVCacheParams(
        torch.float8_e4m3fn, num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, quantization_granularity=8
    )
    collection = pk.PagedKVCacheCollection(params, 8, 2, 16)
    manager = pk.KVCacheManager(collection)
    manager.claim("a")
    step = manager.prepare_step(["a"], [3])
    with pytest.raises(ValueError, match=r"scales: .*StepPlan\.of\(collection, step\)"):
        pk.StepPlan(collection.blocks, step)
    assert pk.StepPlan.of(collection, step).scales is collection.scales
