"""How `make test` spreads the suite over pytest-xdist workers (`-n 2 --dist loadgroup`).

* Each worker gets its share of the cores as torch intra-op threads, and the entry scripts the tests
  start inherit it (OMP_NUM_THREADS): two workers at 2 threads each on 2 cores run slower than one.
* Tests run on one worker (an xdist group) when they share what a worker builds once: a module- or
  class-scoped fixture (grouped by module), a session fixture holding a result that several modules
  check (`SHARED_RESULTS`, grouped by its name), or a resource of the host (`SAME_WORKER`).
* `slow` tests are handed out first, so that the run does not end waiting for one of them.
* Every item has its own node id: xdist schedules by node id, and items that share one run once.
  schemathesis names its items one per API operation (tests/test_server_fuzz.py) but pytest 9.2
  builds their node ids from the function's name alone.

pytest 9.2 keeps a node id as a structured `NodeId`, so xdist's own group suffix (it sets
`item._nodeid`) no longer reaches the node id; `_set_node_id` writes it for both versions.
"""
from __future__ import annotations

import collections
import os

import pytest
import torch

# The sandbox's fork-bomb test bounds the host's process count, which the Ray cluster tests raise by
# dozens, and its timeout test looks for its marker in every host process, which the runs of
# tests/test_sandbox.py that test_task_envs and test_task_rootfs start also use: these modules share a worker.
SAME_WORKER = {m: "host-processes" for m in ("test_sandbox", "test_async_rl", "test_async_chaos", "test_task_envs",
                                               "test_task_rootfs")}
SHARED_RESULTS = ("tiny_cpt_losses",)  # session fixtures in tests/conftest.py


def split_cores() -> None:
    """In an xdist worker: torch threads (and OMP_NUM_THREADS for the processes tests start) = cores / workers."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def xdist_group(item) -> str | None:
    module = item.module.__name__.rsplit(".", 1)[-1]
    if module in SAME_WORKER:
        return SAME_WORKER[module]
    for name in SHARED_RESULTS:
        if name in item.fixturenames:
            return name
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if defs[-1].scope in ("class", "module", "package"):
            return module
    return None


def _set_node_id(item, nodeid: str) -> None:
    structured = getattr(item, "_id", None)
    if structured is not None and hasattr(type(structured), "parse"):  # pytest >= 9.2
        item._id = type(structured).parse(nodeid)
    else:
        item._nodeid = nodeid


def _unique_node_ids(items) -> None:
    counts = collections.Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1:
            _set_node_id(item, item.nodeid.rsplit("::", 1)[0] + "::" + item.name)
    shared = [nodeid for nodeid, n in collections.Counter(item.nodeid for item in items).items() if n > 1]
    if shared:
        raise pytest.UsageError(f"these tests share a node id, so pytest-xdist would run each once: {shared}")


def schedule(items) -> None:
    """In an xdist worker, before xdist reads the collection: unique node ids, groups, slow tests first."""
    _unique_node_ids(items)
    for item in items:
        group = xdist_group(item)
        if group is not None:
            _set_node_id(item, f"{item.nodeid}@{group}")  # what `--dist loadgroup` splits on
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow ones first
