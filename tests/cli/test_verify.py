"""mha.nn.MultiheadAttention against torch and the float64 oracle over random configurations.

Forward output, returned weights (averaged and per head) and the gradients of the inputs and of
every parameter; float64 within 1e-10 of the oracle, float32 within 2x torch's own float32 error.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mha import kernels
from mha.tools import verify


@st.composite
def cases(draw):
    return verify.Case(
        group="hypothesis",
        num_heads=draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8])),
        head_dim=draw(st.sampled_from([1, 2, 3, 4, 8])),
        kdim=draw(st.one_of(st.none(), st.integers(1, 9))),
        vdim=draw(st.one_of(st.none(), st.integers(1, 9))),
        bias=draw(st.booleans()),
        add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        batched=draw(st.booleans()),
        batch=draw(st.integers(1, 3)),
        L=draw(st.integers(1, 9)),
        S=draw(st.integers(1, 9)),
        self_attention=draw(st.booleans()),
        attn_mask=draw(st.sampled_from(verify.MASK_KINDS)),
        key_padding_mask=draw(st.sampled_from(verify.PADDING_KINDS)),
        is_causal=draw(st.booleans()),
        need_weights=draw(st.booleans()),
        average_attn_weights=draw(st.booleans()),
        training=draw(st.booleans()),
        grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    ).consistent()


@given(cases())
def test_random_configuration_matches_torch_and_oracle(case):
    result = verify.run_case(case)
    assert result.passed, f"{case.describe()}: {result.failures}"
    assert result.errors["fp64/output"] <= verify.FP64_TOL


@pytest.mark.parametrize("group", list(verify.GROUPS))
def test_every_group_of_the_default_grid(group):
    cases = [c for c in verify.default_grid(per_group=2, seed=7) if c.group == group]
    assert len(cases) == 2
    for case in cases:
        result = verify.run_case(case)
        assert result.passed, f"{case.describe()}: {result.failures}"


def test_grid_covers_every_option():
    grid = verify.default_grid()
    assert len(grid) >= 200
    for flag in ("bias", "add_bias_kv", "add_zero_attn", "batch_first", "batched", "self_attention",
                 "is_causal", "need_weights", "average_attn_weights", "training", "grad"):
        assert {getattr(c, flag) for c in grid} == {False, True}, flag
    assert {c.attn_mask for c in grid} == set(verify.MASK_KINDS)
    assert {c.key_padding_mask for c in grid} == set(verify.PADDING_KINDS)
    assert any(c.L != c.S for c in grid) and any(c.L == 1 for c in grid) and any(c.batch == 1 for c in grid)
    assert any(c.num_heads % 2 for c in grid) and any(c.kdim and c.vdim and c.kdim != c.vdim for c in grid)


@pytest.mark.parametrize("flaw", ["scale", "weights off by 0.1%", "head merge"])
def test_the_parity_check_catches_a_wrong_implementation(monkeypatch, flaw):
    """The matrix can fail: break the math path in three ways and watch every one be caught."""
    original = kernels.BACKENDS["math"]

    def broken(q, k, v, contract, *, dropout_p=0.0):
        if flaw == "scale":
            return original(q, k, v, contract.replace(scale=1.01 * q.shape[-1] ** -0.5), dropout_p=dropout_p)
        out, weights = original(q, k, v, contract, dropout_p=dropout_p)
        if flaw == "weights off by 0.1%":
            weights = weights * 1.001
            return weights @ v, weights
        return out.flip(1), weights  # heads in the wrong order

    monkeypatch.setitem(kernels.BACKENDS, "math", broken)
    case = verify.Case(num_heads=3, head_dim=2, L=4, S=4, need_weights=True)
    result = verify.run_case(case)
    assert not result.passed
    assert any(f.startswith("fp64/output") for f in result.failures)
