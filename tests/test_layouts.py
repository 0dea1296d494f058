"""mha.layouts: lossless conversion both ways, equal outputs after conversion, the per-head form."""

import pytest
import torch

import mha
from mha import layouts
from mha.tools.verify import randomize_biases

E, H = 12, 3


def _torch_module(**options):
    torch.manual_seed(0)
    return randomize_biases(torch.nn.MultiheadAttention(E, H, batch_first=True, **options))


def _assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


SQUARE = ["general", "torch", "bert", "gpt2", "annotated", "labml", "per_head"]


@pytest.mark.parametrize("layout", SQUARE)
def test_round_trip_through_every_layout_is_exact(layout):
    general = layouts.to_general(_torch_module().state_dict(), "torch")
    there = layouts.from_general(general, layout, num_heads=H)
    back = layouts.to_general(there, layout, num_heads=H)
    _assert_same_state(back, general)


@pytest.mark.parametrize("source, target", [(a, b) for a in SQUARE for b in SQUARE if a != b])
def test_convert_between_any_two_layouts_keeps_the_outputs(source, target):
    theirs = _torch_module()
    start = layouts.convert(theirs.state_dict(), "torch", source, num_heads=H)
    converted = layouts.convert(start, source, target, num_heads=H)
    module = layouts.general_module(converted, target, H)
    x = torch.randn(2, 5, E)
    torch.testing.assert_close(module(x, x, x), theirs(x, x, x)[0])


@pytest.mark.parametrize("options", [dict(), dict(kdim=5, vdim=7), dict(add_bias_kv=True), dict(bias=False)], ids=str)
def test_torch_layout_round_trip_in_every_configuration(options):
    theirs = _torch_module(**options)
    general = layouts.to_general(theirs.state_dict(), "torch")
    _assert_same_state(layouts.from_general(general, "torch"), theirs.state_dict())
    ours = layouts.torch_module(general, "general", H, cls=mha.nn.MultiheadAttention, batch_first=True)
    q = torch.randn(2, 4, E)
    k = torch.randn(2, 6, options.get("kdim", E))
    v = torch.randn(2, 6, options.get("vdim", E))
    torch.testing.assert_close(ours(q, k, v)[0], theirs(q, k, v)[0])
    general_module = layouts.general_module(general, "general", H)
    torch.testing.assert_close(general_module(q, k, v), theirs(q, k, v)[0])


def test_state_of_modules():
    state, layout, heads = layouts.state_of(mha.MultiHeadAttention(4, 5, 6, 2, 3, 7, 2))
    assert layout == "general" and heads == 2 and "v_proj.weight" in state
    assert layouts.state_of(torch.nn.MultiheadAttention(8, 2))[1:] == ("torch", 2)
    with pytest.raises(TypeError, match="Linear"):
        layouts.state_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("add_bias_kv, layout", [(True, "per_head"), (True, "general"), (False, "labml"),
                                                  (False, "bert"), (False, "annotated")])
def test_general_module_with_unequal_widths_round_trips(add_bias_kv, layout):
    m = mha.MultiHeadAttention(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2, add_bias_kv=add_bias_kv)
    state = m.state_dict()
    _assert_same_state(layouts.convert(layouts.convert(state, "general", layout, 2), layout, "general", 2), state)


def test_layouts_that_cannot_hold_the_weights_refuse():
    state = mha.MultiHeadAttention(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2, add_bias_kv=True).state_dict()
    with pytest.raises(ValueError, match="no place for.*bias_k"):
        layouts.from_general(state, "labml")
    with pytest.raises(ValueError, match="torch.nn.MultiheadAttention needs"):
        layouts.from_general(state, "torch")
    with pytest.raises(ValueError, match="GPT-2"):
        layouts.from_general(state, "gpt2")


# --- the per-head form (seed 000) ------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(), dict(add_bias_kv=True, add_zero_attn=True), dict(bias=False),
                                     dict(kdim=5, vdim=7)], ids=str)
