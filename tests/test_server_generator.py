"""ServerGenerator (rlvr.rollout.server) against rlvr serve's vLLM protocol (rlvr.serve.completions),
on loopback with the tiny random model: exact agreement with the in-process HFGenerator, stop and
length endings, full and LoRA weight sync, 400s for bad input, and the error for a server that
returns no token ids."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from safetensors import safe_open

from rlvr.config import GeneratorConfig, ModelConfig, RunConfig
from rlvr.models import LoraSettings, Policy, load_policy
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.hf import HFGenerator
from rlvr.rollout.server import (
    ServerError,
    ServerGenerator,
    build_server_generator,
    launch_command,
    request_seed,
    wait_for_server,
)
from rlvr.serve.app import create_app
from rlvr.serve.runner import BackgroundServer, serve_state
from rlvr.serve.state import ServeState

PROMPTS = [[2, 40, 41, 42, 43], [2, 50, 51], [2, 60, 61, 62, 63, 64, 65]]


class Served:
    """A loopback rlvr serve over a fresh copy of the tiny model."""

    def __init__(self, model_dir: Path) -> None:
        self.state: ServeState = serve_state(load_policy(str(model_dir)), "tiny")
        # In process, this test its only client: weight syncs without a key (serve/auth.py).
        self.server = BackgroundServer(create_app(self.state, open_admin=True)).start()
        self.url = self.server.base_url

    def post(self, path: str, body: Any) -> httpx.Response:
        root = self.url.removesuffix("/v1")
        return httpx.post(f"{root}{path}", json=body, timeout=60, trust_env=False)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    s = Served(tiny_model_dir)
    yield s
    s.server.stop()


@pytest.fixture()
def fresh(tiny_model_dir: Path) -> Iterator[Served]:
    """A server of its own, for tests that change its weights."""
    s = Served(tiny_model_dir)
    yield s
    s.server.stop()


def forward_logprobs(
    model: Any, prompt: Sequence[int], completion: Sequence[int], temperature: float
) -> torch.Tensor:
    """Log-probs of `completion` after `prompt` from one plain forward at `temperature`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[*prompt, *completion]])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return torch.stack([logp[len(prompt) - 1 + j, t] for j, t in enumerate(completion)])


def assert_logprobs_match(
    model: Any, gen: ServerGenerator, sampling: SamplingParams, prompts: list[list[int]]
) -> None:
    for prompt, completions in zip(prompts, gen.generate(prompts, sampling), strict=True):
        for c in completions:
            expected = forward_logprobs(model, prompt, c.token_ids, sampling.temperature)
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


def test_same_tokens_and_logprobs_as_in_process(served: Served) -> None:
    sampling = SamplingParams(n=3, temperature=0.8, max_new_tokens=10)
    gen = ServerGenerator(served.url, seed=7, max_concurrency=3)
    assert gen.model == "tiny"  # read from /v1/models
    saved = gen.get_state()
    out = gen.generate(PROMPTS, sampling)
    state = served.state
    for i, (prompt, completions) in enumerate(zip(PROMPTS, out, strict=True)):
        reference = HFGenerator(
            state.model,
            state.tokenizer,
            set(state.generator.eos_token_ids),
            seed=request_seed(7, i),
            autocast_bf16=False,
        )
        with state.lock:
            expected = reference.generate([prompt], sampling)[0]
        assert completions == expected  # token ids, log-probs and finish reasons, exactly
    # The seed counter is the generator's state: restoring it replays the same samples.
    assert gen.generate(PROMPTS, sampling) != out
    gen.set_state(saved)
    assert gen.generate(PROMPTS, sampling) == out
    gen.close()


