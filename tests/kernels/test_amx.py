"""The native kernel's bfloat16 forward on AMX tiles (AmxProducts: tdpbf16ps over the VNNI-packed K^T
and V), on a CPU that has them: every shape and term at the edges its tiles change (16 rows, 32 keys
a step, D in steps of 32, Dv in tiles of 16), against the float64 oracle and against the same call on
brgemm's products (native.set_amx(False)); the handshake with oneDNN's own tile configuration; the
head dims it takes (that rule is checked on every CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mha
from helpers.backends import NATIVE
from helpers.tolerance import assert_close, max_error
from mha.kernels import Contract, native
from mha.positions import CAUSAL, Band

pytestmark = pytest.mark.skipif(not NATIVE, reason="the native kernel does not build here (no compiler)")


def _kernel():
    return native._kernel()


def _amx() -> bool:
    return NATIVE and _kernel().amx_active()


needs_amx = pytest.mark.skipif(not _amx(), reason="this CPU has no AMX tiles (or the build has no AMX path)")


@pytest.fixture
def amx_switch():
    """set_amx(on) for the test, a decoding step's 16-bit cache read on the tiles (set_step_reading("tiles"),
    which the kernel picks on no CPU by itself: tests/kernels/test_step_reading.py) where they are on, the
    settings before restored after it."""
    kernel = _kernel()
    before = kernel.set_amx(True)
    reading = kernel.set_step_reading("tiles")
    kernel.set_amx(before)

    def switch(on: bool):
        kernel.set_amx(on)

    yield switch
    kernel.set_amx(before)
    kernel.set_step_reading(reading)


def test_the_tiles_take_d_in_steps_of_32_and_dv_in_tiles_of_16():
    """The rule alone (any CPU with the avx512bf16 build; false elsewhere): other head dims run on brgemm."""
    kernel = _kernel()
    if native.variant() != "avx512bf16":
        assert not kernel.amx_takes(64, 64)
        return
    for D, Dv in [(32, 16), (64, 64), (96, 48), (128, 128), (256, 256), (64, 16)]:
        assert kernel.amx_takes(D, Dv), (D, Dv)
    for D, Dv in [(16, 16), (48, 64), (80, 80), (64, 8), (64, 24), (0, 64), (64, 0), (65, 64)]:
        assert not kernel.amx_takes(D, Dv), (D, Dv)


def _inputs(B, H, Hkv, L, S, D, Dv, seed, *, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, L, D, generator=g) * sharp).bfloat16()
    k = (torch.randn(B, Hkv, S, D, generator=g) * sharp).bfloat16()
    v = torch.randn(B, Hkv, S, Dv, generator=g).bfloat16()
    return q, k, v


def _both(q, k, v, contract, switch):
    """(on AMX tiles, on brgemm's products) of one forward."""
    switch(True)
    tiles = native.native_attention(q, k, v, contract)
    switch(False)
    products = native.native_attention(q, k, v, contract)
    switch(True)
    return tiles, products


def _exact(q, k, v, contract):
    return mha.kernels.attention(q.double(), k.double(), v.double(), contract, backend="math")[0]


def _check(q, k, v, contract, switch):
    tiles, products = _both(q, k, v, contract, switch)
    exact = _exact(q, k, v, contract)
    assert_close(tiles.double(), exact, torch.bfloat16)
    # the same products in another order at most: within the brgemm path's own error, plus one rounding
    assert max_error(tiles, exact) <= 1.5 * max_error(products, exact) + 2 ** -8, (
        max_error(tiles, exact), max_error(products, exact))


# (B, H, Hkv, L, S, D, Dv): 15-17 and 63-65 rows per kv head, keys at 32-key steps and 256-key tiles, every
# D step count and Dv tile count
SHAPES = [(1, 2, 2, 17, 1, 64, 64), (1, 2, 1, 9, 31, 32, 16), (1, 1, 1, 33, 32, 64, 64), (1, 1, 1, 63, 33, 64, 64),
          (2, 3, 3, 65, 255, 96, 48), (1, 4, 2, 64, 256, 128, 128), (1, 2, 2, 100, 257, 64, 80),
          (1, 1, 1, 129, 511, 256, 64), (1, 8, 2, 40, 513, 64, 64), (1, 2, 2, 300, 1000, 64, 64),
          # steps of 5-16 rows per kv head take the tiles too (4 or fewer: the run loops)
          (1, 8, 2, 2, 1000, 64, 64), (1, 4, 4, 16, 300, 64, 64), (2, 8, 2, 3, 257, 128, 128), (1, 8, 2, 1, 500, 64, 64)]


@needs_amx
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}/{}L{}S{}D{}Dv{}".format(*s))
@pytest.mark.parametrize("terms", ["none", "causal", "bottom-right", "window"])
def test_tiles_equal_the_oracle_and_the_brgemm_path(shape, terms, amx_switch):
    B, H, Hkv, L, S, D, Dv = shape
    q, k, v = _inputs(*shape, seed=L + S + D, sharp=2.0)
    contract = {"none": None, "causal": Contract(band=CAUSAL),
                "bottom-right": Contract(band=CAUSAL, offset=S - L), "window": Contract(band=Band(37, 5))}[terms]
    _check(q, k, v, contract, amx_switch)


