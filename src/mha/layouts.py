"""Weight layouts of multi-head attention, and lossless conversion between them.

Every layout converts through one hub: the state_dict of the general module
:class:`mha.GeneralAttention` ("general"):

    q_proj.weight (h*dk, cq)  k_proj.weight (h*dk, ck)  v_proj.weight (h*dv, cv)
    out_proj.weight (do, h*dv)  and optionally q_proj.bias, k_proj.bias, v_proj.bias,
    out_proj.bias, bias_k (1, 1, h*dk), bias_v (1, 1, h*dv)

Layouts (the names ``convert`` takes):

    general    mha.GeneralAttention
    torch      torch.nn.MultiheadAttention / mha.nn.MultiheadAttention: in_proj_weight (3E, E)
               when all widths are E, else q/k/v_proj_weight; in_proj_bias (3E,); out_proj.*
    bert       HuggingFace BERT-style: self.query/key/value.*, output.dense.*
    gpt2       GPT-2: c_attn (Conv1D: (cq, 3*h*dk), transposed and packed), c_proj (Conv1D)
    annotated  The Annotated Transformer: linears.0..3 (q, k, v, out)
    labml      labml.ai: query.linear.*, key.linear.*, value.linear.*, output.*
    llama      Llama-style: q_proj, k_proj, v_proj (Hkv heads for GQA), o_proj
    per_head   the paper's matrices: W_q.i (cq, dk), W_k.i (ck, dk), W_v.i (cv, dv) for each head
               i, W_o (h*dv, do), and b_q.i, b_k.i, b_v.i, b_o, bias_k.i, bias_v.i

All heads are laid out head-major (head i owns rows i*d .. (i+1)*d of a projection) in every one
of these libraries, so conversion is renaming, packing and transposing, never reordering.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, masks

__all__ = [
    "LAYOUTS", "convert", "to_general", "from_general", "heads_in", "widths", "general_module",
    "torch_module", "state_of", "PerHead", "per_head", "from_per_head", "per_head_attention",
    "seq_first_to_batch_first", "batch_first_to_seq_first", "labml_mask_to_attn_mask",
    "annotated_mask_to_attn_mask",
]

_PROJ = ("q_proj", "k_proj", "v_proj", "out_proj")


# ---------------------------------------------------------------------------------------------
# The hub: checks and widths
# ---------------------------------------------------------------------------------------------


def _require(state: Mapping[str, Tensor], key: str, layout: str, ndim: int | None = None) -> Tensor:
    if key not in state:
        raise ValueError(f"layout {layout!r} needs the key {key!r}, which is missing "
                         f"(keys present: {sorted(state)[:12]}{' ...' if len(state) > 12 else ''})")
    value = _checks.floating(repr(key), state[key])
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{key!r} must be {ndim}-D, got shape {tuple(value.shape)}")
    return value


def widths(general: Mapping[str, Tensor], num_heads: int | None = None) -> dict:
    """cq, ck, cv, do, h*dk, h*dv (and dk, dv with num_heads) of a general state; checks shapes."""
    q, k, v, o = (_require(general, f"{p}.weight", "general", ndim=2) for p in _PROJ)
    hdk, hdv = q.shape[0], o.shape[1]  # query heads x dk, query heads x dv
    kv_hdk, kv_hdv = k.shape[0], v.shape[0]  # fewer rows with grouped-query attention
    if kv_hdk == 0 or hdk % kv_hdk or hdv % kv_hdv or hdk // kv_hdk != hdv // kv_hdv:
        raise ValueError(f"k_proj.weight ({kv_hdk} rows) and v_proj.weight ({kv_hdv} rows) must hold the same "
                         f"whole fraction of the query heads as q_proj.weight ({hdk}) and out_proj.weight "
                         f"({hdv} columns)")
    found = dict(cq=q.shape[1], ck=k.shape[1], cv=v.shape[1], do=o.shape[0], hdk=hdk, hdv=hdv,
                 kv_groups=hdk // kv_hdk)
    expected = {"q_proj.bias": (hdk,), "k_proj.bias": (kv_hdk,), "v_proj.bias": (kv_hdv,),
                "out_proj.bias": (found["do"],), "bias_k": (1, 1, kv_hdk), "bias_v": (1, 1, kv_hdv)}
    for key, shape in expected.items():
        if key in general and tuple(general[key].shape) != shape:
            raise ValueError(f"{key} must have shape {shape} to match the projections, "
                             f"got {tuple(general[key].shape)}")
    if ("bias_k" in general) != ("bias_v" in general):
        raise ValueError("bias_k and bias_v come together; only one of them is present")
    if num_heads is not None:
        num_heads = _checks.positive_int("num_heads", num_heads)
        if hdk % num_heads or hdv % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide the projection widths h*dk={hdk} "
                             f"and h*dv={hdv}")
        if num_heads % found["kv_groups"]:
            raise ValueError(f"num_heads={num_heads} is not a multiple of the {found['kv_groups']} query heads "
                             "that share each key/value head")
        found.update(h=num_heads, dk=hdk // num_heads, dv=hdv // num_heads,
                     num_kv_heads=num_heads // found["kv_groups"])
    return found


def _biases(general) -> list:
    return [general.get(f"{p}.bias") for p in _PROJ]


# ---------------------------------------------------------------------------------------------
# Layouts: each a pair (from general, to general)
# ---------------------------------------------------------------------------------------------


def _renaming(layout: str, names: dict[str, str]):
    """A layout that only renames keys: general name -> layout name. Weights are required,
    biases and bias_k/bias_v optional."""
    def export(general, num_heads):
        unplaced = sorted(set(general) - set(names))
        if unplaced:
            raise ValueError(f"layout {layout!r} has no place for {unplaced}; converting would lose them")
        return {names[k]: t for k, t in general.items()}

    def load(state, num_heads):
        return {k: _require(state, n, layout) for k, n in names.items()
                if k.endswith(".weight") or n in state}
    return export, load


def _linear_names(q, k, v, o, extra=True) -> dict[str, str]:
    names = {}
    for general, local in zip(_PROJ, (q, k, v, o)):
        names[f"{general}.weight"] = f"{local}.weight"
        names[f"{general}.bias"] = f"{local}.bias"
    if extra:
        names.update(bias_k="bias_k", bias_v="bias_v")
    return names


def _torch_export(general, num_heads):
    w = widths(general)
    E = w["cq"]
    if w["kv_groups"] != 1:
        raise ValueError("torch.nn.MultiheadAttention has as many key/value heads as query heads (no GQA)")
    if not (w["hdk"] == w["hdv"] == w["do"] == E):
        raise ValueError("torch.nn.MultiheadAttention needs h*dk = h*dv = do = query width (embed_dim); "
                         f"got h*dk={w['hdk']}, h*dv={w['hdv']}, do={w['do']}, cq={E}")
    biases = _biases(general)
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("torch.nn.MultiheadAttention has biases on all four projections or on none")
    state = {}
    if w["ck"] == w["cv"] == E:
        state["in_proj_weight"] = torch.cat([general[f"{p}.weight"] for p in _PROJ[:3]])  # (3E, E)
    else:
        state.update({f"{p}_weight": general[f"{p}.weight"] for p in _PROJ[:3]})
    if biases[0] is not None:
        state["in_proj_bias"] = torch.cat(biases[:3])  # (3E,)
    if "bias_k" in general:
        state.update(bias_k=general["bias_k"], bias_v=general["bias_v"])
    state["out_proj.weight"] = general["out_proj.weight"]
    if biases[3] is not None:
        state["out_proj.bias"] = biases[3]
    return state


def _torch_load(state, num_heads):
    if "in_proj_weight" in state:
        packed = _require(state, "in_proj_weight", "torch", ndim=2)
        if packed.shape[0] % 3:
            raise ValueError(f"in_proj_weight must have 3*E rows, got shape {tuple(packed.shape)}")
        q, k, v = packed.chunk(3)  # (3E, E) -> 3 x (E, E)
    else:
        q, k, v = (_require(state, f"{p}_weight", "torch") for p in _PROJ[:3])
    general = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
               "out_proj.weight": _require(state, "out_proj.weight", "torch")}
    if "in_proj_bias" in state:
        general.update(zip(("q_proj.bias", "k_proj.bias", "v_proj.bias"), state["in_proj_bias"].chunk(3)))
    for key in ("out_proj.bias", "bias_k", "bias_v"):
        if key in state:
            general[key] = state[key]
    return general


def _gpt2_export(general, num_heads):
    w = widths(general)
    if not (w["cq"] == w["ck"] == w["cv"] and w["hdk"] == w["hdv"] and w["kv_groups"] == 1):
        raise ValueError("GPT-2's c_attn packs q, k, v of one input: needs cq = ck = cv, dk = dv, no GQA")
    if "bias_k" in general:
        raise ValueError("GPT-2 has no bias_k / bias_v")
    biases = _biases(general)
    if any(b is None for b in biases):
        raise ValueError("GPT-2's Conv1D projections always have biases")
    return {"c_attn.weight": torch.cat([general[f"{p}.weight"] for p in _PROJ[:3]]).t().contiguous(),  # (cq, 3*h*d)
            "c_attn.bias": torch.cat(biases[:3]),
            "c_proj.weight": general["out_proj.weight"].t().contiguous(),  # (h*dv, do)
            "c_proj.bias": biases[3]}


def _gpt2_load(state, num_heads):
    packed = _require(state, "c_attn.weight", "gpt2", ndim=2).t()  # (cq, 3*h*d) -> (3*h*d, cq)
    if packed.shape[0] % 3:
        raise ValueError(f"c_attn.weight must have 3*h*d columns, got shape {tuple(packed.shape[::-1])}")
    general = dict(zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"), packed.chunk(3)))
    general.update(zip(("q_proj.bias", "k_proj.bias", "v_proj.bias"),
                       _require(state, "c_attn.bias", "gpt2").chunk(3)))
    general["out_proj.weight"] = _require(state, "c_proj.weight", "gpt2", ndim=2).t()  # (h*dv, do) -> (do, h*dv)
    general["out_proj.bias"] = _require(state, "c_proj.bias", "gpt2")
    return {k: t.contiguous() for k, t in general.items()}


def _per_head_export(general, num_heads):
    return per_head(general, _heads_needed(num_heads)).as_state()


def _per_head_load(state, num_heads):
    heads = PerHead.from_state(state)
    if num_heads is not None and num_heads != heads.num_heads:
        raise ValueError(f"the per_head weights hold {heads.num_heads} heads, but num_heads={num_heads}")
    return from_per_head(heads)


def _heads_needed(num_heads):
    if num_heads is None:
        raise ValueError("the per_head layout splits by head: pass num_heads")
    return num_heads


@dataclass(frozen=True)
class Layout:
    name: str
    description: str
    export: Callable  # (general state, num_heads) -> layout state
    load: Callable  # (layout state, num_heads) -> general state


def _layout(name, description, pair):
    return Layout(name, description, *pair)


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    _layout("general", "mha.GeneralAttention", _renaming("general", _linear_names(*_PROJ))),
    _layout("torch", "torch.nn.MultiheadAttention (packed in_proj or separate q/k/v_proj_weight)",
            (_torch_export, _torch_load)),
    _layout("bert", "HuggingFace BERT attention: self.query/key/value, output.dense",
            _renaming("bert", _linear_names("self.query", "self.key", "self.value", "output.dense", extra=False))),
    _layout("gpt2", "GPT-2 attention: c_attn, c_proj (Conv1D, transposed)", (_gpt2_export, _gpt2_load)),
    _layout("annotated", "The Annotated Transformer: linears.0..3",
            _renaming("annotated", _linear_names("linears.0", "linears.1", "linears.2", "linears.3", extra=False))),
    _layout("labml", "labml.ai: query.linear, key.linear, value.linear, output",
            _renaming("labml", _linear_names("query.linear", "key.linear", "value.linear", "output", extra=False))),
    _layout("llama", "Llama-style q_proj, k_proj, v_proj (fewer kv heads allowed), o_proj",
            _renaming("llama", _linear_names("q_proj", "k_proj", "v_proj", "o_proj", extra=False))),
    _layout("per_head", "the paper's per-head matrices W_q.i, W_k.i, W_v.i, W_o", (_per_head_export, _per_head_load)),
)}


def _layout_named(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; known: {sorted(LAYOUTS)}")
    return LAYOUTS[name]


def heads_in(state: Mapping[str, Tensor], layout: str, num_heads: int | None = None) -> int | None:
    """The number of heads: the one the weights fix (per_head) checked against ``num_heads``, else ``num_heads``."""
    if layout != "per_head":
        return num_heads
    count = PerHead.from_state(state).num_heads
    if num_heads is not None and num_heads != count:
        raise ValueError(f"the per_head weights hold {count} heads, but num_heads={num_heads}")
    return count


def to_general(state: Mapping[str, Tensor], layout: str, num_heads: int | None = None) -> dict:
    """A state_dict in ``layout`` -> the general module's state_dict (validated)."""
    general = _layout_named(layout).load(dict(state), num_heads)
    widths(general, heads_in(state, layout, num_heads))
    return general


