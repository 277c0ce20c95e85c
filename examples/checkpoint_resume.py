"""Save the KV state mid-generation, continue in a new process: the tokens match an uninterrupted run.

The parent generates a few tokens for three prompts, saves the sequences' KV state with
`pk.save_sequences` (safetensors) plus the generated tokens (JSON beside it), and continues.
A child process (`--resume DIR`) builds a fresh cache, loads the checkpoint with
`pk.load_sequences` and continues from there, without recomputing the prompts. The parent
checks both continuations are identical.

    python examples/checkpoint_resume.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import torch
from compiled_decode import Config, Transformer

import torch_paged_kv as pk

FIRST_TOKENS, MORE_TOKENS = 8, 8


def build(device: torch.device) -> tuple[Transformer, pk.KVCacheManager]:
    torch.manual_seed(0)  # the same weights in both processes
    cfg = Config()
    model = Transformer(cfg).to(device).eval()
    params = pk.KVCacheParams(torch.float32, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page_size=16)
    collection = pk.PagedKVCacheCollection(
        params, num_pages=64, max_batch_size=4, max_seq_len=cfg.max_seq_len, device=device
    )
    model.attach_cache(collection)
    return model, pk.KVCacheManager(collection)


def generate(model, manager, seq_ids: list, inputs: list[list[int]], steps: int, device) -> list[list[int]]:
    """Greedy steps: row b feeds `inputs[b]` first (its prompt, or its last token), then its outputs."""
    out: list[list[int]] = [[] for _ in seq_ids]
    for _ in range(steps):
        step = manager.prepare_step(seq_ids, [len(x) for x in inputs], inputs)
        logits = model(torch.tensor([t for x in inputs for t in x], device=device), step)
        manager.commit_step()
        inputs = [[t] for t in logits.argmax(-1).tolist()]
        for row, (t,) in zip(out, inputs, strict=True):
            row.append(t)
    return out


def resume(directory: pathlib.Path, device: torch.device) -> list[list[int]]:
    """The child: a fresh cache, the saved sequences loaded into it, generation continued."""
    model, manager = build(device)
    state = json.loads((directory / "state.json").read_text())
    seq_ids = pk.load_sequences(manager, directory / "kv.safetensors")
    with torch.no_grad():
        return generate(model, manager, seq_ids, [[g[-1]] for g in state["generated"]], MORE_TOKENS, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resume", type=pathlib.Path, help="(internal) continue from this directory")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.resume:
        print(json.dumps(resume(args.resume, device)))
        return

    model, manager = build(device)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(Config.vocab_size, (n,), generator=gen).tolist() for n in (21, 37, 9)]
    seq_ids = ["a", "b", "c"]
    for seq_id, prompt in zip(seq_ids, prompts, strict=True):
        manager.claim(seq_id, prompt)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        directory = pathlib.Path(tmp)
        first = generate(model, manager, seq_ids, prompts, FIRST_TOKENS, device)
        pk.save_sequences(manager, directory / "kv.safetensors", seq_ids)
        (directory / "state.json").write_text(json.dumps({"generated": first}))
        uninterrupted = generate(model, manager, seq_ids, [[g[-1]] for g in first], MORE_TOKENS, device)
        child = subprocess.run(
            [sys.executable, __file__, "--resume", tmp, "--device", args.device],
            check=True,
            capture_output=True,
            text=True,
        )
        resumed = json.loads(child.stdout.strip().splitlines()[-1])
        size = (directory / "kv.safetensors").stat().st_size
    for seq_id, a, b, c in zip(seq_ids, first, uninterrupted, resumed, strict=True):
        print(f"{seq_id}: first {a} | uninterrupted {b} | resumed in a new process {c}")
    if resumed != uninterrupted:
        raise SystemExit("the resumed continuation differs from the uninterrupted one")
    print(f"identical: the new process continued from a {size / 2**20:.2f} MiB checkpoint without recomputing prompts")


if __name__ == "__main__":
    main()
