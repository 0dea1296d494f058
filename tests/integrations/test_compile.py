"""torch.compile(fullgraph=True) traces every entry point in one graph, and torch.export exports
the modules: break counts from torch._dynamo.explain, outputs against eager."""

import pytest
import torch
import torch._dynamo

import mha

E, H = 32, 4


def _breaks(fn, *args):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    return explained.graph_count, explained.graph_break_count, [str(r.reason)[:200] for r in explained.break_reasons]


def _cases():
    torch.manual_seed(0)
    x = torch.randn(5, 2, E)  # (L, B, E): seq-first, torch's default
    xb = x.transpose(0, 1).contiguous()  # (B, L, E)
    drop_in = mha.nn.MultiheadAttention(E, H).eval()
    general = mha.GeneralAttention(E, E, E, 8, 8, E, H, num_kv_heads=2, rope=mha.RotaryEmbedding(8)).eval()
    encoder = mha.nn.TransformerEncoderLayer(E, H, 64, dropout=0.0).eval()
    decoder = mha.nn.TransformerDecoderLayer(E, H, 64, dropout=0.0).eval()
    q = torch.randn(2, H, 6, 8)
    long = torch.randn(1, 2, 100, 16)  # more rows than flash's window block (64): a partial last block
    table, document = torch.randn(2, 256), torch.arange(100) // 30
    score_mod = lambda s, b, h, i, j: s + table[h, (i - j) % 256]  # noqa: E731
    mask_mod = lambda b, h, i, j: document[i] == document[j]  # noqa: E731
    sdpa = mha.functional.scaled_dot_product_attention
    return {
        "functional SDPA, window + softcap on flash's tiles":
            (lambda a: sdpa(a, a, a, window=(64, 0), softcap=20.0, backend="flash"), long),
        "functional SDPA, score_mod + mask_mod on math":
            (lambda a: sdpa(a, a, a, is_causal=True, score_mod=score_mod, mask_mod=mask_mod, backend="math"), long),
        "functional SDPA on flex, every term":
            (lambda a: sdpa(a, a, a, window=(40, 0), softcap=20.0, alibi_slopes=torch.tensor([0.5, 0.25], dtype=torch.float16),
                            score_mod=score_mod, mask_mod=mask_mod, backend="flex"), long),
        "drop-in, weights": (lambda a: drop_in(a, a, a), x),
        "drop-in, no weights, causal": (lambda a: drop_in(a, a, a, need_weights=False, is_causal=True), x),
        "general, RoPE + GQA + causal": (lambda a: general(a, a, a, is_causal=True), xb),
        "encoder layer": (lambda a: encoder(a), x),
        "decoder layer": (lambda a: decoder(a, a, tgt_is_causal=False), x),
        "functional SDPA, causal": (lambda a: mha.functional.scaled_dot_product_attention(a, a, a, is_causal=True), q),
        "functional SDPA, bottom-right + window":
            (lambda a: mha.functional.scaled_dot_product_attention(a[:, :, :3], a, a, is_causal=True,
                                                                   causal_alignment="bottom_right", window=(2, 0)), q),
    }


_SLOW = {"functional SDPA on flex, every term"}  # Inductor compiles FlexAttention's CPU kernel: seconds in a fresh environment


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in _SLOW else name
                                  for name in _cases()])
def test_no_graph_breaks_and_equal_outputs(name):
    fn, x = _cases()[name]
    graphs, breaks, reasons = _breaks(fn, x)
    assert (graphs, breaks) == (1, 0), reasons
    with torch.no_grad():
        want = fn(x)
        got = torch.compile(fn, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, want)  # tensors, or (output, weights) pairs