def from_general(general: Mapping[str, Tensor], layout: str, num_heads: int | None = None) -> dict:
    """The general module's state_dict -> a state_dict in ``layout``."""
    widths(general, num_heads)
    return _layout_named(layout).export(dict(general), num_heads)


def convert(state: Mapping[str, Tensor], source: str, target: str, num_heads: int | None = None) -> dict:
    """Convert attention weights from one layout to another (no copy beyond what packing needs)."""
    num_heads = heads_in(state, source, num_heads)
    return from_general(to_general(state, source, num_heads), target, num_heads)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


def state_of(module) -> tuple[dict, str, int]:
    """(state_dict, layout name, num_heads) of a torch/mha attention module."""
    from .modules.general import GeneralAttention
    from .nn import MultiheadAttention

    if isinstance(module, GeneralAttention):
        return module.state_dict(), "general", module.h
    if isinstance(module, (MultiheadAttention, torch.nn.MultiheadAttention)):
        return module.state_dict(), "torch", module.num_heads
    raise TypeError(f"expected torch.nn.MultiheadAttention, mha.nn.MultiheadAttention or "
                    f"mha.GeneralAttention, got {type(module).__name__}")


def general_module(state: Mapping[str, Tensor], layout: str, num_heads: int, **options):
    """An mha.GeneralAttention with the widths these weights imply, loaded with them."""
    from .modules.general import GeneralAttention

    general = to_general(state, layout, num_heads)
    w = widths(general, num_heads)
    biases = [b is not None for b in _biases(general)]
    if any(biases) and not all(biases):
        raise ValueError("mha.GeneralAttention has biases on all four projections or on none")
    module = GeneralAttention(w["cq"], w["ck"], w["cv"], w["dk"], w["dv"], w["do"], num_heads,
                                bias=all(biases), add_bias_kv="bias_k" in general,
                                num_kv_heads=w["num_kv_heads"], **options)
    module.load_state_dict(general)
    return module


