"""The rows of `KVCacheManager`'s steps: the prepared step, what the step tensors hold, and the
checks of a step's counts and token ids."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .page_pool import token_array
from .sequences import SequenceState


class PreparedStep(NamedTuple):
    """The prepared step, until `commit_step`: row b is `seqs[b]` in page-table slot `slots[b]`."""

    seqs: list[SequenceState]
    slots: np.ndarray
    num_new: np.ndarray
    new_lengths: np.ndarray
    token_ids: np.ndarray | None  # the rows' new token ids, concatenated

    def without(self, seq: SequenceState) -> PreparedStep:
        """This step less the row of `seq` (released)."""
        keep = np.array([s is not seq for s in self.seqs])
        token_ids = None if self.token_ids is None else self.token_ids[np.repeat(keep, self.num_new)]
        seqs = [s for s in self.seqs if s is not seq]
        return PreparedStep(seqs, self.slots[keep], self.num_new[keep], self.new_lengths[keep], token_ids)


class StepRows(NamedTuple):
    """The rows of a prepared step: page-table slots, new tokens, and lengths once committed."""

    slots: np.ndarray
    num_new: np.ndarray
    new_lengths: np.ndarray


class UploadedRows(NamedTuple):
    """What the collection's step tensors hold: the rows of the last prepared step. The next step
    with the same ids skips their lookup and re-sends only the table rows that gained pages; with
    the same counts (an equal list of ints) it skips their checks and leaves the offsets alone."""

    ids: list
    seqs: list[SequenceState]
    slots: np.ndarray
    counts: list | None  # a copy of the counts as given, when they were a list
    num_new: np.ndarray

    def same_counts(self, num_new_tokens: Sequence[int], batch: int) -> bool:
        return (
            type(num_new_tokens) is list
            and len(num_new_tokens) == batch
            and num_new_tokens == self.counts
            and set(map(type, num_new_tokens)) == {int}  # == holds for 1.0 and True too
        )


def check_num_new(num_new_tokens: Sequence[int], batch: int) -> np.ndarray:
    """`num_new_tokens` as int64 `[batch]`, each >= 1 (ValueError naming it otherwise; no floats or bools)."""
    num_new = np.asarray(num_new_tokens)
    bools = isinstance(num_new_tokens, (list, tuple)) and any(isinstance(n, (bool, np.bool_)) for n in num_new_tokens)
    if num_new.shape != (batch,) or num_new.dtype.kind not in "iu" or bools:
        raise ValueError(f"num_new_tokens: expected {batch} ints (one per sequence), got {num_new_tokens!r}")
    if num_new.min() < 1:
        raise ValueError(f"num_new_tokens: every sequence needs >= 1 new token, got {num_new.min()}")
    return num_new.astype(np.int64, copy=False)


def check_lengths(new_lengths: np.ndarray, ids: list, max_seq_len: int) -> int:
    """The longest of a step's lengths after it (ValueError naming `num_new_tokens` past `max_seq_len`)."""
    longest = int(new_lengths.max())
    if longest > max_seq_len:
        b = int(new_lengths.argmax())
        raise ValueError(
            f"num_new_tokens: sequence {ids[b]!r} would reach {longest} tokens, past max_seq_len={max_seq_len}"
        )
    return longest


def check_token_ids(token_ids: Sequence[Sequence[int]], num_new: np.ndarray) -> np.ndarray:
    """The rows' ids concatenated (int64), after checking their counts and types (ValueError naming `token_ids`)."""
    if int(num_new.sum()) == len(num_new):  # one id per row (decode): unpacking checks the counts
        try:
            flat = [x for (x,) in token_ids]
        except (TypeError, ValueError):
            flat = None
        if flat is not None and len(flat) == len(num_new):
            return token_array("token_ids", flat)
    try:
        counts = list(map(len, token_ids))
    except TypeError:
        raise ValueError("token_ids: expected one sequence of ints per row") from None
    if counts != num_new.tolist():
        raise ValueError(f"token_ids: expected {num_new.tolist()} ids per row, got {counts}")
    return token_array("token_ids", itertools.chain.from_iterable(token_ids))
