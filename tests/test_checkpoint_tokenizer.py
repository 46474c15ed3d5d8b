"""A checkpoint carries its tokenizer, end to end: a tiny training run saves it into --save, and
`python -m megatron_composer.inference.server --load CKPT` (no --tokenizer-model) answers chat
with it, even after the original tokenizer file is gone."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server did not come up in {timeout} s:\n{log.read_text()[-3000:]}")


def test_a_trained_checkpoint_serves_chat_with_only_load(tmp_path):
    from megatron_composer.checkpoint import TOKENIZER_MODEL, checkpoint_tokenizer
    from megatron_composer.data import RandomTokenDataset
    from megatron_composer.data.sft import render_chat
    from megatron_composer.data.tokenizer import Tokenizer
    from tests.serving import SERVE_CONFIG, train_small_tokenizer
    from tests.trainers import make_trainer

    tokenizer = train_small_tokenizer(tmp_path / "tok")
    original = Path(tokenizer.model_path).read_bytes()
    save = tmp_path / "ckpt"
    trainer = make_trainer(RandomTokenDataset(8, 32, SERVE_CONFIG.vocab_size), model_cfg=SERVE_CONFIG,
                           seq_length=32, train_iters=2,
                           checkpoint={"save": str(save), "tokenizer_model": str(tokenizer.model_path)})
    trainer.train()
    carried = save / TOKENIZER_MODEL
    assert carried.read_bytes() == original
    assert checkpoint_tokenizer(str(save)) == str(carried)
    os.remove(tokenizer.model_path)  # the server can only have it from the checkpoint

    messages = [{"role": "user", "content": "def add(a, b):"}]
    expected_prompt, _ = render_chat(messages, Tokenizer(str(carried)), add_generation_prompt=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_composer.inference.server", "--load", str(save), "--port", str(port),
             "--max-model-len", "128", "--max-batch-size", "2"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    try:
        _wait_healthy(url, proc, log)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                       json={"messages": messages, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["prompt_token_ids"] == list(expected_prompt) and 1 <= len(choice["token_ids"]) <= 4
    finally:
        proc.terminate()
        proc.wait(timeout=60)
