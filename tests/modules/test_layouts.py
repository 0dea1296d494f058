"""mha.layouts: lossless conversion both ways, equal outputs after conversion, the per-head form."""

import dataclasses

import pytest
import torch

import mha
from helpers.exact import raises_exactly
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
    state, layout, heads = layouts.state_of(mha.GeneralAttention(4, 5, 6, 2, 3, 7, 2))
    assert layout == "general" and heads == 2 and "v_proj.weight" in state
    assert layouts.state_of(torch.nn.MultiheadAttention(8, 2))[1:] == ("torch", 2)
    with pytest.raises(TypeError, match="Linear"):
        layouts.state_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("add_bias_kv, layout", [(True, "per_head"), (True, "general"), (False, "labml"),
                                                  (False, "bert"), (False, "annotated")])
def test_general_module_with_unequal_widths_round_trips(add_bias_kv, layout):
    m = mha.GeneralAttention(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2, add_bias_kv=add_bias_kv)
    state = m.state_dict()
    _assert_same_state(layouts.convert(layouts.convert(state, "general", layout, 2), layout, "general", 2), state)


def test_layouts_that_cannot_hold_the_weights_refuse():
    state = mha.GeneralAttention(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2, add_bias_kv=True).state_dict()
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
    heads = layouts.per_head(mha.GeneralAttention(8, 8, 8, 2, 2, 8, 4).state_dict(), 4)
    state = heads.as_state()
    assert layouts.heads_in(state, "per_head") == 4
    assert set(layouts.convert(state, "per_head", "torch")) >= {"in_proj_weight"}
    with pytest.raises(ValueError, match="4 heads, but num_heads=2"):
        layouts.general_module(state, "per_head", num_heads=2)
    del state["W_k.3"]
    with pytest.raises(ValueError, match="4 heads in W_q but 3 in W_k"):
        layouts.to_general(state, "per_head")


def test_per_head_bias_k_and_bias_v_come_together():
    state = layouts.per_head(mha.GeneralAttention(8, 8, 8, 2, 2, 8, 4, add_bias_kv=True).state_dict(), 4).as_state()
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


def test_integer_weights_areraises_exactly():
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


# --- exact messages and boundaries of the converters (mutation testing) -------------------------

def _weights(q, k, v, o, **extra):
    """A general state of weights only: q_proj.weight q, k_proj.weight k, ... (shapes)."""
    state = {"q_proj.weight": torch.zeros(q), "k_proj.weight": torch.zeros(k),
             "v_proj.weight": torch.zeros(v), "out_proj.weight": torch.zeros(o)}
    state.update({key: torch.zeros(shape) for key, shape in extra.items()})
    return state


def _four_head_per_head_state():
    torch.manual_seed(0)
    return layouts.per_head(mha.GeneralAttention(8, 8, 8, 2, 2, 8, 4).state_dict(), 4).as_state()


@pytest.mark.parametrize("count, shown", [(12, "['k00', 'k01', 'k02', 'k03', 'k04', 'k05', 'k06', 'k07', "
                                                "'k08', 'k09', 'k10', 'k11']"),
                                          (13, "['k00', 'k01', 'k02', 'k03', 'k04', 'k05', 'k06', 'k07', "
                                                "'k08', 'k09', 'k10', 'k11'] ...")])
def test_missing_key_message_lists_at_most_twelve_keys_present(count, shown):
    state = {f"k{i:02d}": torch.zeros(1) for i in reversed(range(count))}
    message = f"layout 'bert' needs the key 'self.query.weight', which is missing (keys present: {shown})"
    with raises_exactly(ValueError, message):
        layouts.to_general(state, "bert")


def test_non_tensor_weights_are_named_with_their_type():
    with raises_exactly(TypeError, "'self.query.weight' must be a torch.Tensor, got list"):
        layouts.to_general({"self.query.weight": [[1.0]]}, "bert")


FRACTION = ("k_proj.weight ({} rows) and v_proj.weight ({} rows) must hold the same whole fraction of the query "
            "heads as q_proj.weight ({}) and out_proj.weight ({} columns)")


