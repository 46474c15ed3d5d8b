"""The recipe report reads the stage logs and the async RL step log."""
import json


def test_the_report_reads_losses_rewards_and_evals(tmp_path):
    from tools.recipe_report import log_series, rl_evals, rl_rows

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "cpt_32k.log").write_text(
        " [2026-12-01 10:00:00] iteration        5/      50 | consumed samples: 40 | lm loss: 8.250000E+00 | x\n"
        " validation loss at iteration 25 | lm loss value: 7.0 |\n"
        " [2026-12-01 10:00:09] iteration       10/      50 | lm loss: 6.500000E+00 | mtp loss: 7.1E+00 |\n")
    assert log_series(str(logs / "cpt_32k.log"), "lm loss") == [(5, 8.25), (10, 6.5)]
    assert log_series(str(logs / "cpt_32k.log"), "mtp loss") == [(10, 7.1)]
    assert log_series(str(logs / "missing.log"), "lm loss") == []
    (tmp_path / "rl").mkdir()
    rows = [{"iteration": 1, "reward": 0.1, "job": "a"}, {"iteration": 2, "reward": 0.2, "job": "a"},
            {"iteration": 2, "reward": 0.3, "job": "b"}, {"iteration": 3, "reward": 0.4, "job": "b"}]
    (tmp_path / "rl" / "rl_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["reward"] for r in rl_rows(str(tmp_path))] == [0.1, 0.3, 0.4]  # a resumed step: the newer row
    (logs / "rl.log").write_text("> eval of weights version 6: solved 0.250 of 8 held-out tasks, correctness 0.500\n")
    assert rl_evals(str(tmp_path)) == [(6, 0.25, 0.5)]
