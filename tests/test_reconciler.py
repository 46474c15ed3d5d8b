"""The reconciler's slots, lag limit and checkpointed buffer."""
import dataclasses

import pytest
import torch

from megatron_composer.rl.async_rl.reconciler import Group, Reconciler, decode_state, encode_state, token_lags
from megatron_composer.rl.batches import RolloutSample
from megatron_composer.rl.rewards import EffortCounts


def _group(gid, versions, launched=0):
    s = RolloutSample(gid, [1, 2], [3] * len(versions), [-0.5] * len(versions), None, list(versions), "stop",
                      rewards={"correctness": 1.0}, effort=EffortCounts(turns=2, tool_calls=1), info={"turns": 2})
    return Group(gid, [s], launched)


def test_slots_stay_filled_and_ids_are_handed_out_once():
    r = Reconciler(2, max_inflight_groups=3, max_policy_lag=1)
    assert r.to_launch(0) == [0, 1, 2]
    assert r.to_launch(0) == []  # every slot is taken
    r.complete(_group(1, [0, 0]))
    assert r.to_launch(0) == []  # a ready group keeps its slot until the trainer takes it
    r.failed(0)  # its worker died: the id comes back, nothing else
    assert r.to_launch(0) == [0]
    assert r.take_batch(0) is None  # one group ready, two per step
    r.complete(_group(2, [0]))
    assert [g.group_id for g in r.take_batch(0)] == [1, 2]
    assert r.to_launch(1) == [3, 4]  # group 0 still holds its slot
    with pytest.raises(RuntimeError, match="group 2 completed but was not in flight"):
        r.complete(_group(2, [0]))


def test_the_lag_limit_is_on_the_oldest_generated_token():
    r = Reconciler(1, max_inflight_groups=4, max_policy_lag=2)
    r.to_launch(0)
    r.complete(_group(0, [1, 3, 4]))  # oldest token from version 1
    r.complete(_group(1, [2, 2]))
    batch = r.take_batch(4)  # lag 3 > 2 for group 0: dropped and owed again; group 1's lag is 2
    assert [g.group_id for g in batch] == [1]
    assert list(r.relaunch) == [0] and r.stats["stale"] == 1
    assert r.to_launch(4) == [0, 4]  # relaunched before any new id
    assert token_lags([_group(5, [1, 3, -1])], 4) == [3, 1]  # -1: prompt or tool tokens carry no version


def test_synchronous_launches_one_step_when_everything_is_drained():
    r = Reconciler(2, max_inflight_groups=8, max_policy_lag=0, synchronous=True)
    assert r.to_launch(0) == [0, 1]
    assert r.to_launch(0) == []
    r.complete(_group(0, [0]))
    r.complete(_group(1, [0]))
    assert r.to_launch(0) == []  # ready groups not yet trained
    assert [g.group_id for g in r.take_batch(0)] == [0, 1]
    assert r.to_launch(1, trainer_busy=True) == []
    assert r.to_launch(1) == [2, 3]


def test_synchronous_relaunches_a_failed_group_beside_its_ready_peer():
    r = Reconciler(2, max_inflight_groups=8, max_policy_lag=0, synchronous=True)
    assert r.to_launch(0) == [0, 1]
    r.complete(_group(0, [0]))
    r.failed(1)
    assert r.to_launch(0) == [1]  # only what the step lacks; without it no step could ever start
    assert r.to_launch(0) == []
    r.complete(_group(1, [0]))
    assert [g.group_id for g in r.take_batch(0)] == [0, 1]


def test_a_checkpointed_state_owes_the_inflight_groups_and_keeps_the_ready_ones():
    r = Reconciler(2, max_inflight_groups=3, max_policy_lag=1)
    r.to_launch(0)  # 0, 1, 2
    r.complete(_group(2, [0, 0]))
    data = encode_state(r.state_dict())
    restored = Reconciler(2, max_inflight_groups=3, max_policy_lag=1)
    restored.load_state_dict(decode_state(data))
    assert restored.next_group_id == 3 and list(restored.relaunch) == [0, 1] and not restored.inflight
    (g,) = restored.ready
    s = g.samples[0]
    assert (g.group_id, s.policy_versions, s.completion_ids, s.effort.turns, s.rewards) == (2, [0, 0], [3, 3], 2,
                                                                                           {"correctness": 1.0})
    assert restored.to_launch(1) == [0, 1]  # the owed ids first; the ready group holds the third slot
    # loaded with weights_only=True: nothing but plain containers and tensors inside
    assert torch.load(__import__("io").BytesIO(data), weights_only=True)["next_group_id"] == 3
    with pytest.raises(ValueError, match="RL buffer cannot be read"):
        decode_state(b"garbage")