@needs_amx
@pytest.mark.parametrize("term", ["mask", "bool mask", "key padding", "softcap", "alibi", "sinks"])
def test_tiles_under_every_term(term, amx_switch):
    B, H, Hkv, L, S, D, Dv = 2, 4, 2, 70, 300, 64, 64
    q, k, v = _inputs(B, H, Hkv, L, S, D, Dv, seed=7, sharp=2.0)
    g = torch.Generator().manual_seed(8)
    contract = {
        "mask": Contract(mask=torch.randn(B, 1, L, S, generator=g)),
        "bool mask": Contract(mask=torch.rand(B, H, L, S, generator=g) > 0.3),
        "key padding": Contract(key_valid=torch.arange(S)[None, :] < torch.tensor([[S], [S - 45]])),
        "softcap": Contract(softcap=5.0),
        "alibi": Contract(alibi_slopes=torch.rand(H, generator=g), band=CAUSAL),
        "sinks": Contract(sinks=torch.randn(H, generator=g)),
    }[term]
    _check(q, k, v, contract, amx_switch)


@needs_amx
def test_rows_that_see_nothing_are_zeros_and_a_nan_key_makes_its_rows_nan(amx_switch):
    q, k, v = _inputs(1, 2, 2, 40, 100, 64, 64, seed=3)
    nothing = Contract(band=Band(0, 0), offset=200)  # every query's one key lies past S
    amx_switch(True)
    assert torch.equal(native.native_attention(q, k, v, nothing), torch.zeros(1, 2, 40, 64, dtype=torch.bfloat16))
    k = k.clone()
    k[0, 1, 50] = float("nan")
    out = native.native_attention(q, k, v, Contract(band=CAUSAL))
    assert not out[0, 0].isnan().any()
    assert not out[0, 1, :50].isnan().any() and out[0, 1, 50:].isnan().all()