def torch_module(state: Mapping[str, Tensor], layout: str, num_heads: int, cls=None, **options):
    """A torch.nn.MultiheadAttention (or ``cls``, e.g. mha.nn.MultiheadAttention) loaded with these weights."""
    cls = torch.nn.MultiheadAttention if cls is None else cls
    general = to_general(state, layout, num_heads)
    flat = from_general(general, "torch")
    w = widths(general, num_heads)
    module = cls(w["cq"], num_heads, bias="in_proj_bias" in flat, add_bias_kv="bias_k" in flat,
                 kdim=w["ck"], vdim=w["cv"], **options)
    module.load_state_dict(flat)
    return module


# ---------------------------------------------------------------------------------------------
# The paper's per-head form (seed 000)
# ---------------------------------------------------------------------------------------------


@dataclass
class PerHead:
    """head_i = softmax((x_q W_q[i] + b_q[i]) (x_k W_k[i] + b_k[i])^T / sqrt(dk)) (x_v W_v[i] + b_v[i]);
    output = concat(head_1..head_h) W_o + b_o. Matrices act on the right (x @ W), as in the paper.

    W_q[i] (cq, dk), W_k[i] (ck, dk), W_v[i] (cv, dv), W_o (h*dv, do); b_* per head or None;
    bias_k[i] (dk,), bias_v[i] (dv,): the learned extra key/value of head i, or None.
    """
    W_q: list[Tensor]
    W_k: list[Tensor]
    W_v: list[Tensor]
    W_o: Tensor
    b_q: list[Tensor] | None = None
    b_k: list[Tensor] | None = None
    b_v: list[Tensor] | None = None
    b_o: Tensor | None = None
    bias_k: list[Tensor] | None = None
    bias_v: list[Tensor] | None = None

    @property
    def num_heads(self) -> int:
        return len(self.W_q)

    _LISTS = ("W_q", "W_k", "W_v", "b_q", "b_k", "b_v", "bias_k", "bias_v")

    def as_state(self) -> dict[str, Tensor]:
        """Flat keys: W_q.0, W_q.1, ..., W_o, b_o (for saving)."""
        state = {f"{name}.{i}": t for name in self._LISTS if getattr(self, name) is not None
                 for i, t in enumerate(getattr(self, name))}
        state["W_o"] = self.W_o
        if self.b_o is not None:
            state["b_o"] = self.b_o
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Tensor]) -> PerHead:
        def listed(name):
            items = sorted((int(k.split(".")[1]), t) for k, t in state.items()
                           if k.startswith(name + ".") and k.split(".")[1].isdigit())
            if [i for i, _ in items] != list(range(len(items))):
                raise ValueError(f"per_head keys {name}.i must number the heads 0..h-1, got {[i for i, _ in items]}")
            return [t for _, t in items] or None

        lists = {name: listed(name) for name in cls._LISTS}
        for name in ("W_q", "W_k", "W_v"):
            if lists[name] is None:
                raise ValueError(f"layout 'per_head' needs the keys {name}.0 .. {name}.(h-1), which are missing")
        h = len(lists["W_q"])
        for name, items in lists.items():
            if items is not None and len(items) != h:
                raise ValueError(f"per_head has {h} heads in W_q but {len(items)} in {name}")
        if (lists["bias_k"] is None) != (lists["bias_v"] is None):
            raise ValueError("per_head bias_k.i and bias_v.i come together; only one of them is present")
        return cls(W_o=_require(state, "W_o", "per_head", ndim=2), b_o=state.get("b_o"), **lists)


