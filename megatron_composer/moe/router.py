"""megatron-core's top-k router, with pad tokens kept out of its expert-bias counts.

Aux-loss-free balancing moves each expert's bias by the sign of its load
imbalance, counted in `local_tokens_per_expert` over the tokens each router
routed. A pad token (`padding_mask` True: the zigzag split's padding, a filler
micro-batch) must not count, or a padded batch moves the biases differently
from its unpadded tokens. megatron-core's router takes `padding_mask` (True:
pad, whatever its docstrings say; flattened to [tokens]) and leaves pad
tokens out of the z-loss and the aux losses, but its expert-bias count masks
the [tokens, experts] routing map with the [tokens] mask unbroadcast
(`routing_map & ~padding_mask`, megatron-core 0.16 to 0.19): it fails, or,
when tokens == experts, masks the wrong entries. `PaddingAwareTopKRouter`
masks by token; the count itself stays megatron-core's (training forwards
with grad only, so no-grad forwards and activation recompute count nothing
extra), and so does everything else the router does.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter


class PaddingAwareTopKRouter(TopKRouter):
    """TopKRouter whose expert-bias counts leave out the tokens its `padding_mask` marks."""

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """routing_map: [tokens, experts] bool; padding_mask: [tokens] (or any shape of `tokens`
        elements) bool, True on pad tokens, or None."""
        if padding_mask is not None:
            routing_map = routing_map & ~padding_mask.reshape(-1, 1)
        super()._apply_expert_bias(routing_map, padding_mask=None)


def padding_aware_router_spec(moe_submodules) -> None:
    """Put `PaddingAwareTopKRouter` in a (copied) MoE layer spec's submodules, in place."""
    if moe_submodules.router is not TopKRouter:
        raise ValueError(f"the MoE layer spec routes with {moe_submodules.router!r}; the pad-token counts "
                         "(`moe.router`) subclass megatron-core's TopKRouter, which the spec should name")
    moe_submodules.router = PaddingAwareTopKRouter
