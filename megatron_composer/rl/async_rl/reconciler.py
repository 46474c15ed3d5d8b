"""The reconciler: sample slots between the rollout services and the trainer.

It owns the life of every group: launched into one of `max_inflight_groups`
slots, completed (or failed, then launched again), held in the ready buffer,
handed to the trainer as one step's batch. It trades throughput against
staleness in two places:

1. slots: a group holds a slot from its launch until the trainer takes it
   (sampling, or ready and waiting); more slots keep the inference and
   environment workers busy while the trainer steps, but sample further
   behind the newest weights;
2. lag: a group whose oldest generated token is more than `max_policy_lag`
   versions behind the policy that would train on it is dropped and its
   group id launched again (fresh samples of the same task).

Group ids are handed out in order and each id is trained at most once; the
ready buffer and the ids to relaunch are the reconciler's `state_dict`, which
goes into the trainer's checkpoint, so a whole-job restart neither loses a
completed group nor trains one twice (groups in flight at the kill are
launched again). `synchronous=True` is the baseline: one step's groups are
launched only when nothing is in flight and the trainer is idle (as many as
the ready buffer lacks for a step: all of them, unless a group failed).

Pure bookkeeping without Ray: `runner.py` drives it.
"""
from __future__ import annotations

import collections
import dataclasses
import io
from typing import Optional, Sequence

import torch


@dataclasses.dataclass
class Group:
    """One prompt's completed samples, as the environment workers return them."""

    group_id: int
    samples: list  # RolloutSample, every segment of every trajectory of the group
    launched_version: int  # the newest weights version when the group was launched

    @property
    def oldest_version(self) -> int:
        """The policy version of the group's oldest generated token (its launch version if none carry one)."""
        versions = [v for s in self.samples for v in (s.policy_versions or []) if v >= 0]
        return min(versions) if versions else self.launched_version


def token_lags(groups: Sequence[Group], version: int) -> list[int]:
    """Per generated token of `groups`: how many versions it is behind `version` (staleness histogram data)."""
    return [version - v for g in groups for s in g.samples for v in (s.policy_versions or []) if v >= 0]


class Reconciler:
    """Slots, the ready buffer and the lag limit (module docstring)."""

    def __init__(self, groups_per_step: int, *, max_inflight_groups: int, max_policy_lag: int,
                 synchronous: bool = False):
        if groups_per_step < 1:
            raise ValueError(f"--prompts-per-step {groups_per_step} must be >= 1")
        if max_inflight_groups < 1:
            raise ValueError(f"--max-inflight-groups {max_inflight_groups} must be >= 1")
        if max_policy_lag < 0:
            raise ValueError(f"--max-policy-lag {max_policy_lag} must be >= 0 (0: on-policy only)")
        self.groups_per_step, self.max_inflight_groups = groups_per_step, max_inflight_groups
        self.max_policy_lag, self.synchronous = max_policy_lag, synchronous
        self.next_group_id = 0
        self.inflight: dict[int, int] = {}  # group id -> version at launch
        self.relaunch: collections.deque = collections.deque()  # ids that failed or went stale
        self.ready: list[Group] = []
        self.stats = collections.Counter()

    # ---- the rollout side ---------------------------------------------------
    def to_launch(self, version: int, *, trainer_busy: bool = False) -> list[int]:
        """Group ids to launch now (filling the free slots); they are in flight from here on."""
        if self.synchronous:
            if self.inflight or trainer_busy:
                return []
            # what the next step lacks: ready groups stay (a failed group's peers, a resumed buffer)
            room = self.groups_per_step - len(self.ready)
        else:
            room = self.max_inflight_groups - len(self.inflight) - len(self.ready)
        ids = []
        while len(ids) < room:
            if self.relaunch:
                ids.append(self.relaunch.popleft())
            else:
                ids.append(self.next_group_id)
                self.next_group_id += 1
        for gid in ids:
            self.inflight[gid] = version
        self.stats["launched"] += len(ids)
        return ids

    def complete(self, group: Group) -> None:
        """A group's rollouts came back whole."""
        if self.inflight.pop(group.group_id, None) is None:
            raise RuntimeError(f"internal: group {group.group_id} completed but was not in flight")
        self.ready.append(group)
        self.stats["completed"] += 1

    def failed(self, group_id: int) -> None:
        """A group's rollout or environment worker died (or timed out): its samples are lost, its id relaunched."""
        if self.inflight.pop(group_id, None) is not None:
            self.relaunch.append(group_id)
            self.stats["failed"] += 1

    # ---- the trainer side ---------------------------------------------------
    def take_batch(self, version: int) -> Optional[list[Group]]:
        """One step's groups for the trainer at `version` (oldest group ids first), or None when too few
        are ready. Groups past the lag limit are dropped and relaunched first."""
        fresh = []
        for g in self.ready:
            if version - g.oldest_version > self.max_policy_lag:
                self.relaunch.append(g.group_id)
                self.stats["stale"] += 1
            else:
                fresh.append(g)
        self.ready = sorted(fresh, key=lambda g: g.group_id)
        if len(self.ready) < self.groups_per_step:
            return None
        batch, self.ready = self.ready[:self.groups_per_step], self.ready[self.groups_per_step:]
        self.stats["trained"] += len(batch)
        return batch

    # ---- policy-aware checkpoints ---------------------------------------------
    def state_dict(self) -> dict:
        """What a restart needs: the completed groups with their versions, and the ids still owed (those in
        flight now are owed again: their samples die with the job)."""
        return {"next_group_id": self.next_group_id, "ready": list(self.ready),
                "relaunch": sorted(set(self.relaunch) | set(self.inflight)), "stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        self.next_group_id = int(state["next_group_id"])
        self.ready = list(state["ready"])
        self.relaunch = collections.deque(state["relaunch"])
        self.inflight = {}
        self.stats = collections.Counter(state.get("stats", {}))


# ---- the buffer as checkpoint bytes (plain data: loadable with torch.load(weights_only=True)) ----
def encode_state(state: dict) -> bytes:
    """`Reconciler.state_dict()` as bytes for a checkpoint's extra file (samples as `RolloutSample.to_dict`)."""
    plain = dict(state, ready=[{"group_id": g.group_id, "launched_version": g.launched_version,
                                "samples": [s.to_dict() for s in g.samples]} for g in state["ready"]])
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    return buffer.getvalue()


def decode_state(data: bytes) -> dict:
    """The inverse of `encode_state`; ValueError when the bytes are not such a state."""
    from ..batches import RolloutSample

    try:
        plain = torch.load(io.BytesIO(data), weights_only=True)
        ready = [Group(int(g["group_id"]), [RolloutSample.from_dict(s) for s in g["samples"]],
                       int(g["launched_version"])) for g in plain["ready"]]
    except Exception as exc:  # noqa: BLE001 - any damage is the one error below
        raise ValueError(f"the checkpoint's RL buffer cannot be read ({exc}); resume from another "
                         f"checkpoint or start the RL run afresh") from exc
    return dict(plain, ready=ready)
