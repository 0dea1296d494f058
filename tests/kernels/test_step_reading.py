"""How the native kernel reads a decoding step's 16-bit (bfloat16, float16) or 8-bit cache: set_step_reading's
three readings ("tiles": AMX tiles where the CPU has them, else as "strips"; "strips": the values in chunks of
keys strip by strip of the output's columns; "rows": the values as whole rows, as float32 values are),
the one the kernel picks by itself (rows where AMX is present, strips elsewhere), and that each gives the
float64 oracle's output at the edges (0, 1 and tile-boundary key counts, 1-16 rows a key/value head, odd
value widths, caches of more slots than keys, a (B, S, H, D) layout, pages, infinite and NaN values).
"""

from __future__ import annotations

import functools

import pytest
import torch

import mha
from helpers.backends import NATIVE
from helpers.tolerance import assert_close, assert_within_torch_error
from mha.kernels import native

pytestmark = pytest.mark.skipif(not NATIVE, reason="the native kernel does not build here (no compiler)")

READINGS = ("tiles", "strips", "rows")


def _kernel():
    return native._kernel()


@pytest.fixture
def reading():
    """set_step_reading(name) for the test, the reading before restored after it."""
    kernel = _kernel()
    before = kernel.set_step_reading()
    yield kernel.set_step_reading
    kernel.set_step_reading(before)


def test_the_kernel_reads_rows_where_amx_is_present_else_strips():
    """The default (what the kernel reads when nothing set it; every test here restores it): measured
    from memory, rows took 0.58-0.65 of a float32 step's time on a Xeon with AMX where the tiles took
    0.75-0.80 and strips 0.66-0.71; strips kept elsewhere (docs/native.md)."""
    kernel = _kernel()
    before = kernel.set_amx(True)
    try:
        amx = kernel.amx_active()
    finally:
        kernel.set_amx(before)
    assert kernel.set_step_reading() == ("rows" if amx else "strips")


def test_set_step_reading_names_what_it_takes(reading):
    with pytest.raises(ValueError, match=r"reading must be 'tiles', 'strips' or 'rows', got 'columns'"):
        reading("columns")
    for name in READINGS:
        reading(name)
        assert reading() == name
        assert reading("") == name  # "" leaves it


def _step(B, H, Hkv, L, S, Dv, dtype, seed, *, slots=0, layout="bhsd"):
    """(q, k, v) of a decoding step: L rows a head over S keys of a cache with ``slots`` extra slots (rows D
    apart, heads further apart) in (B, H, S, D) or (B, S, H, D) layout (k, v then views with their strides)."""
    g = torch.Generator().manual_seed(seed)
    D = 64
    q = (torch.randn(B, H, L, D, generator=g) * 2).to(dtype)
    if layout == "bhsd":
        k = (torch.randn(B, Hkv, S + slots, D, generator=g) * 2).to(dtype)[:, :, :S]
        v = torch.randn(B, Hkv, S + slots, Dv, generator=g).to(dtype)[:, :, :S]
    else:
        k = (torch.randn(B, S + slots, Hkv, D, generator=g) * 2).to(dtype)[:, :S].transpose(1, 2)
        v = torch.randn(B, S + slots, Hkv, Dv, generator=g).to(dtype)[:, :S].transpose(1, 2)
    return q, k, v


def _exact(q, k, v, contract=None):
    return mha.kernels.attention(q.double(), k.double(), v.double(), contract, backend="math")[0]


def _each_reading(q, k, v, reading, contract=None):
    outs = {}
    for name in READINGS:
        reading(name)
        outs[name] = native.native_attention(q, k, v, contract)
    return outs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S", [0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000])
@pytest.mark.parametrize("H, Hkv, L", [(8, 8, 1), (8, 4, 1), (12, 4, 1), (8, 2, 1), (8, 1, 2), (16, 1, 1)])  # 1-16 rows a kv head
def test_every_reading_equals_the_oracle(dtype, S, H, Hkv, L, reading):
    q, k, v = _step(1, H, Hkv, L, S, 64, dtype, seed=S + H + Hkv)
    exact = _exact(q, k, v)
    for name, out in _each_reading(q, k, v, reading).items():
        assert_close(out.double(), exact, dtype, err_msg=name)