@pytest.mark.parametrize("state, num_heads, exc, message", [
    (dict(q_proj__weight=(6, 4), v_proj__weight=(6, 4), out_proj__weight=(4, 6)), None, ValueError,
     "layout 'general' needs the key 'k_proj.weight', which is missing "
     "(keys present: ['out_proj.weight', 'q_proj.weight', 'v_proj.weight'])"),
    (_weights((6, 4, 1), (6, 4), (6, 4), (4, 6)), None, ValueError, "'q_proj.weight' must be 2-D, got shape (6, 4, 1)"),
    (_weights((6, 4), (0, 4), (0, 4), (4, 6)), None, ValueError, FRACTION.format(0, 0, 6, 6)),
    (_weights((4, 4), (2, 4), (2, 4), (4, 5)), None, ValueError, FRACTION.format(2, 2, 4, 5)),  # only hdv % kv_hdv
    (_weights((5, 4), (2, 4), (2, 4), (4, 4)), None, ValueError, FRACTION.format(2, 2, 5, 4)),  # only hdk % kv_hdk
    (_weights((4, 4), (2, 4), (2, 4), (4, 6)), None, ValueError, FRACTION.format(2, 2, 4, 6)),  # only the ratios
    (_weights((6, 4), (6, 4), (8, 4), (3, 8), **{"q_proj.bias": (5,)}), None, ValueError,
     "q_proj.bias must have shape (6,) to match the projections, got (5,)"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8), **{"k_proj.bias": (8,)}), None, ValueError,
     "k_proj.bias must have shape (6,) to match the projections, got (8,)"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8), **{"v_proj.bias": (6,)}), None, ValueError,
     "v_proj.bias must have shape (8,) to match the projections, got (6,)"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8), **{"out_proj.bias": (8,)}), None, ValueError,
     "out_proj.bias must have shape (3,) to match the projections, got (8,)"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8), bias_k=(1, 1, 8), bias_v=(1, 1, 8)), None, ValueError,
     "bias_k must have shape (1, 1, 6) to match the projections, got (1, 1, 8)"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8), bias_k=(1, 1, 6), bias_v=(1, 1, 6)), None, ValueError,
     "bias_v must have shape (1, 1, 8) to match the projections, got (1, 1, 6)"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8), bias_k=(1, 1, 6)), None, ValueError,
     "bias_k and bias_v come together; only one of them is present"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8), bias_v=(1, 1, 8)), None, ValueError,
     "bias_k and bias_v come together; only one of them is present"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8)), 0, ValueError, "num_heads must be greater than 0, got 0"),
    (_weights((6, 4), (6, 4), (8, 4), (3, 8)), 3, ValueError,  # 3 divides h*dk, not h*dv
     "num_heads=3 must divide the projection widths h*dk=6 and h*dv=8"),
    (_weights((8, 4), (8, 4), (6, 4), (3, 6)), 3, ValueError,  # 3 divides h*dv, not h*dk
     "num_heads=3 must divide the projection widths h*dk=8 and h*dv=6"),
    (_weights((8, 4), (2, 4), (2, 4), (3, 8)), 2, ValueError,
     "num_heads=2 is not a multiple of the 4 query heads that share each key/value head"),
], ids=lambda x: "" if not isinstance(x, str) else x[:40])
def test_widths_refuses_malformed_general_states_with_exact_messages(state, num_heads, exc, message):
    state = {key.replace("__", "."): torch.zeros(v) if isinstance(v, tuple) else v for key, v in state.items()}
    with raises_exactly(exc, message):
        layouts.widths(state, num_heads)


@pytest.mark.parametrize("state, num_heads, want", [
    (_weights((6, 10), (6, 5), (8, 7), (9, 8)), None, dict(cq=10, ck=5, cv=7, do=9, hdk=6, hdv=8, kv_groups=1)),
    (_weights((6, 10), (6, 5), (8, 7), (9, 8)), 2,
     dict(cq=10, ck=5, cv=7, do=9, hdk=6, hdv=8, kv_groups=1, h=2, dk=3, dv=4, num_kv_heads=2)),
    # one key/value row: h=4 query heads of dk=1 share one key head (the boundary kv_hdk == 1)
    (_weights((4, 8), (1, 8), (2, 8), (8, 8)), 4,
     dict(cq=8, ck=8, cv=8, do=8, hdk=4, hdv=8, kv_groups=4, h=4, dk=1, dv=2, num_kv_heads=1)),
])
def test_widths_of_well_formed_states(state, num_heads, want):
    assert layouts.widths(state, num_heads) == want


