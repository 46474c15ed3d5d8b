import importlib.util
import os
import re

import pytest
import torch

from tests.scheduling import schedule, split_cores


def _has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def pytest_configure(config):
    split_cores()


# Modules of this repository: a missing one is a bug, never an optional dependency.
OUR_MODULES = ("megatron_composer", "tests", "benchmarks", "megatron", "torch")


def _selects_gpu_suite(config) -> bool:
    """`-m gpu` (or an expression that asks for `gpu`, not `not gpu`): the GPU suite."""
    return re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or "") is not None


def _missing_optional_module(collector) -> str | None:
    """The package whose absence keeps this test module from importing, if it is an optional
    one (installed nowhere on this machine, not ours); None when the module imports or fails
    for any other reason."""
    try:
        collector.obj
    except collector.CollectError as error:
        cause = error.__cause__
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            top = cause.name.partition(".")[0]
            if top not in OUR_MODULES and importlib.util.find_spec(top) is None:
                return top
    except (Exception, pytest.skip.Exception, pytest.fail.Exception):
        pass  # pytest's own collection imports it again and reports what it raises
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_make_collect_report(collector):
    """Running the GPU suite on a machine with torch and the wheels `tools/gpu_check.sh` installs,
    a test module without GPU tests whose optional dependency (hypothesis, httpx, schemathesis, ...)
    is missing is reported as skipped, naming that dependency, instead of stopping the collection.
    A module with GPU tests still fails: its tests must run there."""
    if not (isinstance(collector, pytest.Module) and _selects_gpu_suite(collector.config)):
        return None
    missing = _missing_optional_module(collector)
    if missing is None or "mark.gpu" in collector.path.read_text():
        return None  # the default report: collected, or the import error itself
    reason = (f"not collected: it needs {missing}, which is not installed (no GPU tests in it; "
              f"pip install -e '.[test]' runs it)")
    return pytest.CollectReport(collector.nodeid, "skipped", (str(collector.path), None, reason), [])


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        schedule(items)  # tests/scheduling.py: how the suite is spread over pytest-xdist workers
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
