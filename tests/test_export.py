"""`rlvr export` (issue 19, item 4): a run's policy as a plain HF folder, loaded back with
transformers (and peft for an adapter) and generating; its model card says what the run was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from typer.testing import CliRunner

from rlvr.cli import app
from rlvr.config import load_config
from rlvr.errors import ConfigError
from rlvr.export import export_run
from rlvr.train.loop import train

pytestmark = pytest.mark.precision  # trains the tiny model under model.bf16: auto


def _run(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, *overrides: str) -> Path:
    import shutil

    examples = Path(__file__).resolve().parent.parent / "examples"
    folder = tmp_path_factory.mktemp("run")
    shutil.copy(examples / "tiny.yaml", folder / "tiny.yaml")
    shutil.copy(examples / "tiny_rewards.py", folder / "tiny_rewards.py")
    cfg = load_config(
        folder / "tiny.yaml",
        [
            f"model.name={model_dir}",
            f"output_dir={folder / 'run'}",
            "tracking.progress=false",
            "train.steps=2",
            "eval.n=4",
            *overrides,
        ],
    )
    return train(cfg, config_dir=folder).run_dir


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return _run(tmp_path_factory, tiny_model_dir)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return _run(tmp_path_factory, tiny_model_dir, "model.lora.enabled=true", "model.lora.r=4")


def _generate(model: torch.nn.Module, tokenizer: object, max_new_tokens: int = 6) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        return model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)  # type: ignore[operator]


def test_a_full_run_exports_a_folder_plain_transformers_loads_and_generates_from(
    full_run: Path, tmp_path: Path
) -> None:
    out = export_run(full_run, tmp_path / "export")
    assert (out / "model.safetensors").is_file()
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template  # the template the run trained under travels with the model
    generated = _generate(model, tokenizer)
    assert generated.shape[1] > 0
    # Same weights as the run's last checkpoint.
    last = sorted((full_run / "checkpoints").iterdir())[-1] / "model"
    trained = AutoModelForCausalLM.from_pretrained(last)
    for (name, exported), (_, original) in zip(
        model.state_dict().items(), trained.state_dict().items(), strict=True
    ):
        assert torch.equal(exported, original), name
    generation = GenerationConfig.from_pretrained(out)
    assert tokenizer.eos_token_id in generation.eos_token_id

    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: ")
    for expected in ("algorithm: `grpo`", "learning_rate", "## Held-out results", "eval/accuracy"):
        assert expected in card, expected
    assert "| eval/accuracy | " in card  # before (step 0) and after (step 2) columns
    assert "step 0 | step 2" in card
    assert "## Monitors that fired" in card
    assert "eval/accuracy is the mean of reward `digits`" in card
    assert (full_run / "config.yaml").read_text().strip() in card


def test_a_lora_run_exports_a_peft_adapter_or_a_merged_model_that_agree(
    lora_run: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    adapter = export_run(lora_run, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (adapter / "adapter_model.safetensors").is_file()
    assert Path(config["base_model_name_or_path"]).is_dir()  # loadable as written
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    assert "library_name: peft" in (adapter / "README.md").read_text()

    merged_dir = export_run(lora_run, tmp_path / "merged", merge_lora=True)
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(ids).logits, with_adapter(ids).logits, rtol=1e-4, atol=1e-5
        )
    assert _generate(merged, tokenizer).shape[1] > 0


def test_export_refuses_what_it_cannot_do_in_one_line(full_run: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"--step 7: .* has no checkpoint of that step \(it has: "
    ):
        export_run(full_run, tmp_path / "x", step=7)
    with pytest.raises(ConfigError, match=r"--merge-lora: .* trained all weights"):
        export_run(full_run, tmp_path / "y", merge_lora=True)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export_run(full_run, tmp_path / "busy")
    with pytest.raises(ConfigError, match="not a run directory"):
        export_run(tmp_path, tmp_path / "z")


def test_the_cli_exports_a_chosen_step_and_prints_its_version(
    full_run: Path, tmp_path: Path
) -> None:
    steps = sorted(int(p.name.removeprefix("step-")) for p in (full_run / "checkpoints").iterdir())
    result = CliRunner().invoke(
        app,
        [
            "export",
            str(full_run),
            str(tmp_path / "cli"),
            "--step",
            str(steps[0]),
            "--dtype",
            "bf16",
        ],
    )
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "cli", dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16
    assert f"# run, step {steps[0]}" in (tmp_path / "cli" / "README.md").read_text()
    version = CliRunner().invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("rlvr ")


def test_the_card_lists_the_alerts_up_to_the_exported_step(full_run: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(full_run, run)
    alert = {
        "step": 1,
        "time": 0.0,
        "event": "entropy_collapse",
        "action": "warn",
        "message": "low",
    }
    late = {**alert, "step": 99, "event": "echo_trap"}
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(alert) + "\n" + json.dumps(late) + "\n")
    card = (export_run(run, tmp_path / "out") / "README.md").read_text()
    assert "- step 1: **entropy_collapse** (warn): low" in card
    assert "**echo_trap**" not in card  # fired after the exported checkpoint
