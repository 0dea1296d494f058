"""mha.distributed on real processes: gloo over 127.0.0.1, spawned by mha.tools.launch.

Each world size runs its whole matrix in one spawn (starting processes costs seconds); every rank
checks the gathered result against the float64 NumPy oracle (mha.numpy) and returns its errors,
and the test asserts on them. Functions the ranks run are at module level: the spawned processes
import this module.
"""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import mha
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close
from mha import numpy as mnp
from mha import positions
from mha.distributed import SequenceLayout, parallelize, ring_attention, ulysses_attention
from mha.distributed.ring import blocks, units, visible_pairs
from mha.kernels import Contract
from mha.tools.launch import spawn

WORLD_SIZES = (1, 2, 3, 4)
FUNCTIONS = {"ring": ring_attention, "ulysses": ulysses_attention}
EXACT = 1e-10  # float64 against the oracle


# -- the rank side ------------------------------------------------------------------------------------


def _case(fn="ring", balance="zigzag", causal=True, length=37, B=1, H=12, Hkv=12, D=8, Dv=8, window=None,
          alibi=False, softcap=None, sinks=False, scale=None) -> dict:
    return dict(fn=fn, balance=balance, causal=causal, length=length, B=B, H=H, Hkv=Hkv, D=D, Dv=Dv, window=window,
                alibi=alibi, softcap=softcap, sinks=sinks, scale=scale)


def exactness_cases() -> dict[str, dict]:
    """Every function x balance with each option alone and all at once, causal or not, at lengths
    the world sizes divide and do not (37 is prime; 48 divides by 2W for W up to 4 but 3)."""
    cases = {}
    for fn, balance in itertools.product(FUNCTIONS, ("zigzag", "contiguous", "striped")):
        for causal, length in itertools.product((False, True), (37, 48, 5)):
            cases[f"{fn} {balance} causal={causal} T={length}"] = _case(fn, balance, causal, length)
        options = {"GQA 12/2": dict(Hkv=2), "MQA": dict(Hkv=1), "window (6, -1)": dict(window=(6, -1)),
                   "window (3, 4)": dict(window=(3, 4), causal=False), "ALiBi": dict(alibi=True),
                   "softcap": dict(softcap=2.0), "sinks": dict(sinks=True), "Dv 5": dict(Dv=5),
                   "batch 3": dict(B=3), "scale": dict(scale=0.3),
                   "everything": dict(B=2, Hkv=4, window=(9, -1), alibi=True, softcap=3.0, sinks=True, Dv=6),
                   "everything, not causal": dict(causal=False, Hkv=4, window=(5, 7), alibi=True, softcap=3.0,
                                                  sinks=True)}
        for name, option in options.items():
            cases[f"{fn} {balance} {name}"] = _case(fn, balance, **option)
    return cases


def _oracle(c: dict, q, k, v, slopes, sinks, grad_out):
    """Output and gradients of dense attention over the whole sequence (float64 NumPy)."""
    repeat = c["H"] // c["Hkv"]
    kr, vr = (np.repeat(x.numpy(), repeat, axis=1) for x in (k, v))  # (B, Hkv, T, D) -> (B, H, T, D)
    terms = dict(band=positions.band(c["causal"], c["window"]), scale=c["scale"], softcap=c["softcap"],
                 alibi_slopes=None if slopes is None else slopes.numpy(), sinks=None if sinks is None else sinks.numpy())
    out, _ = mnp.contract_attention(q.numpy(), kr, vr, **terms)
    grads = mnp.contract_attention_vjp(q.numpy(), kr, vr, grad_out.numpy(), **terms)
    for name in ("k", "v"):  # shared heads: the sum over the query heads that read them
        grads[name] = grads[name].reshape(c["B"], c["Hkv"], repeat, *grads[name].shape[2:]).sum(2)
    return out, grads


