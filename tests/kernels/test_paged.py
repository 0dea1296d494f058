"""mha.kernels.paged_attention: many sequences' new rows over KV-cache pages in one call.

Every backend is held to the float64 oracle (mha.numpy), each sequence alone and dense,
bottom-right (query r of sequence b at S_b - L_b + r): random, shuffled block tables, blocks
partly filled, one-key sequences, windows shorter than a block, GQA, every term. Bad tables are
ValueErrors naming the argument, never a read out of bounds.
"""

import random

import numpy as np
import pytest
import torch

from mha import kernels
from mha.kernels import native, paged
from mha.numpy.contract import contract_attention

BACKENDS = ["math"] + (["native"] if native.native_available() and hasattr(native, "paged_attention_native") else [])


def _pool(rng: random.Random, lengths_k, P, Hkv, D, Dv, dtype, spare=3):
    """Pages for sequences of these key counts, in shuffled pages, and each sequence's dense keys."""
    used = [-(-S // P) for S in lengths_k]
    N = sum(used) + spare
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    k_pages = torch.randn(N, Hkv, P, D, generator=g, dtype=torch.float64)
    v_pages = torch.randn(N, Hkv, P, Dv, generator=g, dtype=torch.float64)
    order = list(range(N))
    rng.shuffle(order)
    table = torch.full((len(lengths_k), max(used) + rng.randint(0, 2)), -1, dtype=torch.int32)
    dense = []
    for b, n in enumerate(used):
        pages, order = order[:n], order[n:]
        table[b, :n] = torch.tensor(pages, dtype=torch.int32)
        keys = [torch.cat([x[p] for p in pages], dim=1)[:, :lengths_k[b]] for x in (k_pages, v_pages)]  # (Hkv, S, X)
        dense.append(keys)
    return k_pages.to(dtype), v_pages.to(dtype), table, dense


def _case(seed, dtype=torch.float64, **terms):
    rng = random.Random(seed)
    B, Hkv, group, P = rng.randint(1, 4), rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([1, 3, 4, 16])
    H, D, Dv = Hkv * group, rng.choice([4, 8]), rng.choice([4, 6])
    lengths_k = [rng.choice([1, 2, P, P + 1, 3 * P - 1, 20]) for _ in range(B)]
    lengths_q = [rng.choice([1, 1, S, max(1, S // 2)]) for S in lengths_k]  # decode rows, whole prompts, chunks
    k_pages, v_pages, table, dense = _pool(rng, lengths_k, P, Hkv, D, Dv, dtype)
    q = torch.randn(sum(lengths_q), H, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cu = torch.tensor([0, *np.cumsum(lengths_q)])
    return q.to(dtype), k_pages, v_pages, table, cu, torch.tensor(lengths_k), dense, lengths_q


def _oracle(q, dense, lengths_q, *, is_causal=True, window=None, alibi_slopes=None, softcap=None, sinks=None,
            scale=None):
    """Each sequence alone in float64: (Tq, H, Dv)."""
    H, outs, start = q.shape[1], [], 0
    left, right = (None, 0 if is_causal else None) if window is None else (window[0], 0 if is_causal else window[1])
    left, right = (None if w == -1 else w for w in (left, right))
    for (k, v), L in zip(dense, lengths_q):
        S, group = k.shape[1], H // k.shape[0]
        rows = q[start:start + L].double().transpose(0, 1).numpy()[None]  # (1, H, L, D)
        kk, vv = (x.double().repeat_interleave(group, 0).numpy()[None] for x in (k, v))
        out, _ = contract_attention(rows, kk, vv, band=None if (left, right) == (None, None) else (left, right),
                                    offset=S - L, scale=scale, softcap=softcap,
                                    alibi_slopes=None if alibi_slopes is None else alibi_slopes.double().numpy(),
                                    sinks=None if sinks is None else sinks.double().numpy())
        outs.append(torch.from_numpy(out[0]).transpose(0, 1))  # (H, L, Dv) -> (L, H, Dv)
        start += L
    return torch.cat(outs)


TERMS = [dict(), dict(is_causal=False), dict(window=(2, 0)), dict(window=(1, 1), is_causal=False),
         dict(softcap=2.0), dict(scale=0.7), dict(alibi=True), dict(sinks=True),
         dict(window=(3, 0), softcap=5.0, alibi=True, sinks=True)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("terms", TERMS, ids=lambda t: ",".join(t) or "causal")
@pytest.mark.parametrize("seed", range(6))
def test_every_sequence_as_if_alone(backend, terms, seed):
    q, k_pages, v_pages, table, cu, lengths_k, dense, lengths_q = _case(seed)
    terms = dict(terms)
    H = q.shape[1]
    if terms.pop("alibi", False):
        terms["alibi_slopes"] = torch.linspace(0.1, 1.0, H, dtype=torch.float64)
    if terms.pop("sinks", False):
        terms["sinks"] = torch.linspace(-1.0, 1.0, H, dtype=torch.float64)
    dtype = torch.float64 if backend == "math" else torch.float32
    cast = {k: (v.to(dtype) if torch.is_tensor(v) else v) for k, v in terms.items()}
    out = kernels.paged_attention(q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), table, cu, lengths_k,
                                  backend=backend, **cast)
    want = _oracle(q, dense, lengths_q, **terms)
    assert out.shape == want.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=1e-12 if dtype == torch.float64 else 2e-5, rtol=1e-5)


def _bad(change, dtype=torch.float64):
    q, k_pages, v_pages, table, cu, lengths_k, _, _ = _case(3, dtype)
    args = dict(q=q, k_pages=k_pages, v_pages=v_pages, block_table=table, cu_seqlens_q=cu, seqlens_k=lengths_k)
    change(args)
    return args


def _set(name, index, value):
    def change(args):
        args[name] = args[name].clone()
        args[name][index] = value
    return change


# each rule of the counts (paged.check_counts), broken once: the native kernel refuses the same calls
COUNTS = [
    (lambda a: a["block_table"].fill_(-1), "block_table names page -1"),
    (lambda a: a["block_table"].fill_(10 ** 6), "block_table names page 1000000"),
    (lambda a: a.update(seqlens_k=a["seqlens_k"] + 10 ** 4), "need up to"),
    (lambda a: a.update(seqlens_k=a["seqlens_k"] * 0), "seqlens_k must count at least"),
    (_set("seqlens_k", 1, 0), "seqlens_k must count at least"),
    (_set("cu_seqlens_q", 0, 1), "cu_seqlens_q must rise from 0"),
    (_set("cu_seqlens_q", -1, 10 ** 3), "cu_seqlens_q must rise from 0"),
    (lambda a: a.update(block_table=torch.cat([a["block_table"], a["block_table"][:1]]),  # a sequence of no rows
                        seqlens_k=torch.cat([a["seqlens_k"], a["seqlens_k"][:1]]),
                        cu_seqlens_q=torch.cat([a["cu_seqlens_q"], a["cu_seqlens_q"][-1:]])), "at least one row"),
    (lambda a: a.update(cu_seqlens_q=torch.cat([a["cu_seqlens_q"][:1], a["cu_seqlens_q"][2:3], a["cu_seqlens_q"][1:2],
                                                a["cu_seqlens_q"][3:]])), "at least one row"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("change", "error", "message"), [
    *((change, ValueError, message) for change, message in COUNTS),
    (lambda a: a.update(block_table=a["block_table"].float()), TypeError, "block_table must be an integer tensor"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:-1]), ValueError, "cu_seqlens_q needs"),
    (lambda a: a.update(seqlens_k=a["seqlens_k"][None]), ValueError, "seqlens_k must be 1-D"),
    (lambda a: a.update(q=a["q"][:, :, :-1]), ValueError, "k_pages must have q's head dim"),
    (lambda a: a.update(q=a["q"].half()), TypeError, "k_pages has dtype torch.float32 but q has dtype torch.float16"),
    (lambda a: a.update(v_pages=a["v_pages"][:-1]), ValueError, "v_pages must have k_pages' blocks"),
    (lambda a: a.update(k_pages=a["k_pages"].tolist()), TypeError, "k_pages must be a torch.Tensor, got list"),
])
def test_bad_tables_and_shapes_are_refused_naming_the_argument(backend, change, error, message):
    with pytest.raises(error, match=message):  # float32: what both backends run
        kernels.paged_attention(**_bad(change, torch.float32), backend=backend)


@pytest.mark.skipif("native" not in BACKENDS, reason="the native kernel is not built here")
@pytest.mark.parametrize(("change", "message"), COUNTS)
def test_the_kernel_refuses_every_count_the_python_rules_refuse(change, message):
    """The native path leaves the counts to the kernel (Python's rules name the argument only after it
    refuses): a count the kernel let through would be read, so each rule must hold in both."""
    args = _bad(change, torch.float32)
    args = [args[name] for name in ("q", "k_pages", "v_pages", "block_table", "cu_seqlens_q", "seqlens_k")]
    with pytest.raises(RuntimeError, match="mha paged"):
        native.paged_attention_native(*args, kernels.Contract())
    with pytest.raises(ValueError, match=message):
        paged.check_counts(args[0], args[1], *paged._check(*args))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_tables_of_every_width_are_read_alike(backend, dtype):
    q, k_pages, v_pages, table, cu, lengths_k, _, _ = _case(2, torch.float32)
    want = kernels.paged_attention(q, k_pages, v_pages, table, cu, lengths_k, backend=backend)
    out = kernels.paged_attention(q, k_pages, v_pages, table.to(dtype), cu.to(dtype), lengths_k.to(dtype), backend=backend)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_only_the_blocks_a_sequence_uses_must_name_pages_of_the_pool():
    """Entries past a sequence's used blocks may be anything (-1, a page of another pool); a used one
    outside the pool is refused, also in the shorter of two sequences, and in a pool of no pages."""
    q = torch.randn(3, 2, 8)
    pages = torch.randn(4, 2, 2, 8)  # 4 pages of 2 keys
    cu, lengths_k = torch.tensor([0, 2, 3]), torch.tensor([5, 1])  # 3 blocks, then 1
    table = torch.tensor([[0, 1, 2, -1], [3, 99, -7, 10 ** 9]])
    out = kernels.paged_attention(q, pages, pages, table, cu, lengths_k)  # garbage only past the used blocks
    assert out.shape == (3, 2, 8) and out.isfinite().all()
    for b, block, page in ((1, 0, 4), (0, 2, -1), (0, 0, 4)):
        bad = table.clone()
        bad[b, block] = page
        with pytest.raises(ValueError, match=f"block_table names page {page} among a sequence's used blocks"):
            kernels.paged_attention(q, pages, pages, bad, cu, lengths_k)
    with pytest.raises(ValueError, match="block_table names page 0 among a sequence's used blocks; the pool has pages 0..-1"):
        kernels.paged_attention(q, pages[:0], pages[:0], torch.zeros(2, 3, dtype=torch.long), cu, lengths_k)


def test_gradients_are_refused_clearly():
    q, k_pages, v_pages, table, cu, lengths_k, _, _ = _case(0)
    with pytest.raises(ValueError, match="paged_attention is for inference: q requires grad"):
        kernels.paged_attention(q.requires_grad_(), k_pages, v_pages, table, cu, lengths_k)
    with torch.no_grad():
        kernels.paged_attention(q, k_pages, v_pages, table, cu, lengths_k)


def test_auto_is_chosen_by_the_dispatch_and_logged(caplog):
    import logging

    q, k_pages, v_pages, table, cu, lengths_k, _, _ = _case(0, dtype=torch.float32)
    with caplog.at_level(logging.DEBUG, logger="mha.dispatch"):
        kernels.paged_attention(q, k_pages, v_pages, table, cu, lengths_k)
    name, why = kernels.dispatch.choose_paged_backend("auto", q, k_pages, v_pages)
    assert f"backend {name} (paged): {why}" in caplog.text
    assert kernels.dispatch.choose_paged_backend("auto", q.double(), k_pages.double(), v_pages.double())[0] == "math"
    # a head dim of 0 (found by the fuzzer: native raised a RuntimeError): math, which gives zeros
    empty = kernels.paged_attention(q[..., :0], k_pages[..., :0], v_pages, table, cu, lengths_k)
    assert kernels.dispatch.choose_paged_backend("auto", q[..., :0], k_pages[..., :0], v_pages)[0] == "math"
    want = kernels.paged_attention(torch.zeros_like(q), torch.zeros_like(k_pages), v_pages, table, cu, lengths_k)
    torch.testing.assert_close(empty, want)  # no dims: every score 0, as with zero vectors
    assert kernels.paged_attention(q, k_pages, v_pages[..., :0], table, cu, lengths_k).shape == (*q.shape[:2], 0)
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.paged_attention(q, k_pages, v_pages, table, cu, lengths_k, backend="flash")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_key_reaches_only_its_own_sequence_and_no_sequences_is_empty(backend):
    q, k_pages, v_pages, table, cu, lengths_k, _, lengths_q = _case(2, dtype=torch.float32)
    page = int(table[0, 0])
    k_pages[page, 0, 0, 0] = float("nan")  # sequence 0's first key (kv head 0); no other sequence uses the page
    out = kernels.paged_attention(q, k_pages, v_pages, table, cu, lengths_k, backend=backend)
    assert out[:lengths_q[0], 0].isnan().all() and out[lengths_q[0]:].isfinite().all()
    empty = kernels.paged_attention(q[:0], k_pages, v_pages, table[:0], cu[:1], lengths_k[:0], backend=backend)
    assert empty.shape == (0, q.shape[1], v_pages.shape[3])
