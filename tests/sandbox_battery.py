"""tests/test_sandbox.py run again in a fresh pytest, every `Sandbox` built with extra keyword arguments."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rerun_sandbox_battery(tmp_path: Path, kwargs: dict, check: str) -> None:
    """Run tests/test_sandbox.py with every `Sandbox(...)` given `kwargs` where its caller passed none, and
    `check` (a Python expression over `self`) asserted after construction; fails unless all of it passes."""
    plugin = tmp_path / "sandbox_kwargs_plugin.py"
    plugin.write_text(f"""
from megatron_composer.rl import sandbox
_init = sandbox.Sandbox.__init__
def __init__(self, *args, **kwargs):
    for key, value in {kwargs!r}.items():
        kwargs[key] = kwargs.get(key) or value
    _init(self, *args, **kwargs)
    assert {check}
sandbox.Sandbox.__init__ = __init__
""")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "sandbox_kwargs_plugin", str(ROOT / "tests" / "test_sandbox.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