@pytest.mark.parametrize("Dv", [16, 48, 80, 100, 128, 256])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_every_reading_takes_odd_widths_strided_caches_and_batches(Dv, layout, reading):
    q, k, v = _step(2, 8, 2, 1, 300, Dv, torch.bfloat16, seed=Dv, slots=9, layout=layout)
    exact = _exact(q, k, v)
    for name, out in _each_reading(q, k, v, reading).items():
        assert_close(out.double(), exact, torch.bfloat16, err_msg=name)


def test_rows_and_strips_are_two_readings(reading):
    """The readings add the keys' values in two orders, which a cancellation shows: 6 keys of weight 1
    (zero queries), 4 rows a kv head, one column's values 2^25, -2^25, 1, 0, 0, 0. Strips add each key in
    turn (2^25 - 2^25 + 1: the output 1/6); rows take three streams of keys, three keys a sum (keys 0, 2, 4
    first: 2^25 + 1 rounds to 2^25 in float32, then - 2^25: the output 0). A reading that ran the other's
    loop would give the other's output."""
    q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 6, 64).bfloat16()
    v = torch.zeros(1, 1, 6, 16, dtype=torch.bfloat16)
    v[0, 0, :3, 0] = torch.tensor([2.0 ** 25, -(2.0 ** 25), 1.0])
    reading("strips")
    assert torch.equal(native.native_attention(q, k, v, None)[0, :, 0, 0].float(), torch.full((4,), 1 / 6).bfloat16().float())
    reading("rows")
    assert torch.equal(native.native_attention(q, k, v, None)[0, :, 0, 0].float(), torch.zeros(4))