def test_stop_string_and_max_tokens(served: Served) -> None:
    tok = served.state.tokenizer
    request = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24, "seed": 3,
               "temperature": 1.0, "return_token_ids": True, "logprobs": 0}  # fmt: skip
    full = served.post("/v1/completions", request).json()["choices"][0]
    ids = full["token_ids"]
    special = set(tok.all_special_ids)
    # A stop string: the first sampled character not seen before it (character-level vocabulary).
    j = next(
        j for j in range(1, len(ids))
        if ids[j] not in special and tok.decode([ids[j]]) not in tok.decode(ids[:j])
    )  # fmt: skip
    stop = tok.decode([ids[j]])
    cut = served.post("/v1/completions", {**request, "stop": [stop]}).json()["choices"][0]
    assert cut["token_ids"] == ids[: j + 1]  # the ids keep the token that completed the stop
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == tok.decode(ids[:j], skip_special_tokens=True)  # the text does not
    assert cut["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][: j + 1]

    gen = ServerGenerator(served.url, "tiny", seed=1)
    (c,) = gen.generate([PROMPTS[1]], SamplingParams(n=1, max_new_tokens=3))[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    stopped = gen.generate([PROMPTS[0]] * 4, SamplingParams(n=2, max_new_tokens=24, stop=(stop,)))
    eos = set(served.state.generator.eos_token_ids)
    for c in (c for cs in stopped for c in cs):
        text = tok.decode(list(c.token_ids), skip_special_tokens=True)
        assert (c.finish_reason == "stop") == (stop in text or c.token_ids[-1] in eos)
    gen.close()


def test_text_prompt_top_logprobs_and_usage(served: Served) -> None:
    body = served.post(
        "/v1/completions",
        {"model": "tiny", "prompt": ["hi", "yo!"], "n": 2, "max_tokens": 4, "logprobs": 2,
         "seed": 0, "return_tokens_as_token_ids": True, "return_token_ids": True},
    ).json()  # fmt: skip
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][2]["prompt_token_ids"] == served.state.tokenizer.encode("yo!")
    for c in body["choices"]:
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        for token, value, top in zip(
            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
        ):
            assert next(iter(top)) == token and top[token] == value and 2 <= len(top) <= 3
            assert max(top.values()) >= value - 1e-6
    usage = body["usage"]
    assert usage["prompt_tokens"] == 5
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


@pytest.mark.parametrize("lora", [False, True])
def test_full_weight_sync(fresh: Served, tiny_model_dir: Path, tmp_path: Path, lora: bool) -> None:
    # A LoRA learner synced in full sends its merged weights; the server's own stay plain.
    learner = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4) if lora else None)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if not lora or "lora_B" in name:
                p.add_(0.1 * torch.randn_like(p))
    learner.model.eval()
    gen = ServerGenerator(fresh.url, "tiny", weight_sync="full", sync_dir=tmp_path)
    sampling = SamplingParams(n=2, temperature=0.7, max_new_tokens=8)
    (before,) = gen.generate(PROMPTS[:1], sampling)[0][:1]
    moved = forward_logprobs(learner.model, PROMPTS[0], before.token_ids, 0.7)
    assert not torch.allclose(torch.tensor(before.logprobs), moved, atol=1e-3)  # really different

    gen.sync_weights(learner, step=1)
    assert fresh.state.weights_version == 1 and not fresh.state.adapters
    assert_logprobs_match(learner.model, gen, sampling, PROMPTS)
    gen.sync_weights(learner, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full-step-2"]  # the old copy went
    gen.close()


def test_build_from_run_config(fresh: Served, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = RunConfig(
        model=ModelConfig(name=str(tiny_model_dir)),
        generator=GeneratorConfig(backend="server", url=fresh.url, max_concurrency=2),
    )
    policy = load_policy(str(tiny_model_dir))
    gen = build_server_generator(policy, cfg, tmp_path)
    assert fresh.state.weights_version == 1  # auto = full for full fine-tuning, pushed as step 0
    assert (tmp_path / "weight_sync" / "full-step-0").is_dir()
    assert gen.stop_token_ids == sorted(fresh.state.generator.eos_token_ids)
    assert_logprobs_match(policy.model, gen, SamplingParams(n=2, max_new_tokens=6), PROMPTS)
    gen.close()


def test_lora_weight_sync(fresh: Served, tiny_model_dir: Path, tmp_path: Path) -> None:
    learner = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4))

    def perturb(policy: Policy, seed: int) -> None:
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn_like(p))  # B starts at zero: nothing would change

    gen = ServerGenerator(fresh.url, "tiny", weight_sync="auto", sync_dir=tmp_path)
    sampling = SamplingParams(n=2, temperature=0.9, max_new_tokens=8)
    learner.model.eval()
    for step in (1, 2):
        perturb(learner, step)
        gen.sync_weights(learner, step=step)
        assert gen.model == f"rlvr-{gen.run_id}-step-{step}"
        assert list(fresh.state.adapters) == [gen.model]  # the previous adapter was unloaded
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{step}"]
        assert_logprobs_match(learner.model, gen, sampling, PROMPTS)
    # The base name still serves the base weights (adapters off), here and for the chat batcher.
    gen.model = "tiny"
    with learner.reference() as reference:
        assert_logprobs_match(reference, gen, sampling, PROMPTS[:1])
    names = [m["id"] for m in httpx.get(f"{fresh.url}/models", trust_env=False).json()["data"]]
    assert names == ["tiny", f"rlvr-{gen.run_id}-step-2"]
    unload = {"lora_name": f"rlvr-{gen.run_id}-step-2"}
    assert fresh.post("/v1/unload_lora_adapter", unload).status_code == 200
    assert fresh.state.adapters == {} and type(fresh.state.model).__name__ == "LlamaForCausalLM"
    with learner.reference() as reference:
        assert_logprobs_match(reference, gen, sampling, PROMPTS[:1])
    with pytest.warns(UserWarning, match="could not unload"):  # it was unloaded above
        gen.close()


