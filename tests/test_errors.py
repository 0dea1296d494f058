"""Bad input: a clear TypeError/ValueError naming the argument, never a wrong answer or a deep crash."""

import pytest
import torch

import mha
from mha.functional import multi_head_attention_forward, scaled_dot_product_attention

E, H, L, S, N = 8, 2, 3, 5, 2


@pytest.fixture
def module():
    return mha.nn.MultiheadAttention(E, H)


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


q, k, v = _x(L, N, E), _x(S, N, E), _x(S, N, E)

MODULE_CALLS = {
    # name: (call kwargs, error type, words the message must contain)
    "query rank 4": (dict(query=_x(L, N, E, 1), key=k, value=v), ValueError, ["query", "4-D"]),
    "query rank 1": (dict(query=_x(E), key=k, value=v), ValueError, ["query", "1-D"]),
    "key rank differs": (dict(query=q, key=_x(S, E), value=v), ValueError, ["key", "3-D"]),
    "embed dim mismatch": (dict(query=_x(L, N, E + 1), key=k, value=v), ValueError, ["embed_dim=8", "query"]),
    "key width mismatch": (dict(query=q, key=_x(S, N, E + 2), value=_x(S, N, E + 2)), ValueError,
                           ["key", "10"]),
    "key/value length mismatch": (dict(query=q, key=k, value=_x(S + 1, N, E)), ValueError,
                                  ["key and value", "length"]),
    "batch mismatch": (dict(query=q, key=_x(S, N + 1, E), value=_x(S, N + 1, E)), ValueError, ["batch"]),
    "integer query": (dict(query=torch.ones(L, N, E, dtype=torch.long), key=k, value=v), TypeError,
                      ["query", "floating", "int64"]),
    "non-tensor query": (dict(query=[[1.0]], key=k, value=v), TypeError, ["query", "list"]),
    "dtype mismatch q/k": (dict(query=q, key=k.double(), value=v), TypeError, ["key", "float64", "float32"]),
    "input dtype vs params": (dict(query=q.double(), key=k.double(), value=v.double()), TypeError,
                              ["float32", "float64"]),
    "attn_mask wrong 2-D shape": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(L, S + 1)), ValueError,
                                  ["attn_mask", f"({L}, {S})", f"({L}, {S + 1})"]),
    "attn_mask wrong 3-D shape": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(N, L, S)), ValueError,
                                  ["attn_mask", f"({N * H}, {L}, {S})"]),
    "attn_mask rank 4": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(1, 1, L, S)), ValueError,
                         ["attn_mask", "4-D"]),
    "attn_mask integer": (dict(query=q, key=k, value=v, attn_mask=torch.zeros(L, S, dtype=torch.long)),
                          TypeError, ["attn_mask", "int64"]),
    "key_padding_mask wrong shape": (dict(query=q, key=k, value=v, key_padding_mask=torch.zeros(S, N, dtype=torch.bool)),
                                     ValueError, ["key_padding_mask", f"({N}, {S})"]),
    "key_padding_mask integer": (dict(query=q, key=k, value=v, key_padding_mask=torch.zeros(N, S, dtype=torch.int32)),
                                 TypeError, ["key_padding_mask", "int32"]),
    "unbatched key_padding_mask 2-D": (dict(query=_x(L, E), key=_x(S, E), value=_x(S, E),
                                            key_padding_mask=torch.zeros(1, S, dtype=torch.bool)),
                                       ValueError, ["key_padding_mask", f"({S},)"]),
    "unbatched 3-D attn_mask needs H": (dict(query=_x(L, E), key=_x(S, E), value=_x(S, E),
                                             attn_mask=torch.zeros(N * H, L, S)), ValueError,
                                        ["attn_mask", f"({H}, {L}, {S})"]),
    "nested tensor": (dict(query=torch.nested.nested_tensor([_x(L, E)], layout=torch.jagged), key=k, value=v), TypeError,
                      ["query", "nested"]),
}


@pytest.mark.parametrize("name", list(MODULE_CALLS))
def test_module_bad_input(module, name):
    kwargs, error, words = MODULE_CALLS[name]
    with pytest.raises(error) as info:
        module(**kwargs)
    for word in words:
        assert word in str(info.value), f"{name}: {word!r} not in {info.value}"


def test_key_width_mismatch_with_separate_weights():
    m = mha.nn.MultiheadAttention(E, H, kdim=5, vdim=7)
    with pytest.raises(ValueError, match=r"key's last dim must be kdim=5.*got.*6"):
        m(q, _x(S, N, 6), _x(S, N, 7))


def test_device_mismatch_names_both_devices(module):
    meta = torch.empty(L, N, E, device="meta")
    with pytest.raises(ValueError, match="meta"):
        module(q, meta, meta)


