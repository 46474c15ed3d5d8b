"""Asynchronous RL on Ray: trainer, inference, environment and evaluation services (see runner.py).

    reconciler.py    sample slots, the policy-lag limit, the ready buffer and its checkpoint form
    services.py      the services as plain classes (Ray makes them actors)
    placement.py     one GPU per trainer rank, inference worker and evaluator: checked, then reserved
    runner.py        the driver loop: launch, collect, train, sync, checkpoint, evaluate
    failures.py      a dead trainer rank: `TrainerDied`, the last checkpoint and the command that resumes

Weights travel as `inference.weight_sync` updates (XOR deltas of bit patterns + zlib, rebuilt
bit-exact), the same format our HTTP server takes.
"""
