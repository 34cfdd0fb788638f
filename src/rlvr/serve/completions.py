"""vLLM's token-id protocol on `rlvr serve`: /v1/completions, runtime LoRA adapters, weight reloads.

Longer than our ~500-line guide on purpose: the protocol as read from vLLM (below) sits beside the
code that answers it, so a change to one is checked against the other.

A trainer sampling on a server (rlvr.rollout.server.ServerGenerator) sends the same requests to
`vllm serve` and to `rlvr serve`; this router answers them from the HF model of `ServeState`.

vLLM's side, as read in vllm-project/vllm (entrypoints/openai/completion/{protocol,serving}.py,
serve/lora/api_router.py, serve/dev/rpc/api_router.py, v1/worker/gpu_model_runner.py,
v1/sample/sampler.py) and docs.vllm.ai (features/lora):
- POST /v1/completions. `prompt`: a string, strings, a token-id list or token-id lists (ids are used
  as given, no BOS added). `n`, `temperature`, `top_p`, `top_k` (-1/0 off), `min_p`,
  `repetition_penalty`, `max_tokens` (default 16), `stop`, `stop_token_ids`, `seed` (every prompt of
  a request gets it), `logprobs` (k: the sampled token's log-prob and the k likeliest), `echo`,
  `stream`; unknown fields are ignored. `return_token_ids: true` (vLLM >= 0.10.2) adds
  `choices[i].token_ids` (sampled ids, the EOS or stop token included) and `prompt_token_ids`;
  `return_tokens_as_token_ids` (or the server flag --return-tokens-as-token-ids) writes
  `logprobs.tokens` as "token_id:123". Choice i*n + j is prompt i's sample j. `logprobs` = {tokens,
  token_logprobs (clamped at -9999.0), top_logprobs ({token: logprob} per position), text_offset};
  `finish_reason` "stop" | "length"; `stop_reason` the stop string, the stop token id, or null for
  EOS; `usage` counts each prompt once.
- Log-probs: by default (--logprobs-mode raw_logprobs) of the raw softmax, before temperature;
  --logprobs-mode processed_logprobs (vLLM >= 0.10.2) gives them after temperature and top-k/top-p
  masking: at top_p = 1 exactly the tempered distribution the trainer recomputes.
- Errors: {"error": {"message", "type", "param", "code"}}; an unknown model is a 404, other bad
  input a 400.
- Runtime LoRA (--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): POST /v1/load_lora_adapter
  {lora_name, lora_path, load_inplace?} -> 200 "Success: LoRA adapter '<name>' added successfully."
  (a loaded name is a 400 unless load_inplace); POST /v1/unload_lora_adapter {lora_name}. Requests
  name the adapter as `model`; /v1/models lists it.
- Full weights: no stable endpoint reloads weights from disk. The real mechanism is the dev-mode RPC
  (VLLM_SERVER_DEV_MODE=1): POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": DIR}} -> Worker.reload_weights -> GPUModelRunner.reload_weights(weights_path=...),
  which loads DIR's safetensors in place (layerwise reload, recent vLLM; older ones take no argument
  and re-read the launch path); then POST /reset_prefix_cache (cached KV came from the old weights).
  Newer vLLM also has NCCL/IPC weight transfer (/init_weight_transfer_engine, /update_weights),
  which needs a process group, not a folder.

Here: the same endpoints and fields, sampled by `state.generator` (HFGenerator: log-probs of the
tempered distribution before top-p). A seeded request reseeds the generator for each prompt, so it
returns exactly what a fresh HFGenerator with that seed returns in process. What HFGenerator cannot
do (top_k, min_p, penalties, beam search, echo, streaming) is a 400, never silently ignored; so is an
unknown model (every client error is a 400 here). /health and /v1/models come from app.py.
"""

from __future__ import annotations

import contextlib
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool

from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.weight_files import read_weight_files
from rlvr.serve.shared import BadInput, error_response, seeded, top_logprobs, training_limits
from rlvr.serve.state import ServeState

DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
MIN_LOGPROB = -9999.0  # vLLM clamps -inf to this (JSON has no infinity)