def run_case(c: dict, dtype=torch.float64) -> dict[str, float]:
    """Errors of one case: output and every gradient, gathered, against the oracle."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(c).encode()))  # the same on every rank
    draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    B, H, Hkv, T = c["B"], c["H"], c["Hkv"], c["length"]
    q, k, v, grad_out = draw(B, H, T, c["D"]), draw(B, Hkv, T, c["D"]), draw(B, Hkv, T, c["Dv"]), draw(B, H, T, c["Dv"])
    slopes = torch.rand(H, generator=generator, dtype=torch.float64) if c["alibi"] else None
    sinks = draw(H) if c["sinks"] else None
    layout = SequenceLayout(T, balance=c["balance"])
    shards = [layout.shard(x.to(dtype), dim=2).requires_grad_() for x in (q, k, v)]
    extras = [None if x is None else x.to(dtype, copy=True).requires_grad_() for x in (slopes, sinks)]
    out = FUNCTIONS[c["fn"]](*shards, layout, is_causal=c["causal"], window=c["window"], alibi_slopes=extras[0],
                             softcap=c["softcap"], sinks=extras[1], scale=c["scale"], enable_gqa=Hkv != H)
    out.backward(layout.shard(grad_out.to(dtype), dim=2))
    expected_out, expected = _oracle(c, q, k, v, slopes, sinks, grad_out)
    got = {"out": layout.unshard(out, dim=2)}
    got.update({name: layout.unshard(x.grad, dim=2) for name, x in zip("qkv", shards)})
    for name, x in zip(("alibi_slopes", "sinks"), extras):
        if x is not None:  # each rank's share, summed
            got[name] = x.grad.clone()
            dist.all_reduce(got[name])
    expected["out"] = expected_out
    errors = {name: float(np.abs(got[name].double().numpy() - expected[name]).max()) for name in got}
    errors["padding"] = _padding_error(layout, out, shards)
    return errors


def _padding_error(layout: SequenceLayout, out, shards) -> float:
    """The largest value in a padding slot of the output and the gradients (all must be zero)."""
    padding = layout.positions() >= layout.length
    return max(float(x[:, :, padding].abs().max()) if padding.any() else 0.0
               for x in (out.detach(), *(s.grad for s in shards)))


def rank_exactness() -> dict[str, dict[str, float]]:
    return {name: run_case(c) for name, c in exactness_cases().items()}


def rank_precision() -> dict[str, tuple[float, float]]:
    """(our error, torch's error) against float64, in float32 and bfloat16, ring and Ulysses, causal."""
    found = {}
    for fn, dtype in itertools.product(FUNCTIONS, (torch.float32, torch.bfloat16)):
        generator = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, 12, 96, 16, generator=generator, dtype=torch.float64) for _ in range(3))
        layout = SequenceLayout(96)
        ours = FUNCTIONS[fn](*(layout.shard(x.to(dtype), dim=2) for x in (q, k, v)), layout, is_causal=True)
        ours = layout.unshard(ours, dim=2).double()
        exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        theirs = F.scaled_dot_product_attention(*(x.to(dtype) for x in (q, k, v)), is_causal=True).double()
        found[f"{fn} {dtype}"] = (float((ours - exact).abs().max()), float((theirs - exact).abs().max()))
    return found


def _gradients(module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in module.named_parameters()}


def _compare_sequence_parallel(reference, parallel, inputs, call, seq_dim, layout) -> float:
    """Output and every gradient of a sequence-parallel module against the one-process module."""
    inputs = [x.requires_grad_() for x in inputs]
    out = call(reference, *inputs)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    sharded = {id(x): layout.shard(x.detach(), dim=seq_dim).requires_grad_() for x in inputs}
    shards = [sharded[id(x)] for x in inputs]  # self-attention stays self-attention
    ours = call(parallel, *shards, layout=layout)
    ours.backward(layout.shard(grad_out, dim=seq_dim))
    errors = [(layout.unshard(ours, dim=seq_dim) - out).abs().max()]
    errors += [(layout.unshard(s.grad, dim=seq_dim) - x.grad).abs().max() for s, x in zip(shards, inputs)]
    expected, got = _gradients(reference), _gradients(parallel)
    errors += [(expected[name] - got[name]).abs().max() for name in expected]
    return float(max(errors))


