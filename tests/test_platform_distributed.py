"""platform.init_distributed: every launcher path hands the timeout to process-group creation."""
from datetime import timedelta

import pytest

from megatron_composer.platform import distributed as pd

LAUNCHER_ENVS = {
    "torchrun": {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                 "MASTER_PORT": "29555"},
    "slurm": {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
              "SLURM_JOB_NODELIST": "gpu[003-004]"},
    "single": {},
}
_ALL_VARS = sorted({name for env in LAUNCHER_ENVS.values() for name in env} | {"SLURM_STEP_NODELIST"})


@pytest.mark.parametrize("launcher", sorted(LAUNCHER_ENVS))
def test_every_launcher_passes_the_timeout(launcher, monkeypatch):
    for name in _ALL_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in LAUNCHER_ENVS[launcher].items():
        monkeypatch.setenv(name, value)
    calls = []
    rank, world = {"torchrun": (1, 4), "slurm": (2, 4), "single": (0, 1)}[launcher]
    monkeypatch.setattr(pd, "apply_cpu_shims", lambda: None)
    monkeypatch.setattr(pd.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pd.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(pd.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(pd.dist, "get_world_size", lambda: world)
    env = pd.init_distributed(timeout_minutes=7)
    assert env.launcher == launcher and (env.rank, env.world_size) == (rank, world)
    assert len(calls) == 1 and calls[0]["timeout"] == timedelta(minutes=7)
    assert (calls[0]["rank"], calls[0]["world_size"]) == (rank, world)


@pytest.mark.parametrize("version, refused", [("0.16.1", False), ("0.18.0", False), ("0.20.0", True),
                                              ("0.15.3", True)])
def test_cuda_start_up_gates_the_megatron_core_version(version, refused, monkeypatch):
    """On CUDA no CPU shim patches megatron-core: 0.16.1 - 0.19 start (the untested ones
    with a warning), others are refused before any process group exists."""
    import megatron.core

    from megatron_composer.platform import MegatronCoreVersionError

    for name in _ALL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(megatron.core, "__version__", version)
    monkeypatch.setattr(pd.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pd, "_select_gpu", lambda local_rank: None)
    monkeypatch.setattr(pd, "apply_library_fixes", lambda: [])
    calls = []
    monkeypatch.setattr(pd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pd.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(pd.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(pd.dist, "get_world_size", lambda: 1)
    if refused:
        with pytest.raises(MegatronCoreVersionError, match=rf"megatron-core {version} .*megatron-core==0\.16\.1"):
            pd.init_distributed()
        assert calls == []
    elif version == "0.16.1":
        pd.init_distributed()
    else:
        with pytest.warns(UserWarning, match=rf"megatron-core {version} is accepted on CUDA but untested"):
            pd.init_distributed()