def test_adapter_names_are_unique_per_run_and_unloaded_at_close(
    fresh: Served, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 35 (2): adapters were named rlvr-step-N, so a resumed run (which re-syncs its last
    step) or a second run against the same server asked for a name the server held: HTTP 400
    "already been loaded". Names now carry a per-run id, and close() unloads the run's adapter."""
    learner = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4))
    crashed = ServerGenerator(fresh.url, "tiny", weight_sync="lora", sync_dir=tmp_path / "a")
    crashed.sync_weights(learner, step=1)
    crashed.sync_weights(learner, step=2)
    crashed.client.close()  # the run dies without close(): its adapter stays on the server

    resumed = ServerGenerator(fresh.url, "tiny", weight_sync="lora", sync_dir=tmp_path / "b")
    other = ServerGenerator(fresh.url, "tiny", weight_sync="lora", sync_dir=tmp_path / "c")
    resumed.sync_weights(learner, step=2)  # the resume's sync of the checkpoint's step
    resumed.sync_weights(learner, step=2)  # the same name again: replaced in place
    other.sync_weights(learner, step=2)  # a second run at the same step
    assert len({crashed.model, resumed.model, other.model}) == 3
    assert sorted(fresh.state.adapters) == sorted([crashed.model, resumed.model, other.model])
    sampling = SamplingParams(n=1, max_new_tokens=4)
    assert resumed.generate(PROMPTS[:1], sampling) and other.generate(PROMPTS[:1], sampling)
    resumed.close()
    other.close()
    assert list(fresh.state.adapters) == [crashed.model]  # only the dead run's is left


