"""Generation on an OpenAI-compatible server (`vllm serve`, or `rlvr serve` speaking the same protocol).

Longer than our ~500-line guide on purpose: client, launcher and weight sync each follow one
server's rules (vLLM's flags and endpoints); kept together so a vLLM change is met in one file.

`ServerGenerator` is a Generator (rollout/generator.py) over HTTP: one POST /v1/completions per prompt,
its n samples in one request, up to `max_concurrency` requests in flight. Prompts go as token ids and
the sampled ids come back exactly (`return_token_ids`), so nothing is re-tokenized; the log-probs are
the server's. The protocol (endpoints, fields, vLLM versions) is written down in
rlvr/serve/completions.py, which serves it from `rlvr serve`.

Reproducible: request k of the run is sent with a seed derived from (seed, k); the counter k is the
generator's checkpointed state (`get_state` / `set_state`), so a resumed run sends the seeds the
uninterrupted one would have. rlvr serve then samples exactly what an in-process HFGenerator seeded
with that seed samples; vLLM is reproducible per seed on the same hardware and batch layout.

After each update `sync_weights` moves the learner's weights to the server:
- lora: the adapter is saved to SYNC_DIR/step-N and loaded as `rlvr-RUN-step-N`
  (/v1/load_lora_adapter; RUN is random per generator, so a resumed run or a second run against
  the same server never asks for a name the server already holds: vLLM answers 400 "already been
  loaded"); later requests name it as `model`; the previous one is unloaded, and the last one at
  `close()`;
- full: the (merged) weights are written to SYNC_DIR/full-step-N as safetensors shards in the
  dtype the server computes in (`generator.sync_dtype`: bf16 for a bf16 vLLM, half the bytes of
  fp32), cast one tensor at a time, and the server reloads them in place (/collective_rpc
  reload_weights, then /reset_prefix_cache: vLLM's dev-mode endpoints). For a server rlvr
  launches, SYNC_DIR defaults to a folder in shared memory (/dev/shm), so a sync is a copy through
  RAM, never the disk (`choose_sync_dir`). vLLM's NCCL weight transfer (GPU to GPU, no copy on the
  host) is not used yet. Each sync's bytes and seconds are logged (`sync/weight_bytes`,
  `sync/weight_seconds`). A model
  whose output head is tied to its input embedding (SmolLM2, Qwen2.5-0.5B/1.5B, Llama 3.2 1B/3B)
  gets `lm_head.weight` written explicitly, and a launched vLLM runs it untied
  (`--hf-overrides {"tie_word_embeddings": false}`): vLLM's reload_weights skips the head of a tied
  model, so it kept sampling from the old head after every sync (a canary gap of ~3e-3 per token in
  fp32, ~400x noise; issue 35);
- none: the server keeps its weights (evaluation).

Which log-probs: vLLM reports the tempered ones only with --logprobs-mode processed_logprobs (the
launcher passes it; a server started by hand needs it too, or its log-probs are those of temperature
1), and with top_p < 1 vLLM renormalises them over the nucleus where this project's convention does
not: the trainer's truncated importance sampling absorbs the difference, which is why a server
backend turns it on.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from rlvr.config import GeneratorConfig, RunConfig
from rlvr.errors import ConfigError, RlvrError
from rlvr.models import Policy, eos_token_ids, resolve_model_path
from rlvr.observe.watchdog import watch
from rlvr.rollout.endpoints import API_KEY_ENV, free_port
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.weight_files import Deferred, Weight, write_shards

MASK64 = (1 << 64) - 1
# A request whose connection broke before an answer came is sent once more (`_send`). vLLM's uvicorn
# closes a connection idle for 5 s and httpx's pool keeps one for 5 s: a request sent on a pooled
# connection as the server closes it dies with RemoteProtocolError "Server disconnected without
# sending a response" (CI, stop 56: a LoRA run idle through its update). Shortening the pool's
# keep-alive instead (2 s) was followed in CI by ReadError "Bad file descriptor" with many threads,
# likely httpcore closing a connection it had just handed to another thread (encode/httpcore#1110):
# the default stays.
RETRIED_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


class ServerError(RlvrError):
    """The generation server failed, refused a request, or answered outside the protocol."""


def request_seed(seed: int, index: int) -> int:
    """The seed sent with request `index` of a generator seeded `seed`: splitmix64 of both, so nearby
    runs and requests get unrelated streams; below 2**31 for any server's seed field."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def server_root(url: str) -> str:
    """http://host:port from a base URL given with or without the /v1 suffix."""
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class ServerGenerator:
    """Generator over a completions server at `base_url` serving `model` (None: the first entry of
    /v1/models). `process`: a server this object launched, terminated by `close()`. `api_key`: sent
    as `Authorization: Bearer` on every request (rlvr serve's and vLLM's --api-key)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        seed: int = 0,
        max_concurrency: int = 32,
        request_timeout_s: float = 600.0,
        weight_sync: str = "none",
        sync_dir: str | Path | None = None,
        stop_token_ids: Sequence[int] = (),
        process: subprocess.Popen[bytes] | None = None,
        api_key: str | None = None,
        sync_dtype: torch.dtype = torch.float32,
        owns_sync_dir: bool = False,
    ) -> None:
        self.root = server_root(base_url)
        self.seed = seed
        self.counter = 0  # requests sent so far: the next one's seed index
        self.max_concurrency = max_concurrency
        self.weight_sync = weight_sync
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self.sync_dtype = sync_dtype  # of a full sync's files (generator.sync_dtype)
        self.owns_sync_dir = (
            owns_sync_dir  # made for this generator (shared memory): removed at close
        )
        self.last_sync: dict[str, float] = {}  # sync/weight_bytes, sync/weight_seconds
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.process = process
        self.api_key = api_key  # torchrun: rank 0 hands it to the other ranks (same server)
        # No proxies from the environment: the server is named explicitly, usually on loopback.
        self.client = httpx.Client(
            timeout=request_timeout_s,
            trust_env=False,
            limits=httpx.Limits(max_connections=max_concurrency),
            headers=auth_headers(api_key),
        )
        self.pool: ThreadPoolExecutor | None = None
        self.base_model = model or self._first_model()
        self.model = self.base_model  # the name requests use: the synced adapter's, with LoRA
        # Part of every adapter name: unique per generator, so names never collide across runs.
        self.run_id = secrets.token_hex(4)
        # (adapter name, or "" for full weights; its folder) of the last sync
        self._synced: tuple[str, Path] | None = None

    # --------------------------------------------------------------------------------------- state
    def get_state(self) -> torch.Tensor:
        return torch.tensor([self.seed, self.counter], dtype=torch.int64, device="cpu")

    def set_state(self, state: torch.Tensor) -> None:
        if tuple(state.shape) != (2,):
            # A checkpoint of another backend (HFGenerator's RNG bytes): its stream cannot carry over.
            warnings.warn(
                "generator state from another backend ignored: the server generator's request seeds "
                "restart from the counter 0",
                stacklevel=2,
            )
            return
        self.seed, self.counter = (int(v) for v in state.tolist())

    # ------------------------------------------------------------------------------------ generate
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        if not prompts:
            return []
        first = self.counter
        self.counter += len(prompts)
        payloads = [
            self._payload(p, sampling, request_seed(self.seed, first + i))
            for i, p in enumerate(prompts)
        ]
        if len(payloads) == 1:
            return [self._complete(payloads[0], sampling.n)]
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="rlvr-gen")
        futures = [self.pool.submit(self._complete, p, sampling.n) for p in payloads]
        return [f.result() for f in futures]

    def canary(self, prompt: Sequence[int], *, n: int, max_tokens: int) -> list[Completion]:
        """`n` samples of `prompt` at temperature 1 with a fixed seed, from the weights the server
        serves now (rlvr.observe.mismatch compares their log-probs with the trainer's). Outside the
        request counter: the run's own request seeds stay what they would be without it."""
        from rlvr.observe.mismatch import CANARY_SEED

        sampling = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_tokens)
        return self._complete(self._payload(prompt, sampling, CANARY_SEED), n)

    def _payload(
        self, prompt: Sequence[int], sampling: SamplingParams, seed: int
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": [int(t) for t in prompt],
            "n": sampling.n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            # Explicit, or vLLM fills them from the model's generation_config.json (top_k 20...).
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "max_tokens": sampling.max_new_tokens,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if sampling.stop:
            payload["stop"] = list(sampling.stop)
        if self.stop_token_ids:
            payload["stop_token_ids"] = self.stop_token_ids
        return payload

    def _complete(self, payload: dict[str, Any], n: int) -> list[Completion]:
        body = self._post("/v1/completions", payload).json()
        choices = sorted(body.get("choices") or [], key=lambda c: int(c.get("index", 0)))
        if len(choices) != n:
            raise ServerError(
                f"{self.root}/v1/completions returned {len(choices)} choices for n={n}"
            )
        return [self._completion(c) for c in choices]

    def _completion(self, choice: dict[str, Any]) -> Completion:
        where = f"{self.root}/v1/completions"
        logprobs = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:
            # Older vLLM has no return_token_ids, but --return-tokens-as-token-ids names the ids.
            tokens = logprobs.get("tokens") or []
            if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                ids = [int(t.split(":", 1)[1]) for t in tokens]
            else:
                raise ServerError(
                    f"{where} returned no token ids: the server must honour the request field "
                    "return_token_ids (vLLM >= 0.10.2) or run with --return-tokens-as-token-ids"
                )
        values = logprobs.get("token_logprobs")
        if values is None or len(values) != len(ids) or any(v is None for v in values):
            raise ServerError(
                f"{where} returned no log-prob for every sampled token (logprobs=0 was asked)"
            )
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise ServerError(f"{where} finished a sample with finish_reason={finish!r}")
        return Completion(tuple(int(t) for t in ids), tuple(float(v) for v in values), finish)

    # ----------------------------------------------------------------------------------------- HTTP
    def _post(self, path: str, payload: dict[str, Any], hint: str = "") -> httpx.Response:
        url = f"{self.root}{path}"
        try:
            with watch("server_request", f"POST {url}"):
                response = self._send("POST", url, json=payload)
        except httpx.HTTPError as err:
            raise ServerError(f"{url}: {type(err).__name__}: {err}") from None
        if response.status_code >= 400:
            raise ServerError(
                f"{url}: HTTP {response.status_code}: {error_message(response)}{hint}"
            )
        return response

    def _send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """One request, sent once more if its connection broke before an answer came
        (RETRIED_ERRORS: a stale pooled connection, a reset). A retried completion is sampled
        again with the same seed; a load or unload that had taken answers the retry with an error
        (vLLM: 400 or 404), which the caller reports, as it does a server that is down both times.
        A timeout is not retried: a slow server stays an error."""
        try:
            return self.client.request(method, url, **kwargs)
        except RETRIED_ERRORS:
            return self.client.request(method, url, **kwargs)

    def _first_model(self) -> str:
        url = f"{self.root}/v1/models"
        try:
            response = self._send("GET", url)
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            raise ServerError(f"{url}: could not read the served model's name ({err})") from None

    # --------------------------------------------------------------------------------- weight sync
    def sync_weights(
        self, policy: Policy, step: int, full_state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Make the server sample from `policy`'s current weights (see the module docstring).
        `full_state`: the policy's unsharded state dict, gathered by the caller when the policy's
        own tensors are shards (fsdp): written in place of them."""
        mode = resolve_weight_sync(self.weight_sync, policy)
        if mode == "none":
            return
        if self.sync_dir is None:
            raise ConfigError("generator.weight_sync needs a sync_dir the server can read")
        previous = self._synced
        started = time.perf_counter()
        if mode == "lora":
            if not policy.lora:
                raise ConfigError("generator.weight_sync lora needs a LoRA policy (model.lora)")
            name = f"rlvr-{self.run_id}-step-{step}"
            folder = write_folder(
                self.sync_dir / f"step-{step}",
                lambda d: policy.model.save_pretrained(d, state_dict=full_state),
            )
            self._post(
                "/v1/load_lora_adapter",
                {
                    "lora_name": name,
                    "lora_path": str(folder.resolve()),
                    "load_inplace": name == self.model,
                },
                hint=" (vLLM needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
            )
            self.model, self._synced = name, (name, folder)
            if previous is not None and previous[0] and previous[0] != name:
                self._post("/v1/unload_lora_adapter", {"lora_name": previous[0]})
        else:
            folder = write_folder(
                self.sync_dir / f"full-step-{step}",
                lambda d: save_full(policy, d, full_state, dtype=self.sync_dtype),
            )
            self._post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}},
                hint=" (vLLM needs VLLM_SERVER_DEV_MODE=1 and a version whose reload_weights takes "
                "weights_path)",
            )
            self._post("/reset_prefix_cache", {})  # cached KV blocks belong to the old weights
            self._synced = ("", folder)
        if previous is not None and previous[1] != folder:
            shutil.rmtree(previous[1], ignore_errors=True)  # the server no longer reads it
        self.last_sync = {
            "sync/weight_bytes": float(
                sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
            ),
            "sync/weight_seconds": time.perf_counter() - started,
        }

    # ---------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Stop the request pool; unload this run's adapter from a server it did not launch (one
        it launched stops with it); stop a launched server."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        if self._synced is not None and self._synced[0] and self.process is None:
            try:
                self._post("/v1/unload_lora_adapter", {"lora_name": self._synced[0]})
            except ServerError as err:  # closing anyway: say so, never raise from a finally
                warnings.warn(f"could not unload LoRA adapter at close: {err}", stacklevel=2)
            self._synced = None
        self.client.close()
        if self.process is not None:
            stop_process(self.process)
            self.process = None
        if self.owns_sync_dir and self.sync_dir is not None:
            shutil.rmtree(self.sync_dir, ignore_errors=True)  # shared memory is the host's RAM

    def __enter__(self) -> ServerGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def error_message(response: httpx.Response) -> str:
    """The one-line message of an error answer: OpenAI's {"error": {"message"}}, FastAPI's
    {"detail"}, or the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0][:300] if response.text.strip() else ""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:300]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def resolve_weight_sync(mode: str, policy: Policy) -> str:
    if mode == "auto":
        return "lora" if policy.lora else "full"
    return mode


