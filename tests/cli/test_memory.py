"""Memory of every default path, each measured in a fresh process (peak RSS growth of one call):
none builds an L x S tensor. The same cases are reported at T = 8192 by `mha bench --sections memory`."""

import subprocess
import sys

import pytest

from mha.tools import bench, bench_memory

pytestmark = pytest.mark.slow  # every case in fresh processes

T = 2048
DENSE_MIB = bench_memory.HEADS * T * T * 4 / 2 ** 20  # one float32 score matrix per head: 128 MiB
CASES = [name for name, (_, baseline) in bench_memory.MEMORY_CASES.items() if baseline is not None]


@pytest.mark.parametrize("name", CASES)
def test_a_default_path_holds_no_score_matrix(name):
    growth, _ = bench.fresh_memory_case(name, T)
    torch_growth, _ = bench.fresh_memory_case(bench_memory.MEMORY_CASES[name][1], T)
    assert growth <= 3 * torch_growth + 8, f"{name}: {growth:.1f} MiB against torch's {torch_growth:.1f} MiB"
    assert growth < DENSE_MIB / 2, f"{name}: {growth:.1f} MiB, a dense score matrix is {DENSE_MIB:.0f} MiB"


def test_the_measurement_sees_a_score_matrix():
    """The measurement can fail: the math backend (which must build the scores) is caught. Measured
    in a fresh process like the cases above: in this one, earlier tests have already raised the peak
    RSS, which hides part of the growth."""
    code = ("from mha.tools import bench_memory as b; "
            "b.MEMORY_CASES['math causal'] = (lambda T: b._functional_case(T, is_causal=True, backend='math'), None); "
            f"print(b.memory_case('math causal', {T})[0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(done.stdout) > DENSE_MIB / 2
