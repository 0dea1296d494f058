"""The native kernel of this tree against another revision's, in one process, interleaved.

    python scripts/kernel_ab.py                        # paged decoding against HEAD, 1 thread, S = 16384
    python scripts/kernel_ab.py --base 3de397d --threads 2 --keys 1024 16384
    python scripts/kernel_ab.py --heads 8 8 --dim 64    # decoding without GQA, at D = 64
    python scripts/kernel_ab.py --dense --keys 1024     # decoding from a (B, Hkv, S, D) cache (the forward of one row)
    python scripts/kernel_ab.py --forward 1024 4096    # the forward (B1 H8 D64, causal and not) instead
    python scripts/kernel_ab.py --backward 2048        # the backward (B1 H8 D64, causal) instead
    python scripts/kernel_ab.py --read --keys 65536    # decoding, each kernel also as a fraction of a read of its bytes
    python scripts/kernel_ab.py --forward 4096 --square-heads 1   # the forward of one head (B1 H1 D64)
    python scripts/kernel_ab.py --forward 1024 --only bfloat16      # only the calls whose names start so

A kernel change measured in two processes on a shared machine compares two machines (its speed
drifts 2x between runs here): this builds the base revision's csrc/native.cpp under another module
name (its ``Terms`` made module-local and its namespace its own, so that both load), then times each dtype's decoding call
(B sequences x 1 row, GQA 32 / 8 heads, D = 128 unless asked, one page per sequence: float32, bfloat16 and int8
pools, as mha bench's cache rows), or the forward (as mha bench's native rows), or the backward of a
causal forward (this tree's forward's saved rows, float32 and bfloat16: its dq), on both kernels,
alternately, and prints the median of the rounds' new/base ratios beside each one's best time, and
the outputs' largest difference. With --read, a decoding point's rounds also time torch's sum over the
same cache tensors (the bytes the step reads, in the same rounds: this machine's read rate drifts
10-20 % within minutes) and print each kernel's fraction of it (the median of read time / call time).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from mha.kernels import native, storage
from mha.tools.bench_native import read_call

SOURCE = "src/mha/kernels/csrc/native.cpp"


def base_kernel(revision: str):
    """The base revision's kernel, built once per revision in a folder of its own."""
    text = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], check=True, capture_output=True, text=True).stdout
    registration = 'pybind11::class_<mha_native::TermArgs>(m, "Terms",'
    if registration not in text:
        raise SystemExit(f"{revision}'s {SOURCE} registers no Terms class this script knows")
    text = text.replace(registration, registration + " pybind11::module_local(),")
    # a namespace of its own: a template's static locals (the workspaces) are unique symbols, which the
    # loader makes one object across both kernels (a crash once their types differed)
    text = text.replace("mha_native", "mha_native_base")
    folder = Path(tempfile.gettempdir()) / f"mha_kernel_ab_{revision}"
    folder.mkdir(exist_ok=True)
    (folder / "native_base.cpp").write_text(text)
    return load(name="mha_native_base", sources=[str(folder / "native_base.cpp")],
                extra_cflags=native._FLAGS[native.variant()], extra_ldflags=["-fopenmp"], build_directory=str(folder))


# Both kernels read the same tensors: with a draw each, two builds of one source read 1.06-1.09 apart
# on a float32 decoding step (2 Zen 3 threads, S = 8192), where one draw reads them alike.
@functools.cache
def decoding_inputs(S: int, B: int, Hq: int = 32, Hkv: int = 8, D: int = 128) -> tuple:
    """(pools by dtype: q, k, v and the 8-bit pools' scales, then the block table, cu_seqlens, lengths)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, D, generator=g)
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    (k8, k_scales), (v8, v_scales) = storage.split(storage.store(k, True)), storage.split(storage.store(v, True))
    pools = {"float32": (q, k, v, None, None), "bfloat16": (q.bfloat16(), k.bfloat16(), v.bfloat16(), None, None),
             "int8": (q, k8, v8, k_scales, v_scales), "int8, bfloat16 queries": (q.bfloat16(), k8, v8, k_scales, v_scales)}
    return pools, torch.arange(B)[:, None], torch.arange(B + 1), torch.full((B,), S)


def decoding_calls(kernel, S: int, B: int, Hq: int = 32, Hkv: int = 8, D: int = 128) -> dict:
    """Each pool dtype's paged_forward call on ``kernel``."""
    pools, table, cu, lengths = decoding_inputs(S, B, Hq, Hkv, D)
    terms = kernel.Terms()
    terms.scale = D ** -0.5
    return {name: (lambda q, k, v, ks, vs: lambda: kernel.paged_forward(q, k, v, table, cu, lengths, terms, ks, vs)[0])(
        *pool) for name, pool in pools.items()}


def cache_read(S: int, B: int, Hq: int = 32, Hkv: int = 8, D: int = 128, dense: bool = False) -> dict:
    """Each pool dtype's read of the bytes its decoding step reads (mha bench's read_call: torch's sum
    over its cache tensors' bytes as 64-bit words, an 8-bit pool's with their scales)."""
    pools = decoding_inputs(S, B, Hq, Hkv, D)[0]
    # an 8-bit pool's rows and scales are views of one stored tensor each (storage.split): read those
    return {name: read_call(*((k, v) if k_scales is None else (k._base, v._base)))
            for name, (_, k, v, k_scales, _) in pools.items() if not (dense and name.startswith("int8"))}


