"""Command line: `python -m torch_paged_kv inspect FILE` describes and verifies a KV checkpoint."""

from __future__ import annotations

import argparse
import sys
import warnings

from .checkpoint import (
    VERIFIED_METADATA_VERSION,
    CheckpointError,
    CheckpointInfo,
    UnverifiedMetadataWarning,
    read_info,
    verify,
)
from .params import KVCacheParams, TPShard


def _size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _quantization(params: KVCacheParams) -> str:
    if not params.quantized:
        return f"none ({_name(params.dtype)})"
    fp8 = _name(params.dtype)
    if params.static_scales is not None:
        planes = "the latent" if params.is_mla else "K, V"
        return f"{fp8}, one static scale per tensor ({', '.join(map(str, params.static_scales))} for {planes})"
    if params.is_mla:
        return (
            f"{fp8} latent, a {_name(params.scale_dtype)} scale per token and {params.quantization_granularity} "
            f"latent elements ({params.scales_per_head} per token of {params.kv_lora_rank})"
        )
    return (
        f"{fp8}, a {_name(params.scale_dtype)} scale per token, head and "
        f"{params.quantization_granularity} elements ({params.scales_per_head} per head of {params.head_dim})"
    )


def _mla(params: KVCacheParams) -> str:
    """The MLA row: latent then rope, and its bytes per token and layer."""
    scales = ""
    if params.quantized:
        scales = ", one static scale" if params.static_scales is not None else (
            f", one {_name(params.scale_dtype)} scale per token" if params.scales_per_head == 1
            else f", {params.scales_per_head} {_name(params.scale_dtype)} scales per token"
        )  # fmt: skip
    row_bytes = (params.bytes_per_token + params.scale_bytes_per_token) // params.num_layers
    return (
        f"latent {params.kv_lora_rank} ({_name(params.dtype)}{scales}) + rope {params.rope_dim} "
        f"({_name(params.rope_dtype)}): {row_bytes} bytes per token and layer"
    )


def _heads(params: KVCacheParams, shard: TPShard | None) -> str:
    if shard is None or params.num_kv_heads == shard.total_kv_heads:
        return f"all {params.num_kv_heads}"
    heads = shard.kv_head_range(params.num_kv_heads)
    return (
        f"{heads.start}..{heads.stop - 1} of {shard.total_kv_heads} (tensor-parallel rank {shard.tp_rank} of "
        f"{shard.tp_size}: one shard; torch_paged_kv.distributed.reshard loads the shards at any size)"
    )


def _printable(text: str) -> str:
    """`text` without control characters (a crafted file's strings reach the terminal)."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _header(version: int) -> str:
    if version >= VERIFIED_METADATA_VERSION:
        return "header checksums: OK (crc32, every file)"
    return f"header:     not verified (format version {version} has no header checksum; save it again to verify)"


def _describe(info: CheckpointInfo) -> str:
    meta = {k: _printable(v) for k, v in info.metadata.items()}
    sizes = sum(f.stat().st_size for f in info.files)
    p = info.params
    page_bytes = info.page_tokens * (p.bytes_per_token + p.scale_bytes_per_token)
    lines = [
        f"checkpoint: {info.path} ({len(info.files)} file(s), {_size(sizes)})",
        f"format:     {meta['format']} v{meta['format_version']}, written by torch_paged_kv "
        f"{meta.get('torch_paged_kv_version', '?')} / torch {meta.get('torch_version', '?')}",
        f"params:     {', '.join(f'{k}={v}' for k, v in p.to_dict().items())}",
        f"quantized:  {_quantization(p)}",
        *([f"mla:        {_mla(p)}"] if p.is_mla else []),
        f"kv heads:   {_heads(p, info.tp_shard)}",
        f"collection: {info.kind}, max_seq_len={info.max_seq_len}, pages stored={info.num_pages} "
        f"({info.page_tokens} tokens each, {_size(info.num_pages * page_bytes)})",
    ]
    for g, group in enumerate(info.groups):  # a sliding window's rows reference no page below it
        spans = zip(info.pages_per_row(), info.first_held_per_row(g), strict=True)
        references = sum(stop - first for stop, first in spans)
        counts = (
            f"{references} referenced by the rows, {group.num_pages} stored "
            f"({references - group.num_pages} references to shared pages)"
        )
        if len(info.groups) == 1:
            lines.append(f"pages:      {counts}")
        else:
            params = ", ".join(f"{k}={v}" for k, v in group.params.to_dict().items())
            lines.append(f"group {g}:    layers {list(group.layers)}: {params}; pages: {counts}")
    if len(info.files) > 1:
        lines += [f"  file {f.name}: {_size(f.stat().st_size)}" for f in info.files]
    if info.user_metadata:
        lines.append(f"metadata:   {info.user_metadata}")
    if info.extra_tensors:
        lines.append(f"extra:      {len(info.extra_tensors)} tensor(s) in the main file")
        lines += [f"  {name} {_name(dtype)}{list(shape)}" for name, (dtype, shape) in info.extra_tensors.items()]
    sources = meta.get("source_batch_indices", "[]")
    lines.append(f"rows:       {len(info.cache_lengths)} (saved from rows {sources})")
    lines.append("  row  cache_length  pages")
    for row, (length, pages) in enumerate(zip(info.cache_lengths, info.pages_per_row(), strict=True)):
        lines.append(f"  {row:>3}  {length:>12}  {pages:>5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_paged_kv")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="describe a KV-cache checkpoint and verify its checksums")
    inspect.add_argument("file")
    inspect.add_argument("--no-verify", action="store_true", help="read headers only, skip the checksums")
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():  # an old file's unverified metadata gets a line of its own
            warnings.simplefilter("ignore", UnverifiedMetadataWarning)
            info = read_info(args.file)
        print(_describe(info))
        print(_header(int(info.metadata["format_version"])))
        if args.no_verify:
            print("checksums:  not verified (--no-verify)")
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnverifiedMetadataWarning)
                verify(args.file)
            print(f"checksums:  OK ({len(info.checksums)} tensors, crc32)")
    except (CheckpointError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