def test_a_tied_head_is_written_into_every_full_sync(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 35 (1): vLLM's in-place reload kept a tied model's old output head. The fix runs vLLM
    untied (--hf-overrides) and writes lm_head.weight into each sync folder. Here the stand-in
    server plays the untied vLLM: its head is a tensor of its own, which a folder without
    lm_head.weight leaves stale (rlvr serve refuses such a folder); with it, the server samples
    exactly the learner's distribution."""
    from rlvr.rollout.server import tied_head_name

    learner = load_policy(str(tiny_model_dir))
    assert tied_head_name(learner.model) == "lm_head.weight"  # the tiny model ties, as SmolLM2
    torch.manual_seed(0)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    learner.model.eval()

    untied = load_policy(str(tiny_model_dir))
    head = untied.model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # as --hf-overrides untied
    assert tied_head_name(untied.model) is None
    state = serve_state(untied, "tiny")
    with BackgroundServer(create_app(state, open_admin=True)) as server:
        gen = ServerGenerator(server.base_url, "tiny", weight_sync="full", sync_dir=tmp_path)
        gen.sync_weights(learner, step=1)
        assert (tmp_path / "full-step-1" / "lm_head.safetensors").is_file()
        assert gen.last_sync["sync/weight_bytes"] > 0 and gen.last_sync["sync/weight_seconds"] > 0
        assert torch.equal(
            state.model.get_output_embeddings().weight,
            learner.model.get_input_embeddings().weight,
        )
        assert_logprobs_match(learner.model, gen, SamplingParams(n=2, max_new_tokens=6), PROMPTS)
        gen.close()

    cfg = GeneratorConfig(backend="server", launch="vllm")
    argv, env = launch_command(cfg, "/models/m", 8123, weight_sync="full", tied_head=True)
    flag = argv.index("--hf-overrides")
    assert json.loads(argv[flag + 1]) == {"tie_word_embeddings": False}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    argv, _ = launch_command(cfg, "/models/m", 8123, weight_sync="lora", tied_head=True)
    assert "--hf-overrides" not in argv  # adapters leave the head alone


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "nope", "prompt": [1, 2]}, "model"),
        ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [[1, 2], []]}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [1, 10**6]}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "n": 0}, None),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "temperature": -1}, None),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "top_k": 5}, "top_k"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "stream": True}, "stream"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "max_tokens": "x"}, "max_tokens"),
        ("/v1/completions", [1, 2], None),
        ("/v1/load_lora_adapter", {"lora_name": "a"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"}, "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, "lora_name"),
        ("/collective_rpc", {"method": "sleep"}, "method"),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {}}, "kwargs"),
    ],
)
def test_bad_input_is_a_400_with_one_line(
    served: Served, path: str, body: Any, param: str | None
) -> None:
    response = served.post(path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param


def test_server_without_token_ids_is_a_clear_error() -> None:
    app = FastAPI()

    @app.post("/v1/completions")
    def completions() -> dict[str, Any]:  # an OpenAI server that knows nothing of token ids
        logprobs = {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": None}
        return {
            "choices": [{"index": 0, "text": "ab", "finish_reason": "length", "logprobs": logprobs}]
        }

    with BackgroundServer(app) as server:
        gen = ServerGenerator(server.base_url, "m")
        with pytest.raises(ServerError, match=r"return_token_ids .*--return-tokens-as-token-ids"):
            gen.generate([[1, 2]], SamplingParams())
        gen.close()


def test_launch_command_and_a_server_that_dies() -> None:
    cfg = GeneratorConfig(backend="server", launch="vllm", launch_args=["--dtype", "float32"])
    argv, env = launch_command(cfg, "/models/m", 8123, weight_sync="lora", lora_rank=4)
    assert argv[1:6] == ["serve", "/models/m", "--host", "127.0.0.1", "--port"]
    for flag in ("--enable-lora", "--return-tokens-as-token-ids", "processed_logprobs"):
        assert flag in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "8" and argv[-2:] == ["--dtype", "float32"]
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    _, env = launch_command(cfg, "/models/m", 8123, weight_sync="full")
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}
    argv, _ = launch_command(cfg.model_copy(update={"launch": "rlvr"}), "m", 8123)
    assert argv[1:6] == ["-m", "rlvr.cli", "serve", "m", "--host"]

    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(ServerError, match="exited with code 3"):
        wait_for_server("http://127.0.0.1:9/v1", 30, process=dead)


def test_vllm_launch_flags_from_the_config() -> None:
    """generator.vllm becomes vllm serve's flags (launch_args after them win); a server on the
    trainer's GPU takes 0.3 of it by default, one on GPUs of its own vLLM's default share."""
    from rlvr.config import VllmLaunch

    shared = GeneratorConfig(backend="server", launch="vllm")
    argv, env = launch_command(shared, "m", 8123)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.3"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    assert "--max-model-len" not in argv and "CUDA_VISIBLE_DEVICES" not in env
    own = shared.model_copy(
        update={
            "vllm": VllmLaunch(devices="6,7", tensor_parallel_size=2, max_model_len=4096),
            "launch_args": ["--gpu-memory-utilization", "0.8"],
        }
    )
    argv, env = launch_command(own, "m", 8123)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv.count("--gpu-memory-utilization") == 1 and argv[-1] == "0.8"  # the user's


def test_the_mismatch_threshold_follows_the_vllm_dtype() -> None:
    from rlvr.config import load_config
    from rlvr.observe.mismatch import mismatch_setup

    def precision(*sets: str) -> str:
        cfg = load_config(
            None,
            ["model.bf16=off", "generator.backend=server", "generator.launch=vllm", *sets],
        )
        setup = mismatch_setup(cfg)
        assert setup is not None
        return setup.precision

    assert precision() == "bf16"
    assert precision("generator.vllm.dtype=float32") == "fp32"
    assert (
        precision("generator.vllm.dtype=float32", "generator.launch_args=['--dtype','bfloat16']")
        == "bf16"
    )


def test_a_bf16_sync_sends_half_the_bytes_and_the_server_gets_the_rounded_weights(
    fresh: Served, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 35 (3): a bf16 server gets bf16 files (half the bytes of fp32), and what it loads is
    exactly the learner's weights rounded to bf16, which it would have rounded them to anyway."""
    learner = load_policy(str(tiny_model_dir))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sent = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = ServerGenerator(
            fresh.url, "tiny", weight_sync="full", sync_dir=tmp_path / str(dtype), sync_dtype=dtype
        )
        gen.sync_weights(learner, step=1)
        files = sorted((tmp_path / str(dtype) / "full-step-1").glob("*.safetensors"))
        with safe_open(str(files[0]), framework="pt") as handle:
            names = list(handle.keys())  # a safetensors handle is not iterable
            assert {handle.get_tensor(k).dtype for k in names} == {dtype}
        sent[dtype] = gen.last_sync["sync/weight_bytes"]
        gen.close()
    assert sent[torch.bfloat16] == pytest.approx(sent[torch.float32] / 2, rel=0.01)
    served = dict(fresh.state.model.named_parameters())
    for name, p in learner.model.named_parameters():
        assert torch.equal(served[name], p.detach().to(torch.bfloat16).float()), name


def test_the_sync_dtype_follows_the_server(tmp_path: Path) -> None:
    def dtype(**fields: object) -> str:
        return GeneratorConfig.model_validate({"backend": "server", **fields}).resolved_sync_dtype()

    assert dtype(launch="vllm") == "bfloat16"  # generator.vllm.dtype's default
    assert dtype(launch="vllm", vllm={"dtype": "float32"}) == "float32"
    assert dtype(launch="vllm", vllm={"dtype": "auto"}) == "float32"  # vLLM casts as it likes
    assert dtype(launch="vllm", launch_args=["--dtype=half"]) == "float16"  # argv wins
    assert dtype(launch="rlvr") == "float32"
    assert dtype(url="http://h:8000/v1") == "float32"  # a server rlvr did not start: unknown
    assert dtype(url="http://h:8000/v1", vllm={"dtype": "bfloat16"}) == "bfloat16"
    assert dtype(launch="vllm", sync_dtype="float32") == "float32"


def test_a_launched_server_syncs_through_shared_memory(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server rlvr launches reads syncs from a fresh folder in shared memory, removed at close;
    without room for two syncs (a container's 64 MB /dev/shm) the run directory, with a warning;
    a server at a URL, or a sync_dir given, gets what the config says."""
    from rlvr.rollout import server

    policy = load_policy(str(tiny_model_dir))
    shared = tmp_path / "shm"
    shared.mkdir()

    class Roomy:  # 64 GiB in all, 60 free: whatever the disk under tmp_path has
        f_frsize, f_blocks, f_bavail = 4096, 16 * 2**20, 15 * 2**20

    class Tiny:  # 64 MiB in all, 1 MiB free
        f_frsize, f_blocks, f_bavail = 4096, 16384, 256

    monkeypatch.setattr(server.os, "statvfs", lambda path: Roomy())
    launched = GeneratorConfig(backend="server", launch="rlvr")
    folder, owned = server.choose_sync_dir(launched, tmp_path / "run", policy, shared)
    assert owned and folder.parent == shared and folder.is_dir()
    gen = ServerGenerator.__new__(ServerGenerator)  # close() only: no server to talk to
    gen.pool, gen._synced, gen.process, gen.client = None, None, None, httpx.Client()
    gen.sync_dir, gen.owns_sync_dir = folder, owned
    gen.close()
    assert not folder.exists()

    at_url = GeneratorConfig(backend="server", url="http://h:8000/v1")
    assert server.choose_sync_dir(at_url, tmp_path / "run", policy, shared) == (
        tmp_path / "run" / "weight_sync",
        False,
    )
    given = GeneratorConfig(backend="server", launch="rlvr", sync_dir=str(tmp_path / "mine"))
    assert server.choose_sync_dir(given, tmp_path, policy, shared) == (tmp_path / "mine", False)

    monkeypatch.setattr(server.os, "statvfs", lambda path: Tiny())
    with pytest.warns(UserWarning, match="weight syncs go to .*weight_sync"):
        folder, owned = server.choose_sync_dir(launched, tmp_path / "run", policy, shared)
    assert (folder, owned) == (tmp_path / "run" / "weight_sync", False)


def test_a_killed_run_removes_its_shared_memory_folder(tmp_path: Path) -> None:
    """The hang watchdog ends the process with os._exit (no close, no atexit): RolloutPlan.abandon
    removes the sync folder made in shared memory, which would hold RAM until the next reboot."""
    from types import SimpleNamespace

    from rlvr.train.rollouts import RolloutPlan

    folder = tmp_path / "rlvr-sync-x"
    (folder / "full-step-3").mkdir(parents=True)
    generator = SimpleNamespace(process=None, owns_sync_dir=True, sync_dir=folder)
    RolloutPlan.abandon(SimpleNamespace(generator=generator))  # type: ignore[arg-type]
    assert not folder.exists()
    kept = tmp_path / "given"
    kept.mkdir()
    RolloutPlan.abandon(  # type: ignore[arg-type]
        SimpleNamespace(generator=SimpleNamespace(process=None, owns_sync_dir=False, sync_dir=kept))
    )
    assert kept.exists()  # a sync_dir the user gave is theirs


def test_a_connection_closed_without_an_answer_is_retried_once() -> None:
    """The keep-alive race (CI, stop 56): a server closing a pooled connection as a request goes
    out answers nothing (RemoteProtocolError); a reset connection reads ECONNRESET (ReadError).
    The generator sends the request once more on a new connection; a server that closes every
    connection is an error after two tries."""
    import socket
    import struct
    import threading

    body = json.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "token_ids": [7, 8],
                    "finish_reason": "length",
                    "logprobs": {"token_logprobs": [-1.0, -2.0]},
                }
            ]
        }
    ).encode()
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )

    def serve(listener: socket.socket, answered: list[str], seen: list[int]) -> None:
        for reply in answered:
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:  # the client went away: no request to count, no busy loop
                        return
                    data += chunk
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(rest) < length and (chunk := conn.recv(65536)):
                    rest += chunk
                seen.append(len(rest))
                if reply == "answer":
                    conn.sendall(answer)
                elif reply == "reset":  # RST, not FIN: the client reads ECONNRESET (ReadError)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # "close": closed with no answer, as a stale keep-alive connection is

    cases = (
        (["close", "answer"], "ok"),
        (["reset", "answer"], "ok"),
        (["close", "close"], "RemoteProtocolError"),
    )
    for answered, outcome in cases:
        listener = socket.create_server(("127.0.0.1", 0))
        seen: list[int] = []
        thread = threading.Thread(target=serve, args=(listener, answered, seen), daemon=True)
        thread.start()
        gen = ServerGenerator(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", "m")
        try:
            if outcome == "ok":
                [[completion]] = gen.generate([[1, 2]], SamplingParams(max_new_tokens=2))
                assert completion.token_ids == (7, 8)
            else:
                with pytest.raises(ServerError, match=outcome):
                    gen.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        finally:
            gen.close()
            thread.join(5)
            listener.close()
        assert len(seen) == 2 and seen[0] == seen[1] > 0  # the same request, twice, no more