def dense_decoding_calls(kernel, S: int, B: int, Hq: int = 32, Hkv: int = 8, D: int = 128) -> dict:
    """The float32 and bfloat16 forward of one query row per head over a (B, Hkv, S, D) cache on ``kernel``."""
    pools = decoding_inputs(S, B, Hq, Hkv, D)[0]
    terms = kernel.Terms()
    terms.scale = D ** -0.5
    return {name: (lambda q, k, v: lambda: kernel.forward(q, k, v, terms, False)[0])(q.unsqueeze(2), k, v)
            for name, (q, k, v, _, _) in pools.items() if not name.startswith("int8")}


@functools.cache
def forward_inputs(T: int, dtype: torch.dtype, H: int = 8) -> tuple:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, H, T, 64, generator=g).to(dtype) for _ in range(3))


def forward_calls(kernel, T: int, H: int = 8) -> dict:
    """The forward of B1 H T D64, float32 and bfloat16, causal and not, on ``kernel``."""
    calls = {}
    for causal in (False, True):
        terms = kernel.Terms()
        terms.scale, terms.has_band, terms.right = 64 ** -0.5, causal, 0 if causal else terms.right
        for dtype in (torch.float32, torch.bfloat16):
            inputs = forward_inputs(T, dtype, H)
            name = f"{str(dtype)[6:]}{' causal' if causal else ''}"
            calls[name] = (lambda inputs, terms: lambda: kernel.forward(*inputs, terms, False)[0])(inputs, terms)
    return calls


def causal_terms(kernel):
    """``kernel``'s Terms of a causal call at D = 64."""
    terms = kernel.Terms()
    terms.scale, terms.has_band, terms.right = 64 ** -0.5, True, 0
    return terms


def backward_calls(kernel, T: int, H: int = 8) -> dict:
    """The backward of B1 H T D64's causal forward (made once by this tree's kernel), float32 and
    bfloat16, on ``kernel``: its dq."""
    calls = {}
    for dtype in (torch.float32, torch.bfloat16):
        inputs, saved, terms = forward_inputs(T, dtype, H), saved_rows(T, dtype, H), causal_terms(kernel)
        calls[str(dtype)[6:]] = (lambda inputs, saved, terms: lambda: kernel.backward(*inputs, *saved, terms)[0])(
            inputs, saved, terms)
    return calls


@functools.cache
def saved_rows(T: int, dtype: torch.dtype, H: int = 8) -> tuple:
    """(dO, row max, row sum, delta) of the causal forward on forward_inputs, by this tree's kernel."""
    kernel = native._kernel()
    out, row_max, row_sum = kernel.forward(*forward_inputs(T, dtype, H), causal_terms(kernel), True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    return grad, row_max, row_sum, (grad.float() * out.float()).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keys", type=int, nargs="+", default=[16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"), help="decoding's heads")
    parser.add_argument("--dim", type=int, default=128, help="decoding's head dim")
    parser.add_argument("--square-heads", type=int, default=8, help="the forward's and backward's heads")
    instead = parser.add_mutually_exclusive_group()
    instead.add_argument("--forward", type=int, nargs="+", metavar="T", help="time the forward at these T instead")
    instead.add_argument("--backward", type=int, nargs="+", metavar="T", help="time the causal backward at these T instead")
    parser.add_argument("--dense", action="store_true", help="decoding from a dense cache, not pages")
    parser.add_argument("--read", action="store_true", help="decoding: time a read of the same bytes in each round too")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="time only the calls whose names start so (float32, bfloat16, 'bfloat16 causal', int8, ...)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new, base = native._kernel(), base_kernel(args.base)
    if new is None:
        raise SystemExit("this tree's native kernel does not build here")
    square = args.forward or args.backward  # T x T attention, else decoding over S keys
    for S in square or args.keys:
        if square:
            make = forward_calls if args.forward else backward_calls
            ours, theirs = make(new, S, args.square_heads), make(base, S, args.square_heads)
        else:
            calls = dense_decoding_calls if args.dense else decoding_calls
            ours, theirs = (calls(kernel, S, args.batch, *args.heads, args.dim) for kernel in (new, base))
        reads = cache_read(S, args.batch, *args.heads, args.dim, dense=args.dense) if args.read and not square else {}
        reps = max(1, (30_000_000 if square else 1_000_000) // (S * (S if square else args.batch)))
        for name in ours:
            if args.only and not name.startswith(tuple(args.only)):
                continue
            difference = float((ours[name]().float() - theirs[name]().float()).abs().max())
            best, ratios, of_read = {"new": float("inf"), "base": float("inf"), "read": float("inf")}, [], {"new": [], "base": []}
            for round_ in range(args.rounds):
                took = {}
                pair = (("base", theirs[name]), ("new", ours[name])) + ((("read", reads[name]),) if name in reads else ())
                for which, call in (pair if round_ % 2 == 0 else pair[::-1]):  # neither always second
                    call()
                    start = time.perf_counter()
                    for _ in range(reps):
                        call()
                    took[which] = (time.perf_counter() - start) / reps
                    best[which] = min(best[which], took[which])
                ratios.append(took["new"] / took["base"])
                for which in of_read if name in reads else ():
                    of_read[which].append(took["read"] / took[which])
            shape = "" if square else f" Hq {args.heads[0]} Hkv {args.heads[1]} D {args.dim}{' dense' if args.dense else ''}"
            what = " backward causal" if args.backward else ""
            heads = f" H {args.square_heads}" if square else ""
            point = f"threads {args.threads} {'T' if square else 'S'} {S} B {args.batch}{heads}{shape} {name}{what}"
            print(f"{point}: base {best['base'] * 1e3:.3f} ms, "
                  f"new {best['new'] * 1e3:.3f} ms, new/base median {statistics.median(ratios):.3f}, "
                  f"largest difference {difference:.2g}"
                  + (f", of read: base {statistics.median(of_read['base']):.3f} new {statistics.median(of_read['new']):.3f}"
                     if name in reads else ""))


if __name__ == "__main__":
    main()