def write_folder(target: Path, write: Callable[[str], Any]) -> Path:
    """`write(tmp)` into a fresh temp folder beside `target`, then rename it to `target`: the server
    never reads a half-written folder, and a resync of the same step replaces it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        write(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@torch.no_grad()
def save_full(
    policy: Policy,
    folder: str,
    full_state: dict[str, torch.Tensor] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    shard_bytes: int = 2**30,
) -> None:
    """The policy's full weights as safetensors shards in `dtype` (what the server computes in:
    a bf16 server gets half the bytes of fp32): a plain model as is, a LoRA policy merged
    (W + scale * B @ A per adapted layer) without touching its own weights. `full_state`: the
    unsharded state dict (fsdp), saved in place of the model's own tensors. Tensors are cast one
    at a time through one scratch buffer and streamed into shards of about `shard_bytes`
    (rlvr.rollout.weight_files): the host never holds a second copy of the model. Names are the
    checkpoint's (transformers'); a tied head is left out, as save_pretrained leaves it, and added
    by `write_tied_head`."""
    model = policy.model
    if policy.lora and full_state is not None:
        raise ConfigError(
            "generator.weight_sync full with a LoRA policy under fsdp is not supported: use "
            "weight_sync lora (the adapter alone is synced)"
        )
    base = model.get_base_model() if policy.lora else model
    state = full_state if full_state is not None else _merged_state(policy)
    tied = tied_head_name(base)
    write_shards(((n, t) for n, t in state.items() if n != tied), Path(folder), dtype, shard_bytes)
    head = None if full_state is None or tied is None else full_state.get(tied)
    write_tied_head(base, folder, head, dtype=dtype)


def _merged_state(policy: Policy) -> dict[str, Weight]:
    """The policy's weights under the base model's names: a LoRA policy's adapted layers merged,
    each made only when it is written (`Deferred`: one merged matrix alive at a time)."""
    model = policy.model
    if not policy.lora:
        return dict(model.state_dict())
    from peft.tuners.lora.layer import Linear as LoraLinear

    base = model.get_base_model()
    merged: dict[str, Weight] = {}
    for name, module in base.named_modules():
        layer = module.get_base_layer() if isinstance(module, LoraLinear) else None
        if isinstance(layer, torch.nn.Linear) and not module.disable_adapters:
            weight = layer.weight
            merged[f"{name}.base_layer.weight"] = Deferred(
                weight.shape, weight.dtype, functools.partial(merged_weight, module, weight)
            )
    return {
        key.replace(".base_layer", ""): merged.get(key, tensor)
        for key, tensor in base.state_dict().items()
        if "lora_" not in key
    }


@torch.no_grad()
def merged_weight(module: Any, weight: torch.Tensor) -> torch.Tensor:
    """`weight` + scale * B @ A for each active adapter of the LoRA layer `module` (a new tensor)."""
    for adapter in module.active_adapters:
        if adapter in module.lora_A:
            weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
    return weight


def tied_head_name(model: Any) -> str | None:
    """The output head's weight name ("lm_head.weight") when it is the input embedding's tensor
    (tied), else None. `model`: a plain transformers model (a peft wrapper's base)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return None
    return next(f"{n}.weight" for n, m in model.named_modules() if m is head)


def write_tied_head(
    model: Any,
    folder: str | Path,
    head: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Add a tied output head to a save_pretrained folder, which leaves it out (the loader reties
    it). vLLM's in-place reload_weights does not retie, so a server running the model untied
    (`--hf-overrides {"tie_word_embeddings": false}`) needs the head in every sync folder. Written
    as its own file, `lm_head.safetensors`, and entered in the shard index when there is one.
    `head`: the unsharded head weight when the model's own is a shard (fsdp)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = tied_head_name(model)
    if name is None:
        return
    folder = Path(folder)
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            if name in list(handle.keys()):  # a safetensors handle has no __contains__
                return
    if head is None:
        head = model.get_output_embeddings().weight
    head = head.detach().to("cpu", dtype or head.dtype, copy=True).contiguous()
    save_file({name: head}, str(folder / "lm_head.safetensors"), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {})[name] = "lm_head.safetensors"
        index.write_text(json.dumps(data, indent=2))


# ---------------------------------------------------------------------------------------------- launch
def launch_command(
    cfg: GeneratorConfig,
    model_path: str,
    port: int,
    *,
    weight_sync: str = "none",
    lora_rank: int | None = None,
    api_key: str | None = None,
    tied_head: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) starting the server `cfg.launch` names on 127.0.0.1:port. The
    `api_key` goes in the environment (RLVR_API_KEY / VLLM_API_KEY), never in argv, which every
    user of the host can read in /proc. `tied_head`: the model's output head is its input
    embedding; with full weight sync vLLM then runs it untied (see the module docstring)."""
    if cfg.launch == "rlvr":
        argv = [sys.executable, "-m", "rlvr.cli", "serve", model_path]
        key_env = {API_KEY_ENV: api_key} if api_key else {}
        return [*argv, "--host", "127.0.0.1", "--port", str(port), *cfg.launch_args], key_env
    if cfg.launch != "vllm":
        raise ConfigError(f"generator.launch must be 'vllm' or 'rlvr', got {cfg.launch!r}")
    vllm = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    argv = [vllm, "serve", model_path, "--host", "127.0.0.1", "--port", str(port)]
    # Tempered log-probs (the trainer's); token ids in logprobs for servers without return_token_ids.
    argv += ["--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids"]
    env: dict[str, str] = {"VLLM_API_KEY": api_key} if api_key else {}
    argv += vllm_flags(cfg)
    if cfg.vllm.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cfg.vllm.devices
    if weight_sync == "lora":
        rank = next((r for r in VLLM_LORA_RANKS if r >= (lora_rank or 16)), VLLM_LORA_RANKS[-1])
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    elif weight_sync == "full":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache
        if tied_head:  # its own head tensor, which reload_weights then fills from lm_head.weight
            argv += ["--hf-overrides", json.dumps({"tie_word_embeddings": False})]
    return [*argv, *cfg.launch_args], env


def vllm_flags(cfg: GeneratorConfig) -> list[str]:
    """`generator.vllm` as `vllm serve` flags (generator.launch_args come after them and win)."""
    v = cfg.vllm
    # A server on the trainer's GPU takes a share that leaves the trainer most of it.
    share = v.gpu_memory_utilization or (0.3 if v.devices is None else None)
    flags = ["--dtype", v.dtype, "--tensor-parallel-size", str(v.tensor_parallel_size)]
    if share is not None:
        flags += ["--gpu-memory-utilization", f"{share:g}"]
    if v.max_model_len is not None:
        flags += ["--max-model-len", str(v.max_model_len)]
    return flags


def launch_server(
    cfg: GeneratorConfig,
    model_path: str,
    port: int = 0,
    *,
    weight_sync: str = "none",
    lora_rank: int | None = None,
    log_path: str | Path | None = None,
    api_key: str | None = None,
    tied_head: bool = False,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server (port 0: a free one), wait until it answers, return (process, base URL
    ending in /v1). Its output goes to `log_path` (default: a temp file), quoted when it dies.
    `api_key`: the key the server requires (and the readiness poll sends)."""
    port = port or free_port()
    argv, env = launch_command(
        cfg,
        model_path,
        port,
        weight_sync=weight_sync,
        lora_rank=lora_rank,
        api_key=api_key,
        tied_head=tied_head,
    )
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="rlvr-server-")) / "server.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        try:
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,  # its own process group: vLLM's engine workers stop with it
            )
        except OSError as err:
            raise ServerError(f"could not start {argv[0]}: {err}") from None
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_for_server(
            base_url, cfg.startup_timeout_s, process=process, log_path=log_path, api_key=api_key
        )
    except BaseException:
        stop_process(process)
        raise
    return process, base_url