def per_head(state: Mapping[str, Tensor], num_heads: int, layout: str = "general") -> PerHead:
    """The paper's per-head matrices (transposed, split by head) of weights in any layout."""
    general = to_general(state, layout, num_heads)  # validated like every other entry, the general layout too
    w = widths(general, num_heads)
    if w["kv_groups"] != 1:
        raise ValueError("the per-head form has one key/value matrix per head: repeat GQA's shared ones first")
    h, dk, dv = num_heads, w["dk"], w["dv"]

    def split(t, d):  # (h*d, c) -> h x (c, d); (h*d,) -> h x (d,)
        return [part.t() if part.dim() == 2 else part for part in t.split(d)]

    def maybe(key, d):
        return None if general.get(key) is None else split(general[key].reshape(h * d, -1).squeeze(-1), d)

    return PerHead(
        W_q=split(general["q_proj.weight"], dk), W_k=split(general["k_proj.weight"], dk),
        W_v=split(general["v_proj.weight"], dv), W_o=general["out_proj.weight"].t(),
        b_q=maybe("q_proj.bias", dk), b_k=maybe("k_proj.bias", dk), b_v=maybe("v_proj.bias", dv),
        b_o=general.get("out_proj.bias"), bias_k=maybe("bias_k", dk), bias_v=maybe("bias_v", dv),
    )