def _compare_head_parallel(reference, parallel, inputs, call) -> float:
    """Output, the inputs' gradients and each rank's slice of every parameter gradient."""
    inputs = [x.requires_grad_() for x in inputs]
    out = call(reference, *inputs)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    copied = {id(x): x.detach().clone().requires_grad_() for x in inputs}
    copies = [copied[id(x)] for x in inputs]
    ours = call(parallel, *copies)
    ours.backward(grad_out)
    errors = [(ours - out).abs().max()] + [(c.grad - x.grad).abs().max() for c, x in zip(copies, inputs)]
    expected, rank = _gradients(reference), dist.get_rank()
    for name, got in _gradients(parallel).items():
        whole = expected[name]
        if whole.shape != got.shape:  # this rank's slice: of each of q, k, v in a packed in_proj
            dim = next(d for d in range(whole.dim()) if whole.shape[d] != got.shape[d])
            parts = 3 if name.startswith("in_proj") else 1
            per = got.shape[dim] // parts
            whole = torch.cat([piece.narrow(dim, rank * per, per) for piece in whole.chunk(parts, dim)], dim)
        errors.append((whole - got).abs().max())
    return float(max(errors))


def _general(**options):
    return mha.GeneralAttention(12, 10, 9, 6, 5, 7, 12, dtype=torch.float64, **options)


def rank_modules() -> dict[str, float]:
    torch.manual_seed(0)
    W = dist.get_world_size()
    found = {}
    general_options = {"plain": {}, "everything": dict(rope=mha.RotaryEmbedding(6), alibi=True, window=(4, -1),
                                                       softcap=3.0, sinks=True, logit_scale=True,
                                                       num_kv_heads=4 if W == 4 else 6)}
    for mode, (name, options) in itertools.product(("ring", "ulysses", "heads"), general_options.items()):
        reference = _general(**options)
        if reference.logit_scale is not None:  # (ones at the start: a factor per head that matters)
            with torch.no_grad():
                reference.logit_scale.copy_(torch.linspace(0.5, 2.0, 12))
        parallel = parallelize(copy.deepcopy(reference), mode)
        x, key, value = torch.randn(2, 23, 12, dtype=torch.float64), torch.randn(2, 23, 10, dtype=torch.float64), \
            torch.randn(2, 23, 9, dtype=torch.float64)
        call = lambda m, *a, **kw: m(*a, is_causal=True, **kw)  # noqa: E731
        if mode == "heads":
            found[f"general {mode} {name}"] = _compare_head_parallel(reference, parallel, [x, key, value], call)
        else:
            layout = SequenceLayout(23)
            found[f"general {mode} {name}"] = _compare_sequence_parallel(reference, parallel, [x, key, value], call,
                                                                         1, layout)
    drop_ins = {"packed": dict(embed_dim=24, num_heads=12), "kdim/vdim, batch_first": dict(
        embed_dim=24, num_heads=12, kdim=6, vdim=7, batch_first=True)}
    for mode, (name, options) in itertools.product(("ring", "ulysses", "heads"), drop_ins.items()):
        reference = mha.nn.MultiheadAttention(**options, dtype=torch.float64)
        parallel = parallelize(copy.deepcopy(reference), mode)
        shape = (2, 21) if options.get("batch_first") else (21, 2)
        x = torch.randn(*shape, 24, dtype=torch.float64)
        key, value = (x, x) if "kdim" not in options else (torch.randn(*shape, 6, dtype=torch.float64),
                                                           torch.randn(*shape, 7, dtype=torch.float64))
        call = lambda m, *a, **kw: m(*a, need_weights=False, is_causal=True, **kw)[0]  # noqa: E731
        if mode == "heads":
            found[f"drop-in {mode} {name}"] = _compare_head_parallel(reference, parallel, [x, key, value], call)
        else:
            layout = SequenceLayout(21, balance="contiguous")
            found[f"drop-in {mode} {name}"] = _compare_sequence_parallel(
                reference, parallel, [x, key, value], call, 1 if options.get("batch_first") else 0, layout)
    return found


def rank_errors() -> dict[str, str]:
    """The messages of the errors only a group of several ranks can raise."""
    found = {}
    layout = SequenceLayout(10)
    q = torch.zeros(1, 3, layout.local_length, 4)
    for name, call in {"ulysses heads": lambda: ulysses_attention(q, q, q, layout),
                       "heads mode": lambda: parallelize(mha.GeneralAttention(6, 6, 6, 2, 2, 6, 4, num_kv_heads=1),
                                                         "heads")}.items():
        try:
            call()
            found[name] = "no error"
        except ValueError as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def rank_layout() -> dict:
    """Each rank's pieces and positions, and shard / unshard of a whole tensor."""
    found = {}
    for balance, length in itertools.product(("zigzag", "contiguous", "striped"), (1, 13, 16)):
        layout = SequenceLayout(length, balance=balance)
        whole = torch.arange(2 * length, dtype=torch.float64).view(2, length)
        shard = layout.shard(whole, dim=1)
        found[(balance, length)] = dict(positions=layout.positions().tolist(), shard=shard.tolist(),
                                        back=bool(torch.equal(layout.unshard(shard, dim=1), whole)),
                                        local_length=layout.local_length)
    return found