def test_bad_settings_name_the_flag():
    with pytest.raises(ValueError, match="--max-inflight-groups 0"):
        Reconciler(1, max_inflight_groups=0, max_policy_lag=1)
    with pytest.raises(ValueError, match="--max-policy-lag -1"):
        Reconciler(1, max_inflight_groups=1, max_policy_lag=-1)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def test_a_buffer_of_samples_with_feedback_hints_round_trips_under_weights_only(tmp_path):
    """Samples as the agentic loop builds them (feedback.attach_hints on an agent trajectory), with effort
    counts, routing records and numpy numbers in the verdict: every field comes back equal."""
    import io

    import numpy as np

    from megatron_composer.data.tool_calls import format_tool_call
    from megatron_composer.rl.agent import Agent, AgentConfig
    from megatron_composer.rl.batches import Hint
    from megatron_composer.rl.feedback import attach_hints, resolve_rules
    from megatron_composer.rl.tools import ToolSet
    from tests.agent_fakes import CharTokenizer, ScriptedClient

    tok = CharTokenizer()
    script = [format_tool_call("list_dir", {}), format_tool_call("open_file", {"path": "a.py"}),
              format_tool_call("finish", {"message": "ok"})]
    config = AgentConfig(max_context_tokens=8192, max_turn_tokens=512, max_observation_tokens=2000)
    traj = Agent(ScriptedClient(tok, script), tok, config).run(ToolSet(tmp_path, run_tests=lambda: ""), "Go.")
    (segment,) = traj.segments
    routed = torch.randint(-1, 8, (segment.length, 2, 2), dtype=torch.int32)
    hinted = RolloutSample(7, segment.prompt_ids, segment.completion_ids, segment.logprobs, routed,
                           segment.policy_versions, traj.stop_reason, "ok", rewards={"correctness": np.float64(0.5)},
                           reward=0.25, advantage=-0.5, trajectory=3, loss_mask=segment.trained, effort=traj.counts,
                           info={"turns": traj.counts.turns, "finished": float(traj.finished)})
    attach_hints(traj, [hinted], resolve_rules("unknown_tool"), tok)
    assert len(hinted.hints) == 1 and isinstance(hinted.hints[0], Hint) and traj.counts.tool_calls > 0
    plain = _group(8, [1, 2]).samples[0]
    r = Reconciler(2, max_inflight_groups=3, max_policy_lag=4)
    r.to_launch(0)
    r.complete(Group(0, [hinted], launched_version=1))
    r.complete(Group(2, [plain], launched_version=0))
    data = encode_state(r.state_dict())
    loaded = torch.load(io.BytesIO(data), weights_only=True)  # plain data only, or this raises
    assert loaded["ready"][0]["samples"][0]["hints"][0]["rules"] == ("unknown_tool",)
    restored = decode_state(data)
    assert [g.group_id for g in restored["ready"]] == [0, 2] and restored["relaunch"] == [1]
    for original, group in zip((hinted, plain), restored["ready"]):
        (back,) = group.samples
        for field in dataclasses.fields(RolloutSample):
            want, got = getattr(original, field.name), getattr(back, field.name)
            if field.name == "rewards":
                want = {k: float(v) for k, v in want.items()}  # numpy numbers come back as Python floats
            assert _equal(got, want) or (isinstance(want, list) and len(got) == len(want)
                                          and all(_equal(x, y) for x, y in zip(got, want))), field.name
    assert restored["ready"][0].samples[0].hints == hinted.hints
    assert restored["ready"][0].samples[0].effort == traj.counts


def test_a_sample_holding_something_that_is_not_plain_data_is_named():
    s = _group(1, [0]).samples[0]
    s.info["tokenizer"] = object()
    with pytest.raises(TypeError, match=r"RolloutSample.info holds object"):
        encode_state({"next_group_id": 2, "ready": [Group(1, [s], 0)], "relaunch": [], "stats": {}})
