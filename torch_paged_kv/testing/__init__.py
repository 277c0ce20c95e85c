"""Test helpers: random paged batches written without the ops, and fp64 attention oracles.

Used by the project's tests on every backend; handy for users testing their own kernels. The
cached prefix is written into `blocks` by direct indexing (not through `store_kv`), and every
unused slot of the pool, null page included, holds random values (or a chosen `fill`), so a
kernel that reads past a sequence or ignores the table shows up.

The modules: `paged` (K/V batches, FP8 ones, `attention_fp64`), `mla` (latent batches and their
oracles), `quantization` (FP8 attention error against bf16).
"""

from .mla import (
    MLABatch,
    absorb_query,
    make_mla_batch,
    mla_as_attention,
    mla_attention_fp64,
    mla_nonabsorbed_fp64,
    mla_row_contents,
)
from .paged import (
    ATTENTION_TOLERANCE,
    UNIT_ROUNDOFF,
    PagedBatch,
    assert_attention_within_rounding,
    attention_fp64,
    attention_fp64_and_spread,
    make_fp8_batch,
    make_paged_batch,
)
from .quantization import outlier_kv, quantized_attention_error

__all__ = [
    "ATTENTION_TOLERANCE",
    "UNIT_ROUNDOFF",
    "MLABatch",
    "PagedBatch",
    "absorb_query",
    "assert_attention_within_rounding",
    "attention_fp64",
    "attention_fp64_and_spread",
    "make_fp8_batch",
    "make_mla_batch",
    "make_paged_batch",
    "mla_as_attention",
    "mla_attention_fp64",
    "mla_nonabsorbed_fp64",
    "mla_row_contents",
    "outlier_kv",
    "quantized_attention_error",
]