def rank_fails() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed on purpose")
    time.sleep(60)  # the others would go on: the launcher must stop them


def rank_hangs() -> None:
    time.sleep(60)


# -- the tests ---------------------------------------------------------------------------------------


# two ranks in the fast set (one spawn, the errors that need several ranks); the other world sizes are slow
@pytest.fixture(scope="module", params=[W if W == 2 else pytest.param(W, marks=pytest.mark.slow) for W in WORLD_SIZES],
                ids=lambda W: f"W{W}")
def world(request):
    """Every rank-side check at one world size, in one spawn."""
    return request.param, spawn(_everything, request.param, timeout=240)


def _everything() -> dict:
    return {"exactness": rank_exactness(), "modules": rank_modules(), "precision": rank_precision(),
            "layout": rank_layout(), "errors": rank_errors() if dist.get_world_size() == 2 else {}}


def test_ring_and_ulysses_equal_dense_attention_in_float64(world):
    """Output and gradients of q, k, v (and of ALiBi slopes and sinks, summed over the ranks) equal
    the float64 oracle to 1e-10 for every case; padding slots hold zeros."""
    W, results = world
    assert len(results[0]["exactness"]) == len(exactness_cases())
    for rank, result in enumerate(results):
        failed = {case: max(errors.values()) for case, errors in result["exactness"].items()
                  if max(errors.values()) > EXACT}
        assert not failed, f"W={W} rank {rank}: {failed}"


def test_low_precision_within_twice_torchs_own_error(world):
    """float32 and bfloat16 (computed and merged in float32): error against float64 at most twice
    torch's SDPA's in the same dtype (plus 1e-6)."""
    W, results = world
    for case, (ours, theirs) in results[0]["precision"].items():
        assert ours <= 2 * theirs + 1e-6, (W, case, ours, theirs)


def test_parallelized_modules_equal_the_one_process_module(world):
    """parallelize: sequence-parallel (ring, ulysses) and head-parallel modules, general and drop-in,
    give the one-process output, input gradients and parameter gradients (heads: each rank's slice)."""
    W, results = world
    for rank, result in enumerate(results):
        assert len(result["modules"]) == 12
        failed = {case: error for case, error in result["modules"].items() if error > EXACT}
        assert not failed, f"W={W} rank {rank}: {failed}"


def test_layouts_place_every_position_once(world):
    W, results = world
    for (balance, length), _ in results[0]["layout"].items():
        taken = [p for r in results for p in r["layout"][(balance, length)]["positions"]]
        assert sorted(taken) == list(range(len(taken))) and len(taken) >= length, (balance, length)
        for r in results:
            found = r["layout"][(balance, length)]
            assert found["back"] and len(found["positions"]) == found["local_length"]
            for slot, position in enumerate(found["positions"]):  # shard = the whole at the slot's position
                expected = [row * length + position if position < length else 0.0 for row in range(2)]
                assert [found["shard"][row][slot] for row in range(2)] == expected
    if W == 4:
        zigzag = [r["layout"][("zigzag", 16)]["positions"] for r in results]
        assert zigzag == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
        striped = [r["layout"][("striped", 13)]["positions"] for r in results]
        assert striped == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_errors_that_need_several_ranks(world):
    W, results = world
    if W != 2:
        return
    errors = results[0]["errors"]
    assert errors["ulysses heads"] == ("ValueError: Ulysses attention splits the heads among the ranks: 3 query heads "
                                       "do not divide among 2 ranks (use ring attention, or a head count divisible by 2)")
    assert errors["heads mode"] == ("ValueError: mode='heads' splits the heads among the ranks: 4 query heads and 1 "
                                    "key/value heads must both divide among 2 ranks")


