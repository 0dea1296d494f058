"""Bad input: a clear TypeError/ValueError naming the argument, never a wrong answer or a deep crash.

Each table row is a bad call and the exact message it must raise: the message is the spec (it names
the argument, what it got and what was expected)."""


import pytest
import torch

import mha
from helpers.exact import raises_exactly
from mha.functional import multi_head_attention_forward, scaled_dot_product_attention

E, H, L, S, N = 8, 2, 3, 5, 2
_DTYPE_HINT = "; they must match (convert one with .to(dtype))"


@pytest.fixture
def module():
    return mha.nn.MultiheadAttention(E, H)


def _x(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _raises(error, message):
    return raises_exactly(error, message)


q, k, v = _x(L, N, E), _x(S, N, E), _x(S, N, E)
_meta = _x(L, N, E, device="meta")

MODULE_CALLS = {
    # name: (call kwargs, error type, exact message)
    "query rank 4": (dict(query=_x(L, N, E, 1), key=k, value=v), ValueError,
                     "query must be 2-D or 3-D ((L, B, E) batched, (L, E) unbatched), got 4-D with shape (3, 2, 8, 1)"),
    "query rank 1": (dict(query=_x(E), key=k, value=v), ValueError,
                     "query must be 2-D or 3-D ((L, B, E) batched, (L, E) unbatched), got 1-D with shape (8,)"),
    "key rank differs": (dict(query=q, key=_x(S, E), value=v), ValueError,
                         "expected `key` and `value` to be 3-D but found 2-D and 3-D tensors respectively: they must "
                         "have query's rank (key (5, 8), value (5, 2, 8))"),
    "embed dim mismatch": (dict(query=_x(L, N, E + 1), key=k, value=v), ValueError,
                           "query's last dim must be embed_dim=8, got shape (3, 2, 9)"),
    "key width mismatch": (dict(query=q, key=_x(S, N, E + 2), value=_x(S, N, E + 2)), ValueError,
                           "key's last dim must be kdim=8, got shape (5, 2, 10)"),
    "key/value length mismatch": (dict(query=q, key=k, value=_x(S + 1, N, E)), ValueError,
                                  "key and value must have the same length (and batch size), got shapes (5, 2, 8) "
                                  "and (6, 2, 8)"),
    "batch mismatch": (dict(query=q, key=_x(S, N + 1, E), value=_x(S, N + 1, E)), ValueError,
                       "key and query must have the same batch size (dim 1), got shapes (5, 3, 8) and (3, 2, 8)"),
    "integer query": (dict(query=torch.ones(L, N, E, dtype=torch.long), key=k, value=v), TypeError,
                      "query must have a floating point dtype, got torch.int64"),
    "non-tensor query": (dict(query=[[1.0]], key=k, value=v), TypeError, "query must be a torch.Tensor, got list"),
    "dtype mismatch q/k": (dict(query=q, key=k.double(), value=v), TypeError,
                           "key has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "input dtype vs params": (dict(query=q.double(), key=k.double(), value=v.double()), TypeError,
                              "the module's weight has dtype torch.float32 but query has dtype torch.float64"
                              + _DTYPE_HINT),
    "input device vs params": (dict(query=_meta, key=_meta, value=_meta), ValueError,
                               "the module's weight is on device cpu but query is on meta; they must be on the "
                               "same device"),
    "attn_mask wrong 2-D shape": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(L, S + 1)), ValueError,
                                  "Expected `attn_mask` shape to be (3, 5) (L, S) but got (3, 6)"),
    "attn_mask wrong 3-D shape": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(N, L, S)), ValueError,
                                  "Expected `attn_mask` shape to be (4, 3, 5) (B*num_heads, L, S) but got (2, 3, 5)"),
    "attn_mask rank 4": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(1, 1, L, S)), ValueError,
                         "expected `attn_mask` to be `None`, 2-D or 3-D but found 4-D tensor instead: (L, S) or "
                         "(B*num_heads, L, S), got shape (1, 1, 3, 5)"),
    "attn_mask integer": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(L, S, dtype=torch.long)), TypeError,
                          "attn_mask must be a bool or floating point tensor, got dtype torch.int64"),
    "key_padding_mask wrong shape": (dict(query=q, key=k, value=v,
                                          key_padding_mask=torch.zeros(S, N, dtype=torch.bool)), ValueError,
                                     "key_padding_mask must have shape (2, 5) (B, S), got (5, 2)"),
    "key_padding_mask integer": (dict(query=q, key=k, value=v,
                                      key_padding_mask=torch.zeros(N, S, dtype=torch.int32)), TypeError,
                                 "key_padding_mask must be a bool or floating point tensor, got dtype torch.int32"),
    "unbatched key_padding_mask 2-D": (dict(query=_x(L, E), key=_x(S, E), value=_x(S, E),
                                            key_padding_mask=torch.zeros(1, S, dtype=torch.bool)), ValueError,
                                       "expected `key_padding_mask` to be `None` or 1-D but found 2-D tensor instead: "
                                       "it must have shape (5,) (S,), got (1, 5)"),
    "unbatched 3-D attn_mask needs H": (dict(query=_x(L, E), key=_x(S, E), value=_x(S, E),
                                             attn_mask=torch.zeros(N * H, L, S)), ValueError,
                                        "Expected `attn_mask` shape to be (2, 3, 5) (num_heads, L, S) for unbatched "
                                        "input but got (4, 3, 5)"),
    "attn_mask device": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(L, S, device="meta")), ValueError,
                         "attn_mask is on device meta but query is on cpu"),
    "key_padding_mask device": (dict(query=q, key=k, value=v,
                                     key_padding_mask=torch.zeros(N, S, dtype=torch.bool, device="meta")), ValueError,
                                "key_padding_mask is on device meta but query is on cpu"),
    "key_padding_mask rank 1": (dict(query=q, key=k, value=v, key_padding_mask=torch.zeros(S, dtype=torch.bool)),
                                ValueError, "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor "
                                            "instead: it must have shape (2, 5) (B, S), got (5,)"),
    "unbatched key_padding_mask length": (dict(query=_x(L, E), key=_x(S, E), value=_x(S, E),
                                               key_padding_mask=torch.zeros(S + 1, dtype=torch.bool)), ValueError,
                                          "key_padding_mask must have shape (5,) (S,), got (6,)"),
    "nested query, dense key": (dict(query=torch.nested.nested_tensor([_x(L, E)], layout=torch.jagged), key=k,
                                     value=v), ValueError,
                                "key must be a nested (B, length, features) tensor like the others, got a dense 3-D "
                                "tensor"),
}


