"""Seed 000: the paper's per-head matrices pulled out of torch.nn.MultiheadAttention.

head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V,  MHA = concat(head_1..head_h) W^O.
torch packs W^Q, W^K, W^V (transposed) into in_proj_weight; mha.layouts.per_head undoes that,
and mha.layouts.per_head_attention computes the formula with a loop over heads.

    python examples/seed000_per_head_from_torch.py
"""

import torch

from mha import layouts

torch.manual_seed(0)

# 1. The seed's readable trace: W = 1..48, X = 51..58 (L=2, D=4, h=2).
L, D, h = 2, 4, 2
W = torch.arange(1, 1 + 3 * D * D, dtype=torch.float32).reshape(3 * D, D)
X = torch.arange(51, 59, dtype=torch.float32).reshape(L, D)
general = layouts.to_general({"in_proj_weight": W, "out_proj.weight": torch.eye(D)}, "torch")
heads = layouts.per_head(general, h)
q_0 = X @ heads.W_q[0]  # the seed's q for head 0: [[530, 1370], [570, 1474]]
q_1 = X @ heads.W_q[1]  # and head 1: [[2210, 3050], [2378, 3282]]
assert q_0.tolist() == [[530.0, 1370.0], [570.0, 1474.0]], q_0
assert q_1.tolist() == [[2210.0, 3050.0], [2378.0, 3282.0]], q_1
print("W_0^Q =\n", heads.W_q[0], "\nq_0 = X W_0^Q =\n", q_0)

# 2. One head and two heads: the per-head loop equals torch on unbatched input.
for D, h in ((3, 1), (4, 2), (12, 3)):
    torch_attention = torch.nn.MultiheadAttention(embed_dim=D, num_heads=h)
    heads = layouts.per_head(layouts.to_general(torch_attention.state_dict(), "torch"), h)
    X = torch.randn(5, D)  # unbatched (L, D)
    want, _ = torch_attention(X, X, X)
    got = layouts.per_head_attention(X, X, X, heads)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    print(f"D={D} h={h}: per-head loop == torch.nn.MultiheadAttention, max |diff| = "
          f"{(got - want).abs().max().item():.1e}")
