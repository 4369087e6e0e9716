"""Fixtures for `k3 serve` tests: a tiny random-init checkpoint with a toy tokenizer, and servers on random free
loopback ports (uvicorn in a background thread)."""
import socket
import threading
import time

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.tokenizer import build_toy_tokenizer


def tiny_config(tok, dtype="float32"):
    L = 3
    return K3Config.from_preset(
        "tiny", vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=L, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
        routed_expert_hidden_size=32, intermediate_size=96, attn_res_block_size=2, kda_gate_low_rank=8,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, dtype=dtype,
        linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                full_attn_layers=[2], kda_layers=[1, 3]))


def make_checkpoint(root, dtype="float32", seed=0):
    """(dir, tokenizer) of a random-init tiny model saved with save_pretrained."""
    tok = build_toy_tokenizer(str(root / "tok"), num_merges=100)
    cfg = tiny_config(tok, dtype)
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    with torch.no_grad():  # sharper distributions than the default init: outputs depend on the prompt
        model.lm_head.weight.normal_(0, 1.0)
    d = str(root / "k3-test")
    model.save_pretrained(d, tokenizer=tok)
    return d, tok


class ServerThread:
    """The `k3 serve` uvicorn server (k3.serve.app.make_server) for `app` on 127.0.0.1:<free port> in a daemon
    thread; `rc` is run_server's exit code once it has stopped."""

    def __init__(self, app, **server_kw):
        from k3.serve.app import make_server
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.app = app
        server_kw.setdefault("timeout_graceful_shutdown", 2)
        self.server = make_server(app, log_level="warning", **server_kw)
        self.rc = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        t = time.time()
        while not self.server.started:
            if time.time() - t > 30 or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def _run(self):
        self.server.run(sockets=[self.sock])
        self.rc = 1 if self.app.state.engine.scheduler.fatal is not None else 0

    @property
    def engine(self):
        return self.app.state.engine

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests run many tiny ops: one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="package")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="package")
def loaded(ckpt):
    from k3.generation.cli import load_for_inference
    d, _ = ckpt
    return load_for_inference(d, "cpu")


def start_server(loaded, server_kw=None, **kw):
    from k3.serve import ServeConfig, create_app
    model, tok = loaded
    kw.setdefault("model_name", "k3-test")
    kw.setdefault("max_context", 192)
    return ServerThread(create_app(model, tok, ServeConfig(**kw)), **(server_kw or {}))


@pytest.fixture(scope="package")
def server(loaded):
    s = start_server(loaded, max_batch=16, max_queue=32, default_max_tokens=8)
    yield s
    s.close()
