"""Tool-call formats of the families people train (rlvr.envs.tool_formats), each checked against the
family's real chat template and special tokens (tests/data/tokenizers/, where each file comes from).

Per family, a tool episode runs through the real multi-turn engine with test_multiturn's scripted
generator, whose turns are what the family's template renders for the call and the answer. The
engine's token ids must equal the tokenization of the template's rendering of the finished
conversation (token-exact), the policy mask must cover exactly the sampled turns, and the glue between
turns must be the template's (the expected glue strings below are written by hand from reading each
template). Where a template renders history differently from what the model sampled (Mistral's call
ids and system message, Qwen3's empty think blocks), the difference is pinned exactly: the engine
keeps what the model sampled and saw.

A little over 500 lines: the parsing, detection and engine tests all lean on the family table and
tokenizer loader at the top (test_env_check.py imports the loader too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from rlvr.config import RolloutConfig
from rlvr.envs.tool_formats import (
    TOOL_FORMATS,
    ToolCall,
    demonstration_messages,
    detect_tool_format,
    openai_messages,
    resolve_tool_format,
    template_text,
)
from rlvr.models import tiny_tokenizer
from rlvr.records import Task, Trajectory
from rlvr.rollout.chat import decode_turn, prompt_text
from rlvr.rollout.engine import RolloutLimits, Scoring, rollout_groups
from rlvr.rollout.generator import SamplingParams
from rlvr.train.batch import collate
from test_multiturn import (
    ADD,
    LOGPROB,
    SYSTEM,
    AddEnv,
    ScriptedGenerator,
    by_turn,
    chatml_turn,
    task,
)

DATA = Path(__file__).resolve().parent / "data" / "tokenizers"
ANSWER = "<answer>5</answer>"
ADD_2_3 = ToolCall("add", {"a": 2, "b": 3})
QUESTION = {"role": "user", "content": "What is 2 + 3?"}


def family_tokenizer(folder: str, template: str | None = None) -> Any:
    """A test tokenizer (a fresh object: rlvr caches per-tokenizer facts on it), optionally with
    another of the stored real templates."""
    tok = AutoTokenizer.from_pretrained(DATA / folder)
    if template is not None:
        tok.chat_template = (DATA / "templates" / template).read_text()
    return tok


def ids(tok: Any, text: str) -> list[int]:
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


@dataclass(frozen=True)
class Family:
    folder: str
    template: str | None  # another file of templates/ instead of the folder's own
    format: str
    turns: tuple[str, str]  # the call turn and the answer turn, as the model writes them
    glue: str  # the template's text between the two sampled turns (after the sampled end token)
    closing: str  # what the template writes after the last sampled end token
    turn_of: Callable[[str], int]  # which turn a decoded prompt asks for
    system: bool = True  # the opening has a system message


def llama_turn(prompt: str) -> int:
    return prompt.count("<|start_header_id|>assistant") - 1


def mistral_turn(prompt: str) -> int:
    return prompt.count("</s>")  # no opening marker: every finished assistant turn ends with </s>


LLAMA_GLUE = (  # the tool's string result is JSON-quoted: its template tojson's any iterable content
    '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
QWEN_GLUE = (
    "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
LLAMA_CALL = TOOL_FORMATS["llama3_json"].render_calls([ADD_2_3])
HERMES_CALL = TOOL_FORMATS["hermes"].render_calls([ADD_2_3])
MISTRAL_ID = "abc123xyz"

FAMILIES = {
    "llama3.1": Family(
        "llama3", None, "llama3_json", (LLAMA_CALL, ANSWER), LLAMA_GLUE, "", llama_turn
    ),
    "llama3.2": Family(
        "llama3",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        "llama3_json",
        (LLAMA_CALL, ANSWER),
        LLAMA_GLUE,
        "",
        llama_turn,
    ),
    "qwen3": Family(
        "qwen3",
        None,
        "qwen3",
        ("<think>\nI add.\n</think>\n\n" + HERMES_CALL, "<think>\nDone.\n</think>\n\n" + ANSWER),
        QWEN_GLUE,
        "\n",
        chatml_turn,
    ),
    "qwen2.5": Family(
        "qwen3",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "hermes",
        (HERMES_CALL, ANSWER),
        QWEN_GLUE,
        "\n",
        chatml_turn,
    ),
    # The model writes the call's id, as the template shows its calls in history; no system message,
    # which Nemo's template writes only while the last message is a user turn (pinned below).
    "mistral": Family(
        "mistral",
        None,
        "mistral",
        (
            TOOL_FORMATS["mistral"].render_calls(
                [ToolCall("add", {"a": 2, "b": 3}, id=MISTRAL_ID)]
            ),
            ANSWER,
        ),
        f'[TOOL_RESULTS]{{"content": 5, "call_id": "{MISTRAL_ID}"}}[/TOOL_RESULTS]',
        "",
        mistral_turn,
        system=False,
    ),
}


def opening(system: bool) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, QUESTION] if system else [QUESTION]


def play_family(
    tok: Any,
    turns: tuple[str, ...],
    turn_of: Callable[[str], int],
    *,
    system: bool = True,
    tool_format: str = "auto",
    eos: int | None = None,
) -> tuple[Trajectory, ScriptedGenerator]:
    gen = ScriptedGenerator(tok, by_turn(*turns), eos=eos or tok.eos_token_id, turn_of=turn_of)
    one = task()
    if not system:
        one = Task(id=one.id, messages=(QUESTION,), fields=one.fields)
    [group] = rollout_groups(
        [one],
        AddEnv,
        gen,
        tok,
        SamplingParams(n=1, max_new_tokens=400),
        Scoring(),
        RolloutLimits(tool_format=tool_format),  # type: ignore[arg-type]
    )
    return group.trajectories[0], gen


# ------------------------------------------------------------------------------ the data is the real one
@pytest.mark.parametrize("folder", ["llama3", "mistral", "qwen3"])
def test_each_tokenizer_carries_its_stored_real_template(folder: str) -> None:
    source = {
        "llama3": "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "qwen3": "Qwen-Qwen3-0.6B.jinja",
    }[folder]
    assert family_tokenizer(folder).chat_template == (DATA / "templates" / source).read_text()


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json"),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3_json"),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
        ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"),
        ("Qwen-Qwen3-0.6B.jinja", "qwen3"),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ],
)
def test_the_format_is_detected_from_each_real_template(template: str, expected: str) -> None:
    assert detect_tool_format((DATA / "templates" / template).read_text()) == expected


def test_detection_falls_back_to_hermes_and_the_config_overrides_it() -> None:
    chatml = tiny_tokenizer()  # SmolLM2-style ChatML, ignores tools: Hermes instructions injected
    assert resolve_tool_format("auto", chatml).name == "hermes"
    assert resolve_tool_format("mistral", chatml).name == "mistral"
    llama = family_tokenizer("llama3")
    assert resolve_tool_format("qwen3", llama).name == "qwen3"
    named = {"default": "{{ x }}", "tool_use": "[TOOL_CALLS]"}  # a tokenizer with named templates
    assert template_text(type("T", (), {"chat_template": named})()) == "[TOOL_CALLS]"
    assert RolloutConfig(tool_format="llama3_json").tool_format == "llama3_json"
    with pytest.raises(ValidationError, match="tool_format"):
        RolloutConfig(tool_format="gemma")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tool format 'gemma'"):
        resolve_tool_format("gemma", llama)


# -------------------------------------------------------------------------- calls as templates render them
@pytest.mark.parametrize(
    ("folder", "template", "calls"),
    [
        ("llama3", None, [ToolCall("weather", {"city": "Zürich", "days": 2})]),  # one call a turn
        ("llama3", "meta-llama-Llama-3.2-3B-Instruct.jinja", [ADD_2_3]),
        ("qwen3", None, [ToolCall("weather", {"city": "Zürich", "days": 2}), ADD_2_3]),
        ("qwen3", "Qwen-Qwen2.5-7B-Instruct.jinja", [ADD_2_3, ToolCall("now", {})]),
        ("mistral", None, [ToolCall("weather", {"city": "Zürich"}, id="a1b2c3d4e"), ADD_2_3]),
        ("mistral", "Mistral-Small-3.2-24B-Instruct-2506.jinja", [ADD_2_3, ToolCall("now", {})]),
    ],
)
def test_parsing_reads_back_what_the_template_renders_for_calls(
    folder: str, template: str | None, calls: list[ToolCall]
) -> None:
    tok = family_tokenizer(folder, template)
    fmt = resolve_tool_format("auto", tok)
    if fmt.needs_call_ids:  # Mistral's templates refuse calls without 9-character ids
        calls = [
            c if c.id else ToolCall(c.name, c.arguments, id=f"id{i:07d}")
            for i, c in enumerate(calls)
        ]
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }
    user = [{"role": "user", "content": "q"}]
    has_opening = fmt.name != "mistral"  # Mistral's templates have no generation prompt
    before = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=has_opening)
    full = tok.apply_chat_template([*user, message], tokenize=False)
    assert full.startswith(before)
    written = full[len(before) :]
    for end in ("<|eot_id|>", "<|im_end|>\n", "</s>"):
        written = written.removesuffix(end)
    # What the model of this family writes for these calls is read back as exactly these calls.
    assert fmt.parse(written) == calls
    if template != "Mistral-Small-3.2-24B-Instruct-2506.jinja":  # render_calls writes Nemo's form
        assert written.endswith(fmt.render_calls(calls))
    # Through the tokenizer, markers that are special tokens survive the engine's decoding.
    token_ids = ids(tok, written)
    assert fmt.parse(decode_turn(tok, token_ids, fmt.markers)) == calls


@pytest.mark.parametrize(
    ("fmt", "text", "error"),
    [
        (
            "llama3_json",
            '{"name": "add", "parameters": {"a": 2,',
            "malformed: tool call is not valid JSON (",
        ),
        ("llama3_json", '{"answer": 5}', 'malformed: expected {"name": ..., "parameters": {...}}'),
        ("llama3_json", '<|python_tag|>brave_search.call(query="x")', "malformed: expected {"),
        ("llama3_json", '{"name": "add", "parameters": [2, 3]}', "malformed: 'arguments' must be"),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2}',
            "malformed: tool call is not valid JSON (",
        ),
        ("mistral", "[TOOL_CALLS]add", "malformed: expected [TOOL_CALLS]["),
        ("mistral", "[TOOL_CALLS][]", "malformed: an empty list of tool calls"),
        ("mistral", "[TOOL_CALLS]add[ARGS]{oops", "malformed: tool call is not valid JSON ("),
        ("mistral", '[TOOL_CALLS][{"arguments": {}}]', "malformed: expected [{"),
        (
            "qwen3",
            "</think>\n\n<tool_call>\n{oops\n</tool_call>",
            "malformed: tool call is not valid JSON (",
        ),
        (
            "llama3_json",
            '{"name": "add", "parameters": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "malformed: tool call JSON is too deep or too large",
        ),
    ],
)
def test_malformed_calls_are_one_line_errors_never_exceptions(
    fmt: str, text: str, error: str
) -> None:
    (call,) = TOOL_FORMATS[fmt].parse(text)
    assert call.error is not None and call.error.startswith(error)
    assert "\n" not in call.error


@pytest.mark.parametrize(
    ("fmt", "text", "names"),
    [
        ("llama3_json", "The answer is <answer>5</answer>", []),  # not a JSON turn: an answer
        ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}', ["add"]),
        (
            "llama3_json",
            '{"name": "add", "parameters": {}}; {"name": "now", "parameters": {}}',
            ["add", "now"],
        ),
        ("mistral", ANSWER, []),
        (
            "mistral",
            'Let me add.[TOOL_CALLS]add[CALL_ID]abc123xyz[ARGS]{"a": 2}[TOOL_CALLS]now[ARGS]{}',
            ["add", "now"],
        ),
        # Qwen3: calls while thinking are thoughts; the answer is after the last </think>.
        ("qwen3", "<think>\n" + HERMES_CALL + "\n</think>\n\n" + ANSWER, []),
        ("qwen3", "<think>\nmaybe " + HERMES_CALL, []),  # cut while thinking
        ("qwen3", "I add.\n</think>\n\n" + HERMES_CALL, ["add"]),  # <think> was in the prompt
        ("hermes", "<think>\n" + HERMES_CALL + "\n</think>", ["add"]),  # plain Hermes reads all
    ],
)
def test_what_counts_as_a_call_in_each_format(fmt: str, text: str, names: list[str]) -> None:
    calls = TOOL_FORMATS[fmt].parse(text)
    assert [c.name for c in calls] == names and all(c.error is None for c in calls)


# --------------------------------------------------------------------------- token-exact, per family
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_tool_episode_is_token_exact_with_the_real_template(name: str) -> None:
    family = FAMILIES[name]
    tok = family_tokenizer(family.folder, family.template)
    fmt = resolve_tool_format("auto", tok)
    assert fmt.name == family.format
    traj, gen = play_family(tok, family.turns, family.turn_of, system=family.system)

    # The env read the call in the family's format (Mistral's [TOOL_CALLS] is a special token the
    # engine keeps in the text it hands the env) and answered; nothing failed.
    assert traj.info["tool_calls"] == 1 and traj.info["tool_failures"] == 0
    assert traj.rewards == {"success": 1.0} and traj.finish_reason == "stop"
    assert [m["content"] for m in traj.messages] == [family.turns[0], "5", family.turns[1]]

    # Piece by piece: the template's prompt, the sampled turns, the template's glue.
    messages = opening(family.system)
    prompt = ids(
        tok,
        tok.apply_chat_template(
            messages, tools=[ADD.schema], tokenize=False, add_generation_prompt=True
        ),
    )
    eos = tok.eos_token_id
    turn1, glue, turn2 = (
        [*ids(tok, family.turns[0]), eos],
        ids(tok, family.glue),
        [*ids(tok, family.turns[1]), eos],
    )
    assert traj.token_ids == tuple(prompt + turn1 + glue + turn2)
    assert gen.calls[1][0] == [
        prompt + turn1 + glue
    ]  # the generator saw exactly that, nothing re-tokenized

    # Whole: the template's rendering of the finished conversation, tokenized at once, is the same
    # ids (plus what the template writes after the last sampled end token).
    conversation = openai_messages(messages + list(traj.messages), fmt)
    rendered = tok.apply_chat_template(conversation, tools=[ADD.schema], tokenize=False)
    assert ids(tok, rendered) == list(traj.token_ids) + ids(tok, family.closing)
    assert rendered == tok.decode(list(traj.token_ids)) + family.closing
    if fmt.name != "mistral":  # the messages as sampled (calls as text) render the same
        as_sampled = tok.apply_chat_template(
            messages + list(traj.messages), tools=[ADD.schema], tokenize=False
        )
        assert as_sampled == rendered

    # Trained tokens: exactly the sampled turns; the tool output and glue are masked and carry no
    # behaviour log-prob, advantage or gradient (collate zeroes them).
    p, a, g, b = len(prompt), len(turn1), len(glue), len(turn2)
    assert traj.policy_mask == (0,) * p + (1,) * a + (0,) * g + (1,) * b
    assert traj.logprobs == (0.0,) * p + (LOGPROB,) * a + (0.0,) * g + (LOGPROB,) * b
    n = len(traj.completion_ids)
    batch = collate([traj], [[1.0] * n], pad_token_id=0)
    assert batch.mask_B_C[0].tolist() == [1.0] * a + [0.0] * g + [1.0] * b
    assert batch.advantages_B_C[0].tolist() == [1.0] * a + [0.0] * g + [1.0] * b


def test_mistral_call_ids_the_model_did_not_write_and_the_system_message() -> None:
    """Where Nemo's template is not prefix-stable, pinned: (1) a call written without an id is filed
    under `call00001` (the template refuses results without one), which a re-render of the history
    writes into the call the model sampled without it; (2) the system message is written only while
    the last message is a user turn, so the prompt the model saw has it and the re-render does not."""
    tok = family_tokenizer("mistral")
    call = TOOL_FORMATS["mistral"].render_calls([ADD_2_3])
    traj, _ = play_family(tok, (call, ANSWER), mistral_turn, system=True)
    assert traj.info["tool_calls"] == 1 and traj.rewards == {"success": 1.0}
    assert traj.messages[1] == {
        "role": "tool",
        "name": "add",
        "content": "5",
        "tool_call_id": "call00001",
    }
    seen = tok.decode(list(traj.token_ids))
    assert f"[INST]{SYSTEM}\n\nWhat is 2 + 3?[/INST]{call}</s>" in seen
    assert '[TOOL_RESULTS]{"content": 5, "call_id": "call00001"}[/TOOL_RESULTS]' in seen

    conversation = openai_messages(opening(True) + list(traj.messages), TOOL_FORMATS["mistral"])
    rendered = tok.apply_chat_template(conversation, tools=[ADD.schema], tokenize=False)
    expected = seen.replace(f"{SYSTEM}\n\n", "").replace(
        '{"a": 2, "b": 3}}]', '{"a": 2, "b": 3}, "id": "call00001"}]'
    )
    assert rendered == expected


def test_qwen3_drops_empty_think_blocks_of_earlier_turns_when_rerendered() -> None:
    """Qwen3's template keeps a turn's think block in history only when it has reasoning (or is the
    last turn); a model in no-think mode writes empty ones. The engine keeps them (the model saw them
    in its own tokens); the re-render lacks the first turn's, and only that."""
    tok = family_tokenizer("qwen3")
    empty = "<think>\n\n</think>\n\n"
    traj, _ = play_family(tok, (empty + HERMES_CALL, empty + ANSWER), chatml_turn)
    assert traj.info["tool_calls"] == 1 and traj.rewards == {"success": 1.0}
    rendered = tok.apply_chat_template(
        opening(True) + list(traj.messages), tools=[ADD.schema], tokenize=False
    )
    seen = tok.decode(list(traj.token_ids))
    assert rendered == seen.replace(empty + HERMES_CALL, HERMES_CALL, 1) + "\n"


