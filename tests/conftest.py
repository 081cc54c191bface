"""Test-session settings: one intra-op thread, no GPU whatever the torch build, the ``fresh_seed`` fixture, the
``distributed`` marker."""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterator

import pytest
import torch
import tqdm

# Tests fork worker processes (Lightning's "fork" launcher, lightning_fpdt.testing). A process that has
# already run a parallel OpenMP region cannot fork safely: the child's thread pool is gone and its
# first parallel matmul can block forever. One intra-op thread in the parent avoids that; the tests
# are small, so nothing is lost.
torch.set_num_threads(1)
# Lightning's launchers set torch's threads to cores / processes in the launching process unless OMP_NUM_THREADS
# is set (lightning.fabric.utilities.distributed._set_num_threads_if_needed): an in-process fit would turn the
# pytest process multi-threaded, and every rank forked after it could hang in its first parallel kernel.
os.environ["OMP_NUM_THREADS"] = "1"
# Threads of the data stack that hold a lock now and then: a process forked at such a moment blocks on that lock
# forever (seen: a rank of test_export's fixture in futex wait inside torch.save, a CLI child inside jsonargparse).
# pyarrow's jemalloc starts a background thread when it loads (datasets imports it): off, before anything imports
# pyarrow; tqdm's monitor thread (datasets' progress bars) wakes every 10 s under tqdm's lock: not started;
# tokenizers' thread pool: off in this process (its children turn it off themselves).
os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
tqdm.tqdm.monitor_interval = 0

# The suite runs on the CPU, whatever torch build and hardware it finds. On a CUDA build of torch (what `pip install
# torch` gives) without a driver, torch.cuda.is_available() and device_count() (Lightning's Trainer asks) fall back to
# the CUDA runtime, which marks every process forked afterwards as unable to use CUDA, and Lightning's fork launcher
# refuses to start in such a process ("Cannot re-initialize CUDA in forked subprocess"): 40 tests on torch
# 2.15.0+cu132. With no device visible and the count taken NVML's way, torch answers 0 from the variable alone.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"

SEED_VARIABLE = "FPDT_TEST_SEED"


@pytest.fixture(autouse=True)
def fork_safe_test_process() -> Iterator[None]:
    """Keep the pytest process safe to fork after each test: one intra-op thread (see above), no process group, and
    the environment as it was.

    Destroys a process group a test left in the pytest process (an in-process ``Trainer.fit`` under a DDP-style
    strategy initializes one and Lightning keeps it). A rank forked later would inherit it, and freeing a gloo
    group whose threads did not survive the fork blocks forever (seen: ``init_process_group`` in a forked rank
    hung in ``~ProcessGroupGloo``). Restores the environment variables: Lightning's ``popen`` launcher writes
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` and others into the process it runs in (even for one device), and
    a later test's ``fpdt-train`` subprocess on two devices inherited them and waited for a rank nobody started (seen:
    ``test_fit_logs_to_tensorboard_and_profiles`` timing out after an in-process one-device fit)."""
    environment = dict(os.environ)
    yield
    for name in set(os.environ) - set(environment):
        del os.environ[name]
    os.environ.update(environment)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        gc.collect()  # its groups freed here, where their threads run, never in a forked child (testing._after_fork)
    if torch.get_num_threads() != 1:  # see the top of this file; too late for forks already made, not for later ones
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_gpu_questions(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cuDNN and no compute capability unless a test pretends them (``tests/test_cudnn_route.py``'s ``gpu``
    fixture): tests pretend CUDA with ``device_type="cuda"`` and meta tensors, and on a CUDA build
    ``attention_backend="auto"`` there asked the real machine (without a GPU the question raised, and its attempt
    to start CUDA made every later fork unusable, as above). Module-scoped fixtures run before it: none asks."""

    def ask_the_test(*args: object) -> tuple[int, int]:
        raise AssertionError("a test asked the CUDA runtime for a compute capability: pretend one with monkeypatch")

    monkeypatch.setattr(torch.cuda, "get_device_capability", ask_the_test)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)


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
