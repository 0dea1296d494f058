"""Seed 003: "Life is short, eat dessert first" with one head (d_q = d_k = 24, d_v = 28), then
three heads with stacked weights, then the labml layout (seq-first, mask [T_q, T_k, B]).

    python examples/seed003_life_is_short.py
"""

import torch

from mha import GeneralAttention, layouts

sentence = "Life is short, eat dessert first"
vocabulary = {s: i for i, s in enumerate(sorted(sentence.replace(",", "").split()))}
tokens = torch.tensor([vocabulary[s] for s in sentence.replace(",", "").split()])
torch.manual_seed(123)
x = torch.nn.Embedding(6, 16)(tokens).detach()  # (6 words, d = 16)

# --- one head: W_query (24, 16), W_key (24, 16), W_value (28, 16), no output projection -------
torch.manual_seed(123)
d, d_q, d_k, d_v = 16, 24, 24, 28
W_query, W_key, W_value = torch.rand(d_q, d), torch.rand(d_k, d), torch.rand(d_v, d)
single = GeneralAttention(cq=d, ck=d, cv=d, dk=d_k, dv=d_v, do=d_v, h=1, bias=False)
with torch.no_grad():
    single.q_proj.weight.copy_(W_query)
    single.k_proj.weight.copy_(W_key)
    single.v_proj.weight.copy_(W_value)
    single.out_proj.weight.copy_(torch.eye(d_v))  # identity: the context vectors themselves
context, weights = single.forward_with_weights(x, x, x)
print("attention weights of 'is':", weights[1])
expected = torch.tensor([0.2912, 0.0106, 0.0982, 0.0625, 0.4917, 0.0458])  # the seed's printout
assert torch.allclose(weights[1], expected, atol=1e-4), weights[1]
assert torch.allclose(context[1, :4], torch.tensor([-1.5993, 0.0156, 1.2670, 0.0032]), atol=1e-4)

# --- three heads with stacked weights, as the seed builds them ----------------------------------
h = 3
multihead_W_query, multihead_W_key = torch.rand(h, d_q, d), torch.rand(h, d_k, d)
multihead_W_value = torch.rand(h, d_v, d)
W_o = torch.eye(h * d_v)  # concat(head_1..head_3) as the output
heads = layouts.PerHead(W_q=[w.T for w in multihead_W_query], W_k=[w.T for w in multihead_W_key],
                        W_v=[w.T for w in multihead_W_value], W_o=W_o)
multi = layouts.general_module(layouts.from_per_head(heads), "general", num_heads=h)
stacked_inputs = x.T.repeat(h, 1, 1)  # (3, 16, 6)
keys = torch.bmm(multihead_W_key, stacked_inputs).permute(0, 2, 1)  # (3, 6, 24), the seed's bmm
values = torch.bmm(multihead_W_value, stacked_inputs).permute(0, 2, 1)  # (3, 6, 28)
queries = torch.bmm(multihead_W_query, stacked_inputs).permute(0, 2, 1)  # (3, 6, 24)
by_hand = torch.softmax(queries @ keys.transpose(1, 2) / d_k ** 0.5, dim=-1) @ values  # (3, 6, 28)
with torch.no_grad():
    out = multi(x, x, x)  # (6, 3 * 28)
assert torch.allclose(out, by_hand.permute(1, 0, 2).reshape(6, h * d_v), atol=1e-4)
assert torch.allclose(out, layouts.per_head_attention(x, x, x, heads), atol=1e-4)
print(f"3 heads with stacked weights: output {tuple(out.shape)} equals the seed's bmm computation")

# --- the labml layout: query.linear / key.linear / value.linear / output, seq-first, mask [T_q, T_k, B]
torch.manual_seed(0)
projections = {name: torch.nn.Linear(d, h * 8) for name in ("query", "key", "value")}  # labml: d_k = 8
output = torch.nn.Linear(h * 8, d)
labml = {f"{name}.linear.{p}": getattr(lin, p) for name, lin in projections.items() for p in ("weight", "bias")}
labml.update({"output.weight": output.weight, "output.bias": output.bias})
module = layouts.general_module(labml, "labml", num_heads=h)


def labml_forward(x, mask):
    """labml's GeneralAttention.forward: [T, B, d] in, einsum scores, softmax over keys (dim 1)."""
    T, B, _ = x.shape
    q, k, v = (projections[n](x).view(T, B, h, 8) for n in ("query", "key", "value"))  # [T, B, h, d_k]
    scores = torch.einsum("ibhd,jbhd->ijbh", q, k) / 8 ** 0.5  # [T_q, T_k, B, h]
    scores = scores.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
    attn = torch.softmax(scores, dim=1)
    return output(torch.einsum("ijbh,jbhd->ibhd", attn, v).reshape(T, B, -1))  # [T, B, d]


seq_first = torch.stack([x, x.flip(0)], dim=1)  # [T, B=2, d]
mask = torch.tril(torch.ones(6, 6)).unsqueeze(-1).repeat(1, 1, 2)  # [T_q, T_k, B]: 1 = may attend
mask[:, 4, 1] = 0  # the second sequence may not look at position 4
attn_mask = layouts.labml_mask_to_attn_mask(mask, num_heads=h)
batch_first = layouts.seq_first_to_batch_first(seq_first)
with torch.no_grad():
    out = layouts.batch_first_to_seq_first(module(batch_first, batch_first, batch_first, attn_mask=attn_mask))
    want = labml_forward(seq_first, mask)
assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
print(f"labml layout, seq-first, mask [T_q, T_k, B]: equals labml's own forward, max |diff| = "
      f"{(out - want).abs().max().item():.1e}")