@pytest.mark.parametrize("batched", [False, True])
def test_per_head_loop_equals_the_batched_module(options, batched):
    theirs = _torch_module(**options)
    heads = layouts.per_head(theirs.state_dict(), H, layout="torch")
    assert heads.num_heads == H and heads.W_q[0].shape == (E, E // H)
    lead = (2,) if batched else ()
    q = torch.randn(*lead, 4, E)
    k = torch.randn(*lead, 6, options.get("kdim", E))
    v = torch.randn(*lead, 6, options.get("vdim", E))
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[1, 2:] = True
    want, _ = theirs(q, k, v, attn_mask=mask)
    got = layouts.per_head_attention(q, k, v, heads, attn_mask=mask,
                                     add_zero_attn=options.get("add_zero_attn", False), batch_first=True)
    torch.testing.assert_close(got, want)


def test_per_head_matrices_are_the_seed_000_slices():
    """W_i^Q is the i-th block of columns of in_proj_weight's q part, transposed (seed 000)."""
    theirs = torch.nn.MultiheadAttention(4, 2)
    heads = layouts.per_head(layouts.to_general(theirs.state_dict(), "torch"), 2)
    w_q = theirs.in_proj_weight.chunk(3)[0].t()  # (D, D)
    w_q_0, w_q_1 = w_q.split(2, dim=1)
    torch.testing.assert_close(heads.W_q[0], w_q_0)
    torch.testing.assert_close(heads.W_q[1], w_q_1)
    torch.testing.assert_close(heads.W_o, theirs.out_proj.weight.t())


# --- adapters ----------------------------------------------------------------------------------


def test_seq_first_adapters_are_inverse_transposes():
    x = torch.randn(5, 2, 8)
    assert layouts.seq_first_to_batch_first(x).shape == (2, 5, 8)
    torch.testing.assert_close(layouts.batch_first_to_seq_first(layouts.seq_first_to_batch_first(x)), x)


def test_labml_mask_becomes_a_torch_attn_mask():
    T, B = 4, 2
    labml = torch.tril(torch.ones(T, T)).unsqueeze(-1).expand(T, T, B).clone()  # [T_q, T_k, B], 1 = attend
    labml[:, 3, 1] = 0  # batch 1 cannot see key 3
    attn_mask = layouts.labml_mask_to_attn_mask(labml, num_heads=H)
    assert attn_mask.shape == (B * H, T, T) and attn_mask.dtype == torch.bool
    assert attn_mask[1 * H + 2, 3, 3] and not attn_mask[0 * H + 2, 3, 3]  # index b*H + h
    broadcast = layouts.labml_mask_to_attn_mask(labml[:1, :, :1], num_heads=H, query_len=T, batch=B)
    assert broadcast.shape == (B * H, T, T)


def test_annotated_mask_becomes_a_torch_attn_mask():
    padding = torch.tensor([[[1, 1, 0]], [[1, 1, 1]]])  # (B, 1, S): 1 = attend
    attn_mask = layouts.annotated_mask_to_attn_mask(padding, num_heads=2, query_len=4)
    assert attn_mask.shape == (4, 4, 3)
    assert attn_mask[0, :, 2].all() and not attn_mask[2].any()


# --- errors ------------------------------------------------------------------------------------


def test_missing_and_misshaped_keys_are_named():
    state = layouts.from_general(layouts.to_general(_torch_module().state_dict(), "torch"), "bert")
    del state["self.key.weight"]
    with pytest.raises(ValueError, match="self.key.weight"):
        layouts.to_general(state, "bert")
    general = layouts.to_general(_torch_module().state_dict(), "torch")
    general["k_proj.bias"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"k_proj.bias must have shape \(12,\)"):
        layouts.from_general(general, "labml")
    general = layouts.to_general(_torch_module().state_dict(), "torch")
    with pytest.raises(ValueError, match="unknown layout"):
        layouts.convert(general, "general", "keras")
    with pytest.raises(ValueError, match="num_heads"):
        layouts.from_general(general, "per_head")
    with pytest.raises(ValueError, match="divide"):
        layouts.from_general(general, "per_head", num_heads=5)


def test_per_head_head_count_comes_from_the_weights():
    heads = layouts.per_head(mha.MultiHeadAttention(8, 8, 8, 2, 2, 8, 4).state_dict(), 4)
    state = heads.as_state()
    assert layouts.heads_in(state, "per_head") == 4
    assert set(layouts.convert(state, "per_head", "torch")) >= {"in_proj_weight"}
    with pytest.raises(ValueError, match="4 heads, but num_heads=2"):
        layouts.general_module(state, "per_head", num_heads=2)
    del state["W_k.3"]
    with pytest.raises(ValueError, match="4 heads in W_q but 3 in W_k"):
        layouts.to_general(state, "per_head")


def test_per_head_bias_k_and_bias_v_come_together():
    state = layouts.per_head(mha.MultiHeadAttention(8, 8, 8, 2, 2, 8, 4, add_bias_kv=True).state_dict(), 4).as_state()
    for key in [k for k in state if k.startswith("bias_v.")]:
        del state[key]
    with pytest.raises(ValueError, match="bias_k.i and bias_v.i come together"):
        layouts.to_general(state, "per_head")


@pytest.mark.parametrize("call, words", [
    (lambda: layouts.labml_mask_to_attn_mask(torch.ones(4, 4, 3), num_heads=2, batch=2), ["batch=2"]),
    (lambda: layouts.annotated_mask_to_attn_mask(torch.ones(2, 3, 4), num_heads=2, query_len=5), ["query_len=5"]),
    (lambda: layouts.annotated_mask_to_attn_mask(torch.ones(1, 1, 4), num_heads=0), ["num_heads"]),
    (lambda: layouts.to_general({"c_attn.weight": torch.zeros(2, 3, 4)}, "gpt2"), ["c_attn.weight", "2-D"]),
    (lambda: layouts.per_head(layouts.to_general(_torch_module().state_dict(), "torch"), 2.0), ["num_heads"]),
])
def test_adapter_and_layout_input_errors(call, words):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert all(w in str(info.value) for w in words), info.value


def test_annotated_subsequent_mask_broadcasts_over_a_batch():
    subsequent = torch.tril(torch.ones(1, 4, 4))  # the Annotated Transformer's subsequent_mask(4)
    attn_mask = layouts.annotated_mask_to_attn_mask(subsequent, num_heads=2, batch=3)
    assert attn_mask.shape == (6, 4, 4) and attn_mask[5, 0, 1] and not attn_mask[5, 1, 0]


def test_integer_weights_are_refused():
    general = layouts.to_general(_torch_module().state_dict(), "torch")
    general["q_proj.weight"] = general["q_proj.weight"].long()
    with pytest.raises(TypeError, match="floating"):
        layouts.from_general(general, "bert")


def test_per_head_attention_reads_the_layout_it_is_told():
    """The README's example: torch's default module is seq-first; the loop must be told so."""
    torch.manual_seed(0)
    torch_mha = torch.nn.MultiheadAttention(E, H)  # seq-first
    heads = layouts.per_head(torch_mha.state_dict(), H, layout="torch")
    x = torch.randn(5, 3, E)  # (L, N, E)
    with torch.no_grad():
        want, _ = torch_mha(x, x, x)
        torch.testing.assert_close(layouts.per_head_attention(x, x, x, heads, batch_first=False), want)
        batch_first = x.transpose(0, 1)
        torch.testing.assert_close(layouts.per_head_attention(batch_first, batch_first, batch_first, heads,
                                                              batch_first=True), want.transpose(0, 1))
    with pytest.raises(ValueError, match="batch_first"):
        layouts.per_head_attention(x, x, x, heads)
