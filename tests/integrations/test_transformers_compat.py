"""mha.integrations.transformers.compat: every use of transformers' private state, one function each.
Each works on the installed transformers, and each fails with a RuntimeError naming the name and the
version when transformers renames it (monkeypatched away here) or is a release mha does not follow."""

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("mha.integrations.transformers")
compat = hf.compat

from transformers import AttentionInterface  # noqa: E402
from transformers import modeling_flash_attention_utils as flash_utils  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.utils import output_capturing  # noqa: E402

from helpers.tiny_decoders import tiny_model  # noqa: E402


class _Allocator:
    _kv_token_views = {0: ("keys", "values")}


# (the private name's owner, its name, a call of compat that reads it)
USES = {
    "registered": (AttentionInterface, "_global_mapping", lambda: compat.registered("mha")),
    "unregister": (AttentionMaskInterface, "_global_mapping", lambda: compat.unregister("no such name")),
    "loaded_flash": (flash_utils, "_loaded_implementation", compat.loaded_flash),
    "set_loaded_flash": (flash_utils, "_loaded_implementation", lambda: compat.set_loaded_flash(compat.loaded_flash())),
    "attentions_recorded": (output_capturing, "_active_collector", compat.attentions_recorded),
    "token_views": (_Allocator, "_kv_token_views", lambda: compat.token_views(_Allocator(), 0)),
}


@pytest.mark.parametrize("use", list(USES))
def test_each_private_name_is_read_where_it_is_and_named_when_it_is_gone(use, monkeypatch):
    owner, name, call = USES[use]
    call()  # the installed transformers has it
    for holder in getattr(owner, "__mro__", (owner,)):  # wherever it is defined, up the class's bases
        if name in vars(holder):
            monkeypatch.delattr(holder, name)
    with pytest.raises(RuntimeError, match=f"reads .*\\.{name}, which transformers .* does not have"):
        call()


def test_a_models_private_attributes_are_named_when_they_are_gone(monkeypatch):
    model = tiny_model("llama")
    assert compat.attn_implementation(model.config) == model.config._attn_implementation
    assert compat.compatible_flash(model) is None  # Llama lists none: any flash implementation
    compat.list_flash(model, ["mha_flash"])
    assert compat.compatible_flash(model) == ["mha_flash"]
    compat.unlist_flash(model)
    assert compat.compatible_flash(model) is None  # the class's own again
    monkeypatch.delattr(transformers.PreTrainedModel, "_compatible_flash_implementations")
    with pytest.raises(RuntimeError, match="_compatible_flash_implementations, which transformers"):
        compat.compatible_flash(model)


def test_a_transformers_release_it_does_not_follow_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "6.0.0")
    with pytest.raises(RuntimeError, match="transformers 6.0.0 does not have or mha does not follow there "
                                           r"\(mha follows transformers 5.x\)"):
        compat.loaded_flash()


class _LazyTransformers(type(sys)):
    """A module whose __version__ comes from its __getattr__, as transformers' lazy module's does."""

    def __init__(self, version: str):
        super().__init__("transformers")
        self.asked = []
        self._answer = version

    def __getattr__(self, name):
        if name == "__version__":
            self.asked.append(name)
            return self._answer
        raise AttributeError(name)


def test_the_version_is_read_from_the_module_transformers_is_now(monkeypatch):
    """compat._version reads a lazy module's __version__ once (3 us a read through its __getattr__)
    and reads again for another module object, or for a version set on the module itself."""
    first, second = _LazyTransformers("6.0.0"), _LazyTransformers("5.99.0")
    monkeypatch.setitem(sys.modules, "transformers", first)
    assert compat._version() == compat._version() == "6.0.0" and first.asked == ["__version__"]
    with pytest.raises(RuntimeError, match="transformers 6.0.0 does not have or mha does not follow"):
        compat.attentions_recorded()
    monkeypatch.setitem(sys.modules, "transformers", second)
    assert compat._version() == "5.99.0"
    second.__version__ = "7.0.0"  # set on the module itself
    assert compat._version() == "7.0.0"


def test_the_private_state_is_touched_in_compat_alone():
    """No other room of the bridge reads a private name of transformers."""
    import re
    from pathlib import Path
    folder = Path(hf.__file__).parent
    names = ("_global_mapping", "_loaded_implementation", "_compatible_flash_implementations", "_attn_implementation",
             "_kv_token_views", "_active_collector")
    for path in folder.glob("*.py"):
        if path.name != "compat.py":
            text = path.read_text()
            assert not [n for n in names if re.search(rf"(?<![A-Za-z0-9_]){n}", text)], path.name


def test_gpt2_returns_its_attention_weights_under_mha():
    """GPT-2's attention takes output_attentions itself and records its outputs: the weights came back as
    an empty tuple under mha (transformers' collector, read through compat, now asks for them)."""
    hf.register()
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 9))
    weights = {}
    for implementation in ("eager", "mha"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            weights[implementation] = model(ids, output_attentions=True).attentions
    assert len(weights["mha"]) == 2
    for ours, theirs in zip(weights["mha"], weights["eager"]):
        torch.testing.assert_close(ours, theirs)
    with torch.no_grad():
        assert not model(ids).attentions  # not asked: none computed


def test_a_transformers_without_output_capturing_is_named(monkeypatch):
    """The module compat reads the collector from, gone: a RuntimeError that names it, not an ImportError."""
    monkeypatch.setitem(sys.modules, "transformers.utils.output_capturing", None)  # import fails
    monkeypatch.delattr(transformers.utils, "output_capturing")
    with pytest.raises(RuntimeError, match=r"reads transformers\.utils\.output_capturing, which transformers"):
        compat.attentions_recorded()
