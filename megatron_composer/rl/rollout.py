"""What both RL drivers share around the update: seeds, sampling parameters, training samples built
from completions and agent episodes, and the interval rule (`report.py` writes the step log and plots).

Group ids are global: the synchronous loop's step `s` samples groups
`s * prompts_per_step ... + prompts_per_step - 1`, the asynchronous one
numbers groups as it launches them. A group's task is `pool[group_id % len(pool)]`
and sample `i` of group `g` is seeded `sample_seed(seed, g, i, group_size)`, so
the same group id gets the same task and seeds in both drivers.
"""
from __future__ import annotations

from typing import Optional

from ..inference import SamplingParams
from .batches import RolloutSample
from .feedback import attach_hints


def sample_seed(seed: int, group_id: int, index: int, group_size: int) -> int:
    """The sampler's seed of sample `index` of group `group_id` (one formula for both drivers)."""
    return (seed * 1_000_003 + group_id * group_size + index) % (2 ** 63)


def sampling_params(rl, *, seed: int, max_tokens: Optional[int] = None, stop_token_ids=(), routed_experts: bool,
                    temperature: Optional[float] = None) -> SamplingParams:
    """The `SamplingParams` of one RL sample from the rollout flags (the only place they are built)."""
    return SamplingParams(max_tokens=rl.rollout.max_new_tokens if max_tokens is None else max_tokens,
                          temperature=rl.rollout.temperature if temperature is None else temperature, top_p=rl.rollout.top_p,
                          seed=seed, stop_token_ids=tuple(stop_token_ids), logprobs=True,
                          return_routed_experts=routed_experts)


def completion_sample(group: int, trajectory: int, completion, tokenizer, task, prompt) -> RolloutSample:
    """One single-turn completion as a sample, scored by `task.verify` on its text (stop tokens dropped)."""
    from .agent import known_ids

    tok = tokenizer
    text = tok.decode([t for t in known_ids(tok, completion.token_ids) if t not in (tok.chat["end"], tok.eod)])
    return RolloutSample(group, completion.prompt_token_ids, completion.token_ids, completion.logprobs,
                         completion.routed_experts, completion.policy_versions, completion.finish_reason, text,
                         rewards=task.verify(prompt, text), trajectory=trajectory)


def calls_per_turn(counts) -> float:
    """Tool calls per model turn of one trajectory (`rewards.EffortCounts`); 0.0 without turns."""
    return counts.tool_calls / counts.turns if counts.turns else 0.0


def episode_samples(results, groups: list[int], group_size: int, tokenizer, rules: Optional[dict] = None,
                    hint_role: str = "user") -> list[RolloutSample]:
    """Agent episodes (`agentic.EpisodeResult`, in group order, `group_size` per group; `groups[j]` is
    result j's group) as training samples: one per segment of each trajectory, with the feedback
    `rules`' hints on the segments they target."""
    samples, seen = [], {}
    for result, g in zip(results, groups):
        i = seen[g] = seen.get(g, -1) + 1
        traj = result.trajectory
        info = {"turns": traj.counts.turns, "summaries": len(traj.summaries),
                "summary tokens": sum(len(tokenizer.encode(x)) for x in traj.summaries),
                "finished": float(traj.finished), "generated tokens": traj.generated_tokens,
                "tool calls": traj.counts.tool_calls, "calls per turn": calls_per_turn(traj.counts),
                "lost episodes": float(result.lost)}
        for seg in traj.segments:
            samples.append(RolloutSample(
                g, seg.prompt_ids, seg.completion_ids, seg.logprobs, seg.padded_routes(), seg.policy_versions,
                traj.stop_reason, traj.final_message or "", rewards=dict(result.verdict),
                trajectory=g * group_size + i, loss_mask=seg.trained, effort=traj.counts, info=info))
        if rules:
            attach_hints(traj, samples[len(samples) - len(traj.segments):], rules, tokenizer, hint_role)
    return samples


def renumber(groups, group_size: int) -> list[RolloutSample]:
    """The samples of `groups` (each with `.samples`) as one step's: group k is groups[k], trajectories
    k * group_size + i."""
    import dataclasses

    samples = []
    for k, g in enumerate(groups):
        first: dict = {}
        for s in g.samples:
            first.setdefault(s.trajectory, len(first))
        for s in g.samples:
            samples.append(dataclasses.replace(s, group=k, trajectory=k * group_size + first[s.trajectory]))
    return samples


def due(iteration: int, interval: int, last: int) -> bool:
    """The interval rule of saves, evaluations and log lines: every `interval` steps, and at `last`."""
    return iteration == last or bool(interval) and iteration % interval == 0
