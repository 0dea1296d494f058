"""Hypothesis profiles: "ci" (small, used when CI is set), "dev" (default), "slow" and "thorough" (many
more examples: HYPOTHESIS_PROFILE=slow), and
"mutation" (HYPOTHESIS_PROFILE=mutation mutmut run: no shrinking, so a mutant that fails a property
is reported killed at once instead of timing out while hypothesis minimises its example).

The measured dispatch (mha.kernels.tuning) is pinned: no test measures at first use or reads the
user's cache (MHA_TUNE=off, MHA_TUNE_CACHE in a temporary folder, inherited by spawned processes),
and auto's crossovers are those of KNOWN's AVX-512-BF16 kind on every CPU, so that which backend
auto picks does not depend on the machine the tests run on. Tests marked ``measured_dispatch``
(tests/kernels/test_tuning.py) get the real lookup.

Run in parallel (the README's ``-n auto``: pytest-xdist, a worker per core), each worker takes its
share of torch's threads, so that the workers do not crowd each other's cores (measured on 2 cores:
the fast set in 144 s against 233 s in one process, 283 s with two workers of two threads each; a
floor of two threads for tests/kernels alone cost 46 s of it, test_native.py 3.7 -> 25 s, as the
kernel's threads waited on each other's descheduled cores). The kernel's splits among threads depend
on the thread count and are tested at set counts (1, 2, 3, 8: tests/kernels/test_native.py,
test_paged_native.py), whatever a worker's share."""

import os
import tempfile

import pytest
from hypothesis import HealthCheck, Phase, settings

os.environ["MHA_TUNE"] = "off"
os.environ["MHA_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="mha-tune-"), "tune.json")

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, derandomize=True, **_common)
settings.register_profile("dev", max_examples=100, **_common)
settings.register_profile("thorough", max_examples=2000, **_common)
settings.register_profile("slow", max_examples=1000, **_common)  # the property tests with many more examples
settings.register_profile("mutation", max_examples=50, derandomize=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate], **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(autouse=True)
def _pinned_dispatch(request, monkeypatch):
    if request.node.get_closest_marker("measured_dispatch") is None:
        from mha.kernels import tuning
        known = tuning.KNOWN["avx512_bf16"]
        monkeypatch.setattr(tuning, "crossovers", lambda dtype: known.get(dtype, tuning.NEVER))


def pytest_configure(config):
    import torch

    from helpers.threads import worker_share
    share = worker_share(torch.get_num_threads(), os.environ)
    if share is not None:
        torch.set_num_threads(share)
