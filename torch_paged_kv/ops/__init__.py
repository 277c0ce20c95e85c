"""The `paged_kv` ops (see docs/design.md for the contract) and their Python entry points.

Importing this package registers the ops and every backend that can load here. The typed public
functions live in `api.py`; the `*_unchecked` names are the `.unchecked` overloads themselves (same
arguments, value checks skipped), for callers that checked the step tensors already.
"""

from __future__ import annotations

import torch

from . import (
    backends,  # noqa: F401  (registers the backends)
    library,  # noqa: F401  (registers torch.ops.paged_kv.*)
)
from .api import copy_pages, flash_attention, gather_kv, mla_attention, store_kv, store_latent
from .dispatch import BackendUnavailableError, backend_info

store_kv_unchecked = torch.ops.paged_kv.store_kv.unchecked
"""`store_kv` without the value checks (shape checks still run): for a caller whose step tensors a
checked call of the same step has covered, such as the layers after layer 0."""

flash_attention_unchecked = torch.ops.paged_kv.flash_attention.unchecked
"""`flash_attention` without the value checks (shape checks still run); see `store_kv_unchecked`."""

gather_kv_unchecked = torch.ops.paged_kv.gather_kv.unchecked
"""`gather_kv` without the value checks (shape checks still run); see `store_kv_unchecked`."""

copy_pages_unchecked = torch.ops.paged_kv.copy_pages.unchecked
"""`copy_pages` without the value checks (shape checks still run): page ids out of range or
duplicate destinations are not caught."""

store_latent_unchecked = torch.ops.paged_kv.store_latent.unchecked
"""`store_latent` without the value checks (shape checks still run); see `store_kv_unchecked`."""

mla_attention_unchecked = torch.ops.paged_kv.mla_attention.unchecked
"""`mla_attention` without the value checks (shape checks still run); see `store_kv_unchecked`."""

__all__ = [
    "BackendUnavailableError",
    "backend_info",
    "copy_pages",
    "copy_pages_unchecked",
    "flash_attention",
    "flash_attention_unchecked",
    "gather_kv",
    "gather_kv_unchecked",
    "mla_attention",
    "mla_attention_unchecked",
    "store_kv",
    "store_kv_unchecked",
    "store_latent",
    "store_latent_unchecked",
]
