"""Textual feedback: the KL against hand-derived formulas, the hint rules on real trajectories,
and the teacher context (the same tokens as the student's, plus the note)."""
from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from tests.agent_fakes import CharTokenizer, ScriptedClient
from megatron_composer.data.tool_calls import format_tool_call
from megatron_composer.rl import feedback
from megatron_composer.rl.agent import Agent, AgentConfig
from megatron_composer.rl.batches import RolloutSample, pack_samples
from megatron_composer.rl.feedback import (FEEDBACK_RULES, JudgeRule, attach_hints, failing_assertion, fire_rules,
                                           register_rule, resolve_rules, teacher_context)
from megatron_composer.rl.feedback_loss import FeedbackLoss, FeedbackTeacher, feedback_kl, teacher_rows
from megatron_composer.rl.tools import ToolSet
from megatron_composer.training.loss_plugins import ModelOutput

TOK = CharTokenizer()
CONFIG = AgentConfig(max_context_tokens=8192, max_turn_tokens=512, max_observation_tokens=2000)
FAILING = "0 passed, 1 failed, 0 errors of 1 tests\n    def test_add():\n>       assert add(1, 2) == 3\nE       assert -1 == 3"
PASSING = "1 passed, 0 failed, 0 errors of 1 tests"


def call(name, **arguments):
    return format_tool_call(name, arguments)


def run(tmp_path, script, tests=PASSING):
    tools = ToolSet(tmp_path, run_tests=lambda: tests)
    return Agent(ScriptedClient(TOK, script), TOK, CONFIG).run(tools, "Make the tests pass.")


# ---- the KL against hand-derived formulas (float64, V = 5) -----------------------------------

