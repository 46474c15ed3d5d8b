"""Asynchronous RL on Ray: trainer, inference, environment and evaluation services (see runner.py).

    weight_sync.py   delta-compressed weight publishing (XOR of bit patterns + zlib), bit-exact rebuild
    reconciler.py    sample slots, the policy-lag limit, the ready buffer and its checkpoint form
    services.py      the services as plain classes (Ray makes them actors)
    runner.py        the driver loop: launch, collect, train, sync, checkpoint, evaluate
"""
