"""PagePool on its own: allocation order, refcounts, the LRU of evictable cached pages, prefix keys."""

from __future__ import annotations

import hashlib

import numpy as np

from torch_paged_kv.page_pool import PagePool, page_key, page_key_of_bytes, root_key


def test_allocate_hands_out_low_ids_first_with_one_owner():
    pool = PagePool(6)
    assert pool.available() == 6
    assert pool.allocate(2) == [1, 2] and pool.allocate(1) == [3]
    assert [pool.refcounts[p] for p in range(7)] == [0, 1, 1, 1, 0, 0, 0]
    pool.unref([2])
    assert pool.free[-1] == 2 and pool.allocate(1) == [2]  # a freed page is the next one handed out


def test_cached_pages_become_evictable_and_leave_least_recently_released_first():
    pool = PagePool(4)
    pages = pool.allocate(4)
    for i, page in enumerate(pages[:3]):
        pool.register(page, bytes([i]) * 32)
    pool.unref([pages[2], pages[0], pages[3], pages[1]])  # page 4 was never cached: it goes to free
    assert pool.free == [pages[3]] and list(pool.evictable) == [pages[2], pages[0], pages[1]]
    assert pool.available() == 4
    pool.ref(pages[0])  # a lookup hit revives it: no longer evictable
    assert list(pool.evictable) == [pages[2], pages[1]] and pool.refcounts[pages[0]] == 1
    taken = pool.allocate(2)  # the free page first, then the least recently released cached page
    assert taken == [pages[3], pages[2]]
    assert pool.lookup(bytes([2]) * 32) is None and pages[2] not in pool.key_of  # its key left with it
    assert pool.lookup(bytes([1]) * 32) == pages[1]


def test_peek_names_what_allocate_would_take_and_take_takes_exactly_that():
    pool = PagePool(5)
    pages = pool.allocate(5)
    for i, page in enumerate(pages[:3]):
        pool.register(page, bytes([i]) * 32)
    pool.unref([pages[0], pages[3], pages[1], pages[2]])  # free: [4]; evictable oldest first: 1, 2, 3
    state = (list(pool.free), list(pool.evictable), dict(pool.key_of))
    assert pool.peek(3) == [pages[3], pages[0], pages[1]]
    assert pool.peek(3, keep={pages[0]}) == [pages[3], pages[1], pages[2]]
    assert (list(pool.free), list(pool.evictable), dict(pool.key_of)) == state  # peek changes nothing
    pool.take(pool.peek(2, keep={pages[0]}))
    assert pool.refcounts[pages[3]] == pool.refcounts[pages[1]] == 1 and pages[1] not in pool.key_of
    assert list(pool.evictable) == [pages[0], pages[2]]
    pool.forget([pages[2], pages[3]])  # an overwritten cached page leaves the cache; a held page is left alone
    assert list(pool.evictable) == [pages[0]] and pool.free[-1] == pages[2] and pool.lookup(bytes([2]) * 32) is None
    assert pool.refcounts[pages[3]] == 1


def test_register_keeps_the_first_page_of_a_key_and_the_first_key_of_a_page():
    pool = PagePool(3)
    a, b, _ = pool.allocate(3)
    pool.register(a, b"k" * 32)
    pool.register(b, b"k" * 32)  # same tokens computed twice: the first page stays the cached one
    pool.register(a, b"j" * 32)
    assert pool.page_of == {b"k" * 32: a} and pool.key_of == {a: b"k" * 32}


def test_keys_chain_sha256_over_little_endian_int64_tokens():
    root = root_key(b"salt")
    assert root == hashlib.sha256(b"torch_paged_kv/prefix/salt").digest() and root != root_key(None)
    tokens = np.array([1, 2, 3, 2**40], dtype=np.int64)
    expected = hashlib.sha256(root + tokens.astype("<i8").tobytes()).digest()
    assert page_key(root, tokens.tolist()) == expected == page_key_of_bytes(root, tokens.astype("<i8").tobytes())


def test_match_prefix_finds_the_longest_cached_chain_and_cache_full_page_builds_it():
    pool, root, size = PagePool(8), root_key(None), 4
    tokens = np.arange(20, dtype=np.int64)
    pages = pool.allocate(3)
    parent = root
    for i, page in enumerate(pages):
        parent = pool.cache_full_page(parent, page, tokens[i * size : (i + 1) * size].astype("<i8").tobytes())
    found, keys = pool.match_prefix(root, tokens, size, max_pages=5)
    assert found == pages and keys[-1] == parent and pool.refcounts[pages[0]] == 1  # match_prefix refs nothing
    assert pool.match_prefix(root, tokens, size, max_pages=2)[0] == pages[:2]
    other = tokens.copy()
    other[5] = 99  # the second page differs: only the first matches
    assert pool.match_prefix(root, other, size, max_pages=5)[0] == pages[:1]
    assert pool.match_prefix(root_key(b"x"), tokens, size, max_pages=5) == ([], [])  # another salt: nothing
