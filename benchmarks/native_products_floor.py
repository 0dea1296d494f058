"""The floor of the native kernel's bfloat16 forward: its tile products alone, no softmax.

    python benchmarks/native_products_floor.py [T ...]

Times, beside torch's SDPA on the same shape (B1 H8 D64, bfloat16), the brgemm calls the native
kernel makes at length T (per head, per 64-row block, per 256-key tile: scores 64 x 256 x 64 and
values 64 x 64 x 256, VNNI-packed operands) with nothing between them: what the forward would cost
if its softmax were free (docs/native.md). Compiles a small extension with torch's tooling.
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <chrono>

double products_ms(int64_t T, int repeat) {
  const int64_t H = 8, D = 64, BQ = 64, BK = 256, blocks = T / BQ, tiles = T / BK;
  std::vector<at::BFloat16> kt(H * tiles * D * BK, at::BFloat16(0.01f)), vv(H * tiles * BK * D, at::BFloat16(0.01f));
  double best = 1e9;
  for (int rep = 0; rep < repeat; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    at::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<at::BFloat16> q(BQ * D, at::BFloat16(0.01f)), p(BQ * BK, at::BFloat16(0.01f));
      std::vector<float> s(BQ * BK), acc(BQ * D);
      for (int64_t task = begin; task < end; ++task)
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const int64_t offset = (task / blocks * tiles + tile) * D * BK;  // this head's tile
          at::native::cpublas::brgemm(BQ, BK, D, D, BK, BK, false, q.data(), kt.data() + offset, s.data(), true);
          at::native::cpublas::brgemm(BQ, D, BK, BK, D, D, true, p.data(), vv.data() + offset, acc.data(), true);
        }
    });
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best * 1e3;
}
"""


def main(lengths):
    floor = load_inline("mha_native_products_floor", cpp_sources=SOURCE, functions=["products_ms"],
                        extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])
    for T in lengths:
        q, k, v = (torch.randn(1, 8, T, 64, dtype=torch.bfloat16) for _ in range(3))
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)
            torch_ms = min(_ms(lambda: F.scaled_dot_product_attention(q, k, v)) for _ in range(3))
        products = floor.products_ms(T, 3)
        print(f"T{T}: products alone {products:.1f} ms ({4 * 8 * T * T * 64 / products / 1e6:.0f} GFLOP/s), "
              f"torch SDPA {torch_ms:.1f} ms: products / torch = {products / torch_ms:.3f}")


def _ms(fn):
    import time
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [1024, 4096])