def test_llama_turns_ended_by_eom_get_no_second_end_token() -> None:
    """Llama 3.1 ends a tool-call turn with <|eom_id|> (built-in tools, sometimes custom ones); the
    template's closing <|eot_id|> must not follow it. The <|python_tag|> the model wrote stays in the
    text the env parses (a special token, dropped by a plain decode)."""
    tok = family_tokenizer("llama3")
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    tagged = "<|python_tag|>" + LLAMA_CALL
    traj, _ = play_family(tok, (tagged, ANSWER), llama_turn, eos=eom)
    assert traj.info["tool_calls"] == 1 and traj.rewards == {"success": 1.0}
    assert traj.messages[0]["content"] == tagged
    turn1_end = traj.turns[0].end
    assert traj.token_ids[turn1_end - 1] == eom
    assert tok.decode(list(traj.token_ids[turn1_end:])).startswith("<|start_header_id|>ipython")


@pytest.mark.parametrize(
    ("folder", "bad", "glue"),
    [
        (
            "llama3",
            '{"name": "add", "parameters": {"a": 2,',
            '<|start_header_id|>ipython<|end_header_id|>\n\n"Error: malformed: ',
        ),
        ("mistral", '[TOOL_CALLS][{"name": "add"', '[TOOL_RESULTS]{"content": Error: malformed: '),
    ],
)
def test_a_malformed_call_is_reported_to_the_model_in_its_template(
    folder: str, bad: str, glue: str
) -> None:
    tok = family_tokenizer(folder)
    turn_of = llama_turn if folder == "llama3" else mistral_turn
    traj, _ = play_family(tok, (bad, ANSWER), turn_of, system=folder == "llama3")
    assert traj.info["tool_errors/malformed"] == 1 and traj.finish_reason == "stop"
    assert traj.rewards == {"success": 1.0}  # the episode went on to the answer
    between = tok.decode(list(traj.token_ids[traj.turns[0].end : traj.turns[1].start]))
    assert between.startswith(glue) and "not valid JSON" in between


