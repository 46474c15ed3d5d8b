import importlib.util
import os

import pytest
import torch


def _has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


# Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`):
# * each worker gets its share of the cores as torch intra-op threads, and the entry scripts the tests
#   start inherit it (OMP_NUM_THREADS): two workers at 2 threads each on 2 cores run slower than one;
# * tests that share a module- or class-scoped fixture run on one worker, which builds it once;
# * `slow` tests are handed out first, so that the run does not end waiting for one of them.
# The sandbox's fork-bomb test bounds the host's process count, which the Ray cluster test raises by
# dozens: those two modules share a worker.
_SAME_WORKER = {"test_sandbox": "host-processes", "test_async_rl": "host-processes"}
# session fixtures that hold a result several modules check: their tests share a worker
_SHARED_RESULTS = ("tiny_cpt_losses",)


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def _xdist_group(item) -> str | None:
    module = item.module.__name__.rsplit(".", 1)[-1]
    if module in _SAME_WORKER:
        return _SAME_WORKER[module]
    for name in _SHARED_RESULTS:
        if name in item.fixturenames:
            return name
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if defs[-1].scope in ("class", "module", "package"):
            return module
    return None


def _schedule_for_xdist(items):
    for item in items:
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow ones first


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _schedule_for_xdist(items)
    cuda = torch.cuda.is_available()
    te = _has_transformer_engine()
    no_cuda = pytest.mark.skip(reason="needs CUDA; run on a GPU machine with `make test-gpu`")
    no_te = pytest.mark.skip(reason="needs Transformer Engine: pip install -e '.[gpu]'")
    for item in items:
        # Markers, not keywords: keywords also hold parent directory names.
        if item.get_closest_marker("gpu") and not cuda:
            item.add_marker(no_cuda)
        elif item.get_closest_marker("te") and not te:
            item.add_marker(no_te)


@pytest.fixture(scope="session")
def data_dir(request):
    """The embedded stdlib CPT data (tokenizer + train/valid indexed datasets).

    Built once into pytest's cache dir and reused while its manifest matches
    (`default_cpt_data` checks Python, sentencepiece and the file lists).
    """
    from filelock import FileLock

    from megatron_composer.data import default_cpt_data

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    d = cache.mkdir("stdlib_cpt_data") if cache is not None else request.getfixturevalue("tmp_path_factory").mktemp("data")
    with FileLock(str(d) + ".lock"):  # two pytest runs at once: one builds, the other reuses
        default_cpt_data(d, progress=False)
    return d


@pytest.fixture(scope="session")
def tiny_cpt_losses(data_dir):
    """`tiny_cpt_losses(bf16=False, expert_precision="bf16")`: the lm losses of 30 tiny CPT steps
    (`tests.trainers.cpt_losses`), computed once per session for each setting. The unquantized fp32
    and bf16 runs are the references of both the bf16 and the NVFP4 checks."""
    from tests.trainers import cpt_losses

    done = {}

    def losses(*, bf16=False, expert_precision="bf16"):
        key = (bf16, expert_precision)
        if key not in done:
            done[key] = cpt_losses(data_dir, bf16=bf16, expert_precision=expert_precision)
        return list(done[key])

    return losses


@pytest.fixture(autouse=True)
def _launcher_env_is_restored():
    """A test that runs a trainer actor in this process sets RANK / WORLD_SIZE / MASTER_PORT; later tests'
    subprocesses would inherit them and try to join that world. Every test ends with the environment it began with."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