def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _case(seed=0, n=3, v=5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, v)) * 2, rng.normal(size=(n, v)) * 2


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_full_vocabulary_kl_and_gradient_equal_the_formulas(direction):
    zs, zt = _case()
    ps, pt = _softmax(zs), _softmax(zt)
    if direction == "forward":
        want = (pt * np.log(pt / ps)).sum(-1)
        want_grad = ps - pt  # d KL(pt || ps) / d zs
    else:
        want = (ps * np.log(ps / pt)).sum(-1)
        want_grad = ps * (np.log(ps / pt) - want[:, None])
    z = torch.tensor(zs, requires_grad=True)
    kl = feedback_kl(z, torch.tensor(np.log(pt)), None, direction)
    kl.sum().backward()
    np.testing.assert_allclose(kl.detach().numpy(), want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(z.grad.numpy(), want_grad, rtol=1e-10, atol=1e-13)
    assert (kl > 0).all()


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_top_k_kl_compares_the_top_k_and_the_rest_bucket(direction):
    zs, zt = _case(seed=1)
    ps, pt = _softmax(zs), _softmax(zt)
    k = 2
    top = np.argsort(-pt, axis=-1, kind="stable")[:, :k]
    n, v = ps.shape
    want, want_grad = np.zeros(n), np.zeros((n, v))
    for i in range(n):
        bucket = np.full(v, k)  # token -> its bucket: its rank among the top k, else the rest (k)
        bucket[top[i]] = np.arange(k)
        P = np.array([ps[i][bucket == b].sum() for b in range(k + 1)])  # the student's buckets
        Q = np.array([pt[i][bucket == b].sum() for b in range(k + 1)])  # the teacher's
        if direction == "forward":
            want[i] = (Q * np.log(Q / P)).sum()
            want_grad[i] = ps[i] - Q[bucket] * ps[i] / P[bucket]
        else:
            want[i] = (P * np.log(P / Q)).sum()
            want_grad[i] = ps[i] * (np.log(P[bucket] / Q[bucket]) - want[i])
    rows, index = teacher_rows(torch.tensor(zt), topk=k)
    assert index.tolist() == top.tolist()
    np.testing.assert_allclose(rows.exp().sum(-1).numpy(), 1.0, rtol=1e-6)  # top k + rest = all the mass
    z = torch.tensor(zs, requires_grad=True)
    kl = feedback_kl(z, rows.double(), index, direction)
    kl.sum().backward()
    np.testing.assert_allclose(kl.detach().numpy(), want, rtol=1e-5)  # teacher rows are float32
    np.testing.assert_allclose(z.grad.numpy(), want_grad, rtol=1e-5, atol=1e-7)
    full = feedback_kl(torch.tensor(zs), torch.log_softmax(torch.tensor(zt), -1), None, direction)
    assert (kl.detach() <= full + 1e-9).all()  # coarsening never adds divergence


def test_top_k_of_the_whole_vocabulary_is_the_full_kl():
    zs, zt = _case(seed=2)
    rows, index = teacher_rows(torch.tensor(zt), topk=5)
    assert index is None and rows.shape == (3, 5)
    rows4, index4 = teacher_rows(torch.tensor(zt), topk=4)  # the rest bucket is the one token left
    full = feedback_kl(torch.tensor(zs), rows.double(), None, "forward")
    torch.testing.assert_close(feedback_kl(torch.tensor(zs), rows4.double(), index4, "forward"), full, rtol=1e-5, atol=0)


def test_only_target_positions_receive_the_distillation_gradient():
    torch.manual_seed(0)
    T, V = 12, 7
    logits = torch.randn(1, T, V, requires_grad=True)
    rows = torch.full((1, T), -1)
    rows[0, 3:6] = torch.tensor([0, 1, 2])
    rows[0, 9] = 3
    table_logp, _ = teacher_rows(torch.randn(4, V))
    batch = pack_samples([RolloutSample(0, [1, 2, 3], list(range(4, 13)), [0.0] * 9, None, [0] * 9, "stop")])
    batch.feedback_rows = rows
    from megatron_composer.rl.feedback_loss import FeedbackTable

    batch.feedback_table = FeedbackTable(table_logp)
    loss = FeedbackLoss("reverse")
    assert loss.count(batch, None).item() == 4
    total = loss.loss_sum(batch, ModelOutput(logits, []), None)
    total.backward()
    touched = logits.grad[0].abs().sum(-1) > 0
    assert touched.tolist() == [t in (3, 4, 5, 9) for t in range(T)]
    want = feedback_kl(logits[0, [3, 4, 5, 9]].detach(), table_logp, None, "reverse").sum()
    assert total.item() == pytest.approx(want.item(), rel=1e-6)


# ---- the rules, each on a crafted trajectory ------------------------------------------------

def test_unknown_tool_lists_the_tools(tmp_path):
    traj = run(tmp_path, [call("create_file", path="a.py", content="x = 1\n"), call("finish", message="ok")])
    (turn, hint), = FEEDBACK_RULES["unknown_tool"](traj)
    assert turn == 0 and "'create_file'" in hint and "write_file" in hint and "run_tests" in hint


def test_malformed_call_shows_the_format_and_bad_arguments_the_signature(tmp_path):
    traj = run(tmp_path, ['<tool_call>{"name": "read_file", </tool_call>', call("read_file", file="a.py"),
                          call("finish", message="ok")])
    hints = dict(FEEDBACK_RULES["malformed_call"](traj))
    assert sorted(hints) == [0, 1]
    assert '<tool_call>{"name": "read_file", "arguments": {"path": "main.py"}}</tool_call>' in hints[0]
    assert "read_file(path)" in hints[1]


def test_failing_test_points_at_the_last_edit_with_the_assertion(tmp_path):
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    script = [call("read_file", path="calc.py"), call("write_file", path="calc.py", content="x = 1\n"),
              call("edit_file", path="calc.py", search="x = 1", replace="x = 2"), call("run_tests"),
              call("finish", message="done")]
    (turn, hint), = FEEDBACK_RULES["failing_test"](run(tmp_path, script, tests=FAILING))
    assert turn == 2 and hint.endswith("assert -1 == 3")
    assert failing_assertion(FAILING) == "assert -1 == 3" and failing_assertion(PASSING) is None


def test_unfinished_todo_names_the_open_items(tmp_path):
    traj = run(tmp_path, [call("todo", items=[{"text": "port the parser", "done": False},
                                              {"text": "docs", "done": True}]), call("finish", message="ok")])
    (turn, hint), = FEEDBACK_RULES["unfinished_todo"](traj)
    assert turn == 1 and "'port the parser'" in hint and "docs" not in hint


def test_thinking_in_comments_and_long_thought(tmp_path):
    script = ["x" * 80 + call("write_file", path="a.py", content="# I think this should work\nx = 1\n"),
              call("finish", message="ok")]
    traj = run(tmp_path, script)
    (turn, hint), = FEEDBACK_RULES["thinking_in_comments"](traj)
    assert turn == 0 and "I think this should work" in hint
    (turn, hint), = FEEDBACK_RULES["long_thought"](traj)  # 80 characters of prose + the stop token
    assert turn == 0 and "81 tokens" in hint
    assert resolve_rules("long_thought", long_thought_tokens=100)["long_thought"](traj) == []


def test_a_clean_trajectory_gets_no_hint(tmp_path):
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    script = ["Fix the sign." + call("edit_file", path="calc.py", search="a - b", replace="a + b"),
              call("todo", items=[{"text": "fix add", "done": True}]), call("run_tests"),
              call("finish", message="Fixed add.")]
    traj = run(tmp_path, script, tests=PASSING)
    assert traj.stop_reason == "finish"
    assert fire_rules(resolve_rules(",".join(FEEDBACK_RULES)), traj) == {}


def test_user_rules_plug_in_by_registration_or_import_and_bad_ones_are_named(tmp_path, monkeypatch):
    traj = run(tmp_path, [call("list_dir"), call("finish", message="ok")])
    module = types.ModuleType("my_rules")
    module.first_turn = lambda t: [(0, "look first")]
    module.bad = lambda t: [(7, "no such turn")]
    monkeypatch.setitem(sys.modules, "my_rules", module)
    assert fire_rules(resolve_rules("my_rules:first_turn"), traj) == {0: [("my_rules:first_turn", "look first")]}
    monkeypatch.setitem(FEEDBACK_RULES, "always", lambda t: [(1, "stop")])
    register_rule("always")(lambda t: [(1, "stop")])
    assert fire_rules(resolve_rules("always"), traj) == {1: [("always", "stop")]}
    with pytest.raises(ValueError, match=r"returned \(7, 'no such turn'\).*0\.\.1"):
        fire_rules(resolve_rules("my_rules:bad"), traj)
    with pytest.raises(ValueError, match="unknown rule 'unknwn_tool'.*unknown_tool"):
        resolve_rules("unknwn_tool")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_rules("no_such_module_xyz:rule")
    with pytest.raises(ValueError, match="--feedback-judge-url"):
        resolve_rules("judge")


def test_the_judge_writes_hints_for_failed_calls_only(tmp_path):
    traj = run(tmp_path, [call("list_dir"), call("read_file", path="missing.py"), call("finish", message="ok")])
    judge = ScriptedClient(TOK, ["Check the folder listing before reading a file."])
    hints = JudgeRule(judge, TOK)(traj)
    assert hints == [(1, "Check the folder listing before reading a file.")]
    assert len(judge.prompts) == 1 and "missing.py" in TOK.decode(judge.prompts[0])
    assert judge.params[0].temperature == 0.0


# ---- the teacher context ----------------------------------------------------------------------

def _hinted_sample(tmp_path, role="user"):
    script = [call("list_dir"), call("open_file", path="a.py"), call("finish", message="ok")]
    traj = run(tmp_path, script)
    (segment,) = traj.segments
    sample = RolloutSample(0, segment.prompt_ids, segment.completion_ids, segment.logprobs, None,
                           segment.policy_versions, traj.stop_reason, loss_mask=segment.trained)
    attach_hints(traj, [sample], resolve_rules("unknown_tool"), TOK, role)
    return traj, sample


def test_teacher_sees_the_student_tokens_plus_the_note_before_the_target_message(tmp_path):
    traj, sample = _hinted_sample(tmp_path)
    (hint,) = sample.hints
    turn = traj.turns[1]
    assert (hint.start, hint.end) == (turn.start, turn.end) and hint.rules == ("unknown_tool",)
    assert hint.note_ids == [TOK.chat["user"], *TOK.encode(hint.text), TOK.chat["end"]]
    teacher, first = teacher_context(sample, hint)
    student = sample.prompt_ids + sample.completion_ids
    at = len(sample.prompt_ids) + hint.start - 1  # the <|assistant|> that opens the message
    assert student[at] == TOK.chat["assistant"]
    n = len(hint.note_ids)
    assert teacher[:at] == student[:at] and teacher[at:at + n] == hint.note_ids
    assert teacher[at + n:] == student[at:len(sample.prompt_ids) + hint.end]  # the message itself, unchanged
    assert first == at + n and teacher[first] == TOK.chat["assistant"]
    # the message's text, predicted from position first + j, is the unknown call
    assert TOK.decode(teacher[first + 1:]).startswith('<tool_call>{"name": "open_file"')
    (tmp_path / "s").mkdir()
    _, system_sample = _hinted_sample(tmp_path / "s", role="system")
    assert system_sample.hints[0].note_ids[0] == TOK.chat["system"]


def test_teacher_rows_are_aligned_with_the_message_tokens(tmp_path):
    """A teacher that puts all its mass on the token that follows each position in its own
    context: its row for student position t must name the student's token t + 1."""
    _, sample = _hinted_sample(tmp_path)
    other = RolloutSample(0, [1, 20, 21, 3], [30, 31, TOK.chat["end"]], [0.0] * 3, None, [0] * 3, "stop")
    samples = [other, sample]
    batch = pack_samples(samples)
    seen = []

    def oracle(teacher_batch):
        tokens = teacher_batch.tokens[0]
        seen.append(tokens.tolist())
        nxt = torch.cat([tokens[1:], tokens[:1]])
        return torch.nn.functional.one_hot(nxt, 256).float()[None] * 50.0  # ASCII ids only

    out = FeedbackTeacher(oracle, topk=3).annotate(batch, samples)
    rows = out.feedback_rows[0]
    hint = sample.hints[0]
    first = other.length + len(sample.prompt_ids) + hint.start - 1
    targets = (rows >= 0).nonzero().squeeze(1).tolist()
    assert targets == list(range(first, first + hint.end - hint.start))
    picked = out.feedback_table.index[rows[targets], 0]  # each row's most likely token
    assert picked.tolist() == batch.labels[0, targets].tolist()
    assert out.feedback_table.logp[:, 0].min() > math.log(0.99)
    assert len(seen) == 1 and seen[0] == teacher_context(sample, hint)[0]  # only the hinted context runs
    plain = FeedbackTeacher(oracle).annotate(pack_samples([other]), [other])
    assert plain.feedback_table is None and (plain.feedback_rows < 0).all()


def test_feedback_flags_are_checked():
    from megatron_composer.rl.config import RLConfig

    ok = RLConfig.from_flat(env="agentic-coding", feedback_rules="unknown_tool,judge")
    assert ok.feedback.kl == "reverse" and ok.feedback.teacher == "current"
    for fields, match in (({"feedback_rules": "unknown_tool"}, "--env agentic-coding"),
                          ({"env": "agentic-coding", "feedback_rules": "nope"}, "unknown rule 'nope'"),
                          ({"env": "agentic-coding", "feedback_rules": "unknown_tool", "feedback_kl": "js"},
                           "--feedback-kl 'js'"),
                          ({"env": "agentic-coding", "feedback_rules": "unknown_tool", "feedback_coef": -1},
                           "--feedback-coef -1")):
        with pytest.raises(ValueError, match=match):
            RLConfig.from_flat(**fields)
    assert feedback.HINT_ROLES == ("user", "system")


def test_hints_land_on_the_segment_of_their_message_after_a_summary(tmp_path):
    """episode_samples (both RL loops build samples with it): a mistake in the second segment."""
    from megatron_composer.rl.rollout import episode_samples

    (tmp_path / "big.txt").write_text("x" * 300)
    read = call("read_file", path="big.txt")
    script = [read, "SUMMARY-1", call("open_file", path="big.txt"), call("finish", message="fin")]
    probe = Agent(ScriptedClient(TOK, script), TOK, CONFIG).run(ToolSet(tmp_path, max_output_chars=300), "Read it.")
    trigger = probe.segments[0].length - len(TOK.encode(script[2])) - 1  # reached after the first tool turn
    config = AgentConfig(max_context_tokens=4 * trigger, summary_trigger_tokens=trigger, max_summaries=1,
                         summary_max_tokens=32, max_observation_tokens=1000)
    traj = Agent(ScriptedClient(TOK, script), TOK, config).run(ToolSet(tmp_path, max_output_chars=300), "Read it.")
    assert len(traj.segments) == 2 and [t.kind for t in traj.turns] == ["action", "summary", "action", "action"]
    result = types.SimpleNamespace(trajectory=traj, verdict={"correctness": 0.0}, lost=0)
    samples = episode_samples([result], [0], 1, TOK, resolve_rules("unknown_tool"))
    assert [len(s.hints) for s in samples] == [0, 1]
    hint = samples[1].hints[0]
    turn = traj.turns[2]
    assert (turn.segment, hint.start, hint.end) == (1, turn.start, turn.end)
    message = samples[1].completion_ids[hint.start:hint.end]
    assert TOK.decode(message).startswith('<tool_call>{"name": "open_file"')
    assert all(samples[1].loss_mask[hint.start:hint.end])  # a generated message: trained tokens


def test_train_rl_flags_reach_the_config():
    from megatron_composer.rl.arguments import parse_rl_args

    rl = parse_rl_args(["--env", "agentic-coding", "--feedback-rules", "unknown_tool,failing_test",
                              "--feedback-coef", "0.5", "--feedback-kl", "forward", "--feedback-kl-topk", "64",
                              "--feedback-teacher", "lagged", "--feedback-teacher-lag", "4",
                              "--feedback-hint-role", "system", "--feedback-long-thought-tokens", "32"]).rl
    assert (rl.feedback.rules, rl.feedback.coef, rl.feedback.kl, rl.feedback.kl_topk) == (
        "unknown_tool,failing_test", 0.5, "forward", 64)
    assert (rl.feedback.teacher, rl.feedback.teacher_lag, rl.feedback.hint_role, rl.feedback.long_thought_tokens) == (
        "lagged", 4, "system", 32)
    with pytest.raises(SystemExit):
        parse_rl_args(["--env", "agentic-coding", "--feedback-rules", "unknown_tool", "--feedback-kl", "both"])

