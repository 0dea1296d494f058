"""How fast this CPU's threads read memory by stream count: the ceiling a decoding step reads under.

    python benchmarks/read_streams.py [MiB]        # a buffer of MiB (default 512: past every cache)

A decoding step reads its cache once (docs/native.md, "Decoding"); `mha bench` judges it against
torch's sum over the same bytes, one stream a thread. This times, in interleaved rounds on one
buffer at the thread count in use, torch's int64 sum and a plain loop of 64-bit adds (each thread
its own share) read as N streams at once: the share cut into N parts, read a tile of each in turn
(what a step does with two, its keys' and its values' tiles), every line asked for 8 KiB ahead into
the second-level cache as the native kernel asks for its rows (or not at all: "hardware only").
Each figure is the median's GB/s and the median of its rounds' ratios to torch's sum. More streams
in flight a thread read faster, and most when the memory is fast: on 2 Zen 4 threads, in runs
minutes apart, eight streams read 1.02-1.50x torch's sum and two in 4 KiB tiles 1.03-1.25x, while
two in 64 KiB tiles (a decoding step's tiles of 256 keys) read as one, and prefetching further
ahead does not help one stream (docs/native.md, "What the read is worth"). The last rows read
128 KiB runs one after another, each cut in 4 or 8 streams read 256 bytes of each in turn, each
stream asked for ahead into the same stream of the next run: a decoding step's tiles of keys (of 16
bits or more) since issue 44's twelfth stop (docs/native.md, "Streams"). Compiles a small
extension with torch's tooling.
"""

import argparse
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <chrono>
#include <cstring>

// The 64-bit sum of ``bytes`` bytes (a multiple of 256) at p, a line a vector, four lines a step, each
// line's counterpart at ``asked`` asked for as it is read (none where asked is null).
typedef int64_t Line __attribute__((vector_size(64)));
static int64_t tile_sum(const int64_t* p, int64_t bytes, const char* asked) {
  const char* at = reinterpret_cast<const char*>(p);
  Line a[4] = {};
  for (int64_t off = 0; off < bytes; off += 256) {
    for (int i = 0; i < 4; ++i) {
      if (asked != nullptr) __builtin_prefetch(asked + off + 64 * i, 0, 2);
      Line x;
      std::memcpy(&x, at + off + 64 * i, sizeof x);
      a[i] += x;
    }
  }
  const Line s = a[0] + a[1] + a[2] + a[3];
  return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

// Each thread's share of x read run by run (``run`` bytes each; 0: the share is one run), each run as
// ``streams`` parts read ``tile`` bytes of each in turn, every line ``ahead`` bytes further in its part
// asked for as it is read (past a part's end, in the same part of the next run; 0: none). Runs of 128 KiB
// are a decoding step's tiles of keys in streams (the native kernel's in_key_blocks): (seconds, bytes read).
std::tuple<double, int64_t> read_runs(const torch::Tensor& x, int64_t streams, int64_t tile, int64_t run, int64_t ahead) {
  const int64_t bytes = x.numel() * 8, threads = at::get_num_threads();
  const int64_t whole = streams * tile, share = bytes / threads / whole * whole;
  if (run == 0) run = share;
  TORCH_CHECK(share > 0 && share % run == 0 && run % whole == 0 && tile % 256 == 0, "a buffer of ", bytes,
              " bytes holds no runs of ", run, " bytes cut in ", streams, " parts of whole tiles of ", tile,
              " bytes (of 256-byte steps) for each of ", threads, " threads: give more MiB");
  const int64_t part = run / streams;
  const int64_t* base = x.data_ptr<int64_t>();
  std::vector<int64_t> sums(threads);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const char* own = reinterpret_cast<const char*>(base + t * share / 8);
      int64_t total = 0;
      for (int64_t first = 0; first < share; first += run)
        for (int64_t at = 0; at < part; at += tile) {
          const int64_t near = std::min(ahead, part), reach = at + near < part ? near : near + run - part;
          for (int64_t s = 0; s < streams; ++s) {
            const char* tile_at = own + first + s * part + at;
            total += tile_sum(reinterpret_cast<const int64_t*>(tile_at), tile, ahead > 0 ? tile_at + reach : nullptr);
          }
        }
      sums[t] = total;
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  TORCH_CHECK(sums[0] != -1, "unreachable");  // keeps the sums
  return {seconds, share * threads};
}
"""

# (name, streams, tile bytes, bytes ahead: 0 for no software prefetch): each thread's share one run
WAYS = [("1 stream, hardware only", 1, 65536, 0), ("1 stream", 1, 65536, 8192), ("1 stream, 64 KiB ahead", 1, 65536, 65536),
        ("2 streams, 64 KiB tiles", 2, 65536, 8192), ("2 streams, 4 KiB tiles", 2, 4096, 8192),
        ("4 streams, 4 KiB tiles", 4, 4096, 8192), ("8 streams, 4 KiB tiles", 8, 4096, 8192),
        ("8 streams, hardware only", 8, 4096, 0)]
# (name, streams, tile bytes, run bytes, bytes ahead): runs read one after another, each as streams side by side
RUNS = [("4 streams in 128 KiB runs", 4, 256, 131072, 8192), ("8 streams in 128 KiB runs", 8, 256, 131072, 8192)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mib", type=int, nargs="?", default=512)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    reader = load_inline("mha_read_streams", cpp_sources=SOURCE, functions=["read_runs"],
                         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    x = torch.ones(args.mib * 2 ** 20 // 8, dtype=torch.int64)
    calls = {"torch int64 sum": lambda: (_seconds(x.sum), x.numel() * 8)}
    calls.update({name: (lambda s=s, t=t, a=a: reader.read_runs(x, s, t, 0, a)) for name, s, t, a in WAYS})
    calls.update({name: (lambda s=s, t=t, r=r, a=a: reader.read_runs(x, s, t, r, a)) for name, s, t, r, a in RUNS})
    rates = {name: [] for name in calls}  # bytes per second, each round
    for call in calls.values():
        call()
    for _ in range(args.rounds):
        for name, call in calls.items():
            seconds, nbytes = call()
            rates[name].append(nbytes / seconds)
    print(f"{args.mib} MiB, {torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds")
    for name, rate in rates.items():
        ratio = statistics.median(a / b for a, b in zip(rate, rates["torch int64 sum"]))
        print(f"{name:26s} {statistics.median(rate) / 1e9:6.1f} GB/s, {ratio:.2f}x torch's sum")


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