def test_layout_table_names_and_descriptions():
    assert {name: (layout.name, layout.description) for name, layout in layouts.LAYOUTS.items()} == {
        "general": ("general", "mha.GeneralAttention"),
        "torch": ("torch", "torch.nn.MultiheadAttention (packed in_proj or separate q/k/v_proj_weight)"),
        "bert": ("bert", "HuggingFace BERT attention: self.query/key/value, output.dense"),
        "gpt2": ("gpt2", "GPT-2 attention: c_attn, c_proj (Conv1D, transposed)"),
        "annotated": ("annotated", "The Annotated Transformer: linears.0..3"),
        "labml": ("labml", "labml.ai: query.linear, key.linear, value.linear, output"),
        "llama": ("llama", "Llama-style q_proj, k_proj, v_proj (fewer kv heads allowed), o_proj"),
        "per_head": ("per_head", "the paper's per-head matrices W_q.i, W_k.i, W_v.i, W_o"),
    }


def test_general_layout_keeps_every_key_including_bias_kv():
    state = mha.GeneralAttention(6, 5, 7, 3, 4, 9, 2, add_bias_kv=True).state_dict()
    for converted in (layouts.from_general(state, "general", 2), layouts.to_general(state, "general", 2)):
        assert sorted(converted) == sorted(state)
        assert all(converted[key] is state[key] for key in state)


def test_renaming_layouts_name_their_keys():
    state = _torch_module().state_dict()
    general = layouts.to_general(state, "torch")
    bert = layouts.from_general(general, "bert")
    assert sorted(bert) == sorted(f"{p}.{w}" for p in ("self.query", "self.key", "self.value", "output.dense")
                                  for w in ("weight", "bias"))
    torch.testing.assert_close(bert["self.key.weight"], state["in_proj_weight"][E:2 * E])
    torch.testing.assert_close(bert["output.dense.bias"], state["out_proj.bias"])
    del bert["self.key.bias"]  # optional: a missing bias is simply absent
    assert sorted(layouts.to_general(bert, "bert")) == sorted(set(general) - {"k_proj.bias"})
    with raises_exactly(ValueError, "layout 'labml' has no place for ['bias_k', 'bias_v']; converting would lose them"):
        layouts.from_general(layouts.to_general(_torch_module(add_bias_kv=True).state_dict(), "torch"), "labml")


def _general_of(**options):
    torch.manual_seed(0)
    return randomize_biases(mha.GeneralAttention(**options)).state_dict()