@needs_amx
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_strided_heads_of_a_projection_on_any_thread_count(threads, amx_switch):
    """q, k, v as a projection's (B, T, H, D) output seen as (B, H, T, D): rows H D apart, read where they lie."""
    B, T, H, D = 2, 150, 4, 64
    g = torch.Generator().manual_seed(threads)
    q, k, v = (torch.randn(B, T, H, D, generator=g).bfloat16().transpose(1, 2) for _ in range(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        _check(q, k, v, Contract(band=CAUSAL), amx_switch)
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_values_past_s_read_as_zeros_to_the_next_32_keys_not_as_an_earlier_calls(amx_switch):
    """A product takes the keys in steps of 32, so the packed V holds zeros from S to the next multiple of
    32 (weights there are 0, and 0 times an earlier call's NaN left in the workspace would be NaN): a call
    over S = 33 right after one whose values were all NaN equals the oracle."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # (the workspaces are the calling thread's)
        amx_switch(True)
        poisoned = torch.full((1, 2, 300, 64), float("nan"), dtype=torch.bfloat16)
        native.native_attention(poisoned, poisoned, poisoned, None)
        q, k, v = _inputs(1, 2, 2, 40, 33, 64, 64, seed=5)
        out = native.native_attention(q, k, v, None)
    finally:
        torch.set_num_threads(before)
    assert_close(out.double(), _exact(q, k, v, None), torch.bfloat16)


@needs_amx
def test_torchs_own_brgemm_before_and_after_the_tiles_on_the_same_threads(amx_switch):
    """oneDNN's brgemm keeps its tile configuration per thread and loads it again only when it thinks
    another is current. Each side releases its tiles at the end of a thread's run (torch's flash kernel
    and the brgemm paths by brgemm_release, the tiles by tilerelease; configure_tiles also releases
    oneDNN's first, for a caller that left its context set, which Python cannot arrange), so torch's
    bfloat16 flash kernel (brgemm on AMX) between the tiles' calls, and the backward's brgemm products,
    compute what they would alone."""
    q, k, v = _inputs(1, 8, 8, 512, 512, 64, 64, seed=9)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    amx_switch(True)
    for _ in range(3):
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ours = native.native_attention(q, k, v, Contract(band=CAUSAL))
        assert max_error(theirs, exact) < 2e-2 and max_error(ours, exact) < 2e-2
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = native.native_attention(*leaves, Contract(band=CAUSAL))  # the backward's forward: brgemm's products
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    exact_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*exact_leaves, is_causal=True)
    for got, expected in zip(grads, torch.autograd.grad(want, exact_leaves, torch.ones_like(want))):
        assert_close(got.double(), expected, torch.bfloat16, chain=True)
    assert max_error(native.native_attention(q, k, v, Contract(band=CAUSAL)), exact) < 2e-2


@needs_amx
def test_torchs_own_brgemm_between_decoding_steps_on_the_same_thread(amx_switch):
    """A decoding step's scores load the tiles' narrow shape and put back the one before (none: released),
    so that torch's bfloat16 flash kernel between two steps on the same thread (which configures and
    releases the tiles itself) leaves the next step nothing stale to run on."""
    q, k, v = _inputs(1, 8, 2, 1, 1000, 128, 128, seed=12)
    exact = _exact(q, k, v, None)
    pq, pk, pv = _inputs(1, 4, 4, 300, 300, 64, 64, seed=13)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        amx_switch(True)
        for _ in range(3):
            assert max_error(native.native_attention(q, k, v, None), exact) < 2e-2
            F.scaled_dot_product_attention(pq, pk, pv, is_causal=True)  # brgemm on the tiles, on this thread
    finally:
        torch.set_num_threads(before)


@needs_amx
@pytest.mark.parametrize("pool", ["bfloat16", "int8"])
@pytest.mark.parametrize("S", [31, 33, 255, 257, 511])
def test_prompts_over_pages_on_the_tiles(pool, S, amx_switch):
    """A prompt's blocks over KV-cache pages (PagedAmxProducts: the tiles gathered from the pages, 32 keys a
    step, their values zero past S_b to the next 32) beside a chunk of 17 rows and a decoding row, pages of
    16 in shuffled order with a NaN page named past every S_b, bfloat16 and 8-bit pools, right after a call
    whose tiles were NaN: the float64 oracle's output within bfloat16's tolerance, and the brgemm path's to
    within its own error and a rounding."""
    from mha.kernels import paged_attention, storage

    g = torch.Generator().manual_seed(S)
    P, H, Hkv, D, Dv = 16, 8, 2, 64, 64
    lengths = [(S, S), (17, S + 40), (1, S)]
    pages = [(s + P - 1) // P for _, s in lengths]
    N = sum(pages) + 1
    order = torch.randperm(N - 1, generator=g)
    table = torch.full((3, max(pages) + 1), N - 1)  # the NaN page past every sequence's keys
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start:start + count]
        start += count
    k_pages, v_pages = torch.randn(N, Hkv, P, D, generator=g), torch.randn(N, Hkv, P, Dv, generator=g)
    k_pages[N - 1], v_pages[N - 1] = float("nan"), float("nan")
    q = (torch.randn(sum(L for L, _ in lengths), H, D, generator=g) * 2).bfloat16()
    cu = torch.tensor([0, *torch.tensor([L for L, _ in lengths]).cumsum(0).tolist()])
    seqlens = torch.tensor([s for _, s in lengths])
    if pool == "int8":
        k_pages, v_pages = storage.store(k_pages, True), storage.store(v_pages, True)
        k_wide, v_wide = storage.load(k_pages, torch.float64), storage.load(v_pages, torch.float64)
    else:
        k_pages, v_pages = k_pages.bfloat16(), v_pages.bfloat16()
        k_wide, v_wide = k_pages.double(), v_pages.double()

    def attend():
        return paged_attention(q, k_pages, v_pages, table, cu, seqlens, is_causal=True)

    # a prompt over pages of NaN first, on the same thread: its tiles (NaN in every slot's keys past S_b
    # here) are what a slot holds when this call packs it again
    poison = torch.full((32, Hkv, P, D), float("nan"))
    poison = storage.store(poison, True) if pool == "int8" else poison.bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        amx_switch(True)
        rows = torch.ones(64, H, D, dtype=torch.bfloat16)
        paged_attention(rows, poison, poison, torch.arange(32)[None], torch.tensor([0, 64]), torch.tensor([512]), is_causal=True)
        tiles = attend()
    finally:
        torch.set_num_threads(before)
    amx_switch(False)
    products = attend()
    amx_switch(True)
    exact = torch.cat([
        mha.kernels.attention(q[int(cu[b]):int(cu[b + 1])].double().transpose(0, 1)[None],
                              *(x.index_select(0, table[b, :pages[b]]).transpose(0, 1).flatten(1, 2)[:, :s]
                                .repeat_interleave(H // Hkv, 0)[None] for x in (k_wide, v_wide)),
                              Contract(band=CAUSAL, offset=s - L), backend="math")[0][0].transpose(0, 1)
        for b, (L, s) in enumerate(lengths)])
    assert not tiles.isnan().any()
    assert_close(tiles.double(), exact, torch.bfloat16)
    assert max_error(tiles, exact) <= 1.5 * max_error(products, exact) + 2 ** -8


@needs_amx
@pytest.mark.parametrize("D", [32, 64, 96, 128, 192, 256])  # 1-6 steps of 32 on the tiles; 8 beyond them
@pytest.mark.parametrize("H, Hkv, L", [(8, 8, 1), (8, 4, 1), (12, 4, 1), (8, 2, 1), (8, 4, 2)])  # 1-4 rows a kv head
@pytest.mark.parametrize("S", [15, 16, 17, 300, 1000])
def test_decoding_scores_on_the_tiles(D, H, Hkv, L, S, amx_switch):
    """A decoding step's scores over bfloat16 keys (tile_score_block: S^T of 16 keys a group, tile-loaded
    from the cache's rows where they lie, the rest of the keys on vdpbf16ps), over a cache of more slots
    than keys (rows D apart, heads further apart): the oracle's output, and the vdpbf16ps path's to within
    its own error and a rounding."""
    g = torch.Generator().manual_seed(D + S + H)
    q = (torch.randn(1, H, L, D, generator=g) * 2).bfloat16()
    cache = torch.randn(2, 1, Hkv, S + 9, D, generator=g).bfloat16()  # (k|v, B, Hkv, slots, D)
    k, v = cache[0, :, :, :S], cache[1, :, :, :S]
    _check(q, k, v, Contract(band=CAUSAL, offset=S - L) if L > 1 else None, amx_switch)


def _tile_keys(call):
    """call()'s output and (keys scored, keys whose values were added) on the decoding tiles, on one thread."""
    kernel = _kernel()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        kernel.take_tile_step_keys()
        out = call()
        return out, kernel.take_tile_step_keys()
    finally:
        torch.set_num_threads(before)


