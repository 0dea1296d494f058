"""Efficient (mostly approximate) attention, each a module with one signature:

    variant(q, k, v, is_causal=False) -> output       q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv)

    exact        softmax attention: the reference
    local        sliding window of w keys (exact within its window: a band of the contract)
    strided      Sparse Transformer, strided pattern (Child et al. 2019): the last c keys, and every
                 c-th key before them; causal; block-sparse, ~O(T sqrt T) work for c ~ sqrt T
    fixed        Sparse Transformer, fixed pattern: the query's own block of c keys, and the last
                 ``summary`` keys of every earlier block; causal
    linformer    keys and values projected along the sequence to k rows by learned E, F (k, n_max)
    nystrom      Nystromformer: segment-mean landmarks, softmax kernels through a Moore-Penrose
                 pseudo-inverse computed by iteration
    linear       linear attention, phi = elu + 1; causal by a chunked prefix sum, O(T D^2)
    performer    FAVOR+: positive orthogonal random features (redrawable), then linear attention

The ones with exact limits reach them: strided/fixed with a pattern covering every key, nystrom
with as many landmarks as keys, linformer with identity projections and k = n, local with w >= T.
Variants that take only causal masks raise on is_causal when they have no causal form. Their
exact parts (exact, local, the block-sparse patterns' parts) are calls of mha.kernels.dispatch,
which chooses the backend: the variants write no choice of their own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checks, positions
from .kernels import Contract, attention, dispatch, merge_attention
from .kernels.dispatch import attention_with_lse
from .positions import CAUSAL, Band

_CAUSAL = Contract(band=CAUSAL)

__all__ = ["Exact", "Local", "Strided", "Fixed", "Linformer", "Nystrom", "LinearAttention", "Performer",
           "VARIANTS", "make"]


class Exact(nn.Module):
    """Softmax attention itself (the dispatch's choice of backend): the reference of the variants."""

    def forward(self, q, k, v, is_causal=False):
        return attention(q, k, v, Contract(band=positions.band(is_causal)))[0]


class Local(nn.Module):
    """Each query sees the ``window`` keys before it and itself (causal), or ``window`` on each side."""

    def __init__(self, window: int = 128):
        super().__init__()
        self.window = _checks.positive_int("window", window)

    def forward(self, q, k, v, is_causal=False):
        band = Band(self.window, 0 if is_causal else self.window)
        offset = positions.offset_of("bottom_right", q.shape[-2], k.shape[-2])
        return attention(q, k, v, Contract(band=band, offset=offset))[0]


def _causal_only(name: str, is_causal: bool, q: Tensor, k: Tensor) -> None:
    if not is_causal:
        raise ValueError(f"the {name} pattern is defined for causal (autoregressive) attention: pass is_causal=True")
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"{name} attention is self-attention: query and key lengths must match, "
                         f"got {q.shape[-2]} and {k.shape[-2]}")


def _unrecorded(name: str) -> None:
    """The sparse patterns merge parts of each row's softmax computed apart: no call sees a whole row,
    so a watcher (mha.capture_attention, mha.explorer.record) would record parts. Refused by name."""
    if dispatch.OBSERVERS:
        raise ValueError(f"the {name} variant cannot be recorded (mha.capture_attention, mha.explorer.record): it "
                         "merges parts of each row's softmax computed apart, and no call sees a whole row")


def _blocks(x: Tensor, c: int) -> Tensor:
    """(..., T, D) -> (..., T/c, c, D), zero-padding T up to a multiple of c (padding comes last,
    so causal queries never see it)."""
    x = F.pad(x, (0, 0, 0, -x.shape[-2] % c))
    return x.unflatten(-2, (-1, c))  # (..., T, D) -> (..., n_blocks, c, D)


