"""Cost of the RL sandbox per command: sandboxed against a plain subprocess.run, side by side.

    python benchmarks/sandbox.py [--runs 30]

For `true` and `python3 -c pass` (the system binaries, as inside), each round runs the command once through
`Sandbox.run` (bubblewrap, namespaces, limits; as root also the staging
mount namespace and the drop to an unprivileged uid, and the workspace
handed over and back) and once through `subprocess.run` with the same argv,
alternating so both see the same machine load. Prints the median ms per
command over `--runs` rounds and the ratio sandboxed / plain.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_composer.rl.sandbox import Sandbox  # noqa: E402

COMMANDS = {"true": ["/usr/bin/true"], "python3 -c pass": ["/usr/bin/python3", "-c", "pass"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-") as workspace:
        sandbox = Sandbox(workspace)
        sandbox.run(["true"])  # the one-time probe and first-exec page cache out of the way
        print(f"{'command':16} {'sandboxed ms':>12} {'plain ms':>9} {'ratio':>6}   (median of {args.runs})")
        for name, argv in COMMANDS.items():
            boxed, plain = [], []
            for _ in range(args.runs):
                start = time.perf_counter()
                result = sandbox.run(argv)
                boxed.append(time.perf_counter() - start)
                assert result.exit_code == 0, result
                start = time.perf_counter()
                subprocess.run(argv, cwd=workspace, check=True, capture_output=True, stdin=subprocess.DEVNULL)
                plain.append(time.perf_counter() - start)
            b, p = 1e3 * statistics.median(boxed), 1e3 * statistics.median(plain)
            print(f"{name:16} {b:12.1f} {p:9.1f} {b / p:6.1f}")


if __name__ == "__main__":
    main()