def from_per_head(heads: PerHead) -> dict[str, Tensor]:
    """The per-head matrices -> the general module's state_dict."""
    def stack(parts):  # h x (c, d) -> (h*d, c); h x (d,) -> (h*d,)
        return torch.cat([p.t() if p.dim() == 2 else p for p in parts]).contiguous()

    general = {"q_proj.weight": stack(heads.W_q), "k_proj.weight": stack(heads.W_k),
               "v_proj.weight": stack(heads.W_v), "out_proj.weight": heads.W_o.t().contiguous()}
    for key, parts in (("q_proj.bias", heads.b_q), ("k_proj.bias", heads.b_k), ("v_proj.bias", heads.b_v)):
        if parts is not None:
            general[key] = stack(parts)
    if heads.b_o is not None:
        general["out_proj.bias"] = heads.b_o
    if (heads.bias_k is None) != (heads.bias_v is None):
        raise ValueError("bias_k and bias_v come together; only one of them is given")
    if heads.bias_k is not None:
        general["bias_k"] = stack(heads.bias_k).reshape(1, 1, -1)  # (h*dk,) -> (1, 1, h*dk)
        general["bias_v"] = stack(heads.bias_v).reshape(1, 1, -1)
    return general


def per_head_attention(query: Tensor, key: Tensor, value: Tensor, heads: PerHead, *,
                       attn_mask: Tensor | None = None, add_zero_attn: bool = False,
                       batch_first: bool | None = None) -> Tensor:
    """The paper's formula with a loop over heads: a readable reference, not a fast path.

    Unbatched query (L, cq), key (S, ck), value (S, cv) -> (L, do). Batched input must say its
    layout, as torch's module does: ``batch_first=True`` for (B, L, cq), ``False`` for torch's
    default (L, B, cq) (more leading dims are read as (..., L, cq)).
    attn_mask: bool (True = masked OUT, as torch.nn.MultiheadAttention) or float, broadcastable
    to (..., L, S); the extra keys (bias_k, zero attention) are always visible.
    """
    if query.dim() == 3:
        if not isinstance(batch_first, bool):
            raise ValueError("per_head_attention: pass batch_first=True for (N, L, E) input, or batch_first=False "
                             "for torch's default layout (L, N, E); 3-D input is ambiguous without it")
        if not batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # (T, B, E) -> (B, T, E)
            out = per_head_attention(query, key, value, heads, attn_mask=attn_mask, add_zero_attn=add_zero_attn,
                                     batch_first=True)
            return out.transpose(0, 1)  # (B, L, do) -> (L, B, do)
    outputs = []
    for i in range(heads.num_heads):
        q = query @ heads.W_q[i] + (0 if heads.b_q is None else heads.b_q[i])  # (..., L, dk)
        k = key @ heads.W_k[i] + (0 if heads.b_k is None else heads.b_k[i])  # (..., S, dk)
        v = value @ heads.W_v[i] + (0 if heads.b_v is None else heads.b_v[i])  # (..., S, dv)
        extra_k, extra_v = [], []
        if heads.bias_k is not None:
            extra_k.append(heads.bias_k[i])
            extra_v.append(heads.bias_v[i])
        if add_zero_attn:
            extra_k.append(torch.zeros_like(heads.W_k[i][0]))
            extra_v.append(torch.zeros_like(heads.W_v[i][0]))
        if extra_k:
            k = torch.cat([k, torch.stack(extra_k).expand(*k.shape[:-2], -1, -1)], dim=-2)  # (..., S+n, dk)
            v = torch.cat([v, torch.stack(extra_v).expand(*v.shape[:-2], -1, -1)], dim=-2)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (..., L, S+n)
        if attn_mask is not None:
            mask = masks.as_additive(attn_mask, true_means_attend=False, dtype=scores.dtype)
            scores = scores + F.pad(mask, (0, len(extra_k)))  # the extra keys are always visible
        outputs.append(torch.softmax(scores, dim=-1) @ v)  # (..., L, dv)
    out = torch.cat(outputs, dim=-1) @ heads.W_o  # concat(head_1..head_h) W_o: (..., L, do)
    return out if heads.b_o is None else out + heads.b_o