class Strided(nn.Module):
    """Query i sees keys i-c < j <= i (local) and j = i - c, i - 2c, ... (strided)."""

    def __init__(self, stride: int = 64):
        super().__init__()
        self.stride = _checks.positive_int("stride", stride)

    def forward(self, q, k, v, is_causal=True):
        _causal_only("strided", is_causal, q, k)
        _unrecorded("strided")
        T, c = q.shape[-2], self.stride
        local, lse_local = attention_with_lse(q, k, v, Contract(band=Band(c - 1, 0)))
        # strided: position p = a*c + r; query (a, r) sees keys (a', r) with a' < a
        qb, kb, vb = _blocks(q, c), _blocks(k, c), _blocks(v, c)  # (B, H, A, c, D)
        column = lambda x: x.transpose(-2, -3)  # noqa: E731  (B, H, A, c, D) -> (B, H, c, A, D): residue-major
        out, lse = attention_with_lse(column(qb), column(kb), column(vb), Contract(band=Band(None, -1)))
        unblock = lambda x: column(x).flatten(-3, -2)[..., :T, :]  # noqa: E731  (B, H, c, A, D) -> (B, H, T, D)
        strided = unblock(out)
        lse_strided = column(lse.unsqueeze(-1)).flatten(-3, -2)[..., :T, 0]  # (B, H, c, A) -> (B, H, T)
        merged, _ = merge_attention(local, lse_local, strided, lse_strided)
        return merged


class Fixed(nn.Module):
    """Query i sees its own block's keys up to i, and the last ``summary`` keys of each earlier block."""

    def __init__(self, block: int = 64, summary: int = 1):
        super().__init__()
        self.block = _checks.positive_int("block", block)
        self.summary = _checks.positive_int("summary", summary)
        if summary > block:
            raise ValueError(f"summary={summary} cannot exceed block={block}")

    def forward(self, q, k, v, is_causal=True):
        _causal_only("fixed", is_causal, q, k)
        _unrecorded("fixed")
        T, c, t = q.shape[-2], self.block, self.summary
        qb, kb, vb = _blocks(q, c), _blocks(k, c), _blocks(v, c)  # (B, H, A, c, D)
        own, lse_own = attention_with_lse(qb, kb, vb, _CAUSAL)  # causal within each block
        own, lse_own = own.flatten(-3, -2)[..., :T, :], lse_own.flatten(-2)[..., :T]  # (B, H, T, ...)
        summary_k, summary_v = kb[..., c - t:, :].flatten(-3, -2), vb[..., c - t:, :].flatten(-3, -2)  # (B, H, A*t, D)
        query_block = torch.arange(T, device=q.device) // c
        key_block = torch.arange(summary_k.shape[-2], device=q.device) // t
        earlier = key_block[None, :] < query_block[:, None]  # (T, A*t) bool: summaries of earlier blocks only
        summary, lse_summary = attention_with_lse(q, summary_k, summary_v, Contract(mask=earlier))
        merged, _ = merge_attention(own, lse_own, summary, lse_summary)
        return merged


class Linformer(nn.Module):
    """K' = E K, V' = F V: keys and values projected along the sequence to ``k`` rows (Wang et al. 2020).

    E, F (k, max_length) are learned (initialised as scaled Gaussians); sequences up to max_length.
    """

    def __init__(self, max_length: int, k: int = 64, share: bool = False):
        super().__init__()
        self.max_length = _checks.positive_int("max_length", max_length)
        self.k = _checks.positive_int("k", k)
        self.E = nn.Parameter(torch.randn(k, max_length) / math.sqrt(k))
        self.F = self.E if share else nn.Parameter(torch.randn(k, max_length) / math.sqrt(k))

    def forward(self, q, k, v, is_causal=False):
        if is_causal:
            raise ValueError("Linformer mixes all positions along the sequence: it has no causal form")
        S = k.shape[-2]
        if S > self.max_length:
            raise ValueError(f"Linformer was built for sequences up to max_length={self.max_length}, got {S}")
        k_proj = torch.einsum("kn,bhnd->bhkd", self.E[:, :S].to(k.dtype), k)  # (B, H, k, D)
        v_proj = torch.einsum("kn,bhnd->bhkd", self.F[:, :S].to(v.dtype), v)
        return attention(q, k_proj, v_proj, None)[0]  # (B, H, L, Dv)


