"""The paged_kv ops on a toy batch: build a collection, give each sequence pages, store, attend.

Two sequences share one pool: a prefill of 5 tokens and one of 11, then a decode step of one
token each. `flash_attention` reads K/V straight from the pages; we check it against SDPA.
"""

import torch
import torch.nn.functional as F

import torch_paged_kv as pk

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
params = pk.KVCacheParams(torch.float32, num_layers=1, num_kv_heads=2, head_dim=16, page_size=4)
kv = pk.PagedKVCacheCollection(params, num_pages=16, max_batch_size=2, max_seq_len=32, device=device)
kv.lookup_table[0, :4] = torch.tensor([3, 1, 7, 5])  # any free pages, in any order (0 is the null page)
kv.lookup_table[1, :4] = torch.tensor([2, 4, 6, 8])
lengths, table, offsets = kv.step_tensors(2)
history = [([], []), ([], [])]  # every key and value per sequence, for the SDPA check

for new in ([5, 11], [1, 1]):  # prefill, then one decode step
    offsets[1:] = torch.tensor(new).cumsum(0)
    q = torch.randn(sum(new), 4, 16, device=device)  # 4 query heads over 2 KV heads (GQA)
    k, v = torch.randn(2, sum(new), 2, 16, device=device)
    pk.store_kv(k, v, kv.blocks, lengths, table, offsets, 0)
    out = pk.flash_attention(q, kv.blocks, lengths, table, offsets, 0, 16**-0.5)

    for b in range(2):  # SDPA reference, one sequence at a time
        rows = slice(int(offsets[b]), int(offsets[b + 1]))
        history[b][0].append(k[rows])
        history[b][1].append(v[rows])
        keys, values = (torch.cat(h).transpose(0, 1) for h in history[b])
        past = int(lengths[b])
        causal = torch.arange(keys.shape[1], device=device) <= past + torch.arange(new[b], device=device)[:, None]
        ref = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, attn_mask=causal, enable_gqa=True)
        torch.testing.assert_close(out[rows], ref.transpose(0, 1))
    lengths += torch.tensor(new, dtype=torch.int32, device=device)  # the caller advances lengths after a step

print(f"cache_lengths={lengths.tolist()}; flash_attention matches SDPA; backends: {pk.backend_info(device)}")
