"""Seed 001: the Annotated Transformer's attention with named projections Wq, Wk, Wv, Wo,
as a function of an input and a memory (self-attention: memory = input; cross-attention: the
encoder's output), with a padding mask.

The Annotated Transformer stores the four projections as linears.0..3; mha.layouts converts them,
and its mask (B, 1, S) with 1 = attend becomes torch's attn_mask.

    python examples/seed001_input_memory.py
"""

import math

import torch

from mha import layouts

torch.manual_seed(0)
h, d_model, N = 4, 16, 2
d_k = d_model // h
Wq, Wk, Wv, Wo = (torch.nn.Linear(d_model, d_model) for _ in range(4))  # the readable names
annotated = {f"linears.{i}.{p}": getattr(lin, p) for i, lin in enumerate((Wq, Wk, Wv, Wo))
             for p in ("weight", "bias")}
attention = layouts.general_module(annotated, "annotated", num_heads=h)


def readable_forward(input_, memory, mask):
    """The seed's rewrite: transform(raw_sequence, project) for q from the input, k and v from memory."""
    def transform(raw_sequence, project):
        return project(raw_sequence).view(N, -1, h, d_k).transpose(1, 2)  # (N, T, d) -> (N, h, T, d_k)

    query, key, value = transform(input_, Wq), transform(memory, Wk), transform(memory, Wv)
    scores = query @ key.transpose(-2, -1) / math.sqrt(d_k)  # (N, h, L, S)
    scores = scores.masked_fill(mask.unsqueeze(1) == 0, -1e9)  # same mask for every head
    x = torch.softmax(scores, dim=-1) @ value  # (N, h, L, d_k)
    return Wo(x.transpose(1, 2).contiguous().view(N, -1, h * d_k))  # (N, L, d_model)


input_ = torch.randn(N, 5, d_model)
memory = torch.randn(N, 7, d_model)
input_padding = torch.ones(N, 1, 5, dtype=torch.long)
input_padding[0, :, 4:] = 0  # the first input has one padding position
memory_padding = torch.ones(N, 1, 7, dtype=torch.long)
memory_padding[1, :, 5:] = 0  # the second memory has two

with torch.no_grad():
    for name, mem, mask in (("self-attention", input_, input_padding), ("cross-attention", memory, memory_padding)):
        attn_mask = layouts.annotated_mask_to_attn_mask(mask, num_heads=h, query_len=input_.shape[1])
        got = attention(input_, mem, mem, attn_mask=attn_mask)
        want = readable_forward(input_, mem, mask)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        print(f"{name}: mha == Annotated Transformer, max |diff| = {(got - want).abs().max().item():.1e}")
