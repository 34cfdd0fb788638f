"""`rlvr serve`: the official `openai` client on loopback (chat, tools, log-probs), token-exact
recordings per rollout id, errors, batching, and the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest
import torch

from rlvr.models import Policy, load_policy
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.serve.app import create_app
from rlvr.serve.runner import BackgroundServer, free_port, serve_state

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return load_policy(str(tiny_model_dir))


@pytest.fixture()
def server(policy: Policy) -> Iterator[BackgroundServer]:
    state = serve_state(policy, "tiny", seed=0)
    with BackgroundServer(create_app(state)) as srv:
        srv.state = state  # type: ignore[attr-defined]
        yield srv


def client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)


def teacher_forced_logprobs(
    model: object, ids: Sequence[int], temperature: float = 1.0
) -> list[float]:
    """log pi(ids[t] | ids[:t]) for t >= 1, by one forward pass (index t-1 in the list)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0].float()  # type: ignore[operator]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]


def test_chat_with_logprobs_answers_the_openai_client(
    server: BackgroundServer, policy: Policy
) -> None:
    response = client(server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == "tiny"
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    token_ids = choice.model_extra["token_ids"]  # type: ignore[index]
    prompt_ids = response.model_extra["prompt_token_ids"]  # type: ignore[index]
    assert response.usage is not None
    assert len(entries) == len(token_ids) == response.usage.completion_tokens > 0
    assert response.usage.prompt_tokens == len(prompt_ids)
    # The log-probs are the policy's, of exactly these tokens in this context.
    expected = teacher_forced_logprobs(policy.model, [*prompt_ids, *token_ids])[
        len(prompt_ids) - 1 :
    ]
    for entry, want in zip(entries, expected, strict=True):
        assert entry.logprob == pytest.approx(want, abs=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob <= tops[0] + 1e-5


class ScriptedGenerator:
    """Replies with scripted texts in order (the endpoint's protocol under test, not the model)."""

    def __init__(self, tokenizer: object, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.calls = 0
        self.rng = torch.Generator()

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        self.calls += 1
        out = []
        for _ in prompts:
            text = self.replies.pop(0)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
            ids = [*ids, self.tokenizer.eos_token_id]  # type: ignore[attr-defined]
            out.append([Completion(tuple(ids), tuple(-0.5 for _ in ids), "stop")])
        return out

    def get_state(self) -> torch.Tensor:
        return self.rng.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.rng.set_state(state)


CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def test_tool_calls_round_trip_and_recording(policy: Policy) -> None:
    state = serve_state(policy, "tiny")
    call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
    )
    state.generator = ScriptedGenerator(policy.tokenizer, [call, "The answer is 391."])  # type: ignore[assignment]
    with BackgroundServer(create_app(state)) as srv:
        c = client(srv)
        messages: list[dict[str, object]] = [{"role": "user", "content": "What is 17 * 23?"}]
        first = c.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[CALCULATOR],
            metadata={"rollout_id": "r-tools"},  # type: ignore[arg-type, list-item]
        )
        reply = first.choices[0]
        assert reply.finish_reason == "tool_calls"
        assert reply.message.tool_calls is not None and len(reply.message.tool_calls) == 1
        tool_call = reply.message.tool_calls[0]
        assert tool_call.function.name == "calculator"
        assert json.loads(tool_call.function.arguments) == {"expression": "17 * 23"}
        messages.append(reply.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "391"})
        second = c.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[CALCULATOR],
            metadata={"rollout_id": "r-tools"},  # type: ignore[arg-type, list-item]
        )
        assert second.choices[0].message.content == "The answer is 391."
        assert second.choices[0].finish_reason == "stop"
        recording = httpx.get(f"{srv.base_url}/rollouts/r-tools").json()
    assert recording["requests"] == 2 and len(recording["segments"]) == 1
    seg = recording["segments"][0]
    (a0, a1), (b0, b1) = seg["turns"]
    ids, mask = seg["token_ids"], seg["policy_mask"]
    tok = policy.tokenizer
    sampled_first = [*tok(call, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert ids[a0:a1] == sampled_first  # what was sampled, not a re-tokenization of the reply
    assert a0 == seg["prompt_length"]
    assert mask == [0] * a0 + [1] * (a1 - a0) + [0] * (b0 - a1) + [1] * (b1 - b0)
    assert "391" in tok.decode(ids[a1:b0])  # the tool result sits between the turns, masked
    assert seg["logprobs"][a0:a1] == [-0.5] * (a1 - a0)
    assert seg["finish_reasons"] == ["tool_calls", "stop"]


def test_streaming_clients_get_the_reply_in_chunks(policy: Policy) -> None:
    """Agent frameworks that always stream: the same reply, tool calls included, as chunks."""
    state = serve_state(policy, "tiny")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    state.generator = ScriptedGenerator(policy.tokenizer, [call, "It is 4."])  # type: ignore[assignment]
    with BackgroundServer(create_app(state)) as srv:
        c = client(srv)
        question = [{"role": "user", "content": "2 + 2?"}]
        chunks = list(
            c.chat.completions.create(
                model="tiny", messages=question, tools=[CALCULATOR], stream=True,  # type: ignore[arg-type, list-item]
                metadata={"rollout_id": "r-stream"}, logprobs=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        calls = [
            tc for ch in chunks for choice in ch.choices for tc in choice.delta.tool_calls or ()
        ]
        assert [tc.function.name for tc in calls] == ["calculator"]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        text = "".join(
            ch.choices[0].delta.content or "" for ch in list(c.chat.completions.create(
                model="tiny", messages=question, stream=True, max_tokens=8,  # type: ignore[arg-type]
            )) if ch.choices
        )  # fmt: skip
        assert text == "It is 4."
        assert httpx.get(f"{srv.base_url}/rollouts/r-stream").json()["requests"] == 1


def test_recorded_rollout_equals_what_was_sampled(server: BackgroundServer, policy: Policy) -> None:
    c = client(server)
    messages: list[dict[str, object]] = [{"role": "user", "content": "Count to three."}]
    sampled: list[tuple[list[int], list[float]]] = []
    for follow_up in ("Again.", "Once more.", None):
        r = c.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=5,
            logprobs=True,
            extra_headers={"X-Rollout-Id": "r-exact"},
            extra_body={"return_token_ids": True},
        )
        choice = r.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        sampled.append(
            (choice.model_extra["token_ids"], [e.logprob for e in choice.logprobs.content])
        )  # type: ignore[index]
        messages.append(choice.message.model_dump(exclude_none=True))
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    recording = httpx.get(f"{server.base_url}/rollouts/r-exact").json()
    assert len(recording["segments"]) == 1
    seg = recording["segments"][0]
    ids = seg["token_ids"]
    assert len(seg["turns"]) == 3
    for (start, end), (token_ids, logprobs) in zip(seg["turns"], sampled, strict=True):
        assert ids[start:end] == token_ids
        assert seg["logprobs"][start:end] == pytest.approx(logprobs)
    # In the recorded context the policy gives the recorded tokens the recorded log-probs: the
    # sequence the trainer will score is the one that was sampled.
    forced = teacher_forced_logprobs(policy.model, ids)
    for t, (m, lp) in enumerate(zip(seg["policy_mask"], seg["logprobs"], strict=True)):
        if m:
            assert forced[t - 1] == pytest.approx(lp, abs=1e-4)


def test_rewritten_history_starts_a_new_segment(server: BackgroundServer) -> None:
    c = client(server)
    first = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        metadata={"rollout_id": "r-seg"},
    )
    # The agent drops its history and asks something else under the same id.
    c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "new topic"}],
        max_tokens=3,
        metadata={"rollout_id": "r-seg"},
    )
    assert first.choices[0].message is not None
    recording = httpx.get(f"{server.base_url}/rollouts/r-seg").json()
    assert len(recording["segments"]) == 2
    assert all(len(s["turns"]) == 1 for s in recording["segments"])