SDPA_CALLS = {
    "rank 1": (dict(query=_x(4), key=_x(4), value=_x(4)), ValueError, ["query", "1-D"]),
    "head dim mismatch": (dict(query=_x(2, L, 4), key=_x(2, S, 5), value=_x(2, S, 5)), ValueError, ["key"]),
    "key/value length": (dict(query=_x(2, L, 4), key=_x(2, S, 4), value=_x(2, S + 1, 4)), ValueError, ["value"]),
    "batch mismatch": (dict(query=_x(2, L, 4), key=_x(3, S, 4), value=_x(3, S, 4)), ValueError, ["batch"]),
    "gqa not divisible": (dict(query=_x(1, 5, L, 4), key=_x(1, 2, S, 4), value=_x(1, 2, S, 4), enable_gqa=True),
                          ValueError, ["multiple"]),
    "gqa not enabled": (dict(query=_x(1, 4, L, 4), key=_x(1, 2, S, 4), value=_x(1, 2, S, 4)), ValueError,
                        ["enable_gqa"]),
    "mask not broadcastable": (dict(query=_x(2, L, 4), key=_x(2, S, 4), value=_x(2, S, 4),
                                    attn_mask=torch.ones(L, S + 1, dtype=torch.bool)), ValueError,
                               ["attn_mask", "broadcast"]),
    "integer mask": (dict(query=_x(2, L, 4), key=_x(2, S, 4), value=_x(2, S, 4),
                          attn_mask=torch.ones(L, S, dtype=torch.long)), TypeError, ["attn_mask", "int64"]),
    "integer inputs": (dict(query=torch.ones(2, L, 4, dtype=torch.int32), key=_x(2, S, 4), value=_x(2, S, 4)),
                       TypeError, ["query", "int32"]),
    "dtype mismatch": (dict(query=_x(2, L, 4), key=_x(2, S, 4, dtype=torch.float64), value=_x(2, S, 4)),
                       TypeError, ["key", "float64"]),
    "dropout out of range": (dict(query=_x(2, L, 4), key=_x(2, S, 4), value=_x(2, S, 4), dropout_p=1.5),
                             ValueError, ["dropout_p"]),
    "unknown backend": (dict(query=_x(2, L, 4), key=_x(2, S, 4), value=_x(2, S, 4), backend="cuda"),
                        ValueError, ["backend", "cuda"]),
}


@pytest.mark.parametrize("name", list(SDPA_CALLS))
def test_sdpa_bad_input(name):
    kwargs, error, words = SDPA_CALLS[name]
    with pytest.raises(error) as info:
        scaled_dot_product_attention(**kwargs)
    for word in words:
        assert word in str(info.value), f"{name}: {word!r} not in {info.value}"


def _functional_args(**overrides):
    args = dict(query=q, key=k, value=v, embed_dim_to_check=E, num_heads=H,
                in_proj_weight=_x(3 * E, E), in_proj_bias=_x(3 * E), bias_k=None, bias_v=None,
                add_zero_attn=False, dropout_p=0.0, out_proj_weight=_x(E, E), out_proj_bias=_x(E))
    args.update(overrides)
    return args


FUNCTIONAL_CALLS = {
    "embed_dim_to_check": (dict(embed_dim_to_check=E + 1), ValueError, ["embed_dim"]),
    "not divisible": (dict(query=_x(L, N, 9), key=_x(S, N, 9), value=_x(S, N, 9), embed_dim_to_check=9),
                      ValueError, ["divisible", "num_heads=2"]),
    "in_proj_weight shape": (dict(in_proj_weight=_x(3 * E, E + 1)), ValueError, ["in_proj_weight", "(24, 8)"]),
    "in_proj_weight missing": (dict(in_proj_weight=None), ValueError, ["in_proj_weight"]),
    "separate missing": (dict(use_separate_proj_weight=True), ValueError, ["q_proj_weight"]),
    "out_proj shape": (dict(out_proj_weight=_x(E, E + 1)), ValueError, ["out_proj_weight"]),
    "in_proj_bias shape": (dict(in_proj_bias=_x(E)), ValueError, ["in_proj_bias", "(24,)"]),
    "bias_k alone": (dict(bias_k=_x(1, 1, E)), ValueError, ["bias_k", "bias_v"]),
    "bias_k shape": (dict(bias_k=_x(1, E), bias_v=_x(1, E)), ValueError, ["bias_k", "(1, 1, 8)"]),
    "static_k shape": (dict(static_k=_x(N, S, E // H)), ValueError, ["static_k", f"({N * H}, S, {E // H})"]),
    "static_k with bias_k": (dict(static_k=_x(N * H, S, 4), bias_k=_x(1, 1, E), bias_v=_x(1, 1, E)), ValueError,
                             ["static_k"]),
    "param dtype": (dict(out_proj_weight=_x(E, E, dtype=torch.float64)), TypeError, ["out_proj_weight", "float64"]),
    "dropout": (dict(dropout_p=-0.1), ValueError, ["dropout_p"]),
    "num_heads zero": (dict(num_heads=0), ValueError, ["num_heads"]),
    "need weights on sdpa": (dict(backend="sdpa"), ValueError, ["weights"]),
}


@pytest.mark.parametrize("name", list(FUNCTIONAL_CALLS))
def test_functional_bad_input(name):
    overrides, error, words = FUNCTIONAL_CALLS[name]
    with pytest.raises(error) as info:
        multi_head_attention_forward(**_functional_args(**overrides))
    for word in words:
        assert word in str(info.value), f"{name}: {word!r} not in {info.value}"
