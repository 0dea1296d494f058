"""mha.kernels.dispatch.attention_with_lse / backward_with_lse and the in-place merges: attention
split over key blocks, in one process.

Blocks of keys computed apart and merged by log-sum-exp equal attention over all the keys; their
backward contributions, given the whole softmax's output and log-sum-exp, add up to its gradients.
This is what the ring (mha.distributed) is made of; here without processes, against the math backend.
"""

import pytest
import torch

from helpers.tolerance import assert_close
from mha import positions
from mha.kernels import Contract, dispatch, math_attention, sdpa
from mha.kernels.merge import add_sinks, merge_into, sink_gradient
from mha.positions import Band

B, H, Hkv, L, S, D = 2, 4, 2, 11, 13, 8
CUT = 6  # keys [0, CUT) and [CUT, S)


def _inputs(Dv=D):
    torch.manual_seed(0)
    return (torch.randn(B, H, L, D, dtype=torch.float64), torch.randn(B, Hkv, S, D, dtype=torch.float64),
            torch.randn(B, Hkv, S, Dv, dtype=torch.float64))


def _whole(q, k, v, contract):
    """Reference output and gradients: the math backend over all keys (kv heads repeated)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, _ = math_attention(q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), contract)
    return out, q, k, v


CONTRACTS = {
    "none": lambda: Contract(),
    "causal, bottom-right": lambda: Contract(band=positions.CAUSAL, offset=S - L),
    "window": lambda: Contract(band=Band(3, 2), offset=1),
    "ALiBi": lambda: Contract(alibi_slopes=torch.rand(H, dtype=torch.float64), offset=2),
    "softcap + scale": lambda: Contract(softcap=2.0, scale=0.4),
    "ALiBi + causal": lambda: Contract(band=positions.CAUSAL, alibi_slopes=torch.rand(H, dtype=torch.float64)),
}


def _part(contract, start):
    """The contract of keys from ``start`` on: key j of the part is key start + j (offset - start)."""
    return contract.replace(offset=contract.offset - start)


@pytest.mark.parametrize("name", CONTRACTS)
def test_parts_merge_to_the_whole_and_their_gradients_add_up(name):
    contract = CONTRACTS[name]()
    q, k, v = _inputs(Dv=5 if name == "window" else D)
    out = torch.zeros(B, H, L, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, H, L), float("-inf"), dtype=torch.float64)
    parts = [(0, CUT), (CUT, S)]
    for start, stop in parts:
        merge_into(out, lse, *dispatch.attention_with_lse(q, k[:, :, start:stop], v[:, :, start:stop], _part(contract, start)))
    expected, qr, kr, vr = _whole(q, k, v, contract)
    assert_close(out, expected.detach())
    grad_out = torch.randn_like(out)
    expected.backward(grad_out)
    dq, dk, dv, d_slopes = torch.zeros_like(q), [], [], 0
    for start, stop in parts:
        grads = dispatch.backward_with_lse(q, k[:, :, start:stop], v[:, :, start:stop], _part(contract, start),
                                           out, lse, grad_out)
        dq += grads[0]
        dk.append(grads[1])
        dv.append(grads[2])
        d_slopes = d_slopes + (0 if grads[3] is None else grads[3])
    assert_close(dq, qr.grad)
    assert_close(torch.cat(dk, 2), kr.grad)
    assert_close(torch.cat(dv, 2), vr.grad)
    if contract.alibi_slopes is not None:  # the math backend's slope gradient, through autograd
        slopes = contract.alibi_slopes.clone().requires_grad_()
        again, *_ = _whole(q, k, v, contract.replace(alibi_slopes=slopes))
        again.backward(grad_out)
        assert_close(d_slopes, slopes.grad)


def test_sinks_join_once_after_the_merge():
    q, k, v = _inputs()
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)
    out, lse = dispatch.attention_with_lse(q, k, v, Contract())
    out, lse = out.clone(), lse.clone()
    add_sinks(out, lse, sinks.detach())
    expected, *_ = _whole(q, k, v, Contract(sinks=sinks))
    assert_close(out, expected.detach())
    grad_out = torch.randn_like(out)
    expected.backward(grad_out)
    delta = (grad_out * out).sum(-1)  # rowsum(dO * O)
    assert_close(sink_gradient(sinks.detach(), lse, delta), sinks.grad)
    lse[0, 0, 0] = float("-inf")  # a row that saw nothing contributes nothing (no NaN)
    assert torch.isfinite(sink_gradient(sinks.detach(), lse, delta)).all()


def test_a_block_with_no_visible_key_merges_as_nothing():
    q, k, v = _inputs()
    out, lse = dispatch.attention_with_lse(q, k, v, Contract())
    before = out.clone()
    nothing = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    merge_into(out, lse, *nothing)
    assert torch.equal(out, before)
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    merge_into(empty_out, empty_lse, *nothing)  # both empty: zeros, not NaN
    assert torch.equal(empty_out, torch.zeros_like(out)) and torch.isinf(empty_lse).all()


def test_torchs_fused_kernel_takes_plain_and_causal_blocks_and_lagging_ones():
    q = torch.randn(1, 2, 8, 4)
    kv = torch.randn(1, 2, 8, 4)
    fused = lambda contract, k=kv: sdpa.lse_form(q, k, k, contract)  # noqa: E731
    assert fused(Contract()) == (False, 0)
    assert fused(Contract(band=positions.CAUSAL)) == (True, 0)
    assert fused(Contract(band=Band(None, -1))) == (True, 1)  # j <= i - 1: a striped block
    assert fused(Contract(band=positions.CAUSAL, offset=-3)) == (True, 3)
    for contract in (Contract(band=positions.CAUSAL, offset=2), Contract(band=Band(2, 0)),
                     Contract(alibi_slopes=torch.ones(2)), Contract(softcap=1.0), Contract(band=Band(None, -8))):
        assert fused(contract) is None, contract
    assert fused(Contract(band=positions.CAUSAL), torch.randn(1, 2, 9, 4)) is None  # not square


def _one_part_equals_math(q, k, v, contract):
    """A single part (all the keys): its output and gradients are the math backend's; returns its lse."""
    out, lse = dispatch.attention_with_lse(q, k, v, contract)
    expected, _ = math_attention(q, k, v, contract)
    assert_close(out, expected)
    grad_out = torch.randn_like(out)
    ours = dispatch.backward_with_lse(q, k, v, contract, out, lse, grad_out)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    math_attention(qr, kr, vr, contract)[0].backward(grad_out)
    for got, want in zip(ours[:3], (qr.grad, kr.grad, vr.grad)):
        assert_close(got, want)
    return lse


