"""train_rl.py end to end on tasks from a file: sandboxed scoring, the zero-signal count and solve-rate
selection logged every step, the estimates continued by a resume, and the held-out evaluation of
--eval-task-file (needs bubblewrap, as test_sandbox)."""
import json
import os

from megatron_composer.rl.tasks.code_tests import EXAMPLE_TASKS


def test_task_file_with_solve_rate_selection_saves_and_resumes(data_dir, tmp_path):
    from megatron_composer.checkpoint import read_meta
    from megatron_composer.rl.train import train_rl

    save = str(tmp_path / "rl")
    common = ["--model-preset", "tiny", "--num-layers", "2", "--seq-length", "256",
              "--tokenizer-model", str(data_dir / "tokenizer.model"), "--data-cache-dir", str(data_dir),
              "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "6", "--lr", "1e-4",
              "--task-file", str(EXAMPLE_TASKS), "--task-selection", "solve-rate",
              "--task-solve-rate-bounds", "0.2,0.9", "--drop-zero-signal-groups", "--sandbox-timeout-s", "5",
              "--eval-task-file", str(EXAMPLE_TASKS), "--eval-pass-k", "2", "--eval-tasks", "3",
              "--save", save, "--log-interval", "1"]
    first = train_rl(common + ["--train-iters", "2"])
    history = first.report.history
    for row in history:
        for key in ("zero-signal groups", "dropped groups", "tasks in bounds", "selected solve rate",
                    "selection fallback", "task all_pass", "task correctness"):
            assert key in row, key
        assert row["dropped groups"] <= row["zero-signal groups"] <= 2
    # held out: before the first step and at the end, pass@1 and pass@k of the first 3 tasks
    evals = first.report.eval_history
    assert [e["iteration"] for e in evals] == [0, 2] and all(e["eval tasks"] == 3.0 for e in evals)
    assert all({"eval pass@1", "eval pass@k", "eval correctness"} <= e.keys() for e in evals)
    counts = read_meta(save)["rl_task_selection"]["counts"]
    assert sum(n for _, n in counts.values()) == 2 * 2 * 2  # steps x groups x samples, each counted once
    assert counts == first.selector.rates.counts
    # untrained, nothing is solved: each task seen once falls to (0 + 1) / (2 + 2) = 0.25, seen twice to 1/6,
    # out of [0.2, 0.9]; step 1 took tasks 0, 1 (all unseen at 0.5), step 2 tasks 2, 3
    assert history[0]["task all_pass"] == 0.0 and sorted(counts) == ["add", "clamp", "is_palindrome", "word_counts"]
    resumed = train_rl(common + ["--train-iters", "3", "--load", save])
    after = read_meta(save)["rl_task_selection"]
    assert sum(n for _, n in after["counts"].values()) == 3 * 2 * 2  # continued, not restarted
    # step 3 resumed at cursor 0 with every task at 0.25, took tasks 0 and 1, which fell to 1/6: half in bounds
    assert after["cursor"] == resumed.selector.cursor == 2
    assert after["counts"]["add"] == [0, 4] and after["counts"]["clamp"] == [0, 2]
    with open(os.path.join(save, "rl_steps.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["iteration"] for r in rows] == [1, 2, 3] and rows[-1]["tasks in bounds"] == 0.5
