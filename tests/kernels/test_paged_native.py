"""The native kernel's paged attention (mha.kernels.native.paged_attention_native): keys and values
read in place from a pool of KV-cache pages, against a dense reference per sequence (its keys
gathered from the pages with index_select, mha.kernels.math_attention bottom-right).

Shuffled block tables, block sizes 1 to 300 (pages of 1 key, odd sizes, pages longer than a tile),
S_b = 1, partial last pages, windows shorter than a page, whole prefills (L_b = S_b), decoding rows
and prefill chunks in one call, GQA ratios 1, 2 and 4, every term alone and together, float64,
float32, bfloat16 and float16, strided pools, pages that follow each other in the pool (read as one
run), keys split among threads and merged; and a bad table refused before anything is read.
"""

from __future__ import annotations

import pytest
import torch

from mha.kernels import Contract, math_attention, native, storage
from mha.positions import CAUSAL, Band

pytestmark = pytest.mark.skipif(not native.native_available(), reason="the native kernel does not build here")

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _pool(lengths: list[tuple[int, int]], H: int, Hkv: int, P: int, *, D: int = 16, Dv: int = 12,
          dtype=torch.float32, seed: int = 0, spare: int = 3, shuffle: bool = True):
    """A call's inputs: sequences of (L_b, S_b), their pages in shuffled order among ``spare`` unused
    ones, the table's unused entries -1. Returns q, k_pages, v_pages, block_table, cu_seqlens_q, seqlens_k."""
    g = torch.Generator().manual_seed(seed)
    needed = [(S + P - 1) // P for _, S in lengths]
    N = sum(needed) + spare
    order = torch.randperm(N, generator=g) if shuffle else torch.arange(N)
    M = max(needed) + 1
    table = torch.full((len(lengths), M), -1, dtype=torch.int64)
    start = 0
    for b, n in enumerate(needed):
        table[b, :n] = order[start:start + n]
        start += n
    Tq = sum(L for L, _ in lengths)
    q = torch.randn(Tq, H, D, generator=g, dtype=torch.float64).to(dtype)
    k_pages = torch.randn(N, Hkv, P, D, generator=g, dtype=torch.float64).to(dtype)
    v_pages = torch.randn(N, Hkv, P, Dv, generator=g, dtype=torch.float64).to(dtype)
    cu = torch.tensor([0] + [L for L, _ in lengths]).cumsum(0)
    seqlens = torch.tensor([S for _, S in lengths])
    return q, k_pages, v_pages, table, cu, seqlens


def _reference(q, k_pages, v_pages, table, cu, seqlens, terms: dict):
    """Each sequence alone: its keys gathered from the pages, dense math attention, bottom-right."""
    H, Hkv, P = q.shape[1], k_pages.shape[1], k_pages.shape[2]
    out = torch.empty(q.shape[0], H, v_pages.shape[3], dtype=q.dtype)
    for b, S in enumerate(seqlens.tolist()):
        first, last = int(cu[b]), int(cu[b + 1])
        L = last - first
        pages = table[b, :(S + P - 1) // P]
        k, v = (x.index_select(0, pages).transpose(0, 1).flatten(1, 2)[:, :S]  # (n, Hkv, P, X) -> (Hkv, S, X)
                .repeat_interleave(H // Hkv, dim=0)[None] for x in (k_pages, v_pages))  # -> (1, H, S, X)
        rows = q[first:last].transpose(0, 1)[None]  # (L, H, D) -> (1, H, L, D)
        o, _ = math_attention(rows, k, v, Contract(offset=S - L, **terms))
        out[first:last] = o[0].transpose(0, 1)  # (1, H, L, Dv) -> (L, H, Dv)
    return out


def _paged(q, k_pages, v_pages, table, cu, seqlens, terms: dict):
    return native.paged_attention_native(q, k_pages, v_pages, table, cu, seqlens, Contract(**terms))


def _check(inputs, terms: dict, dtype):
    got = _paged(*inputs, terms)
    want = _reference(*inputs, terms)
    assert got.dtype == dtype and got.shape == want.shape
    error = (got.double() - want.double()).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g}"


def _terms(H: int) -> dict[str, dict]:
    g = torch.Generator().manual_seed(3)
    return {
        "plain": {},
        "causal": dict(band=CAUSAL),
        "window (5, 0)": dict(band=Band(5, 0)),  # shorter than most pages
        "window (3, 4)": dict(band=Band(3, 4)),
        "no key for the first rows": dict(band=Band(None, -30)),  # rows at positions < 30 see nothing: zeros
        "ALiBi": dict(alibi_slopes=torch.rand(H, generator=g)),
        "softcap, scale": dict(softcap=2.5, scale=0.7),
        "sinks": dict(sinks=torch.randn(H, generator=g)),
        "everything": dict(band=Band(40, 0), alibi_slopes=torch.rand(H, generator=g), softcap=3.0, scale=0.4,
                           sinks=torch.randn(H, generator=g)),
    }


# decoding rows (S_b = 1, partial last pages), a whole prefill (L_b = S_b) and a prefill chunk, in one call
MIXED = [(1, 1), (1, 700), (70, 70), (40, 333), (1, 64), (3, 257)]


@pytest.mark.parametrize("P", [1, 3, 16, 64, 256, 300])
def test_block_sizes_mixed_batch(P):
    _check(_pool(MIXED, 4, 2, P, seed=P), _terms(4)["everything"], torch.float32)
    _check(_pool(MIXED, 4, 2, P, seed=P), dict(band=CAUSAL), torch.float32)


@pytest.mark.parametrize("name", list(_terms(4)))
def test_each_term(name):
    _check(_pool(MIXED, 4, 2, 16, seed=1), _terms(4)[name], torch.float32)


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_gqa_ratios(ratio):
    H = 4
    inputs = _pool(MIXED, H, H // ratio, 16, seed=ratio)
    for terms in (dict(band=CAUSAL), _terms(H)["everything"]):
        _check(inputs, terms, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    inputs = _pool(MIXED, 4, 2, 16, dtype=dtype, seed=5)
    for name in ("causal", "everything"):
        _check(inputs, _terms(4)[name], dtype)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_decoding_batch_keys_split_among_threads(threads):
    """Few decoding rows over long caches: their keys are split into ranges merged by log-sum-exp,
    as many ranges as the thread count asks (a share is a quarter of a thread's): each count equals
    the reference, whatever the machine's cores."""
    lengths = [(1, 3000), (1, 1500), (2, 2100), (5, 700)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for terms in (dict(band=CAUSAL), _terms(4)["sinks"], _terms(4)["everything"]):
            _check(_pool(lengths, 4, 1, 16, seed=11), terms, torch.float32)
    finally:
        torch.set_num_threads(before)


def test_pages_that_follow_each_other_are_one_run():
    """One kv head and pages in pool order: a tile's pages lie one after another and are read as one run."""
    inputs = _pool([(1, 500), (33, 300)], 2, 1, 3, seed=2, shuffle=False)
    _check(inputs, dict(band=CAUSAL), torch.float32)


def test_keys_packed_token_by_token_as_pages_of_one_slot():
    """Keys packed (T, Hkv, D) as transformers' continuous batching hands them, read as one-slot pages
    (T, Hkv, 1, D): a page's slot stride is then the page stride, and pages that follow each other
    are one run; sequences in pool order, one in reverse (no run), one whose pages skip a token."""
    g = torch.Generator().manual_seed(4)
    H, Hkv, D, T = 4, 2, 16, 900
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    rows = [torch.arange(0, 300), torch.arange(599, 299, -1), torch.arange(600, 900, 2)]  # keys of each sequence
    table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
    seqlens = torch.tensor([len(r) for r in rows])
    cu = torch.tensor([0, 7, 8, 158])  # a prefill chunk, a decoding row, a whole prefill
    q = torch.randn(int(cu[-1]), H, D, generator=g)
    for terms in (dict(band=CAUSAL), _terms(H)["everything"]):
        got = _paged(q, k[:, :, None], v[:, :, None], table, cu, seqlens, terms)
        want = _reference(q, k[:, :, None], v[:, :, None], table, cu, seqlens, terms)
        assert (got - want).abs().max().item() <= 1e-5


def test_strided_pool_and_int32_table():
    """A pool whose pages and heads lie further apart (a view), int32 tables and offsets."""
    q, k_pages, v_pages, table, cu, seqlens = _pool(MIXED, 4, 2, 16, seed=9)
    wide = torch.randn(k_pages.shape[0], k_pages.shape[1] + 1, k_pages.shape[2], 20)
    wide[:, :2, :, :16] = k_pages
    k_view = wide[:, :2, :, :16]  # (N, Hkv, P, D): head and slot strides of the wider pool
    v_view = v_pages.transpose(1, 2).contiguous().transpose(1, 2)  # heads interleaved within a page
    for terms in (dict(band=CAUSAL), _terms(4)["everything"]):
        got = _paged(q, k_view, v_view, table.int(), cu.int(), seqlens.int(), terms)
        want = _reference(q, k_pages, v_pages, table, cu, seqlens, terms)
        assert (got - want).abs().max().item() <= 1e-5


def test_rows_that_see_nothing_are_zeros():
    inputs = _pool([(5, 5), (1, 40)], 2, 2, 4, seed=4)
    out = _paged(*inputs, dict(band=Band(None, -10)))  # keys at least 10 before: the first 5 rows see none
    assert (out[:5] == 0).all() and out[5].abs().sum() > 0


@pytest.mark.parametrize("defect", ["page past the pool", "page -1 in use", "keys beyond the table",
                                    "more rows than keys", "offsets past q", "offsets that decrease"])
def test_bad_table_is_refused(defect):
    q, k_pages, v_pages, table, cu, seqlens = _pool([(1, 20), (4, 9)], 2, 1, 4, seed=6)
    N, M = k_pages.shape[0], table.shape[1]
    if defect == "page past the pool":
        table[1, 1] = N
    elif defect == "page -1 in use":
        table[0, 4] = -1  # the fifth of five used pages
    elif defect == "keys beyond the table":
        seqlens[0] = M * 4 + 1
    elif defect == "more rows than keys":
        seqlens[1] = 3
    elif defect == "offsets past q":
        cu[-1] = q.shape[0] + 1
    else:
        cu[1] = 3
        cu[2] = 2
    with pytest.raises((RuntimeError, ValueError)):
        _paged(q, k_pages, v_pages, table, cu, seqlens, dict(band=CAUSAL))


def test_unused_entries_are_never_read():
    """Entries past a sequence's used pages may hold anything."""
    q, k_pages, v_pages, table, cu, seqlens = _pool([(1, 20), (4, 9)], 2, 1, 4, seed=6)
    table[table < 0] = 10 ** 9
    _check((q, k_pages, v_pages, table, cu, seqlens), dict(band=CAUSAL), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_odd_head_dims(dtype):
    """Head dims that are not a whole number of vectors (the products' last values one by one)."""
    inputs = _pool(MIXED, 6, 2, 5, D=13, Dv=7, dtype=dtype, seed=8)
    for name in ("causal", "everything"):
        _check(inputs, _terms(6)[name], dtype)


# chunks of 8 keys (32 in AVX-512 builds) and their tails
WIDENED_LENGTHS = [(1, 1), (1, 7), (1, 8), (1, 9), (2, 33), (1, 300), (1, 32), (1, 64)]


@pytest.mark.parametrize("Dv", [8, 20, 72, 136, 248])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_widened_values_every_strip_and_chunk_tail(group, Dv):
    """Values widened as they are read (value_strips): 8-bit pages, float32 out against float64 over
    their dequantized values (the tolerance float32's). Blocks of 1 to 4 rows (a group of query heads
    a kv head; L = 2 stacks 2 x group), so strips of 8, 4, 3 and 2 vectors (AVX-512: 8 for 1 and 2
    rows, 4 for 3 and 4, then strips of 4, 2 and 1) and the remainders Dv leaves (1 to 31 vectors, a
    scalar tail), keys in chunks of 8 (AVX-512: 32) and every tail: runs cut by shuffled pages of 5, and
    runs of up to a tile over pages of 64 that follow each other in the pool."""
    for P, shuffle in ((5, True), (64, False)):
        q, k_pages, v_pages, table, cu, seqlens = _pool(WIDENED_LENGTHS, 2 * group, 2, P, D=24, Dv=Dv, seed=Dv + group,
                                                        shuffle=shuffle, spare=0)
        k8, v8 = storage.store(k_pages, True), storage.store(v_pages, True)
        for terms in (dict(), dict(band=CAUSAL)):
            got = _paged(q, k8, v8, table, cu, seqlens, terms)
            want = _reference(q.double(), storage.load(k8, torch.float64), storage.load(v8, torch.float64), table,
                              cu, seqlens, terms)
            assert (got.double() - want).abs().max().item() <= TOLERANCE[torch.float32], (P, terms)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Dv", [20, 136])
def test_widened_half_precision_values(dtype, Dv):
    """bfloat16 and float16 pages through the same strips, against float64 over the same rounded inputs:
    the error of rounding the output once (a key dropped from a chunk moves it more: checked by hand)."""
    for P, shuffle in ((5, True), (64, False)):
        inputs = _pool(WIDENED_LENGTHS[:5], 8, 2, P, D=24, Dv=Dv, dtype=dtype, seed=Dv, shuffle=shuffle, spare=0)
        got = _paged(*inputs, dict())
        want = _reference(*(x.double() if x.is_floating_point() else x for x in inputs), dict())
        assert (got.double() - want).abs().max().item() <= 2 * torch.finfo(dtype).eps, P


def _dense_bf16_error(q, k_pages, v_pages, table, cu, seqlens, want):
    """The dense native forward in bfloat16 over each sequence's keys gathered (bottom-right causal):
    its mean error against ``want``, what the kernel's bfloat16 attention errs by on these inputs (as
    torch's bfloat16 SDPA does: tests/kernels/test_native.py)."""
    P = k_pages.shape[2]
    errors = []
    for b, S in enumerate(seqlens.tolist()):
        first, last = int(cu[b]), int(cu[b + 1])
        L, pages = last - first, table[b, :(S + P - 1) // P]
        k, v = (x.index_select(0, pages).transpose(0, 1).flatten(1, 2)[:, :S][None] for x in (k_pages, v_pages))
        o = native.native_attention(q[first:last].transpose(0, 1)[None], k, v, Contract(band=CAUSAL, offset=S - L))
        errors.append((o[0].transpose(0, 1).double() - want[first:last].double()).abs().flatten())
    return torch.cat(errors).mean().item()


@pytest.mark.parametrize("P", [1, 3, 16, 300])
@pytest.mark.parametrize("pool", ["bfloat16", "int8"])
@pytest.mark.parametrize(("D", "Dv"), [(16, 12), (5, 9), (64, 64)])
@torch.no_grad()
def test_bfloat16_prompts_over_pages_err_as_a_bfloat16_attention(P, pool, D, Dv):
    """bfloat16 queries over bfloat16 or 8-bit pages, in blocks of more rows than the run loops take
    (a prompt, chunks, an odd S_b: a tile's pair past it, never read: the table names a page of NaN
    past every sequence's keys) beside decoding rows: bfloat16 products on
    the tiles gathered from the pages (PagedBf16Products). Within the bfloat16 tolerance for every
    term, and causal within 1.1x the mean error of the dense bfloat16 forward over the same keys
    gathered (8-bit: the dequantized keys rounded to bfloat16), whose products it shares."""
    lengths = [(70, 70), (1, 700), (40, 333), (3, 257), (9, 9), (1, 1)]
    q, k_pages, v_pages, table, cu, seqlens = _pool(lengths, 4, 2, P, D=D, Dv=Dv, dtype=torch.bfloat16, seed=P + D)
    spare = next(page for page in range(k_pages.shape[0]) if page not in table)  # NaN, named past every S_b:
    k_pages[spare], v_pages[spare] = float("nan"), float("nan")  # a key read there (a pair past an odd S_b) is NaN
    table[table < 0] = spare
    if pool == "int8":
        k_pages, v_pages = (storage.store(x, True) for x in (k_pages, v_pages))
        k_wide, v_wide = (storage.load(x, torch.float64) for x in (k_pages, v_pages))
    else:
        k_wide, v_wide = k_pages.double(), v_pages.double()
    for name in ("causal", "everything"):
        terms = _terms(4)[name]
        got = _paged(q, k_pages, v_pages, table, cu, seqlens, terms)
        want = _reference(q.double(), k_wide, v_wide, table, cu, seqlens, terms)
        error = (got.double() - want).abs().max().item()
        assert got.dtype == torch.bfloat16 and error <= TOLERANCE[torch.bfloat16], f"{name}: max error {error:.3g}"
        if name == "causal":
            dense = _dense_bf16_error(q, k_wide.bfloat16(), v_wide.bfloat16(), table, cu, seqlens, want)
            mean = (got.double() - want).abs().mean().item()
            assert mean <= 1.1 * dense, (mean, dense)


@pytest.mark.skipif(native.variant() != "avx512bf16", reason="bfloat16 products on tiles of pages: the avx512bf16 build's "
                    "(the others widen a run of pages to float32)")
@pytest.mark.parametrize("P", [1, 16, 300])
@pytest.mark.parametrize(("L", "S"), [(200, 200), (70, 333), (500, 1000), (9, 9), (17, 255), (64, 256), (4, 300)])
@torch.no_grad()
def test_a_bfloat16_prompt_over_bfloat16_pages_is_the_dense_forward(P, L, S):
    """A bfloat16 prompt over bfloat16 pages gives the dense bfloat16 forward's output over the same keys
    gathered, bit for bit, where both take the same path: blocks of more stacked rows than the run loops
    take (here 2 a kv head: L > 8, whole blocks of 64 or one block) on tiles, against the dense prompt
    path (more than 16 rows a kv head): the same products, and the weights rounded to bfloat16 as the
    softmax makes them, as that forward's (weights made in float32 and rounded apart differ in about
    one output in eight); and L = 4, 8 stacked rows, on the run loops' float weights as the dense
    decoding path's (on AMX tiles its values' weights are bfloat16: within that rounding). (Elsewhere the
    two take different paths, each within bfloat16's rounding:
    test_bfloat16_prompts_over_pages_err_as_a_bfloat16_attention.)"""
    q, k_pages, v_pages, table, cu, seqlens = _pool([(L, S)], 4, 2, P, D=64, Dv=64, dtype=torch.bfloat16, seed=P)
    got = _paged(q, k_pages, v_pages, table, cu, seqlens, {"band": CAUSAL})
    pages = table[0, :(S + P - 1) // P]
    k, v = (x.index_select(0, pages).transpose(0, 1).flatten(1, 2)[:, :S][None] for x in (k_pages, v_pages))
    dense = native.native_attention(q.transpose(0, 1)[None], k, v, Contract(band=CAUSAL, offset=S - L))[0].transpose(0, 1)
    if L * 2 <= 8 and S >= 64 and native._kernel().amx_active():
        # on AMX tiles the dense decoding path's values take bfloat16 weights (tile_value_block, from 64
        # keys), the run loops float ones: a rounding of the weights apart
        torch.testing.assert_close(got.float(), dense.float(), rtol=2 ** -7, atol=2 ** -10)
    else:
        assert torch.equal(got, dense)


@pytest.mark.parametrize(("H", "L"), [(2, 7), (2, 8), (2, 9), (4, 4), (4, 5)])
@torch.no_grad()
def test_bfloat16_blocks_at_the_run_loops_edge(H, L):
    """Blocks of 7 to 10 stacked rows over bfloat16 pages (G = 1 or 2, one block a kv head) beside a
    prompt of 70 (which makes the call a prefill's, on PagedBf16Products): up to kRunLoopRows (8) their
    weights stay float32 for the run loops, past it they are rounded to bfloat16 for the tiles
    (rounded_weights and add_values on one rule): float64's output within bfloat16's tolerance, for a
    block that took its weights from the wrong buffer would not be."""
    lengths = [(L, 300), (70, 70)]
    q, k_pages, v_pages, table, cu, seqlens = _pool(lengths, H, 2, 16, D=64, Dv=64, dtype=torch.bfloat16, seed=L)
    got = _paged(q, k_pages, v_pages, table, cu, seqlens, {"band": CAUSAL})
    want = _reference(q.double(), k_pages.double(), v_pages.double(), table, cu, seqlens, {"band": CAUSAL})
    assert (got.double() - want).abs().max().item() <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_a_prompt_over_more_tiles_than_a_thread_keeps(threads, dtype):
    """A thread keeps the tiles it packed for a kv head (8 MiB: 32 tiles at D = Dv = 256 in bfloat16,
    16 in float32), each at its index modulo their count: two blocks of rows over 33 tiles of keys, so
    that a later tile takes tile 0's place and the second block packs tile 0 again; two kv heads and a
    second sequence in between."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lengths = [(40, 8400), (12, 300)]  # 80 and 24 stacked rows a kv head (G = 2): blocks of 64
        q, k_pages, v_pages, table, cu, seqlens = _pool(lengths, 4, 2, 64, D=256, Dv=256, dtype=dtype, seed=9)
        got = _paged(q, k_pages, v_pages, table, cu, seqlens, {"band": CAUSAL})
        want = _reference(q.double(), k_pages.double(), v_pages.double(), table, cu, seqlens, {"band": CAUSAL})
        assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("P", [1, 3, 16, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, "int8", "int8 under bfloat16, D 5"])
@torch.no_grad()
def test_auto_takes_the_fast_path_with_the_full_paths_output(monkeypatch, P, dtype):
    """attend_pages (paged_attention under a contract) with backend "auto" calls the kernel in one step
    (dispatch.plain_paged): its output is the full path's (backend "native": every argument checked in
    Python first) bitwise, for every term, a mixed batch, float and 8-bit pages (kept with their scales)."""
    from mha.kernels import dispatch
    from mha.kernels.paged import attend_pages
    wide = {"int8": torch.float32, "int8 under bfloat16, D 5": torch.bfloat16}.get(dtype, dtype)
    D = 5 if "D 5" in str(dtype) else 16  # (rows of 9 bytes: the scales copied out)
    q, k_pages, v_pages, table, cu, seqlens = _pool(MIXED, 4, 2, P, D=D, dtype=wide, seed=P)
    if "int8" in str(dtype):
        k_pages, v_pages = storage.store(k_pages, True), storage.store(v_pages, True)
    fulls = {}
    for name, terms in _terms(4).items():
        contract = Contract(**terms)
        fast = dispatch.plain_paged(q, k_pages, v_pages, table, cu, seqlens, contract)
        assert fast is not None, name
        fulls[name] = attend_pages(q, k_pages, v_pages, table, cu, seqlens, contract, backend="native")
        assert torch.equal(fast, fulls[name]), name
    monkeypatch.setattr(dispatch, "paged_attention", None)  # auto never reaches the full path's dispatch
    for name, terms in _terms(4).items():
        assert torch.equal(attend_pages(q, k_pages, v_pages, table, cu, seqlens, Contract(**terms)), fulls[name]), name


@torch.no_grad()
def test_the_paged_fast_path_leaves_what_it_does_not_take_to_the_full_path():
    """Each call the fast path does not take goes the full way: float64 (math), a gradient asked for (of
    learned sinks or of the pages: refused by name), a query not contiguous, a bad page (named), a
    table of another kind, a pool of no slots (named, with no sequence too)."""
    from mha.kernels import dispatch, paged_attention
    from mha.kernels.contract import NONE
    q, k_pages, v_pages, table, cu, seqlens = _pool(MIXED, 4, 2, 16, seed=2)
    assert dispatch.plain_paged(q, k_pages, v_pages, table, cu, seqlens, NONE) is not None
    bad = table.clone()
    bad[1, 0] = k_pages.shape[0]
    refused = {
        "float64": (q.double(), k_pages.double(), v_pages.double(), table, NONE),
        "q not contiguous": (q.transpose(0, 1).contiguous().transpose(0, 1), k_pages, v_pages, table, NONE),
        "a page past the pool": (q, k_pages, v_pages, bad, NONE),
        "a table of floats": (q, k_pages, v_pages, table.float(), NONE),
        "sinks that learn": (q, k_pages, v_pages, table, Contract(sinks=torch.zeros(4, requires_grad=True))),
        "pages that learn": (q, k_pages.clone().requires_grad_(), v_pages, table, NONE),
        "a pool of no slots": (q, k_pages[:, :, :0], v_pages[:, :, :0], table, NONE),
    }
    with torch.enable_grad():
        for name, (x, k, v, t, contract) in refused.items():
            assert dispatch.plain_paged(x, k, v, t, cu, seqlens, contract) is None, name
        with pytest.raises(ValueError, match="block_table names page"):
            paged_attention(q, k_pages, v_pages, bad, cu, seqlens)
        with pytest.raises(ValueError, match="paged_attention is for inference: sinks requires grad"):
            paged_attention(q, k_pages, v_pages, table, cu, seqlens, sinks=torch.zeros(4, requires_grad=True))
        with pytest.raises(TypeError, match="block_table"):
            paged_attention(q, k_pages, v_pages, table.float(), cu, seqlens)
        with pytest.raises(ValueError, match="paged_attention is for inference: k_pages requires grad"):
            paged_attention(q, k_pages.clone().requires_grad_(), v_pages, table, cu, seqlens)
    empty = torch.zeros(0, 1, dtype=torch.long)  # no sequence, over a pool of no slots: refused by name as before
    with pytest.raises(ValueError, match="block size of at least 1"):
        paged_attention(q[:0], k_pages[:, :, :0], v_pages[:, :, :0], empty, torch.tensor([0]), torch.tensor([], dtype=torch.long))
    got = paged_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k_pages, v_pages, table, cu, seqlens)
    assert torch.equal(got, paged_attention(q, k_pages, v_pages, table, cu, seqlens))  # the full path makes it contiguous


@pytest.mark.parametrize("S", [15, 16, 17, 63, 64, 65, 255, 256, 257, 511, 512, 513])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
@torch.no_grad()
def test_prompts_over_pages_at_tile_edges(S, dtype):
    """A prompt's blocks (more rows than the run loops take) on tiles packed once (PagedFloatTiles,
    PagedBf16Products) at and around page, block and tile sizes, pages laid out every other one (a
    strided pool), a chunk of 9 rows and a whole prompt, causal and windowed, against float64."""
    wide = torch.float32 if dtype == "int8" else dtype
    lengths = [(min(S, 9), S), (S, S)]
    q, k_pages, v_pages, table, cu, seqlens = _pool(lengths, 4, 2, 16, dtype=wide, seed=S)
    k_pages, v_pages = (torch.stack([x, torch.full_like(x, float("nan"))], 1)[:, 0] for x in (k_pages, v_pages))
    if dtype == "int8":
        k_pages, v_pages = storage.store(k_pages, True), storage.store(v_pages, True)
        k_wide, v_wide = (storage.load(x, torch.float64) for x in (k_pages, v_pages))
    else:
        k_wide, v_wide = k_pages.double(), v_pages.double()
    for terms in (dict(band=CAUSAL), dict(band=Band(40, 0), softcap=3.0)):
        got = _paged(q, k_pages, v_pages, table, cu, seqlens, terms)
        want = _reference(q.double(), k_wide, v_wide, table, cu, seqlens, terms)
        assert (got.double() - want).abs().max().item() <= TOLERANCE[wide], (S, terms)


@pytest.mark.parametrize("G", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("D", [1, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 200])
def test_bfloat16_queries_over_8_bit_keys_score_within_bfloat16_rounding(G, D):
    """A bfloat16 decoding step over 8-bit keys (AVX512-VNNI builds: word_score_block, the queries as
    16-bit integers times a power of two) gives float64's output to within bfloat16's rounding: rows
    whose values span far more than 2^7 (their smallest rounded), each row its own power of two, a row
    of zeros, G query rows a key/value head (blocks of 1 to 4 rows); a float32 call on the same values keeps exact products
    (float32's rounding alone); a NaN query makes its row NaN alone, an infinite one its row NaN."""
    from mha.kernels.paged import paged_attention

    torch.manual_seed(G * 1000 + D)
    S, Hkv = 301, 2  # chunks of 32 value rows, the last of 13: a key without a pair
    k8, v8 = (storage.store(torch.randn(1, Hkv, S, D), True) for _ in range(2))  # one page of S keys
    table, cu, lengths = torch.tensor([[0]]), torch.tensor([0, 1]), torch.tensor([S])

    def attend(q):
        return paged_attention(q, k8, v8, table, cu, lengths, is_causal=False).double()

    # scores of a few units (a softmax neither flat nor one-hot), a quarter of the values 10^4 below the rest
    spans = torch.where(torch.rand(1, G * Hkv, D) < 0.25, 1e-4, 2.0) * 2.0 ** (torch.arange(G * Hkv)[:, None] % 3)
    q = (torch.randn(1, G * Hkv, D) * spans).bfloat16()
    q[0, -1] = 0.0
    exact = attend(q.double())
    top = exact.abs().max()
    assert (attend(q) - exact).abs().max() <= 2 ** -8 * top
    assert (attend(q.float()) - exact).abs().max() <= 2e-6 * top
    for bad in (float("nan"), float("inf")):
        q[0, 0, D // 2] = bad
        got = attend(q)
        assert got[0, 0].isnan().all() and not got[0, 1:].isnan().any()


@pytest.mark.parametrize("scale", [1e-30, 1.5 * 2.0 ** -112, 1.5 * 2.0 ** -113, 1e-36])  # 2^-112: shift 126, then 127
def test_bfloat16_queries_and_weights_far_below_one_over_8_bit_pages(scale):
    """words_of's edge: query rows whose largest value lies near float's smallest normal (1e-36:
    below 2^-112, left to the float loops; 1e-30: scaled up by 2^115) over keys as large in turn (their
    scores of a few units), and chunks of weights near it (every key but one about 85 below the top
    score, e^-85 ~ 1e-37), give float64's output to within bfloat16's rounding."""
    from mha.kernels.paged import paged_attention

    torch.manual_seed(7)
    S, Hkv, G, D = 200, 1, 4, 64
    k, v = torch.randn(1, Hkv, S, D), torch.randn(1, Hkv, S, D)
    k[0, 0, 150] = 0.0
    k[0, 0, 150, 0] = 127.0  # one key whose score leads the rest by about 85 under q[..., 0] = 6
    k8, v8 = storage.store(k, True), storage.store(v, True)
    huge = storage.store(torch.randn(1, Hkv, S, D) / scale, True)  # keys for the tiny queries' row
    table, cu, lengths = torch.tensor([[0]]), torch.tensor([0, 1]), torch.tensor([S])
    q = torch.randn(1, G * Hkv, D) * 0.01
    q[0, :2, 0] = 6.0  # rows 0, 1: the leading key
    q[0, 2] *= scale / q[0, 2].abs().max()  # row 2: tiny values, the largest ``scale``
    q = q.bfloat16()
    for keys in (k8, huge):
        got = paged_attention(q, keys, v8, table, cu, lengths, is_causal=False).double()
        exact = paged_attention(q.double(), keys, v8, table, cu, lengths, is_causal=False)
        assert got.isfinite().all() and (got - exact).abs().max() <= 2 ** -8 * exact.abs().max()