@pytest.mark.parametrize("name", list(MODULE_CALLS))
def test_module_bad_input(module, name):
    kwargs, error, message = MODULE_CALLS[name]
    with _raises(error, message):
        module(**kwargs)


SEPARATE_MODULE_CALLS = {  # a module with kdim=5, vdim=7: its key and value widths are checked
    "key width": ((q, _x(S, N, 6), _x(S, N, 7)), "key's last dim must be kdim=5, got shape (5, 2, 6)"),
    "value width": ((q, _x(S, N, 5), _x(S, N, 6)), "value's last dim must be vdim=7, got shape (5, 2, 6)"),
}


@pytest.mark.parametrize("name", list(SEPARATE_MODULE_CALLS))
def test_module_with_kdim_vdim_checks_key_and_value_widths(name):
    m = mha.nn.MultiheadAttention(E, H, kdim=5, vdim=7)
    args, message = SEPARATE_MODULE_CALLS[name]
    with _raises(ValueError, message):
        m(*args)


def test_device_mismatch_names_both_devices(module):
    meta = torch.empty(L, N, E, device="meta")
    with _raises(ValueError, "key is on device meta but query is on cpu; they must be on the same device"):
        module(q, meta, meta)


CONSTRUCTOR_CALLS = {
    # name: (args, kwargs, error type, exact message)
    "embed_dim float": ((8.0, 2), {}, TypeError, "embed_dim must be an int, got float (8.0)"),
    "num_heads float": ((8, 2.0), {}, TypeError, "num_heads must be an int, got float (2.0)"),
    "embed_dim zero": ((0, 2), {}, ValueError,
                       "embed_dim and num_heads must be greater than 0, got embed_dim=0 and num_heads=2 instead"),
    "num_heads zero": ((8, 0), {}, ValueError,
                       "embed_dim and num_heads must be greater than 0, got embed_dim=8 and num_heads=0 instead"),
    "not divisible": ((10, 3), {}, ValueError,
                      "embed_dim must be divisible by num_heads, got embed_dim=10 and num_heads=3"),
    "dropout": ((8, 2), dict(dropout=1.5), ValueError, "dropout must be in [0, 1], got 1.5"),
    "kdim zero": ((8, 2), dict(kdim=0), ValueError, "kdim must be greater than 0, got 0"),
    "vdim zero": ((8, 2), dict(vdim=0), ValueError, "vdim must be greater than 0, got 0"),
}


