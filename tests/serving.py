"""Test helpers for the inference server: a tiny model, a tokenizer, a server on loopback."""
import contextlib
import dataclasses
import threading
import time

from megatron_composer.config import get_preset

# 2 layers (dense, then MoE with 4 experts top-2 in 2 groups), hidden 64, vocab 512, one MTP layer.
SERVE_CONFIG = get_preset("tiny").replace(
    num_layers=2, hidden_size=64, vocab_size=512, ffn_hidden_size=128, num_experts=4, moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32, max_position_embeddings=512, init_method_std=0.05)


def build_model(seed=1234, cfg=SERVE_CONFIG):
    from megatron_composer.models import build_model as build
    from megatron_composer.parallel import ParallelLayout
    from megatron_composer.parallel.layout import initialize_parallel
    from megatron_composer.platform import init_distributed

    env = init_distributed()
    layout = ParallelLayout(world_size=env.world_size)
    initialize_parallel(layout, seed=seed)
    return build(cfg, layout, seq_length=cfg.max_position_embeddings).eval()


def train_small_tokenizer(prefix):
    from megatron_composer.data.corpus import stdlib_corpus
    from megatron_composer.data.tokenizer import Tokenizer, train_tokenizer

    tokenizer = Tokenizer(train_tokenizer(stdlib_corpus("valid")[:3], SERVE_CONFIG.vocab_size, prefix))
    assert tokenizer.vocab_size == SERVE_CONFIG.vocab_size
    return tokenizer


def save_model(root, model, cfg=SERVE_CONFIG, iteration=1):
    """A weights-only checkpoint of `model`, as training writes one."""
    from megatron_composer.checkpoint import save_checkpoint

    save_checkpoint(str(root), iteration, model, None, {"model_config": dataclasses.asdict(cfg)})
    return str(root)


@contextlib.contextmanager
def serve(app):
    """Run `app` with uvicorn on a free loopback port; yields the base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