def test_bad_requests_get_one_line_errors(server: BackgroundServer) -> None:
    c = client(server)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="model 'nope' is not served"):
        c.chat.completions.create(model="nope", messages=hi)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        c.chat.completions.create(model="tiny", messages=hi, n=2, metadata={"rollout_id": "x"})  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="at least one message"):
        c.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        c.chat.completions.create(model="tiny", messages=hi, temperature=-1)  # type: ignore[arg-type]
    bad = httpx.post(f"{server.base_url}/chat/completions", json={"model": "tiny"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    missing = httpx.get(f"{server.base_url}/rollouts/never-seen")
    assert missing.status_code == 400 and "never-seen" in missing.json()["error"]["message"]


def test_training_endpoint_holds_the_run_temperature(policy: Policy) -> None:
    state = serve_state(policy, "tiny")
    state.required_temperature = 0.7
    with BackgroundServer(create_app(state)) as srv:
        c = client(srv)
        hi = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError, match=r"trains at temperature 0\.7"):
            c.chat.completions.create(model="tiny", messages=hi, temperature=1.0)  # type: ignore[arg-type]
        ok = c.chat.completions.create(model="tiny", messages=hi, max_tokens=2, temperature=0.7)  # type: ignore[arg-type]
        assert ok.choices[0].finish_reason in ("stop", "length")


def test_concurrent_requests_are_sampled_together(policy: Policy) -> None:
    state = serve_state(policy, "tiny")
    calls = []
    real = state.generator.generate

    def counting(
        prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        calls.append(len(prompts))
        return real(prompts, sampling)

    state.generator.generate = counting  # type: ignore[method-assign]
    with BackgroundServer(create_app(state)) as srv:
        c = client(srv)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                c.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": f"q{i}"}],
                    max_tokens=4,
                    metadata={"rollout_id": f"c{i}"},
                )
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        recorded = [httpx.get(f"{srv.base_url}/rollouts/c{i}").json() for i in range(8)]
    assert all(r["requests"] == 1 for r in recorded)
    assert sum(calls) == 8 and len(calls) < 8  # several requests shared one generate call


def test_rlvr_serve_cli_with_the_byo_agent(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`rlvr serve` as a user starts it, and examples/byo_agent/agent.py (plain openai client) against it."""
    port = free_port()
    record_dir = tmp_path / "rollouts"
    # No RLVR_API_KEY from the caller's shell: this server is the keyless one a user starts.
    env = {k: v for k, v in os.environ.items() if k != "RLVR_API_KEY"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlvr.cli", "serve", str(tiny_model_dir), "--port", str(port),
         "--model-name", "tiny", "--record-dir", str(record_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/models").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else "server exited"
            assert time.monotonic() < deadline, "rlvr serve did not come up"
            time.sleep(0.3)
        sys.path.insert(0, str(ROOT / "examples" / "byo_agent"))
        try:
            import agent as byo_agent
        finally:
            sys.path.pop(0)
        conversation = byo_agent.run_episode(
            base, "tiny", "What is 2 + 2?", rollout_id="cli-1", max_turns=2
        )
        assert conversation[0]["role"] == "system" and conversation[-1]["role"] in (
            "assistant",
            "tool",
        )
        saved = json.loads((record_dir / "cli-1.json").read_text())
        assert saved["rollout_id"] == "cli-1" and saved["requests"] >= 1
        assert sum(saved["segments"][0]["policy_mask"]) > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
