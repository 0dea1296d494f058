"""RoPE against its formula, in both conventions, partial, with offsets."""

import math

import pytest
import torch

from mha.rope import RotaryEmbedding, apply_rope


def _by_hand(x, positions, base, rotary_dim, interleaved):
    """The formula, one pair at a time."""
    out = x.clone().double()
    L = x.shape[-2]
    for t in range(L):
        p = float(positions[t])
        for i in range(rotary_dim // 2):
            theta = p * base ** (-2 * i / rotary_dim)
            a_idx, b_idx = (2 * i, 2 * i + 1) if interleaved else (i, i + rotary_dim // 2)
            a, b = x[..., t, a_idx].double(), x[..., t, b_idx].double()
            out[..., t, a_idx] = a * math.cos(theta) - b * math.sin(theta)
            out[..., t, b_idx] = a * math.sin(theta) + b * math.cos(theta)
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [8, 4])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rope_equals_the_formula(interleaved, rotary_dim, base):
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    positions = torch.arange(7, 12)  # an offset: the tokens after 7 cached ones
    got = apply_rope(x, positions, base=base, rotary_dim=rotary_dim, interleaved=interleaved)
    torch.testing.assert_close(got, _by_hand(x, positions, base, rotary_dim, interleaved), atol=1e-6, rtol=0)


def test_rope_makes_scores_depend_on_relative_position_only():
    q, k = torch.randn(1, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)
    rope = RotaryEmbedding(8)
    score = lambda m, n: (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum()  # noqa: E731
    torch.testing.assert_close(score(3, 1), score(13, 11), atol=1e-5, rtol=0)
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_per_sequence_positions_and_dtypes():
    x = torch.randn(2, 4, 3, 6).bfloat16()
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]]).view(2, 1, 3)  # (N, 1, L): per sequence
    got = apply_rope(x, positions)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got[1].float(), apply_rope(x[1].float(), torch.arange(5, 8)), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dim", [0, 3, 10])
def test_bad_rotary_dim(dim):
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rope(torch.randn(2, 8), torch.arange(2), rotary_dim=dim)


def test_the_defaults_are_pinned_to_the_paper():
    """base 10000 and half-split (GPT-NeoX / Llama) pairs unless asked otherwise: checked against the
    formula written out, not against RoPE itself."""
    rope = RotaryEmbedding(8)
    assert (rope.base, rope.rotary_dim, rope.interleaved) == (10000.0, 8, False)
    x = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    positions = torch.arange(6)
    want = _by_hand(x, positions, 10000.0, 8, False)
    torch.testing.assert_close(rope(x, positions), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(x, positions), want, atol=1e-6, rtol=0)