def test_zigzag_gives_every_rank_and_step_the_same_causal_work():
    """Scores per (rank, step) of a causal ring on 4 ranks, from the schedule (layouts described
    without processes): zigzag the same everywhere, contiguous from a quarter to seven quarters
    of the mean; striped covers the causal triangle too."""
    terms = Contract(band=positions.CAUSAL)
    assert visible_pairs(SequenceLayout(64), 0, 0, terms) == 64 * 65 // 2

    def work(balance):
        layout = SequenceLayout(64, balance=balance, world_size=4)
        return [[visible_pairs(layout, r, (r - t) % 4, terms) for t in range(4)] for r in range(4)]

    assert work("zigzag") == [[136, 128, 128, 128]] * 4  # 8-position chunks: 2 diagonals + 1 full, then 2 full
    assert [sum(row) for row in work("contiguous")] == [136, 392, 648, 904]
    assert [sum(row) for row in work("striped")] == [496 + 16 * r for r in range(4)]  # sum over i of (r + 4i + 1)


def test_a_described_layout_shards_without_a_group():
    layout = SequenceLayout(10, balance="zigzag", world_size=3, rank=2)
    assert layout.local_length == 4 and layout.positions().tolist() == [4, 5, 6, 7]
    assert layout.shard(torch.arange(10.0)[None], dim=1).tolist() == [[4.0, 5.0, 6.0, 7.0]]
    last = SequenceLayout(10, balance="zigzag", world_size=3, rank=0)
    assert last.positions().tolist() == [0, 1, 10, 11] and last.shard(torch.arange(10.0), dim=0).tolist() == [0, 1, 0, 0]
    with raises_exactly(ValueError, "unshard gathers from every rank: it needs a layout of the group, not one given "
                                    "world_size"):
        layout.unshard(torch.zeros(4), dim=0)
    with raises_exactly(ValueError, "rank must be in [0, 3), got 3"):
        SequenceLayout(10, world_size=3, rank=3)


