"""PageTable and GroupTable on their own: slots, pages, token ids, the upload into a collection's step
tensors, and the pages a sliding-window group drops."""

from __future__ import annotations

import numpy as np
import torch

import torch_paged_kv as pk
from torch_paged_kv.page_table import PageTable

PARAMS = pk.KVCacheParams(torch.float32, num_layers=1, num_kv_heads=1, head_dim=4, page_size=4)


def make(max_batch: int = 2, max_seq_len: int = 40) -> PageTable:
    return PageTable(pk.PagedKVCacheCollection(PARAMS, num_pages=32, max_batch_size=max_batch, max_seq_len=max_seq_len))


def test_slots_are_reused_lowest_first_and_grow_past_the_batch():
    t = make(max_batch=2)
    g = t.groups[0]
    a, b = t.add([[1]], 3, None), t.add([[2, 3]], 5, np.arange(5))
    assert (a, b) == (0, 1) and len(t.lengths) == 2
    c = t.add([[]], 0, None)  # a third sequence: the slots double
    assert c == 2 and len(t.lengths) == 4 and t.rows.shape == (4, t.rows.shape[1]) and t.rows is g.rows
    assert t.remove(a) == [[1]] and g.pages(a) == [] and (t.rows[a] == pk.NULL_PAGE).all()
    assert t.add([[7]], 1, None) == a  # the freed slot comes back first
    assert g.pages(b) == [2, 3] and t.lengths[b] == 5 and t.token_ids(b) == [0, 1, 2, 3, 4] and t.token_ids(a) is None


def test_set_pages_and_extend():
    t = make()
    g = t.groups[0]
    slot, other = t.add([[4, 5, 6]], 9, None), t.add([[9]], 2, None)
    g.set_pages(slot, [4])
    assert g.pages(slot) == [4] and (t.rows[slot, 1:] == pk.NULL_PAGE).all()
    g.extend(np.array([slot, other]), np.array([1, 1]), [10, 11])  # one page each: vectorised
    assert g.pages(slot) == [4, 10] and g.pages(other) == [9, 11]
    g.extend(np.array([other, slot]), np.array([2, 1]), [12, 13, 14])
    assert g.pages(other) == [9, 11, 12, 13] and g.pages(slot) == [4, 10, 14]
    assert t.pages_for(np.array([0, 1, 4, 5])).tolist() == [0, 1, 1, 2]


def test_groups_hold_their_own_pages_and_a_sliding_group_drops_what_left_the_window():
    window = pk.KVCacheParams(torch.float32, num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, sliding_window=6)
    t = PageTable([make().groups[0].collection, pk.PagedKVCacheCollection(window, 16, 2, 40)])
    full, sliding = t.groups
    slot = t.add([[1, 2, 3], [pk.NULL_PAGE, 6, 7]], 9, None)  # at length 9 the window starts in page 1
    assert full.pages(slot) == [1, 2, 3] and sliding.pages(slot) == [0, 6, 7] and sliding.held(slot) == [6, 7]
    # length 9 -> 13: the next query (position 13) sees keys 8..12, so pages 0 and 1 (tokens 0..7) left
    assert sliding.first_held(np.array([9, 13, 5, 4])).tolist() == [1, 2, 0, 0]  # 9 - 6 + 1 = 4: page 1
    sliding.extend(np.array([slot]), np.array([1]), [8])
    full.extend(np.array([slot]), np.array([1]), [4])
    assert sliding.leave_window(np.array([slot]), np.array([9]), np.array([13])) == ([0], [6])
    assert sliding.pages(slot) == [0, 0, 7, 8] and sliding.held(slot) == [7, 8]
    assert full.leave_window(np.array([slot]), np.array([9]), np.array([13])) == ([], [])
    assert t.remove(slot) == [[1, 2, 3, 4], [7, 8]]


def test_token_ids_grow_by_doubling_up_to_the_longest_sequence_and_append_only_to_known_rows():
    t = make(max_seq_len=40)  # 10 pages of 4 at most
    known, unknown = t.add([[]], 0, np.arange(3)), t.add([[]], 0, None)
    assert t.tokens.shape[1] == 4
    t.reserve_tokens(9)
    assert t.tokens.shape[1] == 12  # whole pages: ceil(9 / 4) = 3
    t.reserve_tokens(13)
    assert t.tokens.shape[1] == 24  # doubled
    t.reserve_tokens(30)
    assert t.tokens.shape[1] == 40  # doubling stops at max_seq_len
    slots, old, num_new = np.array([known, unknown]), np.array([2, 0]), np.array([3, 1])
    ids = np.array([70, 71, 72, 80])
    got = t.append_tokens(slots, old, old + num_new, num_new, ids)
    assert got.tolist() == [5, -1]  # the known row now knows 5 ids (its prompt's third id overwritten)
    assert t.token_ids(known) == [0, 1, 70, 71, 72] and t.token_ids(unknown) is None
    t.groups[0].set_pages(known, [5, 6])
    assert t.page_tokens([known], [1]) == np.array([72, 0, 0, 0], dtype="<i8").tobytes()


def test_upload_writes_lengths_offsets_and_only_the_changed_rows():
    t = make(max_batch=3)
    c = t.groups[0].collection
    g = t.groups[0]
    slots = np.array([t.add([[3, 4]], 6, None), t.add([[8]], 1, None)])
    g.upload(slots, t.lengths[slots], np.array([2, 1]), None, False)
    step = g.step_tensors(2)
    assert step.cache_lengths.tolist() == [6, 1] and step.input_row_offsets.tolist() == [0, 2, 3]
    assert step.lookup_table[:, :3].tolist() == [[3, 4, 0], [8, 0, 0]]
    c.lookup_table[0, 0] = 99  # row 0 is not re-sent unless it changed
    g.extend(slots[1:], np.array([1]), [9])
    t.lengths[slots] += [2, 1]
    g.upload(slots, t.lengths[slots], np.array([2, 1]), np.array([1]), True)
    assert step.cache_lengths.tolist() == [8, 2] and step.lookup_table[1, :2].tolist() == [8, 9]
    assert int(step.lookup_table[0, 0]) == 99 and step.input_row_offsets.tolist() == [0, 2, 3]
    assert g.step_tensors(2) is step  # views are made once per batch size