class CompletionRequest(BaseModel):
    """vLLM's completion request fields that matter here; unknown ones are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    use_beam_search: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None


def completions_router(state: ServeState) -> APIRouter:
    """/v1/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter, /collective_rpc
    (reload_weights) and /reset_prefix_cache over `state`."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(http: Request) -> Response:
        try:
            request = CompletionRequest.model_validate(await _json_object(http))
            return JSONResponse(await run_in_threadpool(complete, state, request))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            return error_response(f"{where}: {first.get('msg')}", where or None)
        except BadInput as err:
            return error_response(str(err), err.param)

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(http: Request) -> Response:
        try:
            body = await _json_object(http)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise BadInput("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
            inplace = bool(body.get("load_inplace", False))
            await run_in_threadpool(load_adapter, state, name, path, inplace)
        except BadInput as err:
            return error_response(str(err), err.param)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(http: Request) -> Response:
        try:
            name = (await _json_object(http)).get("lora_name")
            if not isinstance(name, str) or not name:
                raise BadInput("'lora_name' needs to be provided to unload a LoRA adapter.")
            await run_in_threadpool(unload_adapter, state, name)
        except BadInput as err:
            return error_response(str(err), err.param)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @router.post("/collective_rpc")
    async def collective_rpc(http: Request) -> Response:
        # vLLM's dev-mode RPC; of its methods only the one a weight sync needs is served.
        try:
            body = await _json_object(http)
            if body.get("method") != "reload_weights":
                raise BadInput(
                    f"collective_rpc: rlvr serve runs only 'reload_weights', got {body.get('method')!r}",
                    "method",
                )
            path = (body.get("kwargs") or {}).get("weights_path")
            if not isinstance(path, str) or not path:
                raise BadInput("reload_weights needs kwargs.weights_path (a folder)", "kwargs")
            await run_in_threadpool(reload_weights, state, path)
        except BadInput as err:
            return error_response(str(err), err.param)
        return JSONResponse({"results": [None]})

    @router.post("/reset_prefix_cache")
    def reset_prefix_cache() -> Response:
        return Response(status_code=200)  # nothing is cached across requests here

    return router


async def _json_object(http: Request) -> dict[str, Any]:
    try:
        body = await http.json()
    except ValueError:
        raise BadInput("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadInput("the request body must be a JSON object")
    return body


# ------------------------------------------------------------------------------------------ completions
def complete(state: ServeState, request: CompletionRequest) -> dict[str, Any]:
    """Answer one /v1/completions request (blocking: sampling holds `state.lock`)."""
    model = request.model or state.model_name
    if model != state.model_name and model not in state.adapters:
        raise BadInput(f"The model `{model}` does not exist.", "model")
    _refuse_unsupported(state, request)
    prompts = prompt_ids_of(state, request)
    sampling = sampling_of(state, request, max(len(p) for p in prompts))
    tops: list[list[list[list[tuple[int, float]]]]] = []  # [prompt][sample][position][k]
    with state.lock, use_model(state, model):
        generator = state.generator
        if request.seed is None:
            results = generator.generate(prompts, sampling)
        else:
            # Each prompt sampled from a stream seeded with the request's seed (vLLM gives every
            # prompt of a request the same seed).
            results = []
            for prompt in prompts:
                with seeded(generator, request.seed):
                    results.extend(generator.generate([prompt], sampling))
        if request.logprobs:
            tops = [
                [
                    top_logprobs(state, p, c.token_ids, sampling.temperature, request.logprobs)
                    for c in completions
                ]
                for p, completions in zip(prompts, results, strict=True)
            ]
    choices: list[dict[str, Any]] = []
    for i, (prompt, completions) in enumerate(zip(prompts, results, strict=True)):
        for j, completion in enumerate(completions):
            top = tops[i][j] if tops else None
            choices.append(_choice(state, request, len(choices), prompt, completion, top))
    completion_tokens = sum(len(c.token_ids) for cs in results for c in cs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _refuse_unsupported(state: ServeState, r: CompletionRequest) -> None:
    """400 for what HFGenerator cannot do, rather than sampling something else than was asked."""
    refused = {
        "stream": r.stream, "echo": r.echo, "use_beam_search": r.use_beam_search,
        "top_k": r.top_k not in (None, 0, -1), "min_p": r.min_p not in (None, 0.0),
        "repetition_penalty": r.repetition_penalty not in (None, 1.0),
        "presence_penalty": r.presence_penalty not in (None, 0.0),
        "frequency_penalty": r.frequency_penalty not in (None, 0.0),
        "logit_bias": bool(r.logit_bias), "ignore_eos": r.ignore_eos, "min_tokens": r.min_tokens > 0,
        "prompt_logprobs": r.prompt_logprobs is not None,
    }  # fmt: skip
    for param, asked in refused.items():
        if asked:
            raise BadInput(
                f"{param}: not supported by rlvr serve (its sampler has no such option)", param
            )
    if r.logprobs is not None and not 0 <= r.logprobs <= 20:
        raise BadInput(f"logprobs: must be in [0, 20], got {r.logprobs}", "logprobs")
    # The generator always stops at the model's EOS ids; other stop ids it cannot honour.
    extra = set(r.stop_token_ids or ()) - set(state.generator.eos_token_ids)
    if extra:
        raise BadInput(
            f"stop_token_ids: only the model's EOS ids {state.generator.eos_token_ids} are "
            f"supported, got {sorted(extra)}",
            "stop_token_ids",
        )


def prompt_ids_of(state: ServeState, r: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token-id lists (text is tokenized; ids are taken as given)."""
    prompt = r.prompt
    if prompt is None or prompt == "" or prompt == []:
        raise BadInput("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    texts: list[str] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt[0], str):
        texts = [str(p) for p in prompt]
    if texts:
        tok = state.tokenizer
        prompts = [
            list(tok(t, add_special_tokens=r.add_special_tokens)["input_ids"]) for t in texts
        ]
    elif isinstance(prompt[0], int):
        prompts = [[int(t) for t in prompt]]  # type: ignore[arg-type]
    else:
        prompts = [[int(t) for t in p] for p in prompt]  # type: ignore[union-attr]
    vocab = int(state.model.config.vocab_size)
    for i, p in enumerate(prompts):
        if not p:
            raise BadInput(f"prompt {i} is empty: at least one token is needed", "prompt")
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadInput(
                f"prompt {i}: token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
            )
    return prompts


def sampling_of(state: ServeState, r: CompletionRequest, longest_prompt: int) -> SamplingParams:
    """SamplingParams for the request: vLLM's defaults (temperature 1, top_p 1), the serve state's
    training limits, and max_tokens cut to the context left after the longest prompt."""
    context = getattr(state.model.config, "max_position_embeddings", None)
    room = None if context is None else int(context) - longest_prompt
    if room is not None and room < 1:
        raise BadInput(
            f"This model's maximum context length is {context} tokens; the prompt has "
            f"{longest_prompt} tokens",
            "prompt",
        )
    max_tokens = r.max_tokens if r.max_tokens is not None else (room or DEFAULT_MAX_TOKENS)
    if room is not None:
        max_tokens = min(max_tokens, room)
    temperature, max_tokens = training_limits(state, r.temperature, max_tokens)
    stop = (r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ())
    try:
        return SamplingParams(
            n=r.n,
            temperature=temperature,
            top_p=1.0 if r.top_p is None else r.top_p,
            max_new_tokens=max_tokens,
            stop=tuple(s for s in stop if s),
        )
    except ValueError as err:
        raise BadInput(str(err)) from None


def _choice(
    state: ServeState,
    r: CompletionRequest,
    index: int,
    prompt: list[int],
    completion: Completion,
    top: list[list[tuple[int, float]]] | None,
) -> dict[str, Any]:
    tok = state.tokenizer
    ids = list(completion.token_ids)
    text = str(tok.decode(ids, skip_special_tokens=r.skip_special_tokens))
    stop_reason: int | str | None = None
    if completion.finish_reason == "stop" and ids:
        stops = (r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ())
        hits = [(text.index(s), s) for s in stops if s and s in text]
        if ids[-1] in (r.stop_token_ids or ()):
            stop_reason = ids[-1]
        elif ids[-1] not in state.generator.eos_token_ids and hits:
            at, stop_reason = min(hits)
            if not r.include_stop_str_in_output:
                text = text[:at]  # as vLLM: the text ends before the stop string, the ids do not
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": None if r.logprobs is None else _logprobs(state, r, completion, top),
        "finish_reason": completion.finish_reason,
        "stop_reason": stop_reason,
        "prompt_logprobs": None,
    }
    if r.return_token_ids:
        choice["token_ids"] = ids
        choice["prompt_token_ids"] = prompt
    return choice


def _logprobs(
    state: ServeState,
    r: CompletionRequest,
    completion: Completion,
    top: list[list[tuple[int, float]]] | None,
) -> dict[str, Any]:
    def name(token_id: int) -> str:
        if r.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return str(state.tokenizer.decode([token_id]))

    tokens = [name(t) for t in completion.token_ids]
    values = [max(float(lp), MIN_LOGPROB) for lp in completion.logprobs]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops: list[dict[str, float]] = []
    for j, (token, value) in enumerate(zip(tokens, values, strict=True)):
        entry = {token: value}  # the sampled token first, then the k most likely (vLLM's layout)
        for other, other_value in top[j] if top else ():
            entry.setdefault(name(other), max(other_value, MIN_LOGPROB))
        tops.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": tops,
    }


# ------------------------------------------------------------------------------------------ adapters
def is_peft(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _base_adapters(state: ServeState) -> list[str]:
    """Adapters the served model came with (not loaded over HTTP): they stay on for its base name."""
    if not is_peft(state.model):
        return []
    return [a for a in state.model.peft_config if a not in state.adapters]


def _rest(state: ServeState) -> None:
    """Put the model back to what its base name serves: its own adapters, or none (layers off), so
    that code sampling without `use_model` (the chat batcher) never sees a loaded adapter."""
    model = state.model
    if not is_peft(model):
        return
    own = _base_adapters(state)
    if own:
        model.base_model.enable_adapter_layers()
        model.set_adapter(own[0])
    else:
        model.base_model.disable_adapter_layers()


@contextlib.contextmanager
def use_model(state: ServeState, name: str) -> Iterator[None]:
    """Sample from `name` (a loaded adapter, or the base name) inside the block. The caller holds
    `state.lock`: the active adapter is the model's state, shared by every request."""
    if name not in state.adapters:
        yield
        return
    state.model.base_model.enable_adapter_layers()
    state.model.set_adapter(name)
    try:
        yield
    finally:
        _rest(state)


def load_adapter(state: ServeState, name: str, path: str, inplace: bool = False) -> None:
    """Load the peft adapter folder `path` as `name` (wrapping a plain model on the first load)."""
    if name == state.model_name:
        raise BadInput(
            f"The lora adapter name '{name}' conflicts with the served model.", "lora_name"
        )
    if not (Path(path) / "adapter_config.json").is_file():
        raise BadInput(f"No adapter found at '{path}' (no adapter_config.json)", "lora_path")
    from peft import PeftModel

    with state.lock:
        if name in state.adapters:
            if not inplace:
                raise BadInput(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the "
                    "adapter in place, set 'load_inplace' to True.",
                    "lora_name",
                )
            _drop_adapter(state, name)
        try:
            if is_peft(state.model):
                state.model.load_adapter(path, adapter_name=name, is_trainable=False)
            else:
                wrapped = PeftModel.from_pretrained(
                    state.model, path, adapter_name=name, is_trainable=False
                )
                state.model = state.generator.model = wrapped
        except Exception as err:  # a bad folder is the client's error, in one line
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise BadInput(f"could not load LoRA adapter '{name}' from '{path}': {first}") from None
        state.model.eval()
        state.adapters[name] = path
        _rest(state)


def unload_adapter(state: ServeState, name: str) -> None:
    with state.lock:
        if name not in state.adapters:
            raise BadInput(f"The lora adapter '{name}' cannot be found.", "lora_name")
        _drop_adapter(state, name)
        _rest(state)


def _drop_adapter(state: ServeState, name: str) -> None:
    others = [a for a in state.model.peft_config if a != name]
    del state.adapters[name]
    if others:
        with warnings.catch_warnings():  # "adapter X was active, now Y": _rest sets it right after
            warnings.simplefilter("ignore", UserWarning)
            state.model.delete_adapter(name)
    else:
        # peft cannot run a model whose last adapter was deleted: unwrap it instead.
        state.model = state.generator.model = state.model.unload()


# ------------------------------------------------------------------------------------------ weights
def plain_parameters(model: Any) -> dict[str, torch.Tensor]:
    """{name as in a plain save_pretrained folder: tensor} of `model`'s base weights (a peft wrapper's
    `.base_layer` dropped, adapter tensors left out). Tied weights appear under each name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        name.replace(".base_layer", ""): tensor
        for name, tensor in base.state_dict(keep_vars=True).items()
        if "lora_" not in name
    }


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """rollout.weight_files.read_weight_files, a missing file a client error."""
    try:
        return read_weight_files(path)
    except FileNotFoundError as err:
        raise BadInput(str(err), "weights_path") from None


def reload_weights(state: ServeState, path: str | Path) -> None:
    """Copy the weights saved at `path` (save_pretrained folder) into the served model in place, under
    the lock, and bump `state.weights_version`. Loaded adapters stay, on top of the new weights.

    All or nothing for names: a tensor the model lacks, a parameter the files lack (tied weights
    aside) or a shape mismatch is an error before anything is copied; a partial load would sample
    from weights no learner ever had."""
    weights = read_weights(path)
    with state.lock:
        target = plain_parameters(state.model)
        unknown = [n for n in weights if n not in target]
        if unknown:
            raise BadInput(
                f"'{path}' holds '{unknown[0]}', which the served model has no place for"
            )
        covered = {target[n].data_ptr() for n in weights}
        missing = [n for n, t in target.items() if n not in weights and t.data_ptr() not in covered]
        if missing:
            raise BadInput(f"'{path}' lacks the weight '{missing[0]}' of the served model")
        for n, w in weights.items():
            if tuple(w.shape) != tuple(target[n].shape):
                raise BadInput(
                    f"'{path}': '{n}' has shape {tuple(w.shape)}, the model {tuple(target[n].shape)}"
                )
        with torch.no_grad():
            for n, w in weights.items():
                target[n].copy_(w.to(target[n].device, target[n].dtype))
        state.weights_version += 1