def test_one_process_without_torch_distributed():
    """Not initialised: one process holds the whole sequence and gets plain attention."""
    assert not dist.is_initialized()
    layout = SequenceLayout(10, balance="zigzag")
    assert (layout.world_size, layout.rank, layout.local_length, layout.padded_length) == (1, 0, 10, 10)
    q, k, v = (torch.randn(2, 4, 10, 8, dtype=torch.float64) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for fn in FUNCTIONS.values():
        assert_close(fn(q, k, v, layout, is_causal=True), expected)
    assert torch.equal(layout.unshard(layout.shard(q)), q)
    assert units(10) == [range(0, 5), range(5, 10)] and units(1) == [range(1)]
    found = blocks(layout, 0, 0, Contract(band=positions.CAUSAL))  # zigzag: chunks 0 and 1
    assert [(b.rows, b.cols, b.contract.band, b.contract.offset) for b in found] == [
        (slice(0, 5), slice(0, 5), positions.CAUSAL, 0), (slice(5, 10), slice(0, 5), None, 0),  # chunk 1 sees chunk 0
        (slice(5, 10), slice(5, 10), positions.CAUSAL, 0)]  # chunk 0 never sees chunk 1: skipped


def test_argument_errors():
    layout = SequenceLayout(8)
    q = torch.zeros(1, 4, 8, 16)
    with raises_exactly(TypeError, "layout must be an mha.distributed.SequenceLayout, got int"):
        ring_attention(q, q, q, 8)
    with raises_exactly(ValueError, "q must hold this rank's 8 slots of the sequence (layout.local_length, dim 2), "
                                    "got shape (1, 4, 7, 16)"):
        ring_attention(q[:, :, :7], q, q, layout)
    with raises_exactly(ValueError, "k and v have 2 heads and q has 4: pass enable_gqa=True with key/value heads "
                                    "that divide the query heads"):
        ulysses_attention(q, q[:, :2], q[:, :2], layout)
    with raises_exactly(ValueError, "with enable_gqa the query heads (dim 1: 4) must be a multiple of k's heads (3)"):
        ring_attention(q, q[:, :3], q[:, :3], layout, enable_gqa=True)
    with raises_exactly(ValueError, "with enable_gqa the query heads (dim 1: 4) must be a multiple of k's heads (0)"):
        ring_attention(q, q[:, :0], q[:, :0], layout, enable_gqa=True)  # was a ZeroDivisionError
    with raises_exactly(ValueError, "k's head dim must equal q's (16), got shape (1, 4, 8, 15)"):
        ring_attention(q, q[..., :15], q, layout)
    with raises_exactly(ValueError, "q, k and v must have the same batch size and k, v the same heads, got shapes "
                                    "(1, 4, 8, 16), (2, 4, 8, 16) and (1, 4, 8, 16)"):
        ring_attention(q, q.expand(2, -1, -1, -1), q, layout)
    with raises_exactly(ValueError, "q must be 4-D (batch, heads, local length, head dim), got 3-D with shape (4, 8, 16)"):
        ring_attention(q[0], q, q, layout)
    with raises_exactly(ValueError, "sinks must have shape (4,) (num_heads,): one value per query head (dim -3 of "
                                    "query), got (3,)"):
        ring_attention(q, q, q, layout, sinks=torch.zeros(3))
    with raises_exactly(ValueError, "balance must be one of ('zigzag', 'contiguous', 'striped'), got 'spiral'"):
        SequenceLayout(8, balance="spiral")
    with raises_exactly(ValueError, "length must be greater than 0, got 0"):
        SequenceLayout(0)
    with raises_exactly(ValueError, "group was given but torch.distributed is not initialised (call "
                                    "torch.distributed.init_process_group first)"):
        SequenceLayout(8, group=object())
    with raises_exactly(ValueError, "x must have 8 = the whole sequence (length) entries along dim 1, got shape (2, 9)"):
        layout.shard(torch.zeros(2, 9), dim=1)
    with raises_exactly(ValueError, "dim must be in [-2, 2) for x of shape (2, 8), got 2"):
        layout.shard(torch.zeros(2, 8), dim=2)


def test_parallelize_refuses_what_it_cannot_run():
    with raises_exactly(TypeError, "parallelize takes an mha.GeneralAttention or mha.nn.MultiheadAttention, got Linear"):
        parallelize(torch.nn.Linear(2, 2))
    with raises_exactly(ValueError, "mode must be one of ('ring', 'ulysses', 'heads'), got 'rings'"):
        parallelize(mha.nn.MultiheadAttention(8, 2), "rings")
    module = parallelize(mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2), "ring")
    assert type(module).__name__ == "SequenceParallelGeneralAttention" and "parallel='ring'" in repr(module)
    x = torch.randn(1, 6, 8)
    with raises_exactly(ValueError, "a module parallelized with mode='ring' does not take key_padding_mask; causality, "
                                    "windows, ALiBi, softcap, sinks, logit_scale, RoPE and GQA are supported"):
        module(x, x, x, key_padding_mask=torch.zeros(1, 6, dtype=torch.bool))
    with raises_exactly(ValueError, "the module is already parallelized ('ring')"):
        parallelize(module, "heads")
    drop_in = parallelize(mha.nn.MultiheadAttention(8, 2), "ulysses")
    with raises_exactly(ValueError, "a MultiheadAttention parallelized with mode='ulysses' returns no attention "
                                    "weights: call it with need_weights=False"):
        drop_in(x[0], x[0], x[0])
    with raises_exactly(ValueError, "an efficient attention variant is not parallelized: use attention='exact'"):
        parallelize(mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2, attention="linear"), "heads")


@pytest.mark.slow
def test_a_failing_rank_stops_the_others_at_once():
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose"):
        spawn(rank_fails, 3, timeout=60)
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_a_hanging_run_ends_at_its_timeout():
    start = time.monotonic()
    with raises_exactly(TimeoutError, "the 2 ranks did not finish within 8 s"):
        spawn(rank_hangs, 2, timeout=8)
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_the_command_and_torchrun_run_and_check(tmp_path):
    """mha distributed spawns its ranks and checks the result; torchrun runs the same demo."""
    done = subprocess.run([sys.executable, "-m", "mha", "distributed", "--nproc", "2", "--length", "600", "--causal",
                           "--heads", "2", "--head-dim", "16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "balance, slowest / fastest rank" in done.stdout and "ok the float32 tolerance" in done.stdout
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "mha.tools.distributed_demo", "--length", "600", "--mode", "ulysses", "--heads", "2", "--head-dim", "16"]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ulysses attention, 2 ranks" in done.stdout and "largest error against one-process flash" in done.stdout