@pytest.mark.parametrize("name", list(CONSTRUCTOR_CALLS))
def test_module_constructor_bad_arguments(name):
    args, kwargs, error, message = CONSTRUCTOR_CALLS[name]
    with _raises(error, message):
        mha.nn.MultiheadAttention(*args, **kwargs)


def _sdpa(q_shape=(2, L, 4), k_shape=(2, S, 4), v_shape=None, **overrides):
    args = dict(query=_x(*q_shape), key=_x(*k_shape), value=_x(*(v_shape or k_shape)))
    args.update(overrides)
    return args


SDPA_CALLS = {
    "rank 1": (dict(query=_x(4), key=_x(4), value=_x(4)), ValueError,
               "query must be at least 2-D (..., length, features), got 1-D with shape (4,)"),
    "key rank 1": (_sdpa(key=_x(4)), ValueError,
                   "key must be at least 2-D (..., length, features), got 1-D with shape (4,)"),
    "value rank 1": (_sdpa(value=_x(4)), ValueError,
                     "value must be at least 2-D (..., length, features), got 1-D with shape (4,)"),
    "non-tensor query": (_sdpa(query=[[1.0]]), TypeError, "query must be a torch.Tensor, got list"),
    "non-tensor key": (_sdpa(key=[[1.0]]), TypeError, "key must be a torch.Tensor, got list"),
    "non-tensor value": (_sdpa(value=(1.0,)), TypeError, "value must be a torch.Tensor, got tuple"),
    "head dim mismatch": (_sdpa(k_shape=(2, S, 5)), ValueError,
                          "key's last dim must equal query's (4), got shape (2, 5, 5)"),
    "key/value length": (_sdpa(v_shape=(2, S + 1, 4)), ValueError,
                         "value must have as many positions as key (5), got shape (2, 6, 4)"),
    "batch mismatch": (_sdpa(k_shape=(3, S, 4), v_shape=(1, S, 4)), ValueError,
                       "the batch dims of query (2,), key (3,) and value (1,) do not broadcast together "
                       "(pass enable_gqa=True for fewer key/value heads)"),
    "gqa batch mismatch": (_sdpa((2, 4, L, 4), (3, 2, S, 4), enable_gqa=True), ValueError,
                           "the batch dims of query (2,), key (3,) and value (3,) do not broadcast together"),
    "gqa not divisible": (_sdpa((4, 5, L, 6), (4, 2, S, 6), enable_gqa=True), ValueError,
                          "with enable_gqa the query heads (dim -3: 5) must be a multiple of key's heads (2)"),
    "gqa value heads not divisible": (_sdpa((1, 4, L, 4), (1, 2, S, 4), (1, 3, S, 4), enable_gqa=True), ValueError,
                                      "with enable_gqa the query heads (dim -3: 4) must be a multiple of value's "
                                      "heads (3)"),
    "gqa zero key heads": (_sdpa((1, 4, L, 4), (1, 0, S, 4), enable_gqa=True), ValueError,
                           "with enable_gqa the query heads (dim -3: 4) must be a multiple of key's heads (0)"),
    "gqa not enabled": (_sdpa((1, 4, L, 4), (1, 2, S, 4)), ValueError,
                        "the batch dims of query (1, 4), key (1, 2) and value (1, 2) do not broadcast together "
                        "(pass enable_gqa=True for fewer key/value heads)"),
    "enable_gqa not a bool": (_sdpa(enable_gqa=1), TypeError, "enable_gqa must be a bool, got int (1)"),
    "mask not broadcastable": (_sdpa(attn_mask=torch.ones(L, S + 1, dtype=torch.bool)), ValueError,
                               "attn_mask of shape (3, 6) does not broadcast to the attention scores' shape "
                               "(2, 3, 5) (batch..., L, S)"),
    "attn_mask device": (_sdpa(attn_mask=torch.ones(L, S, dtype=torch.bool, device="meta")), ValueError,
                         "attn_mask is on device meta but query is on cpu"),
    "integer mask": (_sdpa(attn_mask=torch.ones(L, S, dtype=torch.long)), TypeError,
                     "attn_mask must be a bool or floating point tensor, got dtype torch.int64"),
    "integer inputs": (_sdpa(query=torch.ones(2, L, 4, dtype=torch.int32)), TypeError,
                       "query must have a floating point dtype, got torch.int32"),
    "integer key": (_sdpa(key=torch.ones(2, S, 4, dtype=torch.int32)), TypeError,
                    "key must have a floating point dtype, got torch.int32"),
    "integer value": (_sdpa(value=torch.ones(2, S, 4, dtype=torch.int64)), TypeError,
                      "value must have a floating point dtype, got torch.int64"),
    "dtype mismatch": (_sdpa(key=_x(2, S, 4, dtype=torch.float64)), TypeError,
                       "key has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "value dtype mismatch": (_sdpa(value=_x(2, S, 4, dtype=torch.float16)), TypeError,
                             "value has dtype torch.float16 but query has dtype torch.float32" + _DTYPE_HINT),
    "dropout out of range": (_sdpa(dropout_p=1.5), ValueError, "dropout_p must be in [0, 1], got 1.5"),
    "scale not a number": (_sdpa(scale="0.5"), TypeError, "scale must be a real number, got str ('0.5')"),
    "softcap zero": (_sdpa(softcap=0.0), ValueError, "softcap must be a finite number greater than 0, got 0.0"),
    "alibi_slopes shape": (_sdpa(alibi_slopes=_x(3)), ValueError,
                           "alibi_slopes must have shape (2,) (num_heads,): one value per query head (dim -3 of "
                           "query), got (3,)"),
    "alibi_slopes device": (_sdpa(alibi_slopes=_x(2, device="meta")), ValueError,
                            "alibi_slopes is on device meta but query is on cpu"),
    "sinks shape": (_sdpa(sinks=_x(1)), ValueError,
                    "sinks must have shape (2,) (num_heads,): one value per query head (dim -3 of query), got (1,)"),
    "unknown backend": (_sdpa(backend="cuda"), ValueError,
                        "backend must be one of ('auto', 'math', 'sdpa', 'flash', 'native', 'flex'), got 'cuda'"),
}