@needs_amx
@pytest.mark.parametrize("D, S, scored, added", [(128, 63, 0, 0), (128, 64, 64, 64), (128, 79, 64, 64), (128, 80, 80, 80),
                                                 (192, 300, 256, 256), (224, 300, 0, 256), (96, 320, 320, 320),
                                                 (80, 300, 0, 256)])
def test_which_decoding_scores_take_the_tiles(D, S, scored, added, amx_switch):
    """tile_score_block takes a call of at least kStepTileKeys (64) keys, D in whole steps of 32 and at most
    kStepTiles (6) of them, whole groups of 16 keys (the rest on vdpbf16ps); tile_value_block the same calls'
    values where Dv is a whole number of 32 (here 64) whatever D; the kernel counts the keys of each
    (take_tile_step_keys, this thread's). One kv head, one row: a call per tile of 256 keys (S = 300: 256 and
    44, the second under 64; S = 320: 256 and 64)."""
    q, k, v = _inputs(1, 1, 1, 1, S, D, 64, seed=S + D)
    amx_switch(True)
    out, taken = _tile_keys(lambda: native.native_attention(q, k, v, None))
    assert taken == (scored, added)
    assert_close(out.double(), _exact(q, k, v, None), torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("Dv, added", [(16, 0), (48, 0), (80, 0), (288, 0), (32, 992), (96, 992), (160, 992),
                                       (256, 992)])
@pytest.mark.parametrize("H, Hkv", [(8, 8), (8, 4), (8, 2), (12, 4)])  # 1, 2, 4, 3 rows a kv head
def test_decoding_values_on_the_tiles(Dv, added, H, Hkv, amx_switch):
    """A decoding step's values over bfloat16 rows (tile_value_block: V's rows as they lie, weights as (w, 0)
    and (0, w) pairs, up to 4 tiles of 32 columns a pass: Dv 160 and 256 take two passes) where Dv is a whole
    number of 32 up to 256, else none of them on the tiles; 1000 keys: 3 tiles of 256 and one of 232, whole groups of
    16 (992 a row block), the rest on the widening loop. The oracle's output, and the widening loop's to
    within its own error and a rounding."""
    q, k, v = _inputs(1, H, Hkv, 1, 1000, 64, Dv, seed=Dv + H)
    amx_switch(True)
    _, taken = _tile_keys(lambda: native.native_attention(q, k, v, None))
    assert taken[1] == added * Hkv * -(-(H // Hkv) // 4)  # per row block of at most 4 rows, per kv head
    _check(q, k, v, None, amx_switch)


@needs_amx
def test_an_infinite_or_nan_value_stays_in_its_own_column_on_the_tiles(amx_switch):
    """The tiles pair each value with its neighbouring column's (times a zero weight): a call whose sums are
    not all finite goes to the widening loop, so an infinite value makes its own column infinite and a NaN
    its own column NaN, the other columns the oracle's, as without the tiles; the key tiles without them
    stay on the tiles."""
    q, k, v = _inputs(1, 8, 2, 1, 1000, 64, 64, seed=5)
    v = v.clone()
    v[0, 0, 300, 10] = float("inf")  # the second tile of 256 keys, kv head 0
    v[0, 1, 700, 33] = float("nan")  # the third, kv head 1
    amx_switch(True)
    tiles, taken = _tile_keys(lambda: native.native_attention(q, k, v, None))
    assert taken[1] == 992 * 2 - 256 * 2  # one call of 256 keys in each kv head refused
    amx_switch(False)
    products = native.native_attention(q, k, v, None)
    amx_switch(True)
    assert torch.equal(tiles.isinf(), products.isinf()) and torch.equal(tiles.isnan(), products.isnan())
    assert tiles[0, :4, 0, 10].isinf().all() and tiles[0, 4:, 0, 33].isnan().all()
    assert tiles.isinf().sum() == 4 and tiles.isnan().sum() == 4
    finite = tiles.isfinite()
    exact = _exact(q, k, v, None)
    assert_close(tiles[finite].double(), exact[finite], torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("S", [100, 600])  # one call of at most 256 keys; three
def test_the_weights_values_on_the_tiles(S, amx_switch):
    """forward_weights' rows (a decoding step's few) add their values over all S keys in one call, whose
    tiles take at most kBlockK keys at a time: its output, the oracle's; its weights, the other path's
    (its scores there on vdpbf16ps: the same products, summed in another order)."""
    q, k, v = _inputs(1, 8, 2, 1, S, 64, 64, seed=S)
    amx_switch(True)
    (out, weights), taken = _tile_keys(lambda: native.native_attention_weights(q, k, v, None))
    assert taken[1] == S // 16 * 16 * 2
    amx_switch(False)
    out_products, weights_products = native.native_attention_weights(q, k, v, None)
    amx_switch(True)
    exact = _exact(q, k, v, None)
    assert_close(out.double(), exact, torch.bfloat16)
    assert max_error(out, exact) <= 1.5 * max_error(out_products, exact) + 2 ** -8
    assert_close(weights.double(), weights_products.double(), torch.bfloat16)


def _int8_step(H, Hkv, S, D, seed, *, dtype=torch.bfloat16, page=None):
    """(a decoding step's call over an 8-bit paged cache of ``page``-key pages (one page: S), its float64
    oracle): one sequence, one row a head, bfloat16 (or ``dtype``) queries."""
    from mha.kernels import paged_attention, storage

    g = torch.Generator().manual_seed(seed)
    P = page or S
    pages = -(-S // P)
    k, v = (torch.randn(pages, Hkv, P, D, generator=g) for _ in range(2))
    k8, v8 = storage.store(k, True), storage.store(v, True)
    q = (torch.randn(1, H, D, generator=g) * 2).to(dtype)
    table, cu, seqlens = torch.arange(pages)[None], torch.tensor([0, 1]), torch.tensor([S])
    wide = [storage.load(x, torch.float64).transpose(0, 1).flatten(1, 2)[:, :S].repeat_interleave(H // Hkv, 0)[None]
            for x in (k8, v8)]
    exact = mha.kernels.attention(q.double().transpose(0, 1)[None], *wide, None, backend="math")[0][0].transpose(0, 1)
    return (lambda: paged_attention(q, k8, v8, table, cu, seqlens)), exact


@needs_amx
@pytest.mark.parametrize("D, S, scored", [(128, 63, 0), (128, 64, 64), (128, 300, 256), (64, 320, 320), (64, 1000, 992),
                                          (96, 300, 0), (192, 300, 0), (32, 300, 0)])
@pytest.mark.parametrize("H, Hkv", [(8, 8), (8, 4), (8, 2), (12, 4)])  # 1, 2, 4, 3 rows a kv head
def test_eight_bit_decoding_scores_on_the_tiles(D, S, scored, H, Hkv, amx_switch):
    """A decoding step's scores over 8-bit keys under bfloat16 queries (tile_word_score_block: the queries'
    16-bit integers as a signed high byte and an unsigned low one on tdpbssd and tdpbsud, D 64 or 128, at
    least kStepTileKeys keys a call, whole groups of 16; the rest on vpdpwssd): the oracle's output, and the
    vpdpwssd path's to within its own error and a rounding; float32 queries never take them (their rule is
    float32's products)."""
    call, exact = _int8_step(H, Hkv, S, D, seed=S + D + H)
    amx_switch(True)
    tiles, taken = _tile_keys(call)
    assert taken[0] == scored * Hkv
    amx_switch(False)
    products = call()
    amx_switch(True)
    assert_close(tiles.double(), exact, torch.bfloat16)
    assert max_error(tiles, exact) <= 1.5 * max_error(products, exact) + 2 ** -8
    wide_call, _ = _int8_step(H, Hkv, S, D, seed=S + D + H, dtype=torch.float32)
    assert _tile_keys(wide_call)[1][0] == 0


@needs_amx
def test_eight_bit_tiles_with_a_nan_query_or_key_and_far_apart_values(amx_switch):
    """A NaN query row refuses the words (words_of: the float loops take its block); a NaN key makes its
    rows NaN; a query whose values lie 2^20 apart keeps its largest exactly (the rest within 2^-15 of it)."""
    from mha.kernels import paged_attention, storage

    g = torch.Generator().manual_seed(3)
    S, H, Hkv, D = 256, 8, 2, 128
    k, v = (torch.randn(1, Hkv, S, D, generator=g) for _ in range(2))
    k[0, 1, 100] = float("nan")
    k8, v8 = storage.store(k, True), storage.store(v, True)
    q = torch.randn(1, H, D, generator=g).bfloat16()
    q[0, 0] = float("nan")
    q[0, 5, ::2] *= 2 ** 20  # kv head 1's block: on the tiles
    table, cu, seqlens = torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([S])
    amx_switch(True)
    out, taken = _tile_keys(lambda: paged_attention(q, k8, v8, table, cu, seqlens))
    assert taken[0] == 0 + S  # the first kv head's block (a NaN row) on the float loops, the second's on the tiles
    assert out[0, 0].isnan().all() and not out[0, 1:4].isnan().any()  # the NaN row alone
    assert out[0, 4:].isnan().all()  # a NaN key: the second kv head's rows
    k[0, 1, 100] = 1.0
    k8 = storage.store(k, True)
    out, taken = _tile_keys(lambda: paged_attention(q, k8, v8, table, cu, seqlens))
    assert taken[0] == S
    amx_switch(False)
    products = paged_attention(q, k8, v8, table, cu, seqlens)
    amx_switch(True)
    assert out[0, 0].isnan().all() and not out[0, 1:].isnan().any()
    assert_close(out[0, 1:].double(), products[0, 1:].double(), torch.bfloat16)


@needs_amx
def test_a_nan_or_infinite_key_on_the_decoding_tiles_makes_its_rows_nan(amx_switch):
    q, k, v = _inputs(1, 8, 2, 1, 300, 128, 128, seed=21)
    k = k.clone()
    k[0, 0, 200] = float("nan")
    k[0, 1, 100, 5] = float("inf")
    amx_switch(True)
    out = native.native_attention(q, k, v, None)
    assert out.isnan().all()  # both kv heads' rows (GQA 4): a NaN score, an infinite one
    k[0, 1, 100, 5] = 1.0
    out = native.native_attention(q, k, v, None)
    assert out[0, :4].isnan().all() and not out[0, 4:].isnan().any()
    empty = native.native_attention(q[:, :, :0], k, v, None)
    assert empty.shape == (1, 8, 0, 128)