def wait_for_server(
    base_url: str,
    timeout_s: float,
    *,
    process: subprocess.Popen[bytes] | None = None,
    log_path: str | Path | None = None,
    api_key: str | None = None,
) -> None:
    """Poll GET /health (then /v1/models) until 200; a dead process or the timeout is an error
    quoting the end of the server's log."""
    root = server_root(base_url)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False, headers=auth_headers(api_key)) as client:
        while True:
            if process is not None and process.poll() is not None:
                raise ServerError(
                    f"the generation server exited with code {process.returncode} before it was "
                    f"ready{_log_tail(log_path)}"
                )
            for path in ("/health", "/v1/models"):
                try:
                    if client.get(f"{root}{path}").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise ServerError(
                    f"the generation server at {root} was not ready within {timeout_s:g} s "
                    f"(generator.startup_timeout_s){_log_tail(log_path)}"
                )
            time.sleep(0.5)


def _log_tail(log_path: str | Path | None, lines: int = 5) -> str:
    if log_path is None or not Path(log_path).exists():
        return ""
    tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-lines:]
    return f"; log {log_path} ends: " + " | ".join(tail) if tail else ""


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM the server (it shuts its workers down), then SIGKILL its process group if it hangs."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the group start_new_session made for it
        except (ProcessLookupError, PermissionError):
            process.kill()
        process.wait(timeout=timeout_s)