@pytest.mark.parametrize("name", list(SDPA_CALLS))
def test_sdpa_bad_input(name):
    kwargs, error, message = SDPA_CALLS[name]
    with _raises(error, message):
        scaled_dot_product_attention(**kwargs)


def _functional_args(**overrides):
    args = dict(query=q, key=k, value=v, embed_dim_to_check=E, num_heads=H,
                in_proj_weight=_x(3 * E, E), in_proj_bias=_x(3 * E), bias_k=None, bias_v=None,
                add_zero_attn=False, dropout_p=0.0, out_proj_weight=_x(E, E), out_proj_bias=_x(E))
    args.update(overrides)
    return args


def _separate(**weights):
    """Overrides for use_separate_proj_weight=True: good (E, E) weights unless given."""
    return dict(use_separate_proj_weight=True, in_proj_weight=None, q_proj_weight=_x(E, E), k_proj_weight=_x(E, E),
                v_proj_weight=_x(E, E)) | weights


FUNCTIONAL_CALLS = {
    # name: (overrides of the good call, error type, exact message)
    "embed_dim_to_check": (dict(embed_dim_to_check=E + 1), ValueError,
                           "embed_dim must be divisible by num_heads, got embed_dim=9 and num_heads=2"),
    "embed_dim zero": (dict(embed_dim_to_check=0), ValueError, "embed_dim must be greater than 0, got 0"),
    "query width": (dict(query=_x(L, N, E + 2)), ValueError,
                    "query's last dim must be embed_dim=8, got shape (3, 2, 10)"),
    "batch_first query rank": (dict(query=_x(N, L, E, 1), batch_first=True), ValueError,
                               "query must be 2-D or 3-D ((B, L, E) batched, (L, E) unbatched), got 4-D with shape "
                               "(2, 3, 8, 1)"),
    "not divisible": (dict(query=_x(L, N, 9), key=_x(S, N, 9), value=_x(S, N, 9), embed_dim_to_check=9), ValueError,
                      "embed_dim must be divisible by num_heads, got embed_dim=9 and num_heads=2"),
    "in_proj_weight shape": (dict(in_proj_weight=_x(3 * E, E + 1)), ValueError,
                             "in_proj_weight must have shape (24, 8) (3*embed_dim, embed_dim), got (24, 9)"),
    "in_proj_weight missing": (dict(in_proj_weight=None), ValueError,
                               "use_separate_proj_weight=False needs in_proj_weight, got None"),
    "in_proj_weight not a tensor": (dict(in_proj_weight=[[0.0]]), TypeError,
                                    "in_proj_weight must be a torch.Tensor, got list"),
    "in_proj_weight dtype": (dict(in_proj_weight=_x(3 * E, E, dtype=torch.float64)), TypeError,
                             "in_proj_weight has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "packed with other key width": (dict(key=_x(S, N, 6), value=_x(S, N, E)), ValueError,
                                    "packed in_proj_weight needs key and value widths equal to embed_dim=8, got 6 "
                                    "and 8; use separate q/k/v_proj_weight for other widths"),
    "separate missing q": (_separate(q_proj_weight=None), ValueError,
                           "use_separate_proj_weight=True needs q_proj_weight, got None"),
    "separate missing k": (_separate(k_proj_weight=None), ValueError,
                           "use_separate_proj_weight=True needs k_proj_weight, got None"),
    "separate missing v": (_separate(v_proj_weight=None), ValueError,
                           "use_separate_proj_weight=True needs v_proj_weight, got None"),
    "q_proj_weight not a tensor": (_separate(q_proj_weight=[[0.0]]), TypeError,
                                   "q_proj_weight must be a torch.Tensor, got list"),
    "q_proj_weight rank": (_separate(q_proj_weight=_x(E, E, 1)), ValueError,
                           "q_proj_weight must be 2-D (embed_dim, input width), got 3-D with shape (8, 8, 1)"),
    "k_proj_weight rows": (_separate(k_proj_weight=_x(E + 1, E)), ValueError,
                           "k_proj_weight must have embed_dim=8 rows, got shape (9, 8)"),
    "v_proj_weight rows": (_separate(v_proj_weight=_x(E - 1, E)), ValueError,
                           "v_proj_weight must have embed_dim=8 rows, got shape (7, 8)"),
    "q_proj_weight shape": (_separate(q_proj_weight=_x(E, E + 1)), ValueError,
                            "q_proj_weight must have shape (8, 8) (embed_dim, embed_dim), got (8, 9)"),
    "key width vs k_proj_weight": (_separate(k_proj_weight=_x(E, 5), key=_x(S, N, 6)), ValueError,
                                   "key's last dim must be kdim=5 (the width of the module's projection), got 6"),
    "value width vs v_proj_weight": (_separate(v_proj_weight=_x(E, 7), value=_x(S, N, 6)), ValueError,
                                     "value's last dim must be vdim=7 (the width of the module's projection), got 6"),
    "q_proj_weight dtype": (_separate(q_proj_weight=_x(E, E, dtype=torch.float64)), TypeError,
                            "q_proj_weight has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "k_proj_weight dtype": (_separate(k_proj_weight=_x(E, E, dtype=torch.float64)), TypeError,
                            "k_proj_weight has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "v_proj_weight dtype": (_separate(v_proj_weight=_x(E, E, dtype=torch.float16)), TypeError,
                            "v_proj_weight has dtype torch.float16 but query has dtype torch.float32" + _DTYPE_HINT),
    "out_proj shape": (dict(out_proj_weight=_x(E, E + 1)), ValueError,
                       "out_proj_weight must have shape (8, 8) (embed_dim, embed_dim), got (8, 9)"),
    "out_proj_weight not a tensor": (dict(out_proj_weight=[[0.0]]), TypeError,
                                     "out_proj_weight must be a torch.Tensor, got list"),
    "out_proj_bias shape": (dict(out_proj_bias=_x(E + 1)), ValueError, "out_proj_bias must have shape (8,), got (9,)"),
    "out_proj_bias not a tensor": (dict(out_proj_bias=[0.0]), TypeError,
                                   "out_proj_bias must be a torch.Tensor, got list"),
    "out_proj_bias dtype": (dict(out_proj_bias=_x(E, dtype=torch.float64)), TypeError,
                            "out_proj_bias has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "in_proj_bias shape": (dict(in_proj_bias=_x(E)), ValueError, "in_proj_bias must have shape (24,), got (8,)"),
    "in_proj_bias not a tensor": (dict(in_proj_bias=[0.0]), TypeError, "in_proj_bias must be a torch.Tensor, got list"),
    "in_proj_bias device": (dict(in_proj_bias=_x(3 * E, device="meta")), ValueError,
                            "in_proj_bias is on device meta but query is on cpu"),
    "bias_k alone": (dict(bias_k=_x(1, 1, E)), ValueError, "bias_k and bias_v must be given together, got only bias_k"),
    "bias_v alone": (dict(bias_v=_x(1, 1, E)), ValueError, "bias_k and bias_v must be given together, got only bias_v"),
    "bias_k shape": (dict(bias_k=_x(1, E), bias_v=_x(1, E)), ValueError,
                     "bias_k must have shape (1, 1, 8) (1, 1, embed_dim), got (1, 8)"),
    "bias_v shape": (dict(bias_k=_x(1, 1, E), bias_v=_x(1, 1, E + 1)), ValueError,
                     "bias_v must have shape (1, 1, 8) (1, 1, embed_dim), got (1, 1, 9)"),
    "bias_k not a tensor": (dict(bias_k=[0.0], bias_v=_x(1, 1, E)), TypeError, "bias_k must be a torch.Tensor, got list"),
    "bias_k dtype": (dict(bias_k=_x(1, 1, E, dtype=torch.float64), bias_v=_x(1, 1, E)), TypeError,
                     "bias_k has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "bias_v dtype": (dict(bias_k=_x(1, 1, E), bias_v=_x(1, 1, E, dtype=torch.float64)), TypeError,
                     "bias_v has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "static_k shape": (dict(static_k=_x(N, S, E // H)), ValueError,
                       "static_k must have shape (4, S, 4) = (N*num_heads, S, head_dim), got (2, 5, 4)"),
    "static_k with bias_k": (dict(static_k=_x(N * H, S, 4), bias_k=_x(1, 1, E), bias_v=_x(1, 1, E)), ValueError,
                             "bias cannot be added to static key (or value): bias_k/bias_v cannot be added to "
                             "static_k/static_v; pass one or the other"),
    "param dtype": (dict(out_proj_weight=_x(E, E, dtype=torch.float64)), TypeError,
                    "out_proj_weight has dtype torch.float64 but query has dtype torch.float32" + _DTYPE_HINT),
    "dropout": (dict(dropout_p=-0.1), ValueError, "dropout_p must be in [0, 1], got -0.1"),
    "num_heads zero": (dict(num_heads=0), ValueError, "num_heads must be greater than 0, got 0"),
    "need weights on sdpa": (dict(backend="sdpa"), ValueError,
                             "backend='sdpa' does not return attention weights; use backend='math' (or 'native', "
                             "without gradients or dropout) or need_weights=False"),
}


@pytest.mark.parametrize("name", list(FUNCTIONAL_CALLS))
def test_functional_bad_input(name):
    overrides, error, message = FUNCTIONAL_CALLS[name]
    with _raises(error, message):
        multi_head_attention_forward(**_functional_args(**overrides))