# ---------------------------------------------------------------------------------------------
# Activation and mask layouts of the seeds
# ---------------------------------------------------------------------------------------------


def seq_first_to_batch_first(x: Tensor) -> Tensor:
    """[T, B, d] (torch's default, labml) -> [B, T, d] (mha.GeneralAttention, SDPA)."""
    return x.transpose(0, 1)


def batch_first_to_seq_first(x: Tensor) -> Tensor:
    """[B, T, d] -> [T, B, d]."""
    return x.transpose(0, 1)


def labml_mask_to_attn_mask(mask: Tensor, num_heads: int, query_len: int | None = None,
                            batch: int | None = None) -> Tensor:
    """labml's mask [T_q, T_k, B] (True/1 = may attend; T_q and B may be 1 to broadcast) ->
    an attn_mask (B*num_heads, T_q, T_k) in torch.nn.MultiheadAttention's convention (True = masked out)."""
    if mask.dim() != 3:
        raise ValueError(f"a labml mask is [T_q, T_k, B], got shape {tuple(mask.shape)}")
    allowed = mask.bool().permute(2, 0, 1)  # [T_q, T_k, B] -> (B, T_q, T_k)
    return _heads_of(allowed, num_heads, query_len, batch, "labml mask [T_q, T_k, B]")


