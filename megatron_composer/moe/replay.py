"""Router replay (R3) with a plausibility filter, on megatron-core's `RouterReplay`.

In RL the trainer recomputes log-probs of tokens that the inference engine
sampled; if its routers pick other experts than the engine did (bf16 vs
fp32, new weights), train and rollout disagree. Replay makes the training
forward use the engine's experts (`Completion.routed_experts`), while the
gate values still come from the training router, so the router keeps
learning. Forcing an expert the router now finds implausible would train
through a path the policy would not take, so each replayed expert is
checked first. The rule, per token t with

    g        the router's gate probabilities (sigmoid scores, or softmax
             probabilities), before any expert bias
    O_t      the router's own top-k choice (megatron-core's top-k on its ranking
             scores: with expert bias and group-limited routing), best first
    R_t      the replayed experts
    tau_t  = threshold * min_{e in O_t} g[t, e]   (the router's own k-th gate)

is: a replayed e in R_t is implausible iff g[t, e] < tau_t; implausible
experts are replaced, in R_t's order, by the best experts of O_t that are
not in R_t. There are always enough: every member of O_t has a gate >=
tau_t (for threshold <= 1), so implausible experts are outside O_t. Rows of
-1 (a token the engine never fed) take O_t. threshold 0 replays everything.

`RouterReplayController` installs one `FilteredRouterReplay` (a
`RouterReplay` kept out of megatron-core's global list, whose order the
engine's recorder does not share) on every decoder MoE router; MTP layers
route themselves (the engine records only the decoder).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from ..parallel.wrappers import unwrap


def filter_replayed_experts(gates: torch.Tensor, own: torch.Tensor, replayed: torch.Tensor,
                            threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the plausibility rule of the module docstring.

    Args:
        gates: [N, E] float, the router's gate probabilities.
        own: [N, k] int64, the router's own top-k, best first.
        replayed: [N, k] int64, the engine's experts (rows of -1: not recorded).
        threshold: the fraction of the router's k-th gate below which a replayed expert is dropped.
    Returns:
        (chosen [N, k] int64, replaced [N, k] bool: entries of `replayed` that were replaced).
    """
    if not 0 <= threshold <= 1:
        raise ValueError(f"replay plausibility threshold {threshold}; use a value in [0, 1] (0 replays everything)")
    missing = (replayed < 0).any(dim=1)
    safe = replayed.clamp_min(0)
    tau = threshold * gates.gather(1, own).min(dim=1, keepdim=True).values
    implausible = (gates.gather(1, safe) < tau) & ~missing[:, None]
    available = ~(own[:, :, None] == safe[:, None, :]).any(dim=-1)  # [N, k] members of O_t not replayed
    order = torch.sort((~available).to(torch.int8), dim=1, stable=True).indices  # available first, in O_t order
    candidates = own.gather(1, order)
    rank = (torch.cumsum(implausible.long(), dim=1) - 1).clamp_min(0)
    chosen = torch.where(implausible, candidates.gather(1, rank), safe)
    chosen = torch.where(missing[:, None], own, chosen)
    return chosen, implausible


class FilteredRouterReplay(RouterReplay):
    """Replays the target experts of one router through `filter_replayed_experts`.

    Deterministic in (scores, target), so activation recompute in backward
    chooses the same experts without megatron-core's replay-backward queue.
    """

    def __init__(self, router, threshold: float):  # no super().__init__(): it registers globally
        self.router, self.threshold = router, threshold
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = RouterReplayAction.REPLAY_FORWARD
        self.replay_backward_list = []
        self.replaced = 0
        self.replayed = 0

    def _gates(self, scores: torch.Tensor) -> torch.Tensor:
        cfg = self.router.config
        if cfg.moe_router_score_function == "sigmoid":
            bias = self.router.expert_bias
            return scores - bias if bias is not None else scores
        return scores if cfg.moe_router_pre_softmax else torch.softmax(scores.float(), dim=-1)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target_topk_idx is None:
            return values, own
        target = self.target_topk_idx.to(device=scores.device, dtype=torch.long)
        if target.shape != own.shape:
            raise ValueError(f"replayed experts have shape {tuple(target.shape)}; this layer routes "
                             f"{tuple(own.shape)} (tokens, topk): the routing records do not match the batch")
        if int(target.max()) >= scores.shape[1]:
            raise ValueError(f"replayed expert id {int(target.max())} >= num_experts {scores.shape[1]}")
        chosen, replaced = filter_replayed_experts(self._gates(scores), own, target, self.threshold)
        recorded = (target >= 0).all(dim=1)
        self.recorded_topk_idx = chosen  # what this forward routed by, for metrics and tests
        self.replaced += int(replaced.sum())
        self.replayed += int(recorded.sum()) * topk
        return scores.gather(1, chosen), chosen


class RouterReplayController:
    """Installs filtered replay on a model's decoder MoE routers and feeds it routing records.

    Usage: `controller.set(routed)` with routed [tokens, num_moe_layers, topk]
    in the order of the forward's flattened tokens ([s, b] -> s * b rows, as
    megatron-core's router sees them), run the forward (and backward), then
    `controller.clear()`. `replaced_fraction()` reports the filter's work.
    """

    def __init__(self, model, threshold: float = 0.0):
        gpt = unwrap(model)
        self.replays = []
        for layer in gpt.decoder.layers:
            if isinstance(layer.mlp, MoELayer):
                replay = FilteredRouterReplay(layer.mlp.router, threshold)
                layer.mlp.router.router_replay = replay
                self.replays.append(replay)
        if not self.replays:
            raise ValueError("router replay needs a model with MoE layers; this one has none")

    def set(self, routed: torch.Tensor) -> None:
        """routed: int [tokens, num_moe_layers, topk]."""
        if routed.dim() != 3 or routed.shape[1] != len(self.replays):
            raise ValueError(f"routing records of shape {tuple(routed.shape)}; expected [tokens, "
                             f"{len(self.replays)} MoE layers, topk]")
        for i, replay in enumerate(self.replays):
            replay.target_topk_idx = routed[:, i]

    def clear(self) -> None:
        for replay in self.replays:
            replay.target_topk_idx = None

    def replaced_fraction(self, reset: bool = True) -> float:
        replaced = sum(r.replaced for r in self.replays)
        total = sum(r.replayed for r in self.replays)
        if reset:
            for r in self.replays:
                r.replaced = r.replayed = 0
        return replaced / total if total else 0.0