def test_a_lagging_block_on_the_fused_kernel_equals_flash():
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    lse = _one_part_equals_math(q, k, v, Contract(band=Band(None, -2)))  # query i sees keys j <= i - 2
    assert torch.isinf(lse[..., :2]).all() and torch.isfinite(lse[..., 2:]).all()  # rows 0 and 1 see nothing


def test_plain_causal_and_lagging_blocks_run_on_torchs_kernel_with_the_contracts_scale(monkeypatch):
    """The fused path is taken (it is what makes the ring fast) and honours an explicit scale."""
    calls = []
    fused, fused_backward = sdpa._FUSED, sdpa._FUSED_BACKWARD
    monkeypatch.setattr(sdpa, "_FUSED", lambda *a, **kw: calls.append("forward") or fused(*a, **kw))
    monkeypatch.setattr(sdpa, "_FUSED_BACKWARD", lambda *a, **kw: calls.append("backward") or fused_backward(*a, **kw))
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    for contract in (Contract(scale=0.3), Contract(band=positions.CAUSAL, scale=0.3), Contract(band=Band(None, -2), scale=0.3)):
        calls.clear()
        _one_part_equals_math(q, k, v, contract)
        assert calls == ["forward", "backward"], contract


def test_sink_gradient_comes_in_the_sinks_dtype():
    sinks = torch.zeros(H, dtype=torch.float32)
    lse, delta = torch.randn(B, H, L, dtype=torch.float64), torch.randn(B, H, L, dtype=torch.float64)
    assert sink_gradient(sinks, lse, delta).dtype == torch.float32