def annotated_mask_to_attn_mask(mask: Tensor, num_heads: int, query_len: int | None = None,
                                batch: int | None = None) -> Tensor:
    """The Annotated Transformer's mask (B or 1, 1 or T_q, T_k) (1 = may attend) -> an attn_mask
    (B*num_heads, T_q, T_k), True = masked out. (The Annotated Transformer fills with -1e9, so a
    row with no visible key becomes uniform there and zeros here.)"""
    if mask.dim() != 3:
        raise ValueError(f"an Annotated Transformer mask is (B, 1 or T_q, T_k), got shape {tuple(mask.shape)}")
    return _heads_of(mask.bool(), num_heads, query_len, batch, "Annotated Transformer mask (B, T_q, T_k)")


def _heads_of(allowed: Tensor, num_heads: int, query_len, batch, what: str) -> Tensor:
    """(B|1, T_q|1, T_k) "may attend" -> (B*H, T_q, T_k) "masked out", index b*H + h."""
    num_heads = _checks.positive_int("num_heads", num_heads)
    B = allowed.shape[0] if batch is None else _checks.positive_int("batch", batch)
    T_q = allowed.shape[1] if query_len is None else _checks.positive_int("query_len", query_len)
    for name, have, want in (("batch", allowed.shape[0], B), ("query_len", allowed.shape[1], T_q)):
        if have not in (1, want):
            raise ValueError(f"the {what} has {have} along {name}, which neither equals {name}={want} nor is 1")
    full = allowed.expand(B, T_q, allowed.shape[2])  # broadcast the size-1 axes
    return (~full).repeat_interleave(num_heads, dim=0)  # (B, T_q, T_k) -> (B*H, T_q, T_k)
