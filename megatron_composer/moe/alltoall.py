"""megatron-core's alltoall token dispatcher without its host syncs where every expert is local.

megatron-core 0.16.1's `MoEAlltoAllTokenDispatcher`, dropless, without
permute fusion, makes the host wait for the GPU three times per MoE layer
forward at EP = ETP = 1 (token_dispatcher.py, moe_utils.py):

    1. `permute`: `masked_select` of the token indices (the output size
       depends on the routing map's values);
    2. `permute`: `masked_select` of the probabilities, likewise;
    3. `_maybe_dtoh_and_synchronize`: the per-expert token counts are copied
       to the host and the host waits on that copy's event before
       `sort_chunks_by_idxs` (which splits by a host list) and returns them.

At EP = ETP = 1 the chunk sort is the identity (one source rank, chunks
already in expert order) and the counts are needed only by experts that
take them on the device (`GroupedSequentialMLP`). `DeviceCountsAlltoAllTokenDispatcher`
subclasses megatron's dispatcher and changes exactly this:

    permute      `permute_by_expert`: the same permutation, found by a stable
                 sort of the expert-major routing map instead of
                 `masked_select`; dropless routing routes exactly
                 T * topk (token, expert) pairs, the size megatron itself
                 allocates for (`num_out_tokens`), so no shape depends on
                 values. Bit-identical outputs and gradients.
    EP=ETP=1     no host copy, no event wait, no identity chunk sort: the
                 counts stay on the device.
    otherwise    megatron's bookkeeping: the split sizes reach the host once
                 per layer (NCCL's all_to_all_single takes host split lists),
                 after one event wait, before the EP all-to-all.

Host syncs per MoE layer, forward (backward has none: index_select,
scatter_add and their gradients have static shapes):

                                      megatron's   this dispatcher
    EP = ETP = 1                      3            0
    EP or ETP > 1                     3            1 (the split sizes)

Experts that split by host lists (megatron's `SequentialMLP`,
`QuantizedSequentialMLP`) read device counts with one `.tolist()`, still
fewer waits than megatron's three. Token dropping or padding (capacity
factor, `moe_pad_expert_input_to_capacity`, `moe_router_padding_for_quantization`)
and fused permutation keep megatron's own code paths unchanged.

megatron-core picks the dispatcher class from `config.moe_token_dispatcher_type`
inside `MoELayer.__init__`, with no spec hook, so the spec selects
`DeviceCountsMoELayer`, a MoELayer that swaps in its dispatcher class right
after its own constructor. The layer has no extra parameters or state.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


def permute_by_expert(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, num_out_tokens: int):
    """megatron's unfused `permute(tokens, routing_map, probs, num_out_tokens)` without `masked_select`.

    Args:
        tokens: [T, hidden].
        routing_map: [T, E] bool with exactly `num_out_tokens` True entries.
        probs: [T, E] float (the router's, float32).
        num_out_tokens: the number of routed (token, expert) pairs, T * topk when dropless.
    Returns:
        (permuted tokens [num_out_tokens, hidden], permuted probs [num_out_tokens],
         token index of each permuted row [num_out_tokens] int64), rows sorted by expert
        and, within an expert, by token: megatron's order.
    """
    num_tokens = routing_map.shape[0]
    by_expert = routing_map.t().reshape(-1)  # [E * T], expert-major: the order megatron selects in
    # a stable descending sort puts the routed pairs first, in expert-major order
    routed = torch.argsort(by_expert.to(torch.int8), descending=True, stable=True)[:num_out_tokens]
    token_index = routed % num_tokens
    permuted_probs = probs.t().reshape(-1).index_select(0, routed)
    return tokens.index_select(0, token_index), permuted_probs, token_index


class DeviceCountsAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's alltoall dispatcher: no data-dependent shapes, counts on the device at EP=ETP=1.

    Same constructor and contract as `MoEAlltoAllTokenDispatcher`, except that
    `dispatch_postprocess` returns `tokens_per_expert` [num_local_experts] int64
    on the device at EP = ETP = 1 (on the host otherwise, as megatron).
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        # dropless, unpadded, unfused: the routed pair count is static (megatron's num_out_tokens)
        self.sort_permute = not (config.moe_permute_fusion or self.drop_and_pad
                                 or config.moe_expert_capacity_factor is not None
                                 or config.moe_router_padding_for_quantization)
        self.all_local = self.sort_permute and self.ep_size == 1 and self.tp_size == 1

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """megatron's dispatch_preprocess with `permute_by_expert` as its permutation.

        Args:
            hidden_states: [S, B, hidden].
            routing_map: [S * B, E] bool.
            probs: [S * B, E] float32.
        Returns:
            ([S * B * topk, hidden] tokens, [S * B * topk] probs), sorted by expert.
        """
        if not self.sort_permute:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        tokens, permuted_probs, self.reversed_local_input_permutation_mapping = permute_by_expert(
            hidden_states, routing_map, probs, self.num_out_tokens)
        return tokens, permuted_probs

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        """megatron's host copy and event wait; neither at EP = ETP = 1."""
        if self.all_local:
            return tokens_per_expert
        return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor):
        """megatron's; at EP = ETP = 1 without the chunk sort, the identity there.

        Returns (tokens [N, hidden] sorted by local expert, tokens_per_expert [E_local] int64, probs [N]).
        """
        if not self.all_local:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """megatron's; at EP = ETP = 1 the chunk unsort is the identity."""
        if not self.all_local:
            return super().combine_preprocess(hidden_states)
        return hidden_states


class DeviceCountsMoELayer(MoELayer):
    """megatron's MoELayer with `dispatcher` (a `DeviceCountsAlltoAllTokenDispatcher` class)
    in place of the one its config names (MoELayer has no dispatcher spec hook)."""

    dispatcher = DeviceCountsAlltoAllTokenDispatcher

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if config.moe_token_dispatcher_type != "alltoall":
            raise ValueError(
                f"{type(self).__name__} subclasses the alltoall dispatcher, got moe_token_dispatcher_type "
                f"{config.moe_token_dispatcher_type!r}; use 'alltoall'"
            )
        if pg_collection is None:  # as MoELayer does
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
        dispatcher = self.dispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection
        )
        if self.use_shared_expert and self.shared_expert_overlap:
            dispatcher.set_shared_experts(self.shared_experts)
        self.token_dispatcher = dispatcher
