"""The suite on every core (the README's ``-n auto``): each pytest-xdist worker takes its share of
torch's threads (tests/conftest.py), so that the workers do not crowd each other's cores."""

import pytest

from helpers.threads import worker_share


@pytest.mark.parametrize("threads, environ, share", [
    (2, {"PYTEST_XDIST_WORKER_COUNT": "2"}, 1),
    (16, {"PYTEST_XDIST_WORKER_COUNT": "2"}, 8),
    (16, {"PYTEST_XDIST_WORKER_COUNT": "16"}, 1),
    (2, {"PYTEST_XDIST_WORKER_COUNT": "3"}, 1),  # more workers than threads: one each
    (16, {"PYTEST_XDIST_WORKER_COUNT": "1"}, None),  # one worker: torch's count
    (16, {}, None),  # not a parallel run
    (16, {"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "3"}, None),  # the user's count is kept
])
def test_a_worker_takes_its_share_of_the_threads(threads, environ, share):
    assert worker_share(threads, environ) == share