def test_the_config_override_reads_calls_in_the_named_format() -> None:
    tok = family_tokenizer("llama3")  # detected llama3_json; forced hermes
    traj, _ = play_family(tok, (HERMES_CALL, ANSWER), llama_turn, tool_format="hermes")
    assert traj.info["tool_calls"] == 1 and traj.rewards == {"success": 1.0}
    # ...and a Llama JSON turn is then an answer, not a call
    traj, _ = play_family(tok, (LLAMA_CALL, ANSWER), llama_turn, tool_format="hermes")
    assert "tool_calls" not in traj.info and traj.rewards == {"success": 0.0}


def test_a_template_that_ignores_tools_gets_the_chosen_format_in_the_system_message() -> None:
    text = prompt_text(tiny_tokenizer(), opening(True), [ADD.schema], TOOL_FORMATS["llama3_json"])
    assert '"name": "add"' in text
    assert '{"name": "<tool name>", "parameters": {"<argument>": "<value>"}}' in text


def test_a_hermes_demonstration_is_shown_in_each_family_format() -> None:
    demo = [
        {"role": "user", "content": "What is 1 + 1?"},
        {
            "role": "assistant",
            "content": TOOL_FORMATS["hermes"].render_calls([ToolCall("add", {"a": 1, "b": 1})]),
        },
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "<answer>2</answer>"},
        QUESTION,
    ]
    llama = prompt_text(family_tokenizer("llama3"), demo, [ADD.schema], TOOL_FORMATS["llama3_json"])
    assert '<|end_header_id|>\n\n{"name": "add", "parameters": {"a": 1, "b": 1}}<|eot_id|>' in llama
    mistral = prompt_text(family_tokenizer("mistral"), demo, [ADD.schema], TOOL_FORMATS["mistral"])
    assert (
        '[/INST][TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 1}, "id": "demo00001"}]</s>'
        '[TOOL_RESULTS]{"content": 2, "call_id": "demo00001"}[/TOOL_RESULTS]<answer>2</answer></s>'
    ) in mistral
    # Hermes / Qwen3 templates render the text as written.
    assert demonstration_messages(demo, TOOL_FORMATS["qwen3"]) == demo