# --------------------------------------------------------------------------------------------- build
SHARED_MEMORY = Path("/dev/shm")


def choose_sync_dir(
    cfg: GeneratorConfig, run_dir: Path, policy: Policy, shared: Path = SHARED_MEMORY
) -> tuple[Path, bool]:
    """Where syncs are written, and whether the generator made it (and removes it at close).
    generator.sync_dir when set; for a server rlvr launches (on this machine), a fresh folder in
    shared memory when it has room for two syncs (the old folder is removed only after the server
    loaded the new one), with a quarter of it to spare; else RUN_DIR/weight_sync. A container's
    /dev/shm is often 64 MB: then the run directory is used, and said once."""
    if cfg.sync_dir:
        return Path(cfg.sync_dir), False
    fallback = run_dir / "weight_sync"
    if not cfg.launch or not shared.is_dir() or not os.access(shared, os.W_OK):
        return fallback, False
    params = {id(p): p for p in policy.model.parameters()}.values()
    width = torch.finfo(getattr(torch, cfg.resolved_sync_dtype())).bits // 8
    one_sync = sum(p.numel() for p in params) * width
    stats = os.statvfs(shared)
    free = stats.f_bavail * stats.f_frsize
    if free < 2 * one_sync or free - 2 * one_sync < 0.25 * stats.f_blocks * stats.f_frsize:
        warnings.warn(
            f"weight syncs go to {fallback} (disk): {shared} has {free / 2**30:.1f} GiB free, two "
            f"syncs need {2 * one_sync / 2**30:.1f} GiB (set generator.sync_dir to choose)",
            stacklevel=2,
        )
        return fallback, False
    return Path(tempfile.mkdtemp(dir=shared, prefix="rlvr-sync-")), True


