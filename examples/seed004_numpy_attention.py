"""Seed 004: self-attention in NumPy with a causal mask, batched, multi-head, and a transformer
block, each checked against torch (float32, as the seed does).

    python examples/seed004_numpy_attention.py
"""

import numpy as np
import torch
import torch.nn as nn

from mha import numpy as mnp

torch.manual_seed(0)
T, d = 100, 64
M = torch.triu(-float("inf") * torch.ones(T, T), 1)  # the seed's additive causal mask


def norm(a, b):
    return float(np.linalg.norm(a - b))


# one head, one sequence, then a batch of 10
attn = nn.MultiheadAttention(d, 1, bias=False, batch_first=True)
params = {k: v.detach().numpy() for k, v in attn.state_dict().items()}
for X in (torch.randn(1, T, d), torch.randn(10, T, d)):
    Y_, A_ = attn(X, X, X, attn_mask=M)
    Y, A = mnp.multi_head_attention(X.numpy(), X.numpy(), X.numpy(), params, 1, attn_mask=M.numpy(), batch_first=True)
    print(f"batch {X.shape[0]:2}: |A - A_| = {norm(A, A_.detach().numpy()):.1e}, |Y - Y_| = {norm(Y, Y_.detach().numpy()):.1e}")
    assert norm(A, A_.detach().numpy()) < 1e-5 and norm(Y, Y_.detach().numpy()) < 1e-4  # seed: 5.5e-7, 4.0e-6

# the same with is_causal instead of the mask, through the SDPA oracle
q = np.random.default_rng(0).normal(size=(10, T, d)).astype(np.float32)
out, weights = mnp.scaled_dot_product_attention(q, q, q, is_causal=True)
ref = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(q),) * 3, is_causal=True)
assert norm(out, ref.numpy()) < 1e-4 and np.allclose(np.triu(weights[0], 1), 0)

# four heads
heads = 4
attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
params = {k: v.detach().numpy() for k, v in attn.state_dict().items()}
X = torch.randn(10, T, d)
Y_, A_ = attn(X, X, X, attn_mask=M)
Y, A = mnp.multi_head_attention(X.numpy(), X.numpy(), X.numpy(), params, heads, attn_mask=M.numpy(),
                                batch_first=True, average_attn_weights=False)
print(f"{heads} heads: A {A.shape}, |Y - Y_| = {norm(Y, Y_.detach().numpy()):.1e}, "
      f"|mean_h A - A_| = {norm(A.mean(1), A_.detach().numpy()):.1e}")
assert A.shape == (10, heads, T, T) and norm(Y, Y_.detach().numpy()) < 1e-4  # seed: 4.1e-6
assert norm(A.mean(1), A_.detach().numpy()) < 1e-5  # seed: 4.2e-7

# the transformer block, equal to nn.TransformerEncoderLayer (linear biases zeroed, as the seed)
trans = nn.TransformerEncoderLayer(d, heads, dim_feedforward=128, dropout=0.0, batch_first=True)
trans.linear1.bias.data.zero_()
trans.linear2.bias.data.zero_()
Y_ = trans(X, M)
params = {k: v.detach().numpy() for k, v in trans.state_dict().items()}
Y = mnp.transformer_encoder_layer(X.numpy(), params, heads, src_mask=M.numpy(), batch_first=True,
                                  layer_norm_eps=trans.norm1.eps)
print(f"transformer block: |Y - Y_| = {norm(Y, Y_.detach().numpy()):.1e}")
assert norm(Y, Y_.detach().numpy()) < 1e-4  # seed: 2.8e-5
