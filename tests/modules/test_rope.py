"""RoPE against its formula, in both conventions, partial, with offsets."""

import math

import pytest
import torch

from mha.modules.rope import RotaryEmbedding, apply_rope


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


def test_the_module_passes_its_settings():
    rope = RotaryEmbedding(4, base=500.0, interleaved=True)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    positions = torch.arange(3, 8)
    torch.testing.assert_close(rope(x, positions), _by_hand(x, positions, 500.0, 4, True), atol=1e-6, rtol=0)
    assert repr(rope) == "RotaryEmbedding(rotary_dim=4, base=500.0, interleaved=True)"


def test_angles_are_formed_in_float64_and_rounded_once():
    """theta_i = base^(-2i/d) and p·theta_i in float64, then one rounding to float32 (at position
    70,000 a float32 frequency would move the angle by about 1e-3 rad): bit for bit."""
    x = torch.randn(3, 16)
    positions = torch.tensor([5, 70_000, 123_457])
    inv_freq = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    angles = (positions.double()[:, None] * inv_freq).float()  # (L, 8)
    cos, sin = angles.cos(), angles.sin()
    a, b = x[:, :8], x[:, 8:]
    want = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    assert torch.equal(apply_rope(x, positions), want)


def test_any_positive_finite_base_and_exact_messages():
    x = torch.randn(2, 4, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, torch.arange(2), base=0.5), _by_hand(x, torch.arange(2), 0.5, 4, False),
                               atol=1e-6, rtol=0)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match=r"^base must be a finite number greater than 0 \(RoPE's frequencies are "
                                             rf"base\^\(-2i/d\)\), got {bad}$"):
            RotaryEmbedding(4, base=bad)
    with pytest.raises(TypeError, match=r"^base must be a real number"):
        apply_rope(x, torch.arange(2), base="big")
    with pytest.raises(ValueError, match=r"^rotary_dim must be even, got 3$"):
        RotaryEmbedding(3)
    with pytest.raises(ValueError, match=r"^rotary_dim must be greater than 0, got 0$"):
        RotaryEmbedding(0)
    with pytest.raises(TypeError, match=r"^interleaved must be a bool, got int \(1\)$"):
        RotaryEmbedding(4, interleaved=1)
    with pytest.raises(ValueError, match=r"^rotary_dim must be even and in \(0, 4\], got 6$"):
        apply_rope(x, torch.arange(2), rotary_dim=6)