def build_server_generator(
    policy: Policy,
    cfg: GeneratorConfig | RunConfig,
    run_dir: str | Path,
    *,
    seed: int | None = None,
    model_path: str | None = None,
    initial_sync: bool = True,
) -> ServerGenerator:
    """The generator `generator.backend: server` asks for: at `generator.url`, or a server launched
    from `model_path` (default: the run's model.name, else the policy's source path). `cfg` is the
    run's config (its seed is train.seed) or only its generator section. With `initial_sync` the
    policy's weights are pushed at once as step 0 (the server may hold other weights)."""
    if isinstance(cfg, RunConfig):
        seed = cfg.train.seed if seed is None else seed
        model_path = model_path or resolve_model_path(cfg.model.name)
        cfg = cfg.generator
    run_dir = Path(run_dir)
    mode = resolve_weight_sync(cfg.weight_sync, policy)
    base = policy.model.get_base_model() if policy.lora else policy.model
    process = None
    if cfg.url:
        base_url = cfg.url
        api_key = os.environ.get(API_KEY_ENV) or None  # the key the user gave that server, if any
    elif cfg.launch:
        path = model_path or getattr(base.config, "_name_or_path", "")
        if not path:
            raise ConfigError(
                "generator.launch: the policy's source path is unknown; pass model_path"
            )
        rank = policy.model.peft_config["default"].r if policy.lora else None
        # A fresh key per launch: only this trainer can reach the server's admin endpoints.
        api_key = secrets.token_urlsafe(32)
        process, base_url = launch_server(
            cfg,
            path,
            weight_sync=mode,
            lora_rank=rank,
            log_path=run_dir / "generator_server.log",
            api_key=api_key,
            tied_head=tied_head_name(base) is not None,
        )
    else:
        raise ConfigError("generator.backend server needs generator.url or generator.launch")
    sync_dir, owned = choose_sync_dir(cfg, run_dir, policy)
    try:
        generator = ServerGenerator(
            base_url,
            seed=seed or 0,
            max_concurrency=cfg.max_concurrency,
            request_timeout_s=cfg.request_timeout_s,
            weight_sync=mode,
            sync_dir=sync_dir,
            stop_token_ids=sorted(eos_token_ids(base, policy.tokenizer)),
            process=process,
            api_key=api_key,
            sync_dtype=getattr(torch, cfg.resolved_sync_dtype()),
            owns_sync_dir=owned,
        )
    except BaseException:
        if process is not None:
            stop_process(process)
        if owned:
            shutil.rmtree(sync_dir, ignore_errors=True)
        raise
    if initial_sync:
        try:
            generator.sync_weights(policy, step=0)
        except BaseException:
            generator.close()
            raise
    return generator
