"""mha.kernels.storage, the one layout of kept keys and values (int8 rows, each followed by its
float32 scale's bytes) and paged attention reading it where it lies: every backend against float64
attention over the dequantized rows, whatever the strides of the two scale pools."""

import math

import pytest
import torch

from mha.kernels import Contract, dispatch, native, paged_attention, storage
from mha.kernels.contract import NONE, from_keywords
from mha.kernels.paged import batch_paged_attention
from mha.kernels.quantize import dequantize, quantize_int8
from mha.positions import CAUSAL, Band

BACKENDS = ["math"] + (["native"] if native.native_available() else [])


@pytest.mark.parametrize("X", [1, 3, 4, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_kept_row_is_its_int8_values_then_its_float32_scale(X, dtype):
    x = (torch.randn(2, 3, 7, X, generator=torch.Generator().manual_seed(X)) * 5).to(dtype)
    kept = storage.store(x, True)
    assert kept.dtype == torch.int8 and kept.shape == (2, 3, 7, X + 4) and storage.width(kept) == X
    rows, scales = storage.split(kept)
    data, want_scales = quantize_int8(x)
    assert torch.equal(rows, data) and scales.dtype == torch.float32 and torch.equal(scales, want_scales)
    assert rows.data_ptr() == kept.data_ptr()  # the rows are a view
    assert (scales.data_ptr() == kept.data_ptr() + X) == (X % 4 == 0)  # the scales too, where floats can read them
    assert torch.equal(storage.load(kept, torch.float64), dequantize(data, want_scales, torch.float64))
    assert storage.store(x, False) is x and storage.split(x) == (x, None) and storage.width(x) == X


def _edge_rows(X: int) -> torch.Tensor:
    """Rows (float64) at the quantizer's edges, X values each: ties at half a level (rounded half to
    even), zeros, NaN, infinities, a max too small for a float32 scale, subnormal ones, float32's
    largest, and one beyond float32 (infinite once converted)."""
    levels = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -3.5])
    rows = [levels.repeat(X)[:X] if X > 1 else torch.tensor([127.0]), torch.zeros(X)]
    for special in (float("nan"), float("inf"), float("-inf"), 1e-45, 1e-40, 3.4e38, 1e39):
        row = torch.linspace(-1, 1, X, dtype=torch.float64) * (special if abs(special) < 1 else 1)
        row[X // 2] = special
        rows.append(row)
    return torch.stack([r.double() for r in rows])


@pytest.mark.skipif(not native.native_available(), reason="the native kernel is not built here")
@pytest.mark.parametrize("X", [1, 2, 7, 15, 16, 17, 64, 129, 255, 256, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_native_quantizer_keeps_the_bytes_of_the_torch_one(X, dtype):
    """storage.store's one native call (kernel.quantize_rows) against quantize_int8's torch ops, byte
    for byte: random rows at several ranges, the edge rows, a strided view and empty shapes."""
    kernel = native._kernel()
    g = torch.Generator().manual_seed(X)
    ranges = torch.logspace(-30, 30, 5, dtype=torch.float64)[:, None, None]  # (5, 1, 1): a range per row block
    random = torch.randn(5, 3, X, generator=g, dtype=torch.float64) * ranges
    for x in (random, _edge_rows(X), random.transpose(0, 1), torch.zeros(0, 4, X), torch.zeros(2, 0, X)):
        x = x.to(dtype)
        data, scales = quantize_int8(x)
        want = torch.cat([data, scales[..., None].view(torch.int8)], dim=-1)
        got = storage.store(x, True)
        assert torch.equal(got, want), (x, got, want)
        assert torch.equal(kernel.quantize_rows(x.contiguous()), want)
    with pytest.raises(RuntimeError, match="quantize_rows: x must be a contiguous floating CPU tensor"):
        kernel.quantize_rows(random.transpose(0, 1))


def test_int8_levels_are_computed_in_float32_whatever_the_rows_dtype():
    """bfloat16 rows are quantized as their float32 values: a bfloat16 division lands rows a level
    off, and its scales would not be float32."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    rows, scales = storage.split(storage.store(x, True))
    wide = x.float()
    amax = wide.abs().amax(-1)
    assert scales.dtype == torch.float32 and torch.equal(scales, amax / 127)
    assert torch.equal(rows, (wide / (amax / 127)[:, None]).round().to(torch.int8))
    low = (x / (x.abs().amax(-1) / 127)[:, None]).round().to(torch.int8)  # the same levels computed in bfloat16
    assert not torch.equal(rows, low)  # (the planted change this test is here to catch differs)


def test_views_of_kept_rows_keep_each_row_with_its_scale():
    """What a cache does along its slots (narrow, select a batch, every other slot) keeps the scales."""
    x = torch.randn(3, 2, 9, 8, generator=torch.Generator().manual_seed(2))
    kept, (data, scales) = storage.store(x, True), quantize_int8(x)
    for index in ((slice(None), slice(None), slice(2, 7)), ([2, 0],), (slice(None), slice(None), slice(None, None, 2)),
                  (slice(1, None), slice(1, None))):
        rows, got = storage.split(kept[index])
        assert torch.equal(rows, data[index]) and torch.equal(got, scales[index])


@pytest.mark.parametrize("shape", [(2, 4), (2, 3, 3)])
def test_int8_that_is_not_kept_rows_is_refused(shape):
    with pytest.raises(ValueError, match=r"kept as \(\.\.\., length, width \+ 4\)"):
        storage.split(torch.zeros(*shape[:-1], 4 if len(shape) == 2 else 3, dtype=torch.int8))


def _pages(*, N=9, Hkv=2, P=4, D=8, Dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(N, Hkv, P, D, generator=g) * 3, torch.randn(N, Hkv, P, Dv, generator=g)
    return k, v


def _reference(q, k_kept, v_kept, table, cu, lengths, **terms):
    """float64 attention over the dequantized pages, each sequence alone (the math backend)."""
    wide = {n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in terms.items()}
    return paged_attention(q.double(), storage.load(k_kept, torch.float64), storage.load(v_kept, torch.float64),
                           table, cu, lengths, backend="math", **wide)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("P", "D", "Dv"), [(4, 8, 4), (1, 8, 4), (1, 5, 9), (3, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@torch.no_grad()
def test_kept_int8_pages_attend_like_float64_over_their_dequantized_rows(backend, P, D, Dv, dtype):
    """Keys and values of different widths (so their scale pools have different strides), pages of
    one slot with two kv heads, pages laid out in and out of order (runs that merge and runs that do
    not), float64 queries through the public entry: each within its dtype's rounding of float64."""
    k, v = _pages(P=P, D=D, Dv=Dv, N=40 // P + 4)
    k_kept, v_kept = storage.store(k, True), storage.store(v, True)
    N = k.shape[0]
    table = torch.stack([torch.arange(N), torch.arange(N).flip(0)])  # in order (runs merge), reversed (they do not)
    lengths = torch.tensor([N * P - 1, N * P - 3])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, D, generator=g).to(dtype)
    cu = torch.tensor([0, 1, 3])
    terms = dict(window=(N * P // 2, 0), sinks=torch.randn(4, generator=g), softcap=4.0)
    if backend == "native" and dtype == torch.float64:  # (auto takes float64 to math: the native entry itself)
        got = native.paged_attention_native(q, k_kept, v_kept, table, cu, lengths, from_keywords(q, 4, **terms))
    else:
        got = paged_attention(q, k_kept, v_kept, table, cu, lengths, backend=backend, **terms)
    want = _reference(q, k_kept, v_kept, table, cu, lengths, **terms)
    tolerance = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    assert got.dtype == dtype and (got.double() - want).abs().max().item() <= tolerance
    if dtype != torch.float64:
        (k8, ks), (v8, vs) = storage.split(k_kept), storage.split(v_kept)
        apart = paged_attention(q, k8, v8, table, cu, lengths, backend=backend, k_scales=ks.contiguous(),
                                v_scales=vs.contiguous(), **terms)
        assert torch.equal(got, apart)  # the scales where they lie read as the scales apart


@pytest.mark.parametrize(("k_width", "scales", "message"), [
    (8, {}, r"k_pages is int8 \(5, 2, 4, 8\) without its scales: 8-bit pages are kept as \(num_blocks, kv heads, "
            r"block_size, 8 \+ 4\)"),
    (12, {"k_scales": "k"}, "int8 pages need v_scales"),
])
def test_int8_pages_without_their_scales_are_refused_by_name(k_width, scales, message):
    k, v = _pages(N=5)
    k_kept, v_kept = storage.store(k, True), storage.store(v, True)
    pages = k_kept[..., :k_width] if k_width == 8 else k_kept
    extra = {name: storage.split(k_kept)[1] for name in scales}
    with pytest.raises(ValueError, match=message):
        paged_attention(torch.randn(1, 4, 8), pages, v_kept, torch.tensor([[0, 1]]), torch.tensor([0, 1]),
                        torch.tensor([6]), **extra)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("permuted", ["k_scales", "v_scales"])
@pytest.mark.parametrize("rows", [2, 12])  # a decoding step's few rows (read in registers), a chunk's (products)
@torch.no_grad()
def test_a_run_of_pages_ends_where_either_scale_pool_stops_following_on(backend, permuted, rows):
    """Pages in order in a pool of one kv head (keys and values one run), but one pool of scales laid
    out slot-major (page after page does not follow on there): the run ends at each page."""
    k, v = _pages(N=6, Hkv=1, P=4, D=8, Dv=8)
    (k8, ks), (v8, vs) = quantize_int8(k), quantize_int8(v)
    scales = {"k_scales": ks, "v_scales": vs}
    scales[permuted] = scales[permuted].permute(2, 1, 0).contiguous().permute(2, 1, 0)  # strides (1, N, N)
    table, lengths, cu = torch.arange(6)[None], torch.tensor([23]), torch.tensor([0, rows])
    q = torch.randn(rows, 2, 8, generator=torch.Generator().manual_seed(7))
    got = paged_attention(q, k8, v8, table, cu, lengths, backend=backend, is_causal=False, **scales)
    want = paged_attention(q.double(), dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64), table, cu,
                           lengths, backend="math", is_causal=False)
    assert (got.double() - want).abs().max().item() <= 2e-6


def _misaligned(kept: torch.Tensor) -> torch.Tensor:
    """The same bytes one byte into a buffer: no float lies on a whole float there (the scales are copied)."""
    buffer = torch.empty(kept.numel() + 1, dtype=torch.int8)[1:]
    return buffer.view(kept.shape).copy_(kept)


POOLS = {  # how a kept pool may lie: each reads its scales in place, or copies them out (kept_rows)
    "contiguous": lambda kept: kept,
    "every other page": lambda kept: torch.stack([kept, kept], 1)[:, 0],  # page stride twice a page's bytes
    "one byte in": _misaligned,
}


@pytest.mark.skipif(not native.native_available(), reason="the native kernel is not built here")
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize(("P", "D", "Dv"), [(4, 8, 12), (1, 8, 4), (3, 5, 9), (16, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@torch.no_grad()
def test_the_kernel_reads_kept_pages_as_it_reads_their_scales_apart(pool, P, D, Dv, dtype):
    """The native kernel given kept pages whole (no scales) against the same pages with their scales
    apart, bitwise: scales read where they lie (widths a multiple of 4 on whole floats), copied out
    (D 5, Dv 9; one byte into a buffer) or widened (float64 queries); pages of one slot, pages apart."""
    k, v = _pages(P=P, D=D, Dv=Dv, N=24 // P + 3, seed=P + D)
    k_kept, v_kept = (POOLS[pool](storage.store(x, True)) for x in (k, v))
    assert (pool == "every other page") != k_kept.is_contiguous() and (pool == "one byte in") == bool(k_kept.data_ptr() % 4)
    N = k_kept.shape[0]
    table = torch.stack([torch.arange(N), torch.arange(N).flip(0)])
    lengths, cu = torch.tensor([N * P - 1, N * P - 2]), torch.tensor([0, 1, 4])
    q = torch.randn(4, 4, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    contract = from_keywords(q, 4, window=(N * P // 2, 0), softcap=6.0)
    got = native.paged_attention_native(q, k_kept, v_kept, table, cu, lengths, contract)
    (k8, ks), (v8, vs) = storage.split(k_kept), storage.split(v_kept)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    apart = native.paged_attention_native(q, k8, v8, table, cu, lengths, contract, k_scales=ks.to(wide).contiguous(),
                                          v_scales=vs.to(wide).contiguous())
    assert torch.equal(got, apart)
    want = _reference(q, k_kept, v_kept, table, cu, lengths, window=(N * P // 2, 0), softcap=6.0)
    tolerance = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    assert (got.double() - want).abs().max().item() <= tolerance


FAST_TERMS = {
    "none": {},
    "causal": {"band": CAUSAL},
    "window": {"band": Band(5, 0)},
    "softcap, scale": {"softcap": 3.0, "scale": 0.3},
    "sinks, ALiBi": {"sinks": [0.5, -1.0, 2.0, 0.0, 1.0, -0.5], "alibi_slopes": [0.5, 0.25, 0.1, 0.05, 0.02, 0.01]},
}


@pytest.mark.skipif(not native.native_available(), reason="the native kernel is not built here")
@pytest.mark.parametrize(("B", "H", "Hkv", "L", "S", "D", "Dv"), [
    (1, 6, 6, 1, 1, 8, 8), (2, 6, 3, 1, 17, 5, 9), (3, 6, 1, 2, 64, 16, 4), (1, 6, 2, 65, 65, 64, 64),
    (2, 6, 6, 3, 300, 1, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@torch.no_grad()
def test_a_batch_over_kept_rows_takes_the_fast_path_with_the_full_paths_output(B, H, Hkv, L, S, D, Dv, dtype):
    """batch_paged_attention over an 8-bit cache's rows (an 8-bit KVCache's or Int8Cache's step): the
    native kernel's one-step path (dispatch.plain_pages) gives the full path's output bitwise, for
    every term the pages carry, at and around the kernel's block and tile sizes, GQA, L = 1 and L = S."""
    g = torch.Generator().manual_seed(B * S + D)
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k_kept = storage.store(torch.randn(B, Hkv, S, D, generator=g) * 2, True)
    v_kept = storage.store(torch.randn(B, Hkv, S, Dv, generator=g), True)
    for terms in FAST_TERMS.values():
        contract = Contract(**{name: torch.tensor(x) if isinstance(x, list) else x for name, x in terms.items()})
        fast = dispatch.plain_pages(q, k_kept, v_kept, contract)
        assert fast is not None and fast.shape == (B, H, L, Dv) and fast.dtype == dtype, terms
        full = batch_paged_attention(q, k_kept, v_kept, contract, backend="native")  # (the full path: attend_pages)
        assert torch.equal(fast, full), terms
        assert torch.equal(batch_paged_attention(q, k_kept, v_kept, contract), fast), terms  # auto: the fast path
        want = batch_paged_attention(q.double(), storage.load(k_kept, torch.float64), storage.load(v_kept, torch.float64),
                                     contract, backend="math")
        tolerance = {torch.float32: 5e-6, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]  # (the kernel's rounding)
        assert (fast.double() - want).abs().max().item() <= tolerance, terms


def _not_fast(q, k, v):
    """Calls the fast path leaves to the full path (each its own reason)."""
    B, H, L, D = q.shape
    return {
        "float64 queries": (q.double(), k, v, NONE),
        "a gradient asked for": (q.clone().requires_grad_(), k, v, NONE),
        "keys not D + 4 wide": (q, k[..., 1:], v, NONE),
        "values of a float dtype": (q, k, v.float(), NONE),
        "more queries than keys": (q.expand(B, H, k.shape[2] + 1, D), k, v, NONE),
        "no sequence": (q[:0], k[:0], v[:0], NONE),
        "rows not contiguous": (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, NONE),
        "float queries, int8 keys of another batch": (q, k[:1], v[:1], NONE),
        "a term pages do not carry": (q, k, v, Contract(logit_scale=torch.ones(H))),
        "sinks that learn": (q, k, v, Contract(sinks=torch.zeros(H, requires_grad=True))),
        "ALiBi slopes that learn": (q, k, v, Contract(alibi_slopes=torch.ones(H, requires_grad=True))),
    }


PYTHON_ONLY = ("a term pages do not carry", "sinks that learn", "ALiBi slopes that learn")  # (the kernel's terms lack them)


@pytest.mark.skipif(not native.native_available(), reason="the native kernel is not built here")
@pytest.mark.parametrize("case", list(_not_fast(torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 5, 12), torch.zeros(1))))
def test_the_fast_path_leaves_what_it_does_not_take_to_the_full_path(case):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = (storage.store(torch.randn(2, 2, 5, 8, generator=g), True) for _ in range(2))
    assert dispatch.plain_pages(q, k, v, NONE) is not None  # (the call the cases change)
    q, k, v, contract = _not_fast(q, k, v)[case]
    with torch.enable_grad():
        assert dispatch.plain_pages(q, k, v, contract) is None
        if case not in PYTHON_ONLY:  # refused by the kernel's own checks (not an error the dispatch swallows)
            assert native._kernel().plain_pages(q, k, v, native._terms(contract, q.shape[-1], q.dtype)) is None
        else:  # and the full path refuses what only Python checks, or runs it (logit_scale folded into q)
            call = lambda: batch_paged_attention(q, k, v, contract)  # noqa: E731
            if case == "a term pages do not carry":
                assert call().shape == (2, 4, 1, 8)
            else:
                with pytest.raises(ValueError, match="paged_attention is for inference"):
                    call()


def _buffer_of(kept: torch.Tensor) -> tuple[int, int]:
    """(where the buffer starts, how many slots it has) of a tensor a room returned."""
    return kept.data_ptr(), kept.stride(1) // kept.shape[3]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prompt", [1, 5, 255, 256, 257, 300])
def test_appended_rows_are_written_into_the_buffer_until_it_is_full_then_copied_once(dtype, prompt):
    """A prompt of S, then one row at a time: a new buffer has room for twice the slots it holds, at most
    RESERVE more (storage.capacity), each step writes into it (the same buffer, what a concatenation
    gives), and the step past it copies into a new one, again with room."""
    R, room = storage.RESERVE, storage.Room()
    assert [storage.capacity(n) for n in (1, 5, 255, 256, 300)] == [2, 10, 510, 512, 556]
    new = [torch.randn(2, 3, prompt, 5).to(dtype)] + [torch.randn(2, 3, 1, 5).to(dtype) for _ in range(R + 3)]
    kept, joined, copies = None, None, 0
    capacity = storage.capacity(prompt)
    for step, rows in enumerate(new):
        before = None if kept is None else _buffer_of(kept)
        kept = room.append(kept, rows)
        joined = rows if joined is None else torch.cat([joined, rows], dim=2)
        assert torch.equal(kept, joined) and room.filled == kept.shape[2]
        S = kept.shape[2]
        if step == 0 or S > capacity:
            assert kept.data_ptr() != rows.data_ptr()  # never the caller's rows themselves
            assert before is None or kept.data_ptr() != before[0]
            capacity, copies = storage.capacity(S), copies + 1
        else:
            assert _buffer_of(kept) == before  # written in place
        assert _buffer_of(kept)[1] == capacity
    assert copies <= 2 + math.ceil(math.log2(R + 3))  # doubling from one slot, then once every RESERVE


def test_what_is_not_the_rooms_filled_slots_is_copied_not_written_into():
    """A crop, a batch or heads taken of the buffer, its slots trimmed from the front, a contiguous
    copy, a caller's tensor with room past its rows: each copied with the new rows, the buffer (and
    the caller's tensor) left as they were."""
    prompt = torch.randn(2, 4, 5, 3)
    views = (lambda w: w.narrow(2, 0, 3), lambda w: w[0:1], lambda w: w.narrow(1, 0, 2), lambda w: w.narrow(2, 2, 3),
             lambda w: w.contiguous())
    for view in views:
        room = storage.Room()
        whole = room.append(None, prompt)
        kept = view(whole)
        new = torch.randn(kept.shape[0], kept.shape[1], 1, 3)
        out = room.append(kept, new)
        assert torch.equal(out, torch.cat([kept, new], dim=2)) and out.data_ptr() != whole.data_ptr()
        assert torch.equal(whole, prompt)
    user = torch.randn(2, 4, 20, 3)
    snapshot = user.clone()
    out = storage.Room().append(user[:, :, :5], torch.randn(2, 4, 1, 3))
    assert torch.equal(user, snapshot) and out.data_ptr() != user.data_ptr()


def test_another_rooms_slots_or_the_buffer_seen_in_another_order_are_copied():
    """What fills the same slots count but is not this buffer as it lies: another room's (the keys' room
    given the values), the batch and heads swapped (a transpose of as many sequences as heads)."""
    keys_room, values_room = storage.Room(), storage.Room()
    keys_room.append(None, torch.randn(2, 2, 5, 3))
    values = values_room.append(None, torch.randn(2, 2, 5, 3))
    new = torch.randn(2, 2, 1, 3)
    assert torch.equal(keys_room.append(values, new), torch.cat([values, new], dim=2))
    room = storage.Room()
    whole = room.append(None, torch.randn(2, 2, 5, 3))
    swapped = whole.transpose(0, 1)
    assert torch.equal(room.append(swapped, new), torch.cat([swapped, new], dim=2))


def test_two_holders_of_one_room_appended_in_turn_keep_their_own_rows():
    """A shallow copy of a cache shares its room: the first to append writes in place, the other
    (now behind the filled count) copies, so neither sees the other's rows."""
    room = storage.Room()
    shared = room.append(None, torch.randn(1, 2, 5, 3))
    first = room.append(shared, torch.ones(1, 2, 1, 3))
    second = room.append(shared, torch.zeros(1, 2, 1, 3))
    assert first.data_ptr() == shared.data_ptr() != second.data_ptr()
    assert torch.equal(first[:, :, 5], torch.ones(1, 2, 3)) and torch.equal(second[:, :, 5], torch.zeros(1, 2, 3))


def test_a_buffer_made_under_inference_mode_is_copied_outside_it():
    room = storage.Room()
    with torch.inference_mode():
        kept = room.append(None, torch.randn(1, 1, 3, 4))
    with torch.no_grad():
        out = room.append(kept, torch.randn(1, 1, 1, 4))  # (torch refuses an in-place write to it here)
    assert out.shape == (1, 1, 4, 4) and torch.equal(out[:, :, :3], kept) and out.data_ptr() != kept.data_ptr()
    with torch.inference_mode():
        kept = room.append(None, torch.randn(1, 1, 3, 4))
        assert room.append(kept, torch.randn(1, 1, 1, 4)).data_ptr() == kept.data_ptr()


@pytest.mark.parametrize("shape", [(0, 2, 5, 4), (2, 0, 5, 4), (2, 2, 0, 4)])
def test_empty_batches_heads_and_lengths_append_as_a_concatenation(shape):
    kept = torch.zeros(shape)
    new = torch.ones(shape[0], shape[1], 1, shape[3])
    assert storage.Room().append(kept, new).shape == torch.cat([kept, new], dim=2).shape


def test_no_new_rows_keep_the_buffer_and_an_empty_start_grows_from_nothing():
    room = storage.Room()
    empty = room.append(None, torch.zeros(1, 2, 0, 3))
    assert empty.shape == (1, 2, 0, 3)
    kept = room.append(empty, torch.ones(1, 2, 3, 3))
    assert torch.equal(room.append(kept, torch.zeros(1, 2, 0, 3)), kept) and room.filled == 3
    assert room.append(room.append(kept, torch.zeros(1, 2, 0, 3)), torch.ones(1, 2, 1, 3)).data_ptr() == kept.data_ptr()


def test_in_place_is_allowed_only_where_nothing_but_inference_follows():
    assert not storage.in_place_allowed()  # (grad enabled)
    with torch.no_grad():
        assert storage.in_place_allowed()
    with torch.inference_mode():
        assert storage.in_place_allowed()


def test_rows_that_do_not_follow_the_kept_ones_are_refused_by_name():
    kept = storage.Room().append(None, torch.zeros(2, 3, 4, 5, dtype=torch.int8))
    for new, what in ((torch.zeros(1, 3, 1, 5, dtype=torch.int8), r"\(1, 3, 1, 5\)"),
                      (torch.zeros(2, 3, 1, 6, dtype=torch.int8), r"\(2, 3, 1, 6\)"),
                      (torch.zeros(2, 3, 1, 5), r"\(2, 3, 1, 5\) torch.float32")):
        with pytest.raises(ValueError, match=f"new rows {what}.*do not follow the kept"):
            storage.Room().append(kept, new)
    with pytest.raises(ValueError, match=r"new rows must be \(batch, heads, length, width\), got shape \(3, 5\)"):
        storage.Room().append(kept, torch.zeros(3, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"the kept rows must be \(batch, heads, length, width\), got shape \(4, 5\)"):
        storage.Room().append(torch.zeros(4, 5, dtype=torch.int8), torch.zeros(1, 1, 1, 5, dtype=torch.int8))
