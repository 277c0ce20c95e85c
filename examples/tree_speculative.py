"""Speculative decoding with a tree of drafts over `KVCacheManager` and a compiled verify step.

The target is compiled_decode.py's small random Llama; the draft is the same model with noisy
weights (cheap to run, often right, sometimes not). Each step the draft proposes a tree: its top-2
tokens at the first two levels and its top-1 at the third (11 nodes with the root). One compiled
(`fullgraph=True`) target step verifies every node of every sequence at once: the nodes are stored
in tree order after the cached tokens, each attends to the cached prefix plus its own ancestors
(`flash_attention(..., tree_mask=...)`) at the position of its depth. The longest path whose tokens
the target would have chosen greedily is kept with `manager.accept` (its K/V moved into place, the
rest of the tree rolled back), plus the target's own next token. The tokens must equal plain greedy
decoding of the target, recomputed without any cache.

    python examples/tree_speculative.py [--device cuda] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn
from compiled_decode import Config, Transformer, greedy_without_cache

import torch_paged_kv as pk

BRANCHING = (2, 2, 1)  # children per node at each draft level


class TreePlan:
    """A `StepPlan` whose attention sees each new token's ancestors only (`tree_mask`)."""

    def __init__(self, plan: pk.StepPlan, tree_mask: torch.Tensor) -> None:
        self.plan, self.tree_mask = plan, tree_mask

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> None:
        self.plan.store_kv(k, v, layer_idx)

    def flash_attention(self, q: torch.Tensor, layer_idx: int, softmax_scale: float) -> torch.Tensor:
        return self.plan.flash_attention(q, layer_idx, softmax_scale, tree_mask=self.tree_mask)


class Verifier(nn.Module):
    """The target's logits at every new token of a tree step (positions: cached length + depth)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, tree_mask, step: pk.StepTensors) -> torch.Tensor:
        m = self.model
        plan = TreePlan(pk.StepPlan(m.blocks, step), tree_mask)
        x = m.embed(tokens)
        for layer in m.layers:
            x = layer(x, m.cos[positions], m.sin[positions], plan)
        return m.output(m.norm(x))


def draft_tree(draft: Transformer, context: list[int], device) -> tuple[list[int], list[int]]:
    """Tokens and parents (-1: the root) of a tree whose root is `context[-1]`, in breadth-first order."""
    tokens, parents, level = [context[-1]], [-1], [0]
    for width in BRANCHING:
        next_level = []
        for node in level:
            path, i = [], node
            while i > 0:
                path.append(tokens[i])
                i = parents[i]
            logits = draft(torch.tensor(context + path[::-1], device=device), None)[0]
            for token in logits.topk(width).indices.tolist():
                tokens.append(token)
                parents.append(node)
                next_level.append(len(tokens) - 1)
        level = next_level
    return tokens, parents


def tree_inputs(parents: list[int], length: int) -> tuple[list[int], list[int]]:
    """Each node's position (`length` + depth) and its tree-mask bits (itself and its ancestors)."""
    positions, bits = [], []
    for i, parent in enumerate(parents):
        positions.append(length if parent < 0 else positions[parent] + 1)
        bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
    return positions, bits


def accepted_path(tokens: list[int], parents: list[int], greedy: list[int]) -> list[int]:
    """The longest path from the root whose every token is the target's greedy choice after its parent."""
    path = [0]
    while True:
        child = next((c for c, p in enumerate(parents) if p == path[-1] and tokens[c] == greedy[path[-1]]), None)
        if child is None:
            return path
        path.append(child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a model this small only loses time to threads
    torch.manual_seed(0)
    cfg = Config(n_layers=2)
    model = Transformer(cfg).to(device).eval()
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    params = pk.KVCacheParams(torch.float32, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, page_size=8)
    collection = pk.PagedKVCacheCollection(
        params, num_pages=64, max_batch_size=2, max_seq_len=cfg.max_seq_len, device=device
    )
    model.attach_cache(collection)
    manager = pk.KVCacheManager(collection)
    verify = torch.compile(Verifier(model), fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    prompts = {i: torch.randint(cfg.vocab_size, (n,), generator=gen).tolist() for i, n in enumerate((21, 34))}

    with torch.no_grad():
        out = {}
        for i, prompt in prompts.items():  # prefill (eager): the first generated token
            manager.claim(i, prompt)
            step = manager.prepare_step([i], [len(prompt)])
            out[i] = [int(model(torch.tensor(prompt, device=device), step).argmax(-1))]
            manager.commit_step()
        steps = accepted = 0
        while min(len(t) for t in out.values()) < args.new_tokens:
            trees = {i: draft_tree(draft, prompts[i] + out[i], device) for i in prompts}
            rows = [tree_inputs(parents, manager.cache_length(i)) for i, (_, parents) in trees.items()]
            step = manager.prepare_step(list(trees), [len(tokens) for tokens, _ in trees.values()])
            tokens = torch.tensor([t for tokens, _ in trees.values() for t in tokens], device=device)
            positions = torch.tensor([p for pos, _ in rows for p in pos], device=device)
            mask = torch.tensor([b for _, bits in rows for b in bits], dtype=torch.int64, device=device)
            greedy = verify(tokens, positions, mask, step).argmax(-1).tolist()
            if steps == 0:
                torch.compiler.set_stance("fail_on_recompile")  # every later step reuses the graph
            manager.commit_step()
            start = 0
            for i, (tree_tokens, parents) in trees.items():
                mine = greedy[start : start + len(tree_tokens)]
                path = accepted_path(tree_tokens, parents, mine)
                manager.accept(i, path, [tree_tokens[j] for j in path])  # the root and the kept drafts
                out[i] += [tree_tokens[j] for j in path[1:]] + [mine[path[-1]]]
                accepted += len(path) - 1
                start += len(tree_tokens)
            steps += 1
        torch.compiler.set_stance("default")
        for i, prompt in prompts.items():
            out[i] = out[i][: args.new_tokens]
            expected = greedy_without_cache(model, prompt, args.new_tokens, device)
            assert out[i] == expected, f"sequence {i}: speculative {out[i]} != greedy {expected}"
    depth = len(BRANCHING)
    print(f"{steps} verify steps of {len(prompts)} sequences, trees of {len(trees[0][0])} nodes (depth {depth})")
    print(f"acceptance rate: {accepted / (steps * len(prompts) * depth):.2f} ({accepted} drafts kept)")
    print(f"tokens per verify step: {(accepted + steps * len(prompts)) / (steps * len(prompts)):.2f}")
    print(f"identical to plain greedy decoding: {len(prompts)} sequences x {args.new_tokens} tokens")


if __name__ == "__main__":
    main()
