"""The rollout engine: continuous batching over an MLA latent KV cache.

What comes from megatron-core and what is ours:

* megatron-core: the model and its weights (GPTModel's embedding, MLA
  projections and norms, its RoPE table and unfused RoPE, the dense MLPs,
  the MoE router, shared expert and experts, the MTP layers, the output
  head), `RouterReplay` (in record mode) for the routed experts, and
  checkpoints through our DCP loader. Modules are called as they are, except
  the linears the runner multiplies itself and the MoE token dispatcher it
  skips when every expert is local (`runner.py` says why; both exact).
* ours, because megatron-core's pieces do not run without CUDA: its
  `DynamicInferenceContext` (the one with `cache_mla_latent`) allocates its
  block tables and KV memory on `torch.cuda.current_device()` and attends to
  cached latents with flash-attn / FlashMLA kernels; its text-generation
  controller samples every request from one generator created on the CUDA
  device (so a request's tokens depend on what else is batched); its
  OpenAI-style endpoints (Flask + hypercorn) drive that dynamic engine
  through its coordinator. So: the incremental forward over a latent cache
  (`runner.py`), the scheduler here, per-request sampling (`sampling.py`),
  MTP speculative decoding (`speculative.py`), in-flight weight updates
  (`weights.py`) and a FastAPI server (`server.py`).

Each `step()`:

1. admits waiting requests into free cache slots (`max_batch_size` slots);
2. schedules every running request's new tokens as one flat batch: one token
   (plus its MTP draft) per decoding request, and prompt chunks of at most
   `prefill_chunk_size` tokens in all for requests still in prefill;
3. runs the trunk once over the batch, recording every token's experts;
4. samples (or verifies drafts) per request with the request's own
   parameters and seed; tokens record the weights version of this forward
   and their log-prob at the request's temperature (`Completion.logprobs`);
5. drafts the next token with the MTP layer for speculative requests;
6. finishes requests at a stop id / string, `max_tokens` or `max_model_len`,
   frees their slots and hands back a `Completion`.

`update_weights` takes the step lock, so an update lands between two steps;
running sequences keep their cached latents from older weights. A request's
tokens are identical whatever else is batched with it up to floating-point
reassociation in batched GEMMs (fp32 differences ~1e-6).
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Callable, Optional

import torch

from ..checkpoint.state import global_param_names, model_state_dict
from .params import Completion, GenerationEvent, SamplingParams, SpeculativeStats
from .runner import ModelRunner, Segment
from .sampling import sample, sampling_logprobs, temperature_logprobs
from .speculative import MTPDrafter
from .weights import stage_update


class RequestHandle:
    """A submitted request: wait for its `Completion` with `result()`, or `cancel()` it."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._done = threading.Event()
        self._completion: Optional[Completion] = None
        self._error: Optional[BaseException] = None
        self.cancelled = False

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating; the completion ends with the tokens so far (finish_reason "stop")."""
        self.cancelled = True

    def result(self, timeout: Optional[float] = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._completion

    def _finish(self, completion: Optional[Completion], error: Optional[BaseException] = None) -> None:
        self._completion, self._error = completion, error
        self._done.set()


class _Request:
    """Engine-side state of one request."""

    def __init__(self, request_id, prompt, params, handle, on_token, generator):
        self.id, self.prompt, self.params, self.handle = request_id, list(prompt), params, handle
        self.on_token, self.generator = on_token, generator
        self.tokens = list(prompt)  # prompt + generated
        self.num_computed = 0  # tokens whose latents are in the cache
        self.slot: Optional[int] = None
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.sampling_logprobs: list[float] = []
        self.top_logprobs: list = []
        self.versions: list[int] = []
        self.routed: list[torch.Tensor] = []
        self.finish_reason: Optional[str] = None
        self.drafter_state = None  # MTPDrafter's per-request state
        self.stats = SpeculativeStats() if params.speculative else None
        self.text_checked = 0

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


class Engine:
    """Generate from a Composer model; see the module docstring.

    Args:
        model: a GPTModel from `models.build_model` (local layer spec, one
            replica per process), on the device to run on; shared with a
            trainer when RL colocates them.
        model_config: its `config.ModelConfig`.
        tokenizer: a `data.tokenizer.Tokenizer`, needed for `stop` strings and `Completion.text`.
        max_batch_size: cache slots (requests decoding at once).
        max_model_len: longest prompt + completion (default: the model's
            max_position_embeddings, at most 4096 on CPU).
        prefill_chunk_size: prompt tokens fed per step across all prefilling requests.
        seed: the generator for requests without a seed.
        version: the weights version of `model` as given.
    """

    def __init__(self, model, model_config, tokenizer=None, *, max_batch_size: int = 16,
                 max_model_len: Optional[int] = None, prefill_chunk_size: int = 256, seed: int = 0,
                 version: int = 0):
        if max_batch_size < 1 or prefill_chunk_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}, prefill_chunk_size={prefill_chunk_size}; "
                             f"both must be >= 1")
        limit = model_config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit if torch.cuda.is_available() else min(limit, 4096)
        if not 2 <= max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len}; use 2 .. the model's max_position_embeddings "
                             f"({limit})")
        self.model, self.model_config, self.tokenizer = model, model_config, tokenizer
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.prefill_chunk_size = prefill_chunk_size
        model.eval()
        # + 1: the position a speculative draft of the last token may occupy
        self.runner = ModelRunner(model, max_batch_size, max_model_len + 1)
        self.drafter = MTPDrafter(self.runner)
        self.device = self.runner.device
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._version = version
        self._lock = threading.RLock()  # held by step() and by weight updates
        self._incoming: collections.deque = collections.deque()
        self._running: list[_Request] = []
        self._free_slots = list(range(max_batch_size))
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self.steps = 0
        self.busy_seconds = 0.0  # wall time spent inside step() (an idle-fraction witness for RL services)
        self.generated_tokens = 0
        self.max_running = 0  # most requests decoding together so far (a batching witness)

    # ------------------------------------------------------------ construction
    @classmethod
    def from_checkpoint(cls, path: str, *, device=None, dtype=None, tokenizer=None, **engine_kwargs) -> "Engine":
        """An engine on a megatron-composer checkpoint (a root or an iter_XXXXXXX dir; one converted
        from Hugging Face is the same). `device`: default cuda when available, else cpu; `dtype`:
        default float32 on CPU, bfloat16 on CUDA. `tokenizer`: a Tokenizer or a .model path."""
        from ..models.loading import load_checkpoint_model

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        cfg_len = engine_kwargs.get("max_model_len")
        model, cfg = load_checkpoint_model(path, seq_length=cfg_len or 4096)
        model = model.to(device=device, dtype=dtype)
        if isinstance(tokenizer, str):
            from ..data.tokenizer import Tokenizer

            tokenizer = Tokenizer(tokenizer)
        if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer {tokenizer} has {tokenizer.vocab_size} pieces but the model's vocab_size "
                             f"is {cfg.vocab_size}; use the tokenizer the checkpoint was trained with")
        return cls(model, cfg, tokenizer, **engine_kwargs)

    @property
    def version(self) -> int:
        return self._version

    def kv_cache_bytes_per_token(self) -> dict[str, int]:
        """{"latent": bytes this engine caches per token, "expanded": per-head K and V would take}."""
        return self.runner.kv_bytes_per_token()

    # ------------------------------------------------------------ requests
    def check_prompt(self, prompt) -> list[int]:
        """The prompt as a list of ints, or a ValueError naming what is wrong."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError(f"a prompt is a list of token ids; got {type(prompt).__name__}") from None
        if any(isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt is a list of token ids; got booleans")
        if not ids:
            raise ValueError("the prompt is empty; give at least one token id")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this engine's max_model_len is "
                             f"{self.max_model_len} (prompt + at least one generated token)")
        return ids

    def add_request(self, prompt, params: SamplingParams, *, request_id: Optional[str] = None,
                    on_token: Optional[Callable[[GenerationEvent], None]] = None) -> RequestHandle:
        """Queue one request (thread-safe); it joins the batch at the next step."""
        ids = self.check_prompt(prompt)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams; got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={list(params.stop)} needs a tokenizer; pass one to the engine or use "
                             f"stop_token_ids")
        if params.speculative:
            self.drafter.check(params)
        request_id = request_id or f"req-{next(self._ids)}"
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        handle = RequestHandle(request_id)
        self._incoming.append(_Request(request_id, ids, params, handle, on_token, generator))
        with self._wake:
            self._wake.notify()
        return handle

    def has_unfinished(self) -> bool:
        return bool(self._incoming or self._running)

    def generate(self, prompts: list, params: SamplingParams) -> list[Completion]:
        """Generate one completion per prompt (token id lists), batched; blocks until all finish."""
        handles = [self.add_request(p, params) for p in prompts]
        if self._thread is None:
            while not all(h.done() for h in handles):
                self.step()
        return [h.result() for h in handles]

    # ------------------------------------------------------------ background loop
    def start(self) -> None:
        """Run steps in a background thread while requests are pending (for servers)."""
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop = True
        with self._wake:
            self._wake.notify()
        self._thread.join()
        self._thread = None

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread; this one starts on cuda:0
        while not self._stop:
            with self._wake:
                if not self.has_unfinished():
                    self._wake.wait(timeout=0.1)
                    continue
            try:
                self.step()
            except Exception as exc:  # a failed step fails its requests, never the loop
                self._fail_running(exc)

    def _fail_running(self, exc: BaseException) -> None:
        with self._lock:
            for req in list(self._running):
                self._release(req)
                error = RuntimeError(f"generation failed: {exc!r}")
                self._notify_failed(req, error)
                req.handle._finish(None, error)

    # ------------------------------------------------------------ weights
    def update_weights(self, source, version: Optional[int] = None) -> int:
        """Swap in new weights between two steps; returns the new version.

        source: a state dict (global or local parameter names, any subset), a
        checkpoint path, a delta {name: {"indices": flat int64, "values": tensor}},
        or None when the shared model was updated in place (a colocated trainer).
        Everything is read and checked before the step lock is taken; a bad
        source raises ValueError and changes nothing. Running sequences keep
        generating; their cached latents stay those of the older weights.
        """
        # None (a shared model updated in place) has nothing to stage: skip naming every tensor
        apply = None if source is None else stage_update(model_state_dict(self.model), source,
                                                         global_param_names(self.model))
        with self._lock:
            if apply is not None:
                apply()
            self._version = self._version + 1 if version is None else int(version)
            return self._version

    def pause(self) -> None:
        """Hold the scheduler (no decode step starts) until `resume`, from the same thread: an in-flight
        weight swap made of several calls happens between two steps."""
        self._lock.acquire()

    def resume(self) -> None:
        self._lock.release()

    # ------------------------------------------------------------ the step
    def step(self) -> list[Completion]:
        """One scheduler iteration (see the module docstring); returns the requests finished by it."""
        with self._lock, torch.no_grad():
            started = time.perf_counter()
            self._admit()
            for req in [r for r in self._running if r.handle.cancelled]:
                req.finish_reason = "stop"
            finished = [r for r in self._running if r.finish_reason]
            batch = self._schedule()
            if batch:
                self._forward(batch)
            finished += [r for r in self._running if r.finish_reason and r not in finished]
            self.steps += 1
            done = [self._finish(r) for r in finished]
            self.generated_tokens += sum(len(c.token_ids) for c in done)
            self.busy_seconds += time.perf_counter() - started
            return done

    def _admit(self) -> None:
        while self._incoming and self._free_slots:
            req = self._incoming.popleft()
            req.slot = self._free_slots.pop(0)
            self._running.append(req)
        self.max_running = max(self.max_running, len(self._running))

    def _schedule(self) -> list[tuple[_Request, int, list[int]]]:
        """(request, first position, tokens to feed) of this step."""
        batch, budget = [], self.prefill_chunk_size
        for req in self._running:
            if req.finish_reason:
                continue
            if not req.prefilling:
                draft = self.drafter.draft_tokens(req)
                batch.append((req, req.num_computed, req.tokens[req.num_computed:] + draft))
            elif budget > 0:
                n = min(budget, len(req.prompt) - req.num_computed)
                budget -= n
                batch.append((req, req.num_computed, req.tokens[req.num_computed:req.num_computed + n]))
        return batch

    def _forward(self, batch) -> None:
        device = self.device
        segments = [Segment(req.slot, start, len(toks)) for req, start, toks in batch]
        tokens = torch.tensor([t for _, _, toks in batch for t in toks], dtype=torch.long, device=device)
        positions = torch.tensor([start + i for _, start, toks in batch for i in range(len(toks))],
                                 dtype=torch.long, device=device)
        hidden, routed = self.runner.trunk(tokens, positions, segments)
        # rows whose logits are needed: the last prompt token, or every fed token while decoding
        rows, offset = [], 0
        for req, start, toks in batch:
            done_prefill = start + len(toks) >= len(req.prompt)
            first = offset + (len(toks) - 1 if req.prefilling else 0)
            rows.append(list(range(first, offset + len(toks))) if done_prefill else [])
            offset += len(toks)
        flat = [r for rs in rows for r in rs]
        logits = self.runner.logits(hidden[flat]) if flat else None
        offset, used = 0, 0
        for (req, start, toks), req_rows in zip(batch, rows):
            req_logits = logits[used:used + len(req_rows)] if req_rows else None
            used += len(req_rows)
            self._advance(req, start, toks, hidden[offset:offset + len(toks)],
                          None if routed is None else routed[offset:offset + len(toks)], req_logits)
            offset += len(toks)
        self.drafter.draft([req for req, _, _ in batch if req.params.speculative and not req.finish_reason
                            and not req.prefilling], self._generator_of)

    def _advance(self, req: _Request, start: int, toks: list[int], hidden, routed, logits) -> None:
        """Take this step's output for one request: sample (or verify drafts), record experts and
        versions. The j-th new token is drawn from row j of `logits`."""
        if req.prefilling:
            req.num_computed = start + len(toks)
            self._keep(req, routed, hidden, start, len(toks))
            if req.prefilling:
                return
            new = [self._sample(req, logits[-1])]
        else:
            new = self.drafter.verify(req, toks, logits, self._generator_of(req)) if len(toks) > 1 else \
                [self._sample(req, logits[0])]
            fed = len(new)  # the pending token and the accepted drafts
            req.num_computed = start + fed
            self._keep(req, routed, hidden, start, fed)
        event = GenerationEvent(req.id, [], [], [], [], [])
        reported = temperature_logprobs(logits[:len(new)], req.params.temperature)
        for (token, sampling_lp), row in zip(new, reported):
            self._append(req, token, sampling_lp, row, event)
            if req.finish_reason:
                break
        if event.token_ids and req.on_token is not None:
            req.on_token(event)

    def _keep(self, req, routed, hidden, start, n) -> None:
        """Keep the experts (and, for MTP drafting, the trunk's hidden states) of the n tokens fed from `start`."""
        if routed is not None and req.params.return_routed_experts:
            req.routed.append(routed[:n].cpu())
        if req.params.speculative:
            self.drafter.keep_hidden(req, hidden[:n], start)

    def _sample(self, req: _Request, logits: torch.Tensor):
        """(token, its sampling log-prob) from one row of float32 logits [vocab]."""
        p = req.params
        if p.greedy:
            return int(torch.argmax(logits)), 0.0
        lp = sampling_logprobs(logits[None], p.temperature, p.top_k, p.top_p)
        token = int(sample(lp, self._generator_of(req)))
        return token, float(lp[0, token])

    def _generator_of(self, req: _Request) -> torch.Generator:
        return req.generator if req.generator is not None else self._generator

    def _append(self, req: _Request, token: int, sampling_lp: float, reported: torch.Tensor,
                event: GenerationEvent) -> None:
        """Record one new token; `reported` [vocab]: log_softmax(logits / T) of its row (T = 1 when greedy)."""
        p = req.params
        req.tokens.append(token)
        req.generated.append(token)
        req.versions.append(self._version)
        event.token_ids.append(token)
        event.policy_versions.append(self._version)
        if p.logprobs or p.top_logprobs:
            lp = float(reported[token])
            req.logprobs.append(lp)
            req.sampling_logprobs.append(sampling_lp)
            event.logprobs.append(lp)
            event.sampling_logprobs.append(sampling_lp)
        if p.top_logprobs:
            values, ids = torch.topk(reported, p.top_logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
            req.top_logprobs.append(top)
            event.top_logprobs.append(top)
        if token in p.stop_token_ids or self._hit_stop_string(req):
            req.finish_reason = "stop"
        elif len(req.generated) >= p.max_tokens or len(req.tokens) >= self.max_model_len:
            req.finish_reason = "length"

    def _hit_stop_string(self, req: _Request) -> bool:
        if not req.params.stop:
            return False
        text = self._decode(req.generated)
        return any(s in text for s in req.params.stop)

    def _decode(self, ids: list[int]) -> str:
        """Text of ids; ids past the tokenizer's pieces (a padded model vocabulary) decode to nothing."""
        vocab = self.tokenizer.vocab_size
        return self.tokenizer.decode([t for t in ids if t < vocab])

    def _finish(self, req: _Request) -> Completion:
        try:
            completion = self._completion(req)
        except Exception as exc:  # the handle must finish whatever went wrong
            self._release(req)
            error = RuntimeError(f"request {req.id} failed while finishing: {exc!r}")
            self._notify_failed(req, error)
            req.handle._finish(None, error)
            raise
        self._release(req)
        if req.on_token is not None:
            req.on_token(GenerationEvent(req.id, [], [], [], [], [], finished=True, completion=completion))
        req.handle._finish(completion)
        return completion

    def _release(self, req: _Request) -> None:
        if req in self._running:
            self._running.remove(req)
            self._free_slots.append(req.slot)

    @staticmethod
    def _notify_failed(req: _Request, error: BaseException) -> None:
        if req.on_token is not None:
            try:
                req.on_token(GenerationEvent(req.id, [], [], [], [], [], finished=True, error=str(error)))
            except Exception:  # a failing callback must not stop the others from hearing
                pass

    def _completion(self, req: _Request) -> Completion:
        routed = None
        if req.params.return_routed_experts:
            fed = torch.cat(req.routed) if req.routed else torch.empty(0, 0, 0, dtype=torch.int32)
            total = len(req.tokens)
            runner = self.runner
            shape = (total, len(runner.moe_layers), self.model_config.moe_router_topk if runner.moe_layers else 0)
            routed = torch.full(shape, -1, dtype=torch.int32)
            kept = min(len(fed), total - 1)  # the last generated token's row stays -1 (never fed)
            routed[:kept] = fed[:kept]
        return Completion(
            prompt_token_ids=req.prompt, token_ids=req.generated,
            logprobs=req.logprobs if req.params.logprobs else [],
            sampling_logprobs=req.sampling_logprobs if req.params.logprobs else [],
            routed_experts=routed, policy_versions=req.versions, finish_reason=req.finish_reason,
            speculative=req.stats, request_id=req.id,
            text=self._decode(req.generated) if self.tokenizer is not None else None,
            top_logprobs=req.top_logprobs)
