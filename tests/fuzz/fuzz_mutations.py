"""Random damage and crafting, from a `random.Random`: byte flips, truncations, and JSON edits that reach
into JSON carried inside strings (a checkpoint's metadata values, the manager's token-id payload)."""

from __future__ import annotations

import json
import random
from typing import Any

JUNK: list[Any] = [
    None, True, False, -1, 0, 1, 3, 2**31, 2**63, -(2**63) - 1, 10**30, 1.5, -0.0, float("nan"), float("inf"),
    "", "x", "../../etc/passwd", "/tmp/x", "crc32:00000000", "float32", "[", "[[[[[[[[", "{}", "[]", "1e9",
    [], {}, [[0]], [None], {"a": 1}, {"file": "../x", "checksums": {}}, list(range(40)),
]  # fmt: skip


def junk(rng: random.Random) -> Any:
    value = rng.choice(JUNK)
    return json.loads(json.dumps(value)) if isinstance(value, (list, dict)) else value


def mutate_json(value: Any, rng: random.Random) -> Any:
    """A copy of the JSON value `value` with one random edit somewhere inside it; strings holding a JSON
    object or list are decoded, edited and encoded again (with their own spacing) most of the time."""
    if isinstance(value, dict) and value and rng.random() < 0.85:
        out = dict(value)
        key = rng.choice(list(out))
        roll = rng.random()
        if roll < 0.12:
            del out[key]
        elif roll < 0.18:
            out[rng.choice(["extra", "file", "length", "pages", "dtype", key + "_"])] = junk(rng)
        else:
            out[key] = mutate_json(out[key], rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.85:
        out = list(value)
        i = rng.randrange(len(out))
        roll = rng.random()
        if roll < 0.15:
            del out[i]
        elif roll < 0.25:
            out.insert(i, out[i])
        else:
            out[i] = mutate_json(out[i], rng)
        return out
    if isinstance(value, str) and value[:1] in ("{", "[") and rng.random() < 0.85:
        try:
            inner = json.loads(value)
        except ValueError:
            inner = None
        if isinstance(inner, (dict, list)):
            spaced = ", " in value or ": " in value
            separators = (", ", ": ") if spaced else (",", ":")
            return json.dumps(mutate_json(inner, rng), separators=separators)
    if isinstance(value, str) and value and rng.random() < 0.5:
        i = rng.randrange(len(value))
        return value[:i] + rng.choice('0123456789abcdef-."\\x\x00\u00e9[]{}') + value[i + 1 :]
    if type(value) is int and rng.random() < 0.6:
        return value + rng.choice([-1, 1, -value - 1, value, 2**40])
    return junk(rng)


def damage_bytes(data: bytes, rng: random.Random) -> bytes:
    """`data` with a few flipped bytes, cut short, or with bytes appended."""
    raw = bytearray(data)
    roll = rng.random()
    if roll < 0.6 and raw:
        for _ in range(rng.choice([1, 1, 1, 2, 8])):
            raw[rng.randrange(len(raw))] ^= rng.randrange(1, 256)
        return bytes(raw)
    if roll < 0.85:
        return bytes(raw[: rng.randrange(len(raw) + 1)])
    return bytes(raw) + bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 8, 100])))