@pytest.mark.parametrize("options, drop, layout, message", [
    (dict(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4, num_kv_heads=2), None, "torch",
     "torch.nn.MultiheadAttention has as many key/value heads as query heads (no GQA)"),
    (dict(cq=6, ck=5, cv=7, dk=3, dv=4, do=9, h=2), None, "torch",
     "torch.nn.MultiheadAttention needs h*dk = h*dv = do = query width (embed_dim); got h*dk=6, h*dv=8, do=9, cq=6"),
    (dict(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4), "q_proj.bias", "torch",
     "torch.nn.MultiheadAttention has biases on all four projections or on none"),
    (dict(cq=6, ck=5, cv=6, dk=3, dv=3, do=9, h=2), None, "gpt2",  # only cq = ck = cv fails
     "GPT-2's c_attn packs q, k, v of one input: needs cq = ck = cv, dk = dv, no GQA"),
    (dict(cq=8, ck=8, cv=8, dk=2, dv=3, do=8, h=2), None, "gpt2",  # only dk = dv fails
     "GPT-2's c_attn packs q, k, v of one input: needs cq = ck = cv, dk = dv, no GQA"),
    (dict(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4, num_kv_heads=2), None, "gpt2",  # only GQA fails
     "GPT-2's c_attn packs q, k, v of one input: needs cq = ck = cv, dk = dv, no GQA"),
    (dict(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4, add_bias_kv=True), None, "gpt2", "GPT-2 has no bias_k / bias_v"),
    (dict(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4, bias=False), None, "gpt2",
     "GPT-2's Conv1D projections always have biases"),
    (dict(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4), "out_proj.bias", "gpt2",
     "GPT-2's Conv1D projections always have biases"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 20 else None)
def test_layouts_refuse_weights_they_cannot_hold_with_exact_messages(options, drop, layout, message):
    general = _general_of(**options)
    general.pop(drop, None)
    with raises_exactly(ValueError, message):
        layouts.from_general(general, layout)


@pytest.mark.parametrize("layout, state, exc, message", [
    ("torch", dict(in_proj_weight=(36,)), ValueError, "'in_proj_weight' must be 2-D, got shape (36,)"),
    ("torch", dict(in_proj_weight=(8, 4)), ValueError, "in_proj_weight must have 3*E rows, got shape (8, 4)"),
    ("torch", dict(out_proj__weight=(4, 4)), ValueError,
     "layout 'torch' needs the key 'q_proj_weight', which is missing (keys present: ['out_proj.weight'])"),
    ("torch", dict(q_proj_weight=(4, 4), k_proj_weight=(4, 3), v_proj_weight=(4, 2)), ValueError,
     "layout 'torch' needs the key 'out_proj.weight', which is missing "
     "(keys present: ['k_proj_weight', 'q_proj_weight', 'v_proj_weight'])"),
    ("torch", dict(in_proj_weight=(12, 4)), ValueError,
     "layout 'torch' needs the key 'out_proj.weight', which is missing (keys present: ['in_proj_weight'])"),
    ("gpt2", dict(), ValueError, "layout 'gpt2' needs the key 'c_attn.weight', which is missing (keys present: [])"),
    ("gpt2", dict(c_attn__weight=(4, 8)), ValueError, "c_attn.weight must have 3*h*d columns, got shape (4, 8)"),
    ("gpt2", dict(c_attn__weight=(4, 12)), ValueError,
     "layout 'gpt2' needs the key 'c_attn.bias', which is missing (keys present: ['c_attn.weight'])"),
    ("gpt2", dict(c_attn__weight=(4, 12), c_attn__bias=(12,)), ValueError,
     "layout 'gpt2' needs the key 'c_proj.weight', which is missing (keys present: ['c_attn.bias', 'c_attn.weight'])"),
    ("gpt2", dict(c_attn__weight=(4, 12), c_attn__bias=(12,), c_proj__weight=(4,)), ValueError,
     "'c_proj.weight' must be 2-D, got shape (4,)"),
    ("gpt2", dict(c_attn__weight=(4, 12), c_attn__bias=(12,), c_proj__weight=(4, 4)), ValueError,
     "layout 'gpt2' needs the key 'c_proj.bias', which is missing "
     "(keys present: ['c_attn.bias', 'c_attn.weight', 'c_proj.weight'])"),
    ("per_head", {"W_q.0": (4, 2), "W_q.2": (4, 2), "W_k.0": (4, 2), "W_v.0": (4, 2), "W_o": (2, 4)}, ValueError,
     "per_head keys W_q.i must number the heads 0..h-1, got [0, 2]"),
    ("per_head", {"W_q.0": (4, 2), "W_v.0": (4, 2), "W_o": (2, 4)}, ValueError,
     "layout 'per_head' needs the keys W_k.0 .. W_k.(h-1), which are missing"),
    ("per_head", {"W_q.0": (4, 2), "W_k.0": (4, 2), "W_v.0": (4, 2)}, ValueError,
     "layout 'per_head' needs the key 'W_o', which is missing (keys present: ['W_k.0', 'W_q.0', 'W_v.0'])"),
    ("per_head", {"W_q.0": (4, 2), "W_k.0": (4, 2), "W_v.0": (4, 2), "W_o": (4,)}, ValueError,
     "'W_o' must be 2-D, got shape (4,)"),
    ("per_head", {"W_q.0": (4, 2), "W_k.0": (4, 2), "W_v.0": (4, 2), "W_o": (2, 4), "bias_k.0": (2,)}, ValueError,
     "per_head bias_k.i and bias_v.i come together; only one of them is present"),
    # heads of unequal widths: h*dk=5 is no multiple of the 2 heads the keys number
    ("per_head", {"W_q.0": (4, 2), "W_q.1": (4, 3), "W_k.0": (4, 2), "W_k.1": (4, 3), "W_v.0": (4, 2),
                  "W_v.1": (4, 2), "W_o": (4, 4)}, ValueError,
     "num_heads=2 must divide the projection widths h*dk=5 and h*dv=4"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 20 else None)
def test_loading_malformed_layout_states_names_the_problem(layout, state, exc, message):
    state = {key.replace("__", "."): torch.zeros(shape) for key, shape in state.items()}
    with raises_exactly(exc, message):
        layouts.to_general(state, layout)


def test_gpt2_layout_is_torch_packing_transposed():
    """E=8 (not a multiple of 3): GPT-2's c_attn is in_proj_weight transposed, (E, 3E)."""
    theirs = randomize_biases(torch.nn.MultiheadAttention(8, 2))
    state = theirs.state_dict()
    gpt2 = layouts.convert(state, "torch", "gpt2", num_heads=2)
    assert sorted(gpt2) == ["c_attn.bias", "c_attn.weight", "c_proj.bias", "c_proj.weight"]
    assert torch.equal(gpt2["c_attn.weight"], state["in_proj_weight"].t())
    assert torch.equal(gpt2["c_attn.bias"], state["in_proj_bias"])
    assert torch.equal(gpt2["c_proj.weight"], state["out_proj.weight"].t())
    assert torch.equal(gpt2["c_proj.bias"], state["out_proj.bias"])
    _assert_same_state(layouts.convert(gpt2, "gpt2", "torch", num_heads=2), state)


def test_num_heads_is_checked_against_the_weights_on_every_path():
    per_head_state = _four_head_per_head_state()  # 4 heads, h*dk = h*dv = 8: 2 would divide the widths
    message = "the per_head weights hold 4 heads, but num_heads=2"
    for call in (lambda: layouts.heads_in(per_head_state, "per_head", 2),
                 lambda: layouts.convert(per_head_state, "per_head", "torch", num_heads=2),
                 lambda: layouts.LAYOUTS["per_head"].load(per_head_state, 2),
                 lambda: layouts.torch_module(per_head_state, "per_head", 2),
                 lambda: layouts.per_head(per_head_state, 2, layout="per_head")):
        with raises_exactly(ValueError, message):
            call()
    bert = layouts.convert(_torch_module().state_dict(), "torch", "bert")
    general = layouts.to_general(bert, "bert")
    divide = "num_heads=5 must divide the projection widths h*dk=12 and h*dv=12"
    for call in (lambda: layouts.to_general(bert, "bert", num_heads=5),
                 lambda: layouts.from_general(general, "bert", num_heads=5)):
        with raises_exactly(ValueError, divide):
            call()
    with raises_exactly(ValueError, "the per_head layout splits by head: pass num_heads"):
        layouts.from_general(general, "per_head")


def test_per_head_to_per_head_takes_the_head_count_from_the_weights():
    state = _four_head_per_head_state()
    _assert_same_state(layouts.convert(state, "per_head", "per_head"), state)


def test_general_module_refuses_mixed_biases_and_passes_options():
    general = _general_of(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4)
    assert layouts.general_module(general, "general", 4, dropout=0.25).dropout == 0.25
    del general["q_proj.bias"]
    with raises_exactly(ValueError, "mha.GeneralAttention has biases on all four projections or on none"):
        layouts.general_module(general, "general", 4)


def test_torch_module_builds_the_class_asked_for():
    general = layouts.to_general(_torch_module().state_dict(), "torch")
    assert type(layouts.torch_module(general, "general", H)) is torch.nn.MultiheadAttention
    assert type(layouts.torch_module(general, "general", H, cls=mha.nn.MultiheadAttention)) is mha.nn.MultiheadAttention


def test_per_head_refuses_grouped_query_weights():
    general = _general_of(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4, num_kv_heads=2)
    with raises_exactly(ValueError, "the per-head form has one key/value matrix per head: "
                                     "repeat GQA's shared ones first"):
        layouts.per_head(general, 4)


def test_from_per_head_refuses_bias_k_without_bias_v():
    heads = layouts.per_head(_general_of(cq=8, ck=8, cv=8, dk=2, dv=2, do=8, h=4, add_bias_kv=True), 4)
    with raises_exactly(ValueError, "bias_k and bias_v come together; only one of them is given"):
        layouts.from_per_head(dataclasses.replace(heads, bias_v=None))


def test_per_head_of_a_single_one_wide_head_equals_torch():
    """h = dk = 1: every bias is one number, which must stay a (1,) vector per head."""
    torch.manual_seed(0)
    theirs = randomize_biases(torch.nn.MultiheadAttention(1, 1, add_bias_kv=True, batch_first=True))
    heads = layouts.per_head(theirs.state_dict(), 1, layout="torch")
    assert [b.shape for b in heads.b_q + heads.b_k + heads.b_v + heads.bias_k + heads.bias_v] == [(1,)] * 5
    x = torch.randn(2, 3, 1)
    with torch.no_grad():
        torch.testing.assert_close(layouts.per_head_attention(x, x, x, heads, batch_first=True), theirs(x, x, x)[0])


def test_per_head_attention_demands_the_layout_of_3d_input():
    heads = layouts.per_head(_torch_module().state_dict(), H, layout="torch")
    x = torch.randn(2, 3, E)
    with raises_exactly(ValueError, "per_head_attention: pass batch_first=True for (N, L, E) input, or "
                                     "batch_first=False for torch's default layout (L, N, E); 3-D input is "
                                     "ambiguous without it"):
        layouts.per_head_attention(x, x, x, heads)


@pytest.mark.parametrize("options", [dict(add_zero_attn=True, add_bias_kv=True), dict(add_zero_attn=True, bias=False),
                                     dict(add_zero_attn=True, kdim=1, vdim=1)], ids=str)
@pytest.mark.parametrize("float_mask", [False, True], ids=["bool mask", "float mask"])
def test_per_head_attention_seq_first_with_masks_and_extra_keys_equals_torch(options, float_mask):
    torch.manual_seed(0)
    theirs = randomize_biases(torch.nn.MultiheadAttention(E, H, **options))  # seq-first
    heads = layouts.per_head(theirs.state_dict(), H, layout="torch")
    q = torch.randn(4, 2, E)
    k = torch.randn(6, 2, options.get("kdim", E))
    v = torch.randn(6, 2, options.get("vdim", E))
    if float_mask:
        mask = torch.randn(4, 6)
    else:
        mask = torch.zeros(4, 6, dtype=torch.bool)
        mask[1, 2:] = True
        mask[3, :] = True  # a row with only the extra keys visible
    with torch.no_grad():
        want, _ = theirs(q, k, v, attn_mask=mask)
        got = layouts.per_head_attention(q, k, v, heads, attn_mask=mask, add_zero_attn=True, batch_first=False)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("call, message", [
    (lambda: layouts.labml_mask_to_attn_mask(torch.ones(4, 4), num_heads=2),
     "a labml mask is [T_q, T_k, B], got shape (4, 4)"),
    (lambda: layouts.labml_mask_to_attn_mask(torch.ones(4, 4, 3), num_heads=2, batch=2),
     "the labml mask [T_q, T_k, B] has 3 along batch, which neither equals batch=2 nor is 1"),
    (lambda: layouts.labml_mask_to_attn_mask(torch.ones(3, 4, 1), num_heads=2, query_len=4),
     "the labml mask [T_q, T_k, B] has 3 along query_len, which neither equals query_len=4 nor is 1"),
    (lambda: layouts.annotated_mask_to_attn_mask(torch.ones(4, 4), num_heads=2),
     "an Annotated Transformer mask is (B, 1 or T_q, T_k), got shape (4, 4)"),
    (lambda: layouts.annotated_mask_to_attn_mask(torch.ones(2, 3, 4), num_heads=2, query_len=5),
     "the Annotated Transformer mask (B, T_q, T_k) has 3 along query_len, which neither equals query_len=5 nor is 1"),
    (lambda: layouts.annotated_mask_to_attn_mask(torch.ones(2, 1, 4), num_heads=2, batch=3),
     "the Annotated Transformer mask (B, T_q, T_k) has 2 along batch, which neither equals batch=3 nor is 1"),
    (lambda: layouts.annotated_mask_to_attn_mask(torch.ones(1, 1, 4), num_heads=0),
     "num_heads must be greater than 0, got 0"),
    (lambda: layouts.annotated_mask_to_attn_mask(torch.ones(1, 1, 4), num_heads=2, batch=0),
     "batch must be greater than 0, got 0"),
    (lambda: layouts.labml_mask_to_attn_mask(torch.ones(1, 4, 1), num_heads=2, query_len=0),
     "query_len must be greater than 0, got 0"),
])
def test_mask_adapters_refuse_bad_shapes_with_exact_messages(call, message):
    with raises_exactly(ValueError, message):
        call()


def test_annotated_padding_mask_keeps_its_single_query_row():
    padding = torch.tensor([[[1, 1, 0]], [[1, 1, 1]]])  # (B=2, 1, S=3): 1 = attend
    attn_mask = layouts.annotated_mask_to_attn_mask(padding, num_heads=2)
    want = torch.tensor([[[False, False, True]]] * 2 + [[[False, False, False]]] * 2)  # (B*H, 1, S), index b*H + h
    assert torch.equal(attn_mask, want)


def test_per_head_checks_a_general_state_like_every_other_layout():
    """A general state goes through to_general too (it skipped the checks, so an integer bias was
    accepted here alone: found by mutation testing)."""
    state = dict(mha.GeneralAttention(8, 8, 8, 4, 4, 8, 2).state_dict())
    state["q_proj.bias"] = state["q_proj.bias"].long()
    with raises_exactly(TypeError, "'q_proj.bias' must have a floating point dtype, got torch.int64"):
        layouts.per_head(state, 2)
