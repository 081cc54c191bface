"""Test-session settings: one intra-op thread, the ``fresh_seed`` fixture, the ``distributed`` marker."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch

# Tests fork worker processes (Lightning's "fork" launcher, lightning_fpdt.testing). A process that has
# already run a parallel OpenMP region cannot fork safely: the child's thread pool is gone and its
# first parallel matmul can block forever. One intra-op thread in the parent avoids that; the tests
# are small, so nothing is lost.
torch.set_num_threads(1)

SEED_VARIABLE = "FPDT_TEST_SEED"


@pytest.fixture
def fresh_seed(request: pytest.FixtureRequest) -> int:
    """A seed drawn afresh for every run (so the inputs differ from run to run), shown when the test fails.

    ``FPDT_TEST_SEED=<n> pytest ...`` replays a failure with the seed it printed.
    """
    seed = int(os.environ.get(SEED_VARIABLE, random.SystemRandom().randrange(2**30)))
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    seeds = [value for key, value in item.user_properties if key == "seed"]
    if report.failed and seeds:
        report.sections.append(("random seed", f"{SEED_VARIABLE}={seeds[-1]} replays this test's inputs"))
