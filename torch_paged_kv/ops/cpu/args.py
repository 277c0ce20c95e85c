"""The CPU kernels' calling convention, Python's side: one ctypes Structure per op entry, the fields
of its struct in `args.h` in the same order, checked against the library's own description of its
structs (`pkv_args_layout`: each field's name, kind, offset and size, and each struct's size) when
`kernels.py` loads it. A struct edited on one side only fails that load with `ArgsLayoutError`
naming the field.

A call does not build the Structure (about 2 us for 40 fields): it packs its values, in field order,
into one `bytes` with `PACKERS[op]`, a `struct.Struct` whose format is derived from the Structure's
offsets and sizes, and the entry copies those bytes into its struct (a fresh `bytes` per call keeps
concurrent calls apart).
"""

from __future__ import annotations

import ctypes
import struct

_PTR, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
Field = tuple[str, "type[ctypes.c_void_p | ctypes.c_int64 | ctypes.c_double]"]
"""A Structure field here: (name, its ctypes type); no bit fields."""

_POOL: list[Field] = [
    ("blocks", _PTR),
    ("num_pages", _INT),
    ("num_layers", _INT),
    ("page_size", _INT),
    ("kv_heads", _INT),
    ("head_dim", _INT),
    ("layer", _INT),
    ("fp8", _INT),
    ("scales", _PTR),
    ("scale_groups", _INT),
]
"""args.h's PKV_POOL_FIELDS: the pool, the layer, an FP8 pool's format and scales."""

_STEP: list[Field] = [
    ("cache_lengths", _PTR),
    ("table", _PTR),
    ("table_stride", _INT),
    ("table_width", _INT),
    ("offsets", _PTR),
    ("batch", _INT),
]
"""args.h's PKV_STEP_FIELDS: the step's index tensors."""


class StoreKvStruct(ctypes.Structure):
    _fields_ = [
        ("src_dtype", _INT),
        ("key", _PTR),
        ("key_stride_row", _INT),
        ("key_stride_head", _INT),
        ("value", _PTR),
        ("value_stride_row", _INT),
        ("value_stride_head", _INT),
        ("rows", _INT),
        *_POOL,
        *_STEP,
        ("threads", _INT),
    ]


class FlashAttentionStruct(ctypes.Structure):
    _fields_ = [
        ("dtype", _INT),
        ("q", _PTR),
        ("q_stride_row", _INT),
        ("q_stride_head", _INT),
        ("q_rows", _INT),
        ("q_heads", _INT),
        ("out", _PTR),
        ("out_stride_row", _INT),
        ("out_stride_head", _INT),
        *_POOL,
        *_STEP,
        ("scale", _FLOAT),
        ("softcap", _FLOAT),
        ("causal", _INT),
        ("window", _INT),
        ("chunk", _INT),
        ("sinks", _PTR),
        ("tree", _PTR),
        ("min_split", _INT),
        ("want_items", _INT),
        ("min_work", _INT),
        ("threads", _INT),
    ]


class GatherKvStruct(ctypes.Structure):
    _fields_ = [
        ("itemsize", _INT),
        *_POOL,
        *_STEP,
        ("max_kv_len", _INT),
        ("key_out", _PTR),
        ("value_out", _PTR),
        ("threads", _INT),
    ]


class CopyPagesStruct(ctypes.Structure):
    _fields_ = [
        ("pool", _PTR),
        ("page_bytes", _INT),
        ("num_pages", _INT),
        ("src", _PTR),
        ("dst", _PTR),
        ("count", _INT),
        ("threads", _INT),
    ]


class StepOkStruct(ctypes.Structure):
    _fields_ = [
        *_STEP,
        ("table_2d", _INT),
        ("total_rows", _INT),
        ("page_size", _INT),
        ("num_pages", _INT),
        ("reads_all", _INT),
        ("max_kv_len", _INT),
    ]


class StoreLatentStruct(ctypes.Structure):
    _fields_ = [
        ("src_dtype", _INT),
        ("latent", _PTR),
        ("latent_stride_row", _INT),
        ("rope", _PTR),
        ("rope_stride_row", _INT),
        ("rows", _INT),
        ("rank", _INT),
        ("rope_dim", _INT),
        *_POOL,
        *_STEP,
        ("threads", _INT),
    ]


class MlaAttentionStruct(ctypes.Structure):
    _fields_ = [
        ("dtype", _INT),
        ("q_nope", _PTR),
        ("q_nope_stride_row", _INT),
        ("q_nope_stride_head", _INT),
        ("q_rope", _PTR),
        ("q_rope_stride_row", _INT),
        ("q_rope_stride_head", _INT),
        ("q_rows", _INT),
        ("q_heads", _INT),
        ("rank", _INT),
        ("rope_dim", _INT),
        ("out", _PTR),
        *_POOL,
        *_STEP,
        ("scale", _FLOAT),
        ("causal", _INT),
        ("key_positions", _PTR),
        ("top_k", _INT),
        ("sinks", _PTR),
        ("min_split", _INT),
        ("want_items", _INT),
        ("min_work", _INT),
        ("threads", _INT),
    ]


