"""`rlvr serve`'s API key (issue 17; rlvr.serve.auth): with a key every endpoint refuses a request
without it; without one the admin endpoints (adapter load, weight reload) refuse everyone, however
the path is spelled; a server the trainer launches gets a random key that its client sends, through
the environment, never argv."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rlvr.config import GeneratorConfig, ModelConfig, RunConfig
from rlvr.models import Policy, load_policy
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.server import ServerError, ServerGenerator, build_server_generator, launch_command
from rlvr.serve.app import create_app
from rlvr.serve.auth import ADMIN_PATHS, API_KEY_ENV
from rlvr.serve.runner import BackgroundServer, serve_state
from rlvr.serve.state import ServeState

KEY = "sk-test-7c1e"
ENDPOINTS: list[tuple[str, str, Any]] = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/rollouts/nope", None),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": [2, 40], "max_tokens": 2}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
    ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/tmp"}}),
    ("POST", "/reset_prefix_cache", {}),
]


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return load_policy(str(tiny_model_dir))


class Served:
    def __init__(self, policy: Policy, **options: Any) -> None:
        self.state: ServeState = serve_state(policy, "tiny")
        self.server = BackgroundServer(create_app(self.state, **options)).start()
        self.root = self.server.base_url.removesuffix("/v1")

    def call(
        self, method: str, path: str, body: Any = None, key: str | None = None
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.request(
            method, f"{self.root}{path}", json=body, headers=headers, timeout=60, trust_env=False
        )


@pytest.fixture()
def keyed(policy: Policy) -> Iterator[Served]:
    served = Served(policy, api_key=KEY)
    yield served
    served.server.stop()


@pytest.fixture()
def keyless(policy: Policy) -> Iterator[Served]:
    served = Served(policy)
    yield served
    served.server.stop()


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_with_a_key_every_endpoint_refuses_a_request_without_it(
    keyed: Served, method: str, path: str, body: Any
) -> None:
    for key in (None, "wrong", KEY + "x", KEY[:-1], KEY.upper(), f"{KEY}{KEY}"):
        response = keyed.call(method, path, body, key)
        assert response.status_code == 401, (key, response.text)
        assert "API key" in response.json()["error"]["message"]
    other_scheme = httpx.request(
        method,
        f"{keyed.root}{path}",
        json=body,
        headers={"Authorization": f"Basic {KEY}", "X-Api-Key": KEY},
        trust_env=False,
    )
    assert other_scheme.status_code == 401
    assert keyed.state.weights_version == 0 and not keyed.state.adapters


def test_with_the_key_everything_answers(keyed: Served) -> None:
    assert keyed.call("GET", "/health", key=KEY).status_code == 200
    assert keyed.call("GET", "/v1/models", key=KEY).json()["data"][0]["id"] == "tiny"
    client = openai.OpenAI(base_url=keyed.server.base_url, api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message is not None
    # Admin endpoints are reached (a bad body is the endpoint's own 400, not the key's 401/403).
    bad = keyed.call("POST", "/collective_rpc", {"method": "sleep"}, key=KEY)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "method"
    generator = ServerGenerator(keyed.server.base_url, seed=1, api_key=KEY)
    assert len(generator.generate([[2, 40, 41]], SamplingParams(n=2, max_new_tokens=3))[0]) == 2
    generator.close()
    with pytest.raises(ServerError, match=r"401|API key"):
        ServerGenerator(keyed.server.base_url, seed=1)


@pytest.mark.parametrize("path", sorted(ADMIN_PATHS))
def test_without_a_key_admin_endpoints_refuse_everyone(keyless: Served, path: str) -> None:
    body = {"lora_name": "x", "lora_path": "/tmp", "method": "reload_weights", "kwargs": {}}
    for spelling in (path, path + "/", "/" + path, path.replace("/", "//")):
        response = keyless.call("POST", spelling, body, key="anything")
        assert response.status_code == 403, (spelling, response.status_code, response.text)
        assert "--api-key" in response.json()["error"]["message"]
    assert keyless.state.weights_version == 0 and not keyless.state.adapters
    # Inference stays open on a keyless server.
    assert keyless.call("GET", "/v1/models").status_code == 200


def test_an_in_process_app_may_open_its_admin_endpoints(policy: Policy) -> None:
    served = Served(policy, open_admin=True)
    try:
        bad = served.call("POST", "/collective_rpc", {"method": "sleep"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "method"
    finally:
        served.server.stop()


def test_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        create_app(ServeState(None, None, None, "m"), api_key=" ")  # type: ignore[arg-type]


def test_a_launched_server_gets_its_key_through_the_environment() -> None:
    cfg = GeneratorConfig(backend="server", launch="rlvr")
    argv, env = launch_command(cfg, "/models/m", 8123, api_key="k-123")
    assert env == {API_KEY_ENV: "k-123"} and not any("k-123" in a for a in argv)
    argv, env = launch_command(cfg.model_copy(update={"launch": "vllm"}), "m", 8123, api_key="k-9")
    assert env["VLLM_API_KEY"] == "k-9" and not any("k-9" in a for a in argv)


def test_a_url_server_gets_the_key_from_the_environment(
    keyed: Served, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generator.url: the client sends RLVR_API_KEY; the initial weight sync (an admin call) works."""
    cfg = RunConfig(
        model=ModelConfig(name=str(tiny_model_dir)),
        generator=GeneratorConfig(backend="server", url=keyed.server.base_url),
    )
    policy = load_policy(str(tiny_model_dir))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(ServerError, match=r"401|API key"):
        build_server_generator(policy, cfg, tmp_path)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    generator = build_server_generator(policy, cfg, tmp_path)
    assert keyed.state.weights_version == 1
    generator.close()


def test_the_trainer_launches_rlvr_serve_with_a_random_key(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generator.launch: rlvr: the subprocess refuses requests without the key the trainer made up
    (a key in the trainer's own environment is not it), and the trainer's client is let in, admin
    calls included (the initial weight sync)."""
    monkeypatch.setenv(API_KEY_ENV, "the-users-own-key")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = RunConfig(
        model=ModelConfig(name=str(tiny_model_dir)),
        generator=GeneratorConfig(backend="server", launch="rlvr", startup_timeout_s=120),
    )
    policy = load_policy(str(tiny_model_dir))
    generator = build_server_generator(policy, cfg, tmp_path)
    try:
        sent = generator.client.headers["authorization"]
        assert sent.startswith("Bearer ") and len(sent) > 40 and "the-users-own-key" not in sent
        root = generator.root
        for key in (None, "the-users-own-key"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            answer = httpx.get(f"{root}/v1/models", headers=headers, trust_env=False)
            assert answer.status_code == 401
        assert generator.generate([[2, 40]], SamplingParams(max_new_tokens=2))
        assert generator.process is not None
        cmdline = Path(f"/proc/{generator.process.pid}/cmdline").read_bytes()
        assert sent.removeprefix("Bearer ").encode() not in cmdline
    finally:
        generator.close()


def test_the_cli_refuses_an_empty_key(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "rlvr.cli", "serve", "unused-model", "--api-key", " "],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "empty" in done.stderr