def iterative_pinv(a: Tensor, iterations: int = 6) -> Tensor:
    """Moore-Penrose pseudo-inverse of a batch of square matrices by the iteration of Razavi et
    al. (2014) that Nystromformer uses: Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    scale = a.abs().sum(-2).amax(-1, keepdim=True) * a.abs().sum(-1).amax(-1, keepdim=True)  # |A|_1 |A|_inf
    z = a.transpose(-1, -2) / scale[..., None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


class Nystrom(nn.Module):
    """softmax(Q K^T) V ~ softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V (Xiong et al. 2021),
    Q~, K~ the means of ``landmarks`` segments. ``pinv_iterations=None``: torch.linalg.pinv."""

    def __init__(self, landmarks: int = 64, pinv_iterations: int | None = 6):
        super().__init__()
        self.landmarks = _checks.positive_int("landmarks", landmarks)
        self.pinv_iterations = pinv_iterations

    def forward(self, q, k, v, is_causal=False):
        if is_causal:
            raise ValueError("Nystromformer's landmarks summarise the whole sequence: it has no causal form")
        scale = q.shape[-1] ** -0.5
        q_l, k_l = (self._segment_means(x) for x in (q, k))  # (B, H, m, D)
        kernel_1 = torch.softmax(q @ k_l.transpose(-1, -2) * scale, -1)  # (B, H, L, m)
        kernel_2 = torch.softmax(q_l @ k_l.transpose(-1, -2) * scale, -1)  # (B, H, m, m)
        kernel_3 = torch.softmax(q_l @ k.transpose(-1, -2) * scale, -1)  # (B, H, m, S)
        inverse = (torch.linalg.pinv(kernel_2) if self.pinv_iterations is None
                   else iterative_pinv(kernel_2, self.pinv_iterations))
        return kernel_1 @ (inverse @ (kernel_3 @ v))

    def _segment_means(self, x: Tensor) -> Tensor:
        T, D = x.shape[-2:]
        m = min(self.landmarks, T)
        segments = x.transpose(-1, -2).reshape(-1, D, T)  # (..., T, D) -> (N, D, T), any number of leading dims
        return F.adaptive_avg_pool1d(segments, m).reshape(*x.shape[:-2], D, m).transpose(-1, -2)  # (..., m, D)


def _linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, is_causal: bool, chunk: int = 128,
                      key_shift: Tensor | None = None) -> Tensor:
    """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j), over all j or j <= i (chunked prefix).

    Causal features may be given each in its own scale: phi_k[j] = phi(k_j) e^(-key_shift[j])
    with key_shift (B, H, T) non-decreasing along T (a running max). Query i then reads every
    key j <= i at the common scale e^(-key_shift[i]) (the ratio does not depend on it), so that no
    future key changes a past row and no feature overflows.
    """
    if not is_causal:
        kv = phi_k.transpose(-1, -2) @ v  # (B, H, m, Dv)
        normaliser = phi_q @ phi_k.sum(-2, keepdim=True).transpose(-1, -2)  # (B, H, L, 1)
        return (phi_q @ kv) / normaliser.clamp_min(torch.finfo(normaliser.dtype).tiny)
    if key_shift is None:
        key_shift = phi_k.new_zeros(phi_k.shape[:-1])  # (B, H, T): one scale for all
    state = phi_k.new_zeros(*phi_k.shape[:-2], phi_k.shape[-1], v.shape[-1])  # (B, H, m, Dv): sum of phi(k) v^T so far
    total = phi_k.new_zeros(*phi_k.shape[:-2], 1, phi_k.shape[-1])  # (B, H, 1, m): sum of phi(k) so far
    scale = torch.full_like(key_shift[..., :1], float("-inf"))  # (B, H, 1): the scale state and total are at
    outputs = []
    for start in range(0, phi_q.shape[-2], chunk):
        pq, pk, vc = (x[..., start:start + chunk, :] for x in (phi_q, phi_k, v))
        shift = key_shift[..., start:start + chunk]  # (B, H, c)
        rescale = (shift[..., None, :] - shift[..., :, None]).clamp_max(0).exp()  # (B, H, c, c): e^(shift_j - shift_i), j <= i
        within = ((pq @ pk.transpose(-1, -2)) * rescale).tril()  # this chunk's earlier keys and itself
        carried = (scale - shift).exp()[..., None]  # (B, H, c, 1): the state at each query's scale
        numerator = within @ vc + carried * (pq @ state)
        denominator = within.sum(-1, keepdim=True) + carried * (pq @ total.transpose(-1, -2))
        outputs.append(numerator / denominator.clamp_min(torch.finfo(denominator.dtype).tiny))
        end = shift[..., -1:]  # (B, H, 1): the chunk's last scale, the largest
        to_end = (shift - end).exp()[..., None] * pk  # (B, H, c, m): this chunk's features at that scale
        carry = (scale - end).exp()[..., None]  # (B, H, 1, 1)
        state = carry * state + to_end.transpose(-1, -2) @ vc
        total = carry * total + to_end.sum(-2, keepdim=True)
        scale = end
    return torch.cat(outputs, dim=-2)


class LinearAttention(nn.Module):
    """Katharopoulos et al. (2020): phi(x) = elu(x) + 1 in place of exp(q.k)."""

    def __init__(self, chunk: int = 128):
        super().__init__()
        self.chunk = _checks.positive_int("chunk", chunk)

    def forward(self, q, k, v, is_causal=False):
        return _linear_attention(F.elu(q) + 1, F.elu(k) + 1, v, is_causal, self.chunk)


class Performer(nn.Module):
    """FAVOR+ (Choromanski et al. 2021): exp(q.k / sqrt(D)) ~ phi(q).phi(k) with positive random
    features phi(x) = exp(w.x - |x|^2 / 2) / sqrt(m), w orthogonal Gaussian; ``redraw()`` resamples."""

    def __init__(self, head_dim: int, features: int = 256, chunk: int = 128, generator_seed: int | None = None):
        super().__init__()
        self.head_dim = _checks.positive_int("head_dim", head_dim)
        self.features = _checks.positive_int("features", features)
        self.chunk = _checks.positive_int("chunk", chunk)
        self.generator = torch.Generator()
        if generator_seed is not None:
            self.generator.manual_seed(generator_seed)
        self.register_buffer("projection", self._draw())

    def _draw(self) -> Tensor:
        """(features, head_dim): blocks of orthogonal rows, each scaled by a chi-distributed norm."""
        blocks, d = [], self.head_dim
        for _ in range(math.ceil(self.features / d)):
            gaussian = torch.randn(d, d, generator=self.generator)
            orthogonal, r = torch.linalg.qr(gaussian)
            # QR's sign convention ties each column's sign to the data (its first column always points
            # away from the first axis); fixing R's diagonal positive makes the basis uniformly random,
            # which the estimator's unbiasedness needs
            orthogonal = orthogonal * torch.sign(torch.diagonal(r))  # (d, d) columns, Haar-distributed
            blocks.append(orthogonal.T)
        rows = torch.cat(blocks)[: self.features]
        norms = torch.randn(self.features, d, generator=self.generator).norm(dim=1, keepdim=True)
        return rows * norms

    def redraw(self) -> None:
        self.projection = self._draw().to(self.projection.device)

    def _log_features(self, x: Tensor) -> Tensor:
        """(B, H, T, m): w.x' - |x'|^2 / 2 with x' = x / D^(1/4), so exp(q.k / sqrt(D)) = E exp(log phi(q) + log phi(k))."""
        x = x * self.head_dim ** -0.25
        return x @ self.projection.to(x.dtype).T - (x * x).sum(-1, keepdim=True) / 2  # (B, H, T, m)

    def forward(self, q, k, v, is_causal=False):
        norm = self.features ** -0.5
        log_q, log_k = self._log_features(q), self._log_features(k)
        phi_q = torch.exp(log_q - log_q.amax(-1, keepdim=True).detach()) * norm  # a per-row scale cancels
        if is_causal:  # each key at the running max of the keys so far: nothing depends on a later key
            shift = log_k.amax(-1).cummax(-1).values.detach()  # (B, H, T)
            phi_k = torch.exp(log_k - shift[..., None]) * norm
            return _linear_attention(phi_q, phi_k, v, True, self.chunk, key_shift=shift)
        phi_k = torch.exp(log_k - log_k.amax((-1, -2), keepdim=True).detach()) * norm  # one scale for all keys
        return _linear_attention(phi_q, phi_k, v, False, self.chunk)


VARIANTS = {"exact": Exact, "local": Local, "strided": Strided, "fixed": Fixed, "linformer": Linformer,
            "nystrom": Nystrom, "linear": LinearAttention, "performer": Performer}


def make(name: str, **options) -> nn.Module:
    """A variant by name, e.g. make("performer", head_dim=64, features=256)."""
    _checks.one_of("attention", name, sorted(VARIANTS))
    return VARIANTS[name](**options)