def test_an_infinite_or_nan_value_stays_in_its_own_column_in_every_reading(reading):
    q, k, v = _step(1, 8, 2, 1, 1000, 64, torch.bfloat16, seed=5)
    v = v.clone()
    v[0, 0, 300, 10] = float("inf")
    v[0, 1, 700, 33] = float("nan")
    exact = _exact(q, k, v)
    for name, out in _each_reading(q, k, v, reading).items():
        assert out[0, :4, 0, 10].isinf().all() and out[0, 4:, 0, 33].isnan().all(), name
        assert out.isinf().sum() == 4 and out.isnan().sum() == 4, name
        finite = out.isfinite()
        assert_close(out[finite].double(), exact[finite], torch.bfloat16, err_msg=name)


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_reading_over_pages(page, dtype, reading):
    """A batch's step over 16-bit pages read in place (value runs a page long, or a sequence's run of pages
    in order): the oracle's output in every reading."""
    from mha.kernels import paged_attention

    g = torch.Generator().manual_seed(page)
    Hq, Hkv, D, lengths = 8, 2, 64, [1, 300, 1000]
    pages = [-(-S // page) for S in lengths]
    kp = torch.randn(sum(pages), Hkv, page, D, generator=g).to(dtype)
    vp = torch.randn(sum(pages), Hkv, page, D, generator=g).to(dtype)
    table = _table(pages, g)
    q = (torch.randn(len(lengths), Hq, D, generator=g) * 2).to(dtype)
    cu, seqlens = torch.arange(len(lengths) + 1), torch.tensor(lengths)
    for name in READINGS:
        reading(name)
        out = paged_attention(q, kp, vp, table, cu, seqlens)
        for i, S in enumerate(lengths):
            exact = _exact(q[i][None, :, None], _keys_of(kp, table[i], S), _keys_of(vp, table[i], S))[0, :, 0]
            assert_close(out[i].double(), exact, dtype, err_msg=f"{name}, sequence {i}")


def _keys_of(pool: torch.Tensor, table_row: torch.Tensor, S: int) -> torch.Tensor:
    """A sequence's first S rows (1, Hkv, S, X) from a pool of pages (N, Hkv, P, X) and its block table row."""
    pages = -(-S // pool.shape[2])
    return pool[table_row[:pages]].transpose(0, 1).flatten(1, 2)[None, :, :S]


def _table(pages: list[int], g: torch.Generator) -> torch.Tensor:
    """A block table placing each sequence's pages anywhere in a pool of sum(pages) pages."""
    order = torch.randperm(sum(pages), generator=g)
    table = torch.zeros(len(pages), max(pages), dtype=torch.long)
    first = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[first:first + n]
        first += n
    return table


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales_apart", [False, True], ids=["kept", "scales apart"])
def test_every_reading_over_8_bit_pages(page, dtype, scales_apart, reading):
    """8-bit pages (each row's scale after it, or the scales given apart), float32 and bfloat16 queries,
    odd value width: the float64 oracle over the dequantized pages in every reading (rows: the values
    widened in float32 row by row; strips: chunk by chunk, a bfloat16 call's weights as 16-bit integers)."""
    from mha.kernels import paged_attention, storage

    g = torch.Generator().manual_seed(page + 3)
    Hq, Hkv, D, Dv, lengths = 8, 2, 64, 80, [1, 17, 300, 1000]
    pages = [-(-S // page) for S in lengths]
    kept = [storage.store(torch.randn(sum(pages), Hkv, page, X, generator=g) * 2, True) for X in (D, Dv)]
    (k8, ks), (v8, vs) = (storage.split(x) for x in kept)
    table = _table(pages, g)
    q = (torch.randn(len(lengths), Hq, D, generator=g) * 2).to(dtype)
    cu, seqlens = torch.arange(len(lengths) + 1), torch.tensor(lengths)
    pools = dict(k_pages=k8, v_pages=v8, k_scales=ks, v_scales=vs) if scales_apart else dict(k_pages=kept[0], v_pages=kept[1])
    wide_k, wide_v = (rows.double() * scales[..., None].double() for rows, scales in ((k8, ks), (v8, vs)))
    call = functools.partial(paged_attention, q, pools["k_pages"], pools["v_pages"], table, cu, seqlens,
                             k_scales=pools.get("k_scales"), v_scales=pools.get("v_scales"))
    theirs = call(backend="math")  # the dequantized pages in q's dtype (float32 for bfloat16 queries), torch's products
    for name in READINGS:
        reading(name)
        out = call(backend="native")
        for i, S in enumerate(lengths):
            exact = _exact(q[i][None, :, None], _keys_of(wide_k, table[i], S), _keys_of(wide_v, table[i], S))[0, :, 0]
            assert_within_torch_error(out[i].double(), theirs[i].double(), exact, err_msg=f"{name}, sequence {i}")


def test_8_bit_values_are_read_as_rows_or_strips(reading):
    """The 8-bit readings add in two orders too: 6 keys of weight 1 (zero queries), 4 rows a kv head, one
    column's values 2^25, 0, 0, -2^25, 1, 0 (int8 64, 0, 0, -64, 1, 0, scales 2^19 and 1: each product
    exact). Strips add each key in turn (the output 1/6); rows add blocks of three neighbouring keys to
    the output ((-2^25 + 1) rounds to -2^25 in float32: the output 0)."""
    from mha.kernels import paged_attention

    Dv = 16
    values = torch.zeros(1, 1, 8, Dv + 4, dtype=torch.int8)
    values[0, 0, [0, 3, 4], 0] = torch.tensor([64, -64, 1], dtype=torch.int8)
    scales = torch.tensor([2.0 ** 19, 1, 1, 2.0 ** 19, 1, 1, 1, 1])
    values[0, 0, :, Dv:] = scales[:, None].view(torch.int8)
    keys = torch.zeros(1, 1, 8, 64 + 4, dtype=torch.int8)
    keys[..., 64:] = torch.ones(8, 1).view(torch.int8)
    q = torch.zeros(1, 4, 64)

    def call():
        table, cu, lengths = torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([6])
        return paged_attention(q, keys, values, table, cu, lengths, backend="native")[0, :, 0]

    reading("strips")
    assert torch.equal(call(), torch.full((4,), 1 / 6))
    reading("rows")
    assert torch.equal(call(), torch.zeros(4))