STRUCTURES: dict[str, type[ctypes.Structure]] = {
    "store_kv": StoreKvStruct,
    "flash_attention": FlashAttentionStruct,
    "gather_kv": GatherKvStruct,
    "copy_pages": CopyPagesStruct,
    "step_ok": StepOkStruct,
    "store_latent": StoreLatentStruct,
    "mla_attention": MlaAttentionStruct,
}
"""entry (`pkv_<name>`) -> its argument Structure (args.h's PKV_ARG_STRUCTS)."""


class ArgsLayoutError(RuntimeError):
    """A Structure here and its struct in args.h disagree (one side was edited without the other)."""


Layout = tuple[int, tuple[tuple[str, str, int, int], ...]]
"""(struct size, fields as (name, kind: p/i/f, offset, size)), as `pkv_args_layout` reports them."""


def _kind(ctype: type) -> str:
    if issubclass(ctype, ctypes.c_void_p):
        return "p"
    return "f" if issubclass(ctype, (ctypes.c_double, ctypes.c_float)) else "i"


def layout_of(structure: type[ctypes.Structure]) -> Layout:
    """A Structure's layout, as ctypes lays it out (the platform's C rules)."""
    fields = tuple(
        (name, _kind(ctype), getattr(structure, name).offset, getattr(structure, name).size)
        for name, ctype, *_ in structure._fields_
    )
    return ctypes.sizeof(structure), fields


def parse_layout(text: str) -> dict[str, Layout]:
    """`pkv_args_layout()`'s text: one line per struct, "name size field:kind:offset:size ..."."""
    layouts = {}
    for line in text.splitlines():
        name, size, *fields = line.split()
        parsed = []
        for field in fields:
            field_name, kind, offset, field_size = field.split(":")
            parsed.append((field_name, kind, int(offset), int(field_size)))
        layouts[name] = (int(size), tuple(parsed))
    return layouts


def check_layout(reported: str, structures: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """Raise `ArgsLayoutError` unless every Structure (default `STRUCTURES`) matches the library's
    struct of the same name (`reported`: `pkv_args_layout()`'s text) field for field."""
    library = parse_layout(reported)
    structures = STRUCTURES if structures is None else structures
    if set(library) != set(structures):
        raise ArgsLayoutError(
            f"the CPU kernels' argument structs are {sorted(library)}, but args.py declares {sorted(structures)}"
        )
    for name, structure in structures.items():
        size, fields = layout_of(structure)
        lib_size, lib_fields = library[name]
        if fields == lib_fields and size == lib_size:
            continue
        where = next(
            (i for i, (ours, theirs) in enumerate(zip(fields, lib_fields, strict=False)) if ours != theirs),
            min(len(fields), len(lib_fields)),
        )
        ours = fields[where] if where < len(fields) else "(no more fields)"
        theirs = lib_fields[where] if where < len(lib_fields) else "(no more fields)"
        raise ArgsLayoutError(
            f"the CPU kernels' {name} arguments (args.h) and args.py's {structure.__name__} disagree at field "
            f"{where}: the library has {theirs}, args.py {ours} (name, kind, offset, size; struct size "
            f"{lib_size} vs {size}): edit both sides alike"
        )


_CODES = {("i", 8): "q", ("i", 4): "i", ("p", 8): "Q", ("p", 4): "I", ("f", 8): "d", ("f", 4): "f"}


def packer(structure: type[ctypes.Structure]) -> struct.Struct:
    """A `struct.Struct` packing one value per field, in field order, into the Structure's bytes
    (native byte order, the Structure's offsets and padding)."""
    size, fields = layout_of(structure)
    fmt, at = "=", 0
    for _, kind, offset, field_size in fields:
        fmt += "x" * (offset - at) + _CODES[kind, field_size]
        at = offset + field_size
    return struct.Struct(fmt + "x" * (size - at))


PACKERS = {name: packer(structure) for name, structure in STRUCTURES.items()}
"""entry -> the packer of its arguments."""

SIGNATURES = {  # name -> (argument types, result type): what `kernels.load` declares on the library
    "pkv_vector_width": ([], ctypes.c_int),
    "pkv_openmp": ([], ctypes.c_int),
    "pkv_parallel_losses": ([], ctypes.c_int64),
    "pkv_bf16_dot": ([], ctypes.c_int),
    "pkv_fp8_byte_tables": ([], ctypes.c_int),
    "pkv_args_layout": ([], ctypes.c_char_p),
    **{
        f"pkv_{name}": ([ctypes.c_char_p], ctypes.c_int)
        for name in ("flash_attention", "store_kv", "step_ok", "store_latent", "mla_attention")
    },
    **{f"pkv_{name}": ([ctypes.c_char_p], None) for name in ("gather_kv", "copy_pages")},
}
"""The library's functions the `cpu` backend calls: probes of the build, and one entry per struct of
`STRUCTURES`, which takes that struct's packed bytes."""