@pytest.mark.parametrize("cache_kind", [dict(max_length=32), dict()])
def test_a_cache_decode_step_has_no_graph_break(cache_kind):
    torch.manual_seed(0)
    module = mha.GeneralAttention(E, E, E, 8, 8, E, H, num_kv_heads=2, rope=mha.RotaryEmbedding(8)).eval()
    prompt, token = torch.randn(2, 5, E), torch.randn(2, 1, E)
    eager, traced = mha.KVCache(**cache_kind), mha.KVCache(**cache_kind)
    with torch.no_grad():
        for cache in (eager, traced):
            module(prompt, prompt, prompt, is_causal=True, cache=cache)
        want = module(token, token, token, is_causal=True, cache=eager)
        graphs, breaks, reasons = _breaks(lambda t: module(t, t, t, is_causal=True, cache=traced), token)
        assert (graphs, breaks) == (1, 0), reasons
        torch.testing.assert_close(traced.keys[:, :, :6], eager.keys[:, :, :6])  # the traced step stored its key
        traced.crop(5)
        step = torch.compile(lambda t: module(t, t, t, is_causal=True, cache=traced), fullgraph=True, backend="eager")
        torch.testing.assert_close(step(token), want)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [100, 200], ids=["decoding rows", "block mask"])
def test_inductor_compiles_flex_with_every_term_inside_a_graph(rows):
    """FlexAttention inside the caller's compiled graph (CPU: inference): window, softcap, ALiBi with
    float16 slopes, a score_mod and a mask_mod; offsets and caps are plain numbers there. (A tensor the
    functions read must come from outside the graph: one made in it is no input of the kernel, and
    torch 2.13's CPU lowering finds no kernel then.)"""
    x = torch.randn(1, 2, rows, 16)
    table, document = torch.randn(2, 256), torch.arange(rows) // 30
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float16)  # (made outside: see the docstring)

    def fn(a):
        return mha.functional.scaled_dot_product_attention(
            a, a, a, window=(40, 0), softcap=20.0, alibi_slopes=slopes,
            score_mod=lambda s, b, h, i, j: s + table[h, (i - j) % 256], mask_mod=lambda b, h, i, j: document[i] == document[j],
            backend="flex")

    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x), fn(x))


@pytest.mark.slow
def test_inductor_compiles_the_drop_in_to_equal_outputs():
    torch.manual_seed(0)
    module = mha.nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(2, 7, E)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    with torch.no_grad():
        for want, got in zip(module(x, x, x), compiled(x, x, x)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [
    lambda: (mha.nn.MultiheadAttention(E, H, batch_first=True), True),
    lambda: (mha.GeneralAttention(E, E, E, 8, 8, E, H, num_kv_heads=2, rope=mha.RotaryEmbedding(8)), False),
    lambda: (mha.nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True), False),
], ids=["drop-in", "general", "encoder layer"])
def test_torch_export_gives_the_eager_outputs(build):
    torch.manual_seed(0)
    module, three_inputs = build()
    module.eval()
    x = torch.randn(2, 7, E)
    args = (x, x, x) if three_inputs or isinstance(module, mha.GeneralAttention) else (x,)
    exported = torch.export.export(module, args)
    torch.testing.assert_close(exported.module()(*args), module(*args))


@pytest.mark.parametrize("kind", [dict(max_length=32), dict(), dict(window=8)], ids=["preallocated", "growing", "rolling"])
def test_a_compiled_decode_loop_stops_compiling(kind):
    """The cache's length is a tensor shape, not a Python int: after one recompile it is a symbol,
    so a loop of steps does not recompile at every length (nor hit the recompile limit)."""
    torch.manual_seed(0)
    window = (8, 0) if "window" in kind else None
    module = mha.GeneralAttention(E, E, E, 8, 8, E, H, num_kv_heads=2, rope=mha.RotaryEmbedding(8),
                                    window=window).eval()
    prompt = torch.randn(2, 5, E)
    eager, traced = mha.KVCache(**kind), mha.KVCache(**kind)
    graphs = []

    def count(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    step = torch.compile(lambda t: module(t, t, t, is_causal=True, cache=traced), fullgraph=True, backend=count)
    with torch.no_grad():
        for cache in (eager, traced):
            module(prompt, prompt, prompt, is_causal=True, cache=cache)
        for steps in range(24):
            token = torch.randn(2, 1, E)
            torch.testing.assert_close(step(token), module(token, token, token, is_causal=True, cache=eager))
            if steps == 11:
                compiled_in_the_first_12 = len(graphs)
    assert len(graphs) == compiled_in_the_first_12, "a later step compiled again"
    # growing and preallocated: one recompile makes the length a symbol; a rolling cache also
    # recompiles while it fills up to its window (its slots then keep one shape)
    assert len(graphs) <= (2 if "window" not in kind else 5) and traced.size == eager.size
