"""Seed 002: the general GeneralAttention(cq, ck, cv, dk, dv, do, h) loaded from torch with
kdim != vdim and add_bias_kv, with the seed's own weight-copying code, in all four bias settings.

    python examples/seed002_general_from_torch.py
"""

import itertools

import torch

from mha import GeneralAttention

batch_dim, M, N = 10, 5, 3  # batch, query length, key/value length
d, ck, cv, h = 16, 32, 64, 2

for bias, add_bias_kv in itertools.product([False, True], [True, False]):
    torch_attn = torch.nn.MultiheadAttention(embed_dim=d, kdim=ck, vdim=cv, num_heads=h, batch_first=True,
                                             bias=bias, add_bias_kv=add_bias_kv)
    q, k, v = torch.rand(batch_dim, M, d), torch.rand(batch_dim, N, ck), torch.rand(batch_dim, N, cv)
    dh = d // h
    our_attn = GeneralAttention(cq=d, ck=ck, cv=cv, dk=dh, dv=dh, do=d, h=h, bias=bias, add_bias_kv=add_bias_kv)
    with torch.no_grad():  # the seed's loading code, unchanged
        our_attn.q_proj.weight.copy_(torch_attn.q_proj_weight)
        our_attn.k_proj.weight.copy_(torch_attn.k_proj_weight)
        our_attn.v_proj.weight.copy_(torch_attn.v_proj_weight)
        b = torch_attn.in_proj_bias
        if bias:
            our_attn.q_proj.bias.copy_(b[0:d])
            our_attn.k_proj.bias.copy_(b[d:2 * d])
            our_attn.v_proj.bias.copy_(b[2 * d:3 * d])
        if add_bias_kv:
            our_attn.bias_k.copy_(torch_attn.bias_k.squeeze(0))
            our_attn.bias_v.copy_(torch_attn.bias_v.squeeze(0))
        our_attn.out_proj.weight.copy_(torch_attn.out_proj.weight)
        if bias:
            our_attn.out_proj.bias.copy_(torch_attn.out_proj.bias)
    o_our = our_attn(q, k, v)
    o_torch, _ = torch_attn(q, k, v)
    shapes = {n: tuple(p.shape) for n, p in our_attn.named_parameters()}
    expected = {**({"bias_k": (1, 1, d), "bias_v": (1, 1, d)} if add_bias_kv else {}),  # the seed's printout
                "q_proj.weight": (d, d), "k_proj.weight": (d, ck), "v_proj.weight": (d, cv),
                "out_proj.weight": (d, d)}
    assert {n: s for n, s in shapes.items() if not n.endswith(".bias")} == expected, shapes
    assert next(iter(shapes)) == ("bias_k" if add_bias_kv else "q_proj.weight")  # the seed's order
    assert o_our.shape == (batch_dim, M, d)
    assert torch.allclose(o_our, o_torch, atol=1e-6), (o_our - o_torch).abs().max()
    print(f"bias={bias!s:5} add_bias_kv={add_bias_kv!s:5}: max |ours - torch| = "
          f"{(o_our - o_torch).abs().max().item():.1e}; parameters: "
          + ", ".join(f"{n} {tuple(p.shape)}" for n, p in our_attn.named_parameters()))
