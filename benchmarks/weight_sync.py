"""Delta weight sync on the tiny model after real RL steps: bytes and seconds per sync, delta vs full.

    python benchmarks/weight_sync.py [--steps 4] [--lrs 1e-6,1e-5,3e-4]

For each learning rate, a fresh tiny model (from the embedded corpus's
tokenizer, single-turn task) takes `--steps` real RL steps through the async
services (in this process: rollouts from an inference worker, the policy
loss, Adam); after each step rank 0 publishes the weights in bf16. Printed
per learning rate, averaged over the steps after the first: the full upload
(every bf16 byte, zlib-compressed: what a sync without deltas sends), the
delta (XOR with the previous upload, in byte planes, zlib), the fraction of
bf16 weights bit-identical to the previous step, and the seconds to encode
each and to rebuild the weights from the delta (bit-exact, checked).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(lr: float, steps: int, tmp: str) -> dict:
    from megatron_composer.checkpoint import model_state_dict
    from megatron_composer.data import default_cpt_data
    from megatron_composer.rl.async_rl.services import EnvWorker, InferenceWorker, RolloutSpec, TrainerWorker
    from megatron_composer.inference.weight_sync import WeightPublisher, WeightSubscriber, unchanged_fraction

    data = default_cpt_data("data", progress=False)
    argv = ["--model-preset", "tiny", "--seq-length", "256", "--tokenizer-model", str(data.tokenizer_model),
            "--group-size", "4", "--prompts-per-step", "2", "--max-new-tokens", "24", "--lr", str(lr),
            "--min-lr", str(lr), "--lr-warmup-iters", "0", "--train-iters", str(steps + 1),
            "--rl-micro-batch-tokens", "2048", "--save", os.path.join(tmp, f"lr{lr:g}")]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    trainer = TrainerWorker(argv, 0, 1)
    trainer.setup("127.0.0.1", _port())
    info = trainer.describe()
    inference = InferenceWorker(info["model_config"], info["tokenizer_model"], max_model_len=info["seq_length"])
    env = EnvWorker(RolloutSpec(trainer.rl, info["tokenizer_model"], info["seq_length"], info["seed"],
                                info["tasks"]), inference)
    full_pub, subscriber = WeightPublisher(torch.bfloat16), WeightSubscriber()
    rows = []
    try:
        inference.update_weights(trainer.snapshot())
        previous = None
        for step in range(steps):
            groups = [env.run_group(2 * step + k, step) for k in range(2)]
            _, delta = trainer.train_step(groups)
            state = model_state_dict(trainer.trainer.model)
            full = full_pub.publish(state, step, full=True)  # the same weights, sent whole
            started = time.perf_counter()
            rebuilt = subscriber.apply(delta if subscriber.version is not None else trainer.snapshot())
            apply_s = time.perf_counter() - started
            bf16 = {n: t.detach().to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}
            for n, t in bf16.items():
                assert torch.equal(rebuilt[n].view(torch.int16) if t.dtype == torch.bfloat16 else rebuilt[n],
                                   t.view(torch.int16) if t.dtype == torch.bfloat16 else t), n
            inference.update_weights(delta)
            if previous is not None:
                rows.append({"raw": full.raw_bytes, "full": full.sent_bytes, "delta": delta.sent_bytes,
                             "full s": full.seconds, "delta s": delta.seconds, "apply s": apply_s,
                             "unchanged": unchanged_fraction(previous, bf16)})
            previous = bf16
    finally:
        inference.engine.stop()
        trainer.close()
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lrs", default="1e-6,1e-5,3e-4")
    args = p.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as tmp:
        for lr in [float(x) for x in args.lrs.split(",")]:
            r = measure(lr, args.steps, tmp)
            print(f"weight_sync lr {lr:g}: bf16 {r['raw'] / 1e6:.2f} MB | full (zlib) {r['full'] / 1e6:.2f} MB "
                  f"in {r['full s'] * 1e3:.0f} ms | delta {r['delta'] / 1e6:.3f} MB in {r['delta s'] * 1e3:.0f} ms, "
                  f"rebuilt in {r['apply s'] * 1e3:.0f} ms | bit-identical {100 * r['unchanged']:.1f}% | "
                  f"delta / full {r['delta'] / r['full']:.3f}", flush=True)


if __name__ == "__main__":
    main()
