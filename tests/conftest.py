import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on a GPU machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir(request):
    """The embedded stdlib CPT data (tokenizer + train/valid indexed datasets).

    Built once into pytest's cache dir and reused while its manifest matches
    (`default_cpt_data` checks Python, sentencepiece and the file lists).
    """
    from megatron_composer.data import default_cpt_data

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    d = cache.mkdir("stdlib_cpt_data") if cache is not None else request.getfixturevalue("tmp_path_factory").mktemp("data")
    default_cpt_data(d, progress=False)
    return d
