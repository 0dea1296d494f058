"""Small randomly initialised decoders of three transformers families, and a left-padded batch for them
(transformers is imported only when a model is built)."""

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0)
WINDOW = 6  # shorter than the prompts, so that the sliding layers hide keys


def tiny_model(kind: str):
    """A small randomly initialised model of each family: GQA; sinks + sliding window; softcap +
    sliding window."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                           layer_types=["sliding_attention", "full_attention"])
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():  # sinks start at zero: make them matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    else:
        config = transformers.Gemma2Config(**TINY, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                           final_logit_softcapping=30.0, query_pre_attn_scalar=16)
        model = transformers.Gemma2ForCausalLM(config)
    return model.eval()


def left_padded_batch(T: int = 12, padding: int = 4):
    torch.manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (2, T))
    attention_mask = torch.ones(2, T, dtype=torch.long)
    attention_mask[0, :padding] = 0
    ids[0, :padding] = 0
    return ids, attention_mask
