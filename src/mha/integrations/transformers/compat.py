"""Every use of transformers' private state, in one place, gated by version.

mha follows transformers 5.x. What it reads or changes of transformers' own (names with a leading
underscore, which transformers may rename in any release) is each one function here, and each
checks the name exists first: a transformers that renamed it gets a RuntimeError that names the
name, the version and what to do, never an AttributeError deep in a forward. tests/integrations/
test_compat_transformers.py holds each against the installed transformers and against a renamed one.

    registered(name)              the attention function registered under an attn_implementation name
    unregister(name)              an attn_implementation name out of both registries (attention and masks)
    loaded_flash() / set_loaded_flash(name)
                                  the flash implementation transformers believes loaded (continuous
                                  batching takes only "flash" names: mha's registers as one)
    compatible_flash(model) / list_flash(model, names) / unlist_flash(model)
                                  a model class's list of the flash implementations it accepts (GPT-OSS)
    attn_implementation(config)   the implementation a model's config names
    has_token_views(allocator) / token_views(allocator, layer)
                                  a continuous-batching cache's (tokens, Hkv, D) views of one layer
    attentions_recorded()         whether transformers is collecting attention weights (output_attentions
                                  on a model whose layers do not pass the flag to the attention function)
"""

from __future__ import annotations

import sys

__all__ = ["KNOWN", "attentions_recorded", "attn_implementation", "compatible_flash", "has_token_views", "list_flash",
           "loaded_flash", "registered", "set_loaded_flash", "token_views", "unlist_flash", "unregister"]

KNOWN = ("5.",)  # the transformers releases this module follows


_read_version: tuple[object, str] | None = None  # (the transformers module, its version) as last read from it


def _version() -> str:
    """The installed transformers' version, read at each call (the module as sys.modules holds it now).
    transformers' lazy module answers ``__version__`` through its ``__getattr__`` (3 us, at each
    attention call of a model, measured): read once per module object, unless set on the module
    itself (a version changed in place: its own attribute, read first)."""
    global _read_version
    import transformers
    own = vars(transformers).get("__version__")
    if own is not None:
        return own
    if _read_version is None or _read_version[0] is not transformers:
        _read_version = (transformers, transformers.__version__)
    return _read_version[1]


def _missing(where: str, name: str) -> RuntimeError:
    return RuntimeError(f"mha's transformers integration reads {where}.{name}, which transformers {_version()} does not "
                        f"have or mha does not follow there (mha follows transformers {', '.join(KNOWN)}x): use a "
                        "transformers mha supports, or attn_implementation='sdpa'")


def _get(owner, where: str, name: str):
    if not _version().startswith(KNOWN) or not hasattr(owner, name):
        raise _missing(where, name)
    return getattr(owner, name)


def _mapping(interface, where: str) -> dict:
    return _get(interface, where, "_global_mapping")


def registered(name: str):
    """The attention function registered under ``name``, or None."""
    from transformers import AttentionInterface
    return _mapping(AttentionInterface, "transformers.AttentionInterface").get(name)


def unregister(name: str) -> None:
    """``name`` out of transformers' attention and mask registries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    for interface, where in ((AttentionInterface, "transformers.AttentionInterface"),
                             (AttentionMaskInterface, "transformers.masking_utils.AttentionMaskInterface")):
        _mapping(interface, where).pop(name, None)


def _flash_utils():
    from transformers import modeling_flash_attention_utils
    return modeling_flash_attention_utils


def loaded_flash():
    """The flash implementation transformers believes loaded (a name, or None)."""
    return _get(_flash_utils(), "transformers.modeling_flash_attention_utils", "_loaded_implementation")


def set_loaded_flash(name) -> None:
    loaded_flash()  # (checks it exists)
    _flash_utils()._loaded_implementation = name


def compatible_flash(model) -> list | None:
    """The flash implementations the model's class accepts, or None where it lists none (any)."""
    return _get(model, "the model (transformers.PreTrainedModel)", "_compatible_flash_implementations")


def list_flash(model, names: list) -> None:
    """This model (not its class) accepts these flash implementations."""
    compatible_flash(model)  # (checks it exists)
    model._compatible_flash_implementations = list(names)


def unlist_flash(model) -> None:
    """Back to the class's own list."""
    model.__dict__.pop("_compatible_flash_implementations", None)


def attn_implementation(config) -> str | None:
    """The attention implementation a model's config names."""
    return _get(config, "the model's config", "_attn_implementation")


def has_token_views(allocator) -> bool:
    """Whether a continuous-batching cache allocator keeps (tokens, Hkv, D) views of its layers' keys
    and values (where it does not, the keys are gathered by cache.update instead: slower, as right)."""
    return hasattr(allocator, "_kv_token_views")


def token_views(allocator, layer: int):
    """A continuous-batching cache allocator's (tokens, Hkv, D) views of a layer's keys and values."""
    return _get(allocator, "transformers' cache allocator", "_kv_token_views")[layer]


def attentions_recorded() -> bool:
    """Whether transformers collects the attention weights of this forward (``output_attentions``
    asked of a model whose attention modules take the flag themselves and record their outputs, as
    GPT-2's do, instead of passing it to the attention function)."""
    output_capturing = sys.modules.get("transformers.utils.output_capturing")  # (an import statement: 1 us a call)
    if output_capturing is None:
        try:
            from transformers.utils import output_capturing
        except ImportError:
            raise _missing("transformers.utils", "output_capturing") from None
    collector = _get(output_capturing, "transformers.utils.output_capturing", "_active_collector")
    try:
        collected = collector.get()
    except LookupError:  # never set in this context: nothing is collected
        return False
    return bool(collected) and ("attentions" in collected or "cross_attentions" in collected)
