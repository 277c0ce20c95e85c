"""Disaggregated serving: prefill in one process, decode in another, the KV pages shipped between them.

Rank 0 (prefill) runs the prompts of a batch of requests, takes each request's first token from the
prefill logits, and sends the requests' pages, token ids and first tokens to rank 1 with
`send_sequences`, then frees them. Rank 1 (decode) receives them into its own pool with
`receive_sequences` and generates the rest with a decode step compiled with `fullgraph=True`. The
main process then serves the same requests in one process (prefill and decode sharing one pool) and
checks that the tokens are identical. The model is `compiled_decode.py`'s small random Llama.

    python examples/disaggregated.py [--requests 4] [--new-tokens 12] [--device cpu|cuda] [--eager]

gloo on CPU; NCCL when two GPUs are visible (one per rank; the pages then move GPU to GPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled_decode import Config, Transformer

import torch_paged_kv as pk
from torch_paged_kv.distributed import receive_sequences, send_sequences

PREFILL, DECODE = 0, 1


def setup(device: torch.device) -> tuple[Transformer, pk.KVCacheManager, list[list[int]]]:
    """The same model weights and prompts in every process (fixed seeds), and an empty pool."""
    torch.manual_seed(0)
    cfg = Config()
    model = Transformer(cfg).to(device).eval()
    params = pk.KVCacheParams(torch.float32, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page_size=16)
    collection = pk.PagedKVCacheCollection(params, 96, max_batch_size=8, max_seq_len=cfg.max_seq_len, device=device)
    model.attach_cache(collection)
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(cfg.vocab_size, (20,), generator=gen).tolist()  # a shared system prompt
    prompts = [system + torch.randint(cfg.vocab_size, (int(n),), generator=gen).tolist() for n in range(5, 41, 7)]
    return model, pk.KVCacheManager(collection), prompts


def prefill(model, manager, ids: list[int], prompts: list[list[int]], device) -> dict[int, int]:
    """One ragged prefill step for requests `ids`; returns each one's first generated token."""
    todo = [prompts[i][manager.claim(i, prompts[i]) :] for i in ids]  # the prefix cache may hold the start
    step = manager.prepare_step(ids, [len(t) for t in todo])
    logits = model(torch.tensor([t for row in todo for t in row], device=device), step)
    manager.commit_step()
    return dict(zip(ids, logits.argmax(-1).tolist(), strict=True))


def decode(model, manager, generated: dict[int, list[int]], new_tokens: int, device, eager: bool) -> None:
    """Greedy decode until every request has `new_tokens` tokens; one compiled graph for every batch size."""
    step_fn = model if eager else torch.compile(model, fullgraph=True, dynamic=True)
    running = [i for i in generated if len(generated[i]) < new_tokens]
    while running:
        rows = [generated[i][-1:] for i in running]
        step = manager.prepare_step(running, [1] * len(running), rows)
        tokens = torch.tensor([r[0] for r in rows], device=device)
        pk.mark_step_dynamic(step, tokens)
        next_tokens = step_fn(tokens, step).argmax(-1).tolist()
        manager.commit_step()
        for i, t in zip(list(running), next_tokens, strict=True):
            generated[i].append(t)
            if len(generated[i]) == new_tokens:
                manager.release(i)
                running.remove(i)


def batches(num_requests: int) -> list[list[int]]:
    """Requests in two prefill batches, as they might arrive."""
    half = (num_requests + 1) // 2
    return [list(range(half)), list(range(half, num_requests))]


def worker(rank: int, args: argparse.Namespace, backend: str, init_file: str, results) -> None:
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device(args.device)
    if backend == "nccl":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timeout)
    model, manager, prompts = setup(device)
    with torch.no_grad():
        if rank == PREFILL:
            for ids in batches(args.requests):
                first = prefill(model, manager, ids, prompts, device)
                stats = send_sequences(manager, ids, DECODE, metadata={"first_tokens": first}, timeout=timeout)
                for i in ids:  # the decode rank has them now
                    manager.release(i)
                print(
                    f"prefill: sent requests {ids}: {stats.pages} pages ({stats.bytes_sent / 2**20:.1f} MiB) "
                    f"in {stats.seconds * 1e3:.1f} ms"
                )
        else:
            generated: dict[int, list[int]] = {}
            for _ in batches(args.requests):
                stats = receive_sequences(manager, PREFILL, timeout=timeout)
                generated.update({int(i): [t] for i, t in stats.metadata["first_tokens"].items()})
                print(f"decode: received requests {stats.seq_ids} ({stats.pages_sent} of {stats.pages} pages sent)")
            decode(model, manager, generated, args.new_tokens, device, args.eager)
            results.put(generated)
    dist.barrier()
    dist.destroy_process_group()


def single_process(args: argparse.Namespace) -> dict[int, list[int]]:
    """The same requests served in one process: same prefill batches, then the same decode."""
    device = torch.device(args.device)
    model, manager, prompts = setup(device)
    generated: dict[int, list[int]] = {}
    with torch.no_grad():
        for ids in batches(args.requests):
            generated.update({i: [t] for i, t in prefill(model, manager, ids, prompts, device).items()})
        decode(model, manager, generated, args.new_tokens, device, args.eager)
    return generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--eager", action="store_true", help="decode without torch.compile")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            worker, args=(args, backend, os.path.join(tmp, "rendezvous"), results), nprocs=2, start_method="spawn"
        )
    disaggregated = results.get()
    expected = single_process(args)
    for i in sorted(expected):
        print(f"request {i}: {disaggregated[i]}")
    assert disaggregated == expected, f"disaggregated {disaggregated} != single process {expected}"
    print(f"identical to a single-process run: {args.requests} requests, {args.new_tokens} tokens each ({backend})")


if __name__ == "__main__":
    main()
