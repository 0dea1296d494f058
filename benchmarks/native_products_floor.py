"""The floor of the native kernel's forward: its tile products alone, no softmax.

    python benchmarks/native_products_floor.py [T ...]                  # bfloat16 (VNNI pairs)
    python benchmarks/native_products_floor.py --dtype float32 [T ...]

Times, beside torch's SDPA on the same shape (B1 H8 D64), the brgemm calls the native kernel makes
at length T (per head, per 64-row block, per 256-key tile: scores 64 x 256 x 64 and values
64 x 64 x 256; bfloat16 operands VNNI-packed, float32 ones as they are) with nothing between them:
what the forward would cost if its softmax were free, and its rate as a fraction of this CPU's
limit for the dtype at the thread count in use (`mha bench --sections peaks`'s). A forward built
of these products and a separate softmax stays below that fraction (docs/native.md). Compiles a
small extension with torch's tooling.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

from mha.tools import bench_peaks

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <chrono>

template <typename T>
double products_ms_of(int64_t length, int repeat, bool vnni) {
  const int64_t H = 8, D = 64, BQ = 64, BK = 256, blocks = length / BQ, tiles = length / BK;
  std::vector<T> kt(H * tiles * D * BK, T(0.01f)), vv(H * tiles * BK * D, T(0.01f));
  double best = 1e9;
  for (int rep = 0; rep < repeat; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    at::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> q(BQ * D, T(0.01f)), p(BQ * BK, T(0.01f));
      std::vector<float> s(BQ * BK), acc(BQ * D);
      for (int64_t task = begin; task < end; ++task)
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const int64_t offset = (task / blocks * tiles + tile) * D * BK;  // this head's tile
          at::native::cpublas::brgemm(BQ, BK, D, D, BK, BK, false, q.data(), kt.data() + offset, s.data(), vnni);
          at::native::cpublas::brgemm(BQ, D, BK, BK, D, D, true, p.data(), vv.data() + offset, acc.data(), vnni);
        }
      if (vnni) at::native::cpublas::brgemm_release(true);
    });
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best * 1e3;
}

double products_ms(int64_t length, int64_t repeat, bool bfloat16) {
  return bfloat16 ? products_ms_of<at::BFloat16>(length, repeat, true) : products_ms_of<float>(length, repeat, false);
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lengths", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    floor = load_inline("mha_native_products_floor", cpp_sources=SOURCE, functions=["products_ms"],
                        extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])
    dtype = getattr(torch, args.dtype)
    name, limit = bench_peaks.limit_of("bf16" if dtype == torch.bfloat16 else "fp32", bench_peaks.current())
    print(f"{args.dtype}, {torch.get_num_threads()} threads; the limit: {name} {limit:.0f}")
    for T in args.lengths:
        q, k, v = (torch.randn(1, 8, T, 64, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)
            torch_ms = min(_ms(lambda: F.scaled_dot_product_attention(q, k, v)) for _ in range(3))
        products = floor.products_ms(T, 3, dtype == torch.bfloat16)
        rate = 4 * 8 * T * T * 64 / products / 1e6
        print(f"T{T}: products alone {products:.1f} ms ({rate:.0f} GFLOP/s, {rate / limit:.2f} of the limit), "
              f"torch SDPA {torch_ms:.1f} ms: products / torch = {products / torch_ms:.3f}")


def _ms(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


if __name__ == "__main__":
    main()
