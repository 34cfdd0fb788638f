"""`rlvr plan`: a run's peak memory per device, from its config and the model's config.json alone.

Over the 500-line guide: the estimate's formulas and the advice search read together; its docstring
holds the formulas (~45 lines).

Nothing is loaded but config.json (and, for the prompt length, a local tokenizer). Notation: P
parameters, T trainable, H hidden, I intermediate, A = heads x head_dim, K = kv_heads x head_dim,
V vocabulary, L layers; B rows of a micro-batch, G group size, Lp prompt and C completion tokens,
N gpus. fsdp divides the starred items by N; ddp divides nothing (rows are split either way).

Persistent: weights* 4P (full FT; LoRA: 4T + the frozen base, its matmul weights 2 bytes when
    stored in bf16: a bf16 update on a GPU, or the CPU's bf16 sampler), AdamW* 8T
    (two fp32 moments, torch's fused kernel: no temporaries), reference* (full FT with beta > 0: a
    copy, matmul weights bf16 under bf16), ppo's critic (backbone + value head: 4 bytes each, 12
    more per trained one)*, distill's teacher (4P')*, an async producer's or fsdp's sampling copy (4P).
Update (one micro-batch while the gradients are whole: not the first micro-batch): gradients* 4T
    (freed after each optimizer step, so rollouts and evals never hold them),
    activations: what autograd saves, per token and layer (a census with
        `torch.autograd.graph.saved_tensors_hooks` of HF's Llama and Qwen2 in training mode):
            fp32  4(6H + 4A + 4I + heads + 2) + 4 Lk      bf16  4(4H + heads + 2) + 2(5H + 4A + 4I) + 2 Lk
        (Lk: the keys the token attends over; sdpa gets its own float mask per layer), plus 8H a
        token outside the layers and 4(3H + 2I) held by the backward. The shared-prompt path runs
        each of a micro-batch's ceil(B/G) prompts once and keeps every row's repeated prompt keys
        and values (2 A Lp b per row and layer). Gradient checkpointing: the plain path (prompt per
        row), 4H per token and layer, two layers' worth (recomputed + its backward).
    logits: unfused 12 B C V (the fp32 log-softmax, the gather's gradient and its own, together in
        its backward; +8 B C V with an entropy bonus); the fused head (train/fused_logprobs.py):
        two (128, V) fp32 buffers, in bf16 a (<=1024, V) bf16 block and the head's bf16 cast.
    the head's fresh (V, H) gradient before it is added to .grad (full FT);
    bf16 autocast: a 2-byte cast of every matmul weight the forward reads (cached for trained
        weights, once per forward call for frozen fp32 ones).
    A second update phase: the shared-prompt path uses every weight twice, so the completion pass's
        weight gradients wait for the prompt pass's backward: 4T more, with the prompt activations.
        (Found with torch.profiler's memory timeline: the peak of SmolLM2's full FT update.)
Rollout / eval: KV cache rows x (Lp + C) x L x 2K (2 bytes for the fast path's bf16 cache, else 4),
    rows = prompts per step per rank x G, at most 256 a call (HFGenerator); the fast path's bf16
    weight copy (2 bytes per matmul weight and the head); LoRA's merged fp32 copies on HF's path;
    the last logits. Multi-turn envs: C = rollout.max_total_tokens.
Peak = the largest phase. On the CPU two calibrated terms join it (peak RSS of real runs minus the
imports' and minus the above, tests/test_plan.py): a runtime constant (tokenizer, tasks, rollouts;
more with peft) and allocator slack, a share of the blocks freed and made again every step (glibc
never moves a block). `overhead_bytes` is not the run's: the CUDA context and allocator slack on a
GPU (a rule of thumb), the interpreter with torch imported on the CPU; `required_bytes` adds it.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlvr.config import RunConfig, apply_overrides, config_to_dict
from rlvr.errors import ConfigError
from rlvr.optim import LEAN_CHUNK
from rlvr.registry import ALGORITHMS

GiB, MiB = 2**30, 2**20
CPU_RUNTIME_BYTES = 40 * MiB  # calibrated (tests/test_plan.py, docs/performance.md)
CPU_LORA_RUNTIME_BYTES = 40 * MiB  # calibrated: peft's small per-layer tensors fragment the heap
CPU_SLACK = 0.35  # calibrated: share of the re-made blocks that lands in fresh pages
CPU_BASELINE_BYTES = 400 * MiB  # measured: python + torch + transformers + peft + rlvr imported
CUDA_CONTEXT_BYTES = GiB  # CUDA context and cuBLAS workspace: a rule of thumb, not measured here
CUDA_SLACK = 0.05  # the caching allocator's fragmentation, a share of the peak: a rule of thumb
P, U2 = "persistent", "update (prompt backward)"  # phases: also update, update+ (both), rollout...
SAMPLER_MAX_ROWS = 256  # HFGenerator.max_batch_rows
ASSUMED_PROMPT_TOKENS = 256  # dataset / env prompts are not rendered here (--prompt-tokens)
FAST_DECODE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes from its config.json (Llama, Qwen2/3, Mistral, ...)."""

    architecture: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    experts: int = 1  # MoE: experts per layer (of `intermediate` width each), top_k run a token
    top_k: int = 1

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        kind, heads = str(getattr(c, "model_type", "")), int(c.num_attention_heads)
        experts = int(getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 1)
        moe = getattr(c, "moe_intermediate_size", None) if experts > 1 else None
        bias = bool(getattr(c, "attention_bias", False))
        return cls(
            architecture=(getattr(c, "architectures", None) or [kind])[0],
            vocab=int(c.vocab_size),
            hidden=int(c.hidden_size),
            layers=int(c.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            intermediate=int(moe or c.intermediate_size),
            tied=bool(getattr(c, "tie_word_embeddings", True)),
            qkv_bias=bias or kind.startswith("qwen2"),
            o_bias=bias,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            qk_norm=kind.startswith("qwen3"),
            experts=experts,
            top_k=int(getattr(c, "num_experts_per_tok", None) or 1) if experts > 1 else 1,
        )

    def linears(self) -> list[tuple[str, int, int, bool]]:
        """One layer's linear layers as (name, in, out, bias); an MoE layer's for every expert."""
        h, i = self.hidden, self.intermediate
        a, k = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
        attention = [("q_proj", h, a), ("k_proj", h, k), ("v_proj", h, k)]
        return [
            *[(n, fi, fo, self.qkv_bias) for n, fi, fo in attention],
            ("o_proj", a, h, self.o_bias),
            *[(n, fi, fo, self.mlp_bias) for _ in range(self.experts) for n, fi, fo in mlp],
        ]

    @property
    def layer_matmul(self) -> int:
        """One layer's matmul weights and their biases."""
        return sum(fi * fo + (fo if b else 0) for _, fi, fo, b in self.linears())

    @property
    def layer_params(self) -> int:
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.layer_matmul + norms + (self.hidden * self.experts if self.experts > 1 else 0)

    @property
    def head(self) -> int:
        """The lm_head's own parameters (0 when tied to the embedding)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def total(self) -> int:
        """Embedding + layers + final norm + untied head: `sum(p.numel())` of the HF model."""
        return self.vocab * self.hidden + self.layers * self.layer_params + self.hidden + self.head

    def lora_params(self, r: int, targets: str | list[str]) -> int:
        """peft's trainable count: r (in + out) per targeted linear ("all-linear": all but lm_head)."""
        names = (
            LINEAR_NAMES
            if targets == "all-linear"
            else [targets]
            if isinstance(targets, str)
            else targets
        )
        chosen = [(fi, fo) for n, fi, fo, _ in self.linears() if any(n.endswith(t) for t in names)]
        return self.layers * sum(r * (fi + fo) for fi, fo in chosen)

    def saved_per_token_layer(self, bf16: bool, keys: int) -> float:
        """Bytes autograd saves per token and layer (the census in the module docstring)."""
        h, a, i = self.hidden, self.heads * self.head_dim, self.top_k * self.intermediate
        small = self.heads + 2 + (2 * (a + self.kv_heads * self.head_dim) if self.qk_norm else 0)
        if bf16:
            return 4 * (4 * h + small) + 2 * (5 * h + 4 * a + 4 * i) + 2 * keys
        return 4 * (6 * h + 4 * a + 4 * i + small) + 4 * keys


@dataclass
class Item:
    name: str
    bytes: int
    phase: str  # persistent, update, update+ (both update phases), rollout, eval, critic
    note: str = ""


@dataclass
class Advice:
    sets: list[str]
    gpus: int
    peak_bytes: int
    fits: bool
    text: str


@dataclass
class MemoryPlan:
    model: str
    device: str
    gpus: int
    strategy: str
    params: int
    trainable: int
    items: list[Item]
    phases: dict[str, int]
    peak_bytes: int
    peak_phase: str
    overhead_bytes: int
    assumptions: dict[str, Any]
    available_bytes: int | None = None
    available_source: str = ""
    advice: list[Advice] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.available_bytes is None else self.required_bytes <= self.available_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "required_bytes": self.required_bytes, "fits": self.fits}

    def table(self) -> str:
        a, gib = self.assumptions, lambda n: f"{n / GiB:.2f}"
        lines = [
            f"model {self.model}: {self.params / 1e6:,.1f}M parameters, {self.trainable / 1e6:,.2f}M trained",
            f"{self.device} x {self.gpus} ({self.strategy}), {'bf16' if a['bf16'] else 'fp32'} update; "
            f"micro-batch {a['micro_batch_rows']} rows x ({a['prompt_tokens']} prompt "
            f"({a['prompt_source']}) + {a['completion_tokens']} completion tokens); "
            f"{a['sampler_rows']} rows sampled at once ({a['decode']} decode)",
            f"{'item':<30}{'GiB':>8}  {'phase':<25} note",
            *[f"{i.name:<30}{gib(i.bytes):>8}  {i.phase:<25} {i.note}" for i in self.items],
            "by phase (GiB): " + ", ".join(f"{k} {gib(v)}" for k, v in self.phases.items()),
        ]
        avail = "?" if self.available_bytes is None else gib(self.available_bytes)
        verdict = {True: "fits", False: "does NOT fit", None: "unknown"}[self.fits]
        lines.append(
            f"peak {gib(self.peak_bytes)} GiB ({self.peak_phase}) + overhead "
            f"{gib(self.overhead_bytes)} = {gib(self.required_bytes)} GiB of {avail} GiB "
            f"({self.available_source}): {verdict}"
        )
        lines += [f"note: {n}" for n in self.notes]
        for n, adv in enumerate(self.advice):
            lead = (
                ("smallest change that fits" if n == 0 else "also fits")
                if adv.fits
                else "best found"
            )
            lines.append(f"{lead}: {adv.text} (peak {gib(adv.peak_bytes)} GiB)")
        if self.fits is False and not any(a.fits for a in self.advice):
            lines.append("nothing tried makes it fit")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------- inputs
def load_shape(name: str) -> ModelShape:
    from transformers import AutoConfig

    from rlvr.models import resolve_model_path

    return ModelShape.from_config(AutoConfig.from_pretrained(resolve_model_path(name)))


def longest_prompt(cfg: RunConfig) -> tuple[int, str]:
    """The longest prompt in tokens: arithmetic prompts rendered (the largest operands, the chat
    template, the system prompt) with the model's local tokenizer, else ASSUMED_PROMPT_TOKENS."""
    longest, how = 0, "rendered"
    for part in cfg.components():
        task = part.task
        if task.source != "arithmetic":
            longest, how = max(longest, ASSUMED_PROMPT_TOKENS), "assumed"
            continue
        big = int("9" * task.arithmetic.digits)
        messages = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
        messages.append(
            {"role": "user", "content": task.arithmetic.prompt.format(a=big, b=big, op="*")}
        )
        longest = max(longest, _render_length(cfg.model.name, messages))
    return longest, how


def _render_length(name: str, messages: list[dict[str, str]]) -> int:
    from rlvr.models import SMOLLM2_ALIAS, TINY_ALIAS, load_tokenizer, resolve_model_path

    files = ("tokenizer.json", "tokenizer_config.json")
    if name not in (SMOLLM2_ALIAS, TINY_ALIAS) and not any(
        (Path(name) / f).exists() for f in files
    ):
        return 64 + sum(len(m["content"]) for m in messages) // 3  # no download: ~3 chars a token
    tokenizer = load_tokenizer(resolve_model_path(name))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def available_bytes(
    kind: str, gpu_memory_gb: float | None, cfg: RunConfig
) -> tuple[int | None, str]:
    """The device's memory: --gpu-memory, else the CUDA device's total, else MemAvailable."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * GiB), "--gpu-memory"
    if kind == "cpu":
        from rlvr.rollout.turn_cache import meminfo_available_bytes

        return meminfo_available_bytes(), "host MemAvailable"
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device here: give --gpu-memory"
    from rlvr.build import device_or_cpu

    target = device_or_cpu(cfg.model.device)
    props = torch.cuda.get_device_properties(target.index if target.type == "cuda" else 0)
    return int(props.total_memory), props.name


def _bf16(cfg: RunConfig, kind: str) -> bool:
    if cfg.model.precision == "lean":  # bf16 weights
        return True
    if cfg.model.bf16 != "auto" or kind == "cuda":
        return cfg.model.bf16 != "off"  # auto on a GPU: bf16 (compute capability 8.0+ assumed)
    from rlvr.precision import bf16_setting_on

    return bf16_setting_on("auto", cfg.model.name, "cpu")


def _sampler(cfg: RunConfig, shape: ModelShape, kind: str) -> tuple[str, bool]:
    """(decode path, bf16 weight copy) of the in-process sampler; ("none", False) for a server."""
    g = cfg.generator
    if g.other_engine():
        return "none", False
    path: str
    if kind == "cuda":
        copy = g.decode_dtype == "bfloat16" or (
            g.decode_dtype == "auto" and cfg.model.bf16 != "off"
        )
        path = g.decode if g.decode != "auto" else ("fast" if copy else "hf")
    else:
        from rlvr.config import bf16_sampling_copy, decode_path

        copy = bf16_sampling_copy(g.backend, g.decode, g.decode_dtype, cfg.model.bf16, "cpu")
        path = decode_path(g.backend, g.decode, g.decode_dtype, cfg.model.bf16, "cpu")
    if shape.architecture not in FAST_DECODE or shape.experts > 1:
        return "hf", False
    return path, copy and path == "fast"


# -------------------------------------------------------------------------------------- estimate
def estimate(
    cfg: RunConfig,
    *,
    gpus: int = 1,
    gpu_memory_gb: float | None = None,
    device: Any = None,
    prompt_tokens: int | None = None,
    advise: bool = True,
) -> MemoryPlan:
    """The run's peak memory per device (module docstring), whether it fits, and what would.
    `device`: where it runs ("cpu", "cuda", a torch.device); default a GPU with `gpu_memory_gb`,
    else `model.device` resolved here."""
    if device is not None:
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
    elif gpu_memory_gb is not None:
        kind = "cuda"
    else:
        from rlvr.build import device_or_cpu

        kind = device_or_cpu(cfg.model.device).type
    shape = load_shape(cfg.model.name)
    lp, how = (prompt_tokens, "given") if prompt_tokens else longest_prompt(cfg)
    plan = _estimate(cfg, shape, kind, gpus, lp, how)
    plan.available_bytes, plan.available_source = available_bytes(kind, gpu_memory_gb, cfg)
    if advise and plan.fits is False:
        plan.advice = _advise(cfg, shape, plan)
    return plan


def _estimate(cfg: RunConfig, s: ModelShape, kind: str, gpus: int, lp: int, how: str) -> MemoryPlan:
    t, o, lora, ckpt = (
        cfg.train,
        cfg.objective,
        cfg.model.lora.enabled,
        cfg.model.gradient_checkpointing,
    )
    fsdp = cfg.distributed.strategy == "fsdp" and gpus > 1
    shard, bf16 = (gpus if fsdp else 1), _bf16(cfg, kind)
    b = 2 if bf16 else 4
    lean = cfg.model.precision == "lean"  # bf16 weights, gradients and moments (full FT)
    w = 2 if lean else 4  # bytes of a stored weight and of its gradient
    path, copy_bf16 = _sampler(cfg, s, kind)
    envs = any(p.task.source == "env" for p in cfg.components()) or cfg.rollout.mode == "external"
    c = max(cfg.sampling.max_new_tokens, cfg.rollout.max_total_tokens if envs else 0)
    g = cfg.sampling.group_size
    rows = math.ceil(cfg.sampling.prompts_per_step / gpus) * g  # this rank's rows
    mb = min(t.micro_batch_size, rows)
    if cap := getattr(t, "max_tokens_per_micro_batch", None):
        mb = max(1, min(mb, cap // (lp + c)))
    fused_setting = t.fused_logprobs if t.fused_logprobs != "auto" else lora or kind == "cuda"
    algorithm = ALGORITHMS.resolve(cfg.algorithm)  # a plug-in's critic or teacher counts too
    needs_critic, needs_teacher = algorithm.needs_critic, algorithm.needs_teacher
    fused = bool(fused_setting) and not fsdp and not needs_teacher
    trained = s.lora_params(cfg.model.lora.r, cfg.model.lora.target_modules) if lora else s.total
    v, vh = s.vocab, s.vocab * s.hidden
    matmul = s.layers * s.layer_matmul + vh  # every matmul weight, the head's too
    rest = s.total - matmul + (vh if s.tied else 0)  # fp32 always: embedding (looked up), norms
    items: list[Item] = []

    def add(name: str, n: float, phase: str, note: str = "") -> None:
        if n > 0:
            items.append(Item(name, int(n), phase, note))

    # -- persistent
    # As RolloutPlan.store_frozen_base_bf16 decides: the in-process sampler reads a bf16 weight copy
    # (HF's fp32 forward needs an fp32 base; an async producer samples from weights of its own).
    base_bf16 = lora and bf16 and copy_bf16 and not cfg.rollout.async_rollouts
    if lora:  # matmul weights 2 or 4 bytes; norms (and a tied embedding, looked up) stay fp32
        frozen = 4 * rest + (2 if base_bf16 else 4) * (matmul - (vh if s.tied else 0))
        frozen += 2 * vh if base_bf16 and s.tied else 0  # the head's own bf16 tensor
        add("weights (frozen base)", frozen / shard, P, "bf16 matmuls" if base_bf16 else "fp32")
        add("weights (adapters)", 4 * trained / shard, P, f"LoRA r={cfg.model.lora.r}")
    else:
        add("weights", w * s.total / shard, P, "bf16 (lean)" if lean else "fp32 master")
    # Freed after each optimizer step (train/update.py): held through the update only.
    grads_note = "bf16" if lean else "fp32"
    add("gradients", w * trained / shard, "update+", f"{grads_note}, freed after the step")
    if lean:
        add("optimizer", 4 * trained / shard, P, "AdamW, 2 x bf16, stochastic rounding")
        # the step's fp32 slices (rlvr.optim.LEAN_CHUNK): about 7 of them at once
        add("optimizer step slices", 7 * 4 * min(LEAN_CHUNK, s.total), "update step", "fp32")
    else:
        add("optimizer", 8 * trained / shard, P, "AdamW, 2 x fp32")
    if not lora and o.beta > 0:
        if lean:
            ref, what = 2 * s.total, ", bf16"
        else:  # a tied head: its own bf16 copy
            ref, what = (4 * rest + 2 * matmul, ", bf16 matmuls") if bf16 else (4 * s.total, "")
        add("reference", ref / shard, P, "frozen copy" + what)
    critic = load_shape(cfg.critic.model) if needs_critic and cfg.critic.model else s
    if needs_critic:
        backbone = critic.total - critic.head + critic.hidden + 1
        cl = cfg.critic.lora
        lora_ct = critic.lora_params(cl.r, cl.target_modules) + critic.hidden + 1
        critic_bytes = 4 * backbone + 12 * (lora_ct if cl.enabled else backbone)
        add("critic", critic_bytes / shard, P, "+ grads, AdamW")  # sharded like the policy
    if needs_teacher and cfg.distill.teacher:
        add("teacher", 4 * load_shape(cfg.distill.teacher).total / shard, P, "frozen, fp32")
    if fsdp and path != "none" and copy_bf16:  # matmul weights bf16, read by the fast path as is
        add("sampling copy", 4 * rest + 2 * matmul, P, "fsdp's unsharded, bf16 matmuls")
    elif cfg.rollout.async_rollouts or (fsdp and path != "none"):
        add("sampling copy", 4 * s.total, P, "async producer's / fsdp's unsharded fp32")
    if fsdp:
        add("gathered layers (fsdp)", 8 * s.layer_params, "update+", "two layers unsharded")

    # -- update
    plain = ckpt or not t.share_prompt_prefix
    prompts = min(mb, math.ceil(mb / g) + (1 if mb % g else 0))  # a micro-batch's prompts

    def activations(m: ModelShape, shared: bool) -> float:
        spt, lc = m.saved_per_token_layer, lp + c
        if ckpt:  # layer inputs kept; one layer recomputed and its backward
            return mb * lc * (4 * m.hidden * m.layers + 8 * m.hidden + 2 * spt(bf16, lc))
        if not shared:
            n, layer = mb * lc, mb * lc * spt(bf16, lc)
        else:  # the prompts once; every row keeps its prompt's repeated keys and values
            n = prompts * lp + mb * c
            layer = prompts * lp * spt(bf16, lp) + mb * c * spt(bf16, lc)
            layer += mb * lp * 2 * m.heads * m.head_dim * b
        return layer * m.layers + n * (8 * m.hidden + 4 * (3 * m.hidden + 2 * m.intermediate))

    route = "checkpointed" if ckpt else "plain path" if plain else "shared prompt"
    add("activations", activations(s, not plain), "update", f"{mb} rows, {route}")
    if fused:
        head = 2 * 128 * v * 4
        head += 128 * v * 2 + min(mb * c, 1024) * v * 2 + (0 if lean else 2 * vh) if bf16 else 0
        add("logits (fused head)", head, "update", "chunked (128, V) buffers")
    else:
        per = 12 + (8 if o.entropy_coef > 0 else 0) + (12 if needs_teacher else 0)
        add("logits", per * mb * c * v, "update", f"fp32 log-softmax ({mb}, {c}, {v}) x3")
    if not lora:
        add("head gradient (fresh)", w * vh, "update+", "before it is added to .grad")
    if bf16 and not lean:  # trained weights' casts are cached; frozen fp32 ones cast per call
        frozen_casts = (0 if base_bf16 else matmul) * (1 if plain else 2)
        casts = frozen_casts if lora else (matmul - (vh if fused else 0)) / shard
        add("autocast bf16 casts", 2 * casts, "update+", "weights cast for matmuls")
    if not plain:
        add("gradients in flight", w * trained / shard, U2, "the completion pass's")
        per_prompt = s.saved_per_token_layer(bf16, lp) * (s.layers + 1) + 8 * s.hidden
        add("prompt activations", prompts * lp * per_prompt, U2, f"{prompts} x {lp} tokens")
    if needs_critic:
        add("critic activations", activations(critic, False), "critic", "the critic's update")

    # -- rollout and eval
    adapted = s.layers * sum(fi * fo for _, fi, fo, _ in s.linears())
    merged = 4 * adapted if lora and path == "hf" and kind != "cuda" else 0  # CPU-only merging
    sampler_rows = min(rows, max(1, SAMPLER_MAX_ROWS // g) * g)
    for phase, n_rows, new in (
        ("rollout", 0 if cfg.distributed.ray else sampler_rows, c),  # Ray samples elsewhere
        ("eval", min(cfg.eval.n, SAMPLER_MAX_ROWS), max(cfg.eval.max_new_tokens or 0, c)),
    ):
        evals = cfg.eval.at_start or cfg.eval.at_end or 0 < cfg.eval.every <= t.steps
        if path == "none" or not n_rows or (phase == "eval" and not evals):
            continue
        kv = n_rows * (lp + new) * s.layers * 2 * s.kv_heads * s.head_dim * (2 if copy_bf16 else 4)
        add(f"KV cache ({phase})", kv, phase, f"{n_rows} rows x {lp + new} tokens")
        add(f"sampler logits ({phase})", n_rows * v * (20 if kind == "cpu" else 4), phase)
        weights, what = (2 * matmul, "bf16 copy") if copy_bf16 else (merged, "LoRA merged, fp32")
        if copy_bf16 and (lean or fsdp):  # its weights are bf16 already: read in place
            weights = 0
        add(f"sampler weights ({phase})", weights, phase, what)
    if kind == "cpu":
        runtime = CPU_RUNTIME_BYTES + (CPU_LORA_RUNTIME_BYTES if lora else 0)
        add("runtime (CPU)", runtime, P, "calibrated: tokenizer, tasks, rollouts")
        update = sum(i.bytes for i in items if i.name.startswith(("activations", "logits")))
        remade = (0 if lora else w * trained) + update + merged
        add("allocator slack (CPU)", CPU_SLACK * remade, P, f"calibrated: {CPU_SLACK} x re-made")

    persistent = sum(i.bytes for i in items if i.phase == "persistent")
    both = sum(i.bytes for i in items if i.phase == "update+")
    phases = {"update": persistent + both}
    for i in items:
        if i.phase not in ("persistent", "update+"):
            extra = both if i.phase.startswith("update") else 0
            phases[i.phase] = phases.get(i.phase, persistent + extra) + i.bytes
    if cfg.rollout.async_rollouts:  # the producer samples while the update runs
        phases["update"] += phases.get("rollout", persistent) - persistent
    peak_phase = max(phases, key=lambda k: phases[k])
    peak = phases[peak_phase]
    notes = []
    if cfg.generator.backend == "server" and cfg.generator.launch == "vllm":
        notes.append("vLLM takes --gpu-memory-utilization (default 0.9) of its GPU: not counted")
    elif cfg.generator.backend == "vllm_colocate":
        share = cfg.generator.vllm.gpu_memory_utilization or 0.3
        notes.append(
            f"the colocated vLLM takes {share:g} of the GPU while it samples (asleep during the "
            "update): not counted"
        )
    if how == "assumed":
        notes.append(f"prompts assumed {lp} tokens (datasets, envs): --prompt-tokens N")
    if s.experts > 1:
        notes.append("MoE: all experts' weights, top-k experts' activations")
    overhead = CUDA_CONTEXT_BYTES + int(CUDA_SLACK * peak) if kind == "cuda" else CPU_BASELINE_BYTES
    assumptions = {"prompt_tokens": lp, "prompt_source": how, "completion_tokens": c, "bf16": bf16}
    assumptions |= {"micro_batch_rows": mb, "rows_per_step": rows, "sampler_rows": sampler_rows}
    assumptions |= {"fused_head": fused, "decode": path}
    strategy = cfg.distributed.strategy if gpus > 1 else "single"
    return MemoryPlan(
        cfg.model.name, kind, gpus, strategy, s.total, trained, items, phases, peak, peak_phase,
        overhead, assumptions, notes=notes,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- advice
def with_sets(cfg: RunConfig, sets: list[str]) -> RunConfig:
    """`cfg` with `--set key=value` overrides applied, validated as `load_config` does."""
    from pydantic import ValidationError

    try:
        return RunConfig.model_validate(apply_overrides(config_to_dict(cfg), list(sets), RunConfig))
    except ValidationError as err:
        raise ConfigError(f"--set {' '.join(sets)}: {err.errors()[0]['msg']}") from None


def _advise(cfg: RunConfig, s: ModelShape, plan: MemoryPlan) -> list[Advice]:
    """Each change alone, in order, each re-estimated: a smaller micro-batch; gradient
    checkpointing, the fused head, the lean precision, LoRA (each with the largest micro-batch
    that then fits); fsdp
    over the fewest GPUs that fit. All that fit are returned, the first being the smallest change.
    None alone: the changes stacked in that order."""
    kind, gpus, avail = plan.device, plan.gpus, plan.available_bytes or 0
    lp, how = plan.assumptions["prompt_tokens"], plan.assumptions["prompt_source"]

    def fits(sets: list[str], n: int) -> bool:
        p = _estimate(with_sets(cfg, sets), s, kind, n, lp, how)
        return p.required_bytes <= avail

    def micro(sets: list[str], n: int) -> list[str] | None:
        """[] when `sets` fit as they are, else the largest micro-batch that does (bisection)."""
        if (sets or n != gpus) and fits(sets, n):
            return []
        low, high, best = 1, plan.assumptions["micro_batch_rows"] - 1, None
        while low <= high:
            mid = (low + high) // 2
            if fits([*sets, f"train.micro_batch_size={mid}"], n):
                best, low = mid, mid + 1
            else:
                high = mid - 1
        return None if best is None else [f"train.micro_batch_size={best}"]

    def advice(sets: list[str], n: int) -> Advice:
        text = " ".join(f"--set {x}" for x in sets)
        if n != gpus:
            text += f" on {n} GPUs (torchrun --nproc_per_node {n}; rlvr plan --gpus {n})"
        p = _estimate(with_sets(cfg, sets), s, kind, n, lp, how)
        return Advice(sets, n, p.peak_bytes, p.required_bytes <= avail, text.strip())

    levers = [] if cfg.model.gradient_checkpointing else [["model.gradient_checkpointing=true"]]
    if not plan.assumptions["fused_head"] and plan.strategy != "fsdp":
        levers.append(["train.fused_logprobs=true"])
    if not cfg.model.lora.enabled and cfg.model.precision != "lean":
        levers.append(["model.precision=lean"])  # still full fine-tuning: bf16 weights and moments
    if not cfg.model.lora.enabled:  # a lean run's LoRA keeps fp32 adapters
        mixed = ["model.precision=mixed"] if cfg.model.precision == "lean" else []
        levers.append(["model.lora.enabled=true", *mixed])
    fsdp = [] if cfg.distributed.strategy == "fsdp" else ["distributed.strategy=fsdp"]
    if fsdp and cfg.model.precision == "lean":  # lean is for one device: fsdp shards fp32 instead
        fsdp.append("model.precision=mixed")
    more = [n for n in (2, 4, 8, 16, 32, 64) if n > gpus]
    found = []
    for sets in [[], *levers]:
        if (smaller := micro(sets, gpus)) is not None:
            found.append(advice([*sets, *smaller], gpus))
    for n in more:  # the fewest GPUs that fit (with a smaller micro-batch if need be)
        if (smaller := micro(fsdp, n)) is not None:
            found.append(advice([*fsdp, *smaller], n))
            break
    if found:
        return found
    stacked: list[str] = []
    lean = "model.precision=lean"  # for one device's full fine-tune: LoRA or fsdp replace it
    for sets, n in [*[(x, gpus) for x in levers], *[(fsdp, n) for n in more]]:
        if lean in stacked and lean not in sets:
            stacked.remove(lean)
        stacked += [x for x in sets if x not in stacked]
        if (smaller := micro(stacked, n)) is not None:
            return [advice([*stacked, *smaller], n)]
    return [advice([*stacked, "train.micro_batch_size=1"], more[-1] if more else gpus)]


# ------------------------------------------------------------------------------------ check_fits
def check_fits(cfg: RunConfig, device: Any) -> None:
    """Before loading weights: refuse (ConfigError, with the advice) a run that cannot fit on its
    CUDA device; on the CPU only warn when the estimate exceeds MemAvailable. A planner that
    cannot estimate (an unknown architecture) warns and lets the run go on."""
    gpus = int(os.environ.get("WORLD_SIZE", "1") or 1)
    try:
        plan = estimate(cfg, gpus=gpus, device=device, advise=False)
    except ConfigError:
        raise
    except Exception as err:
        warnings.warn(f"rlvr plan could not estimate this run's memory: {err}", stacklevel=2)
        return
    if plan.device == "cuda":
        if plan.fits is False:
            plan.advice = _advise(cfg, load_shape(cfg.model.name), plan)
            raise ConfigError(refusal(plan))
        return
    from rlvr.rollout.turn_cache import meminfo_available_bytes

    free = meminfo_available_bytes()
    if free is not None and plan.peak_bytes > free:  # the imports are resident already
        warnings.warn(
            f"rlvr plan: this run may need {plan.peak_bytes / GiB:.1f} GiB, the host has "
            f"{free / GiB:.1f} GiB available (rlvr plan CONFIG for the breakdown)",
            stacklevel=2,
        )


def refusal(plan: MemoryPlan) -> str:
    """One line: what the run needs, what the device has, the smallest change that fits."""
    fix = next((a for a in plan.advice if a.fits), None)
    return (
        f"this run needs ~{plan.required_bytes / GiB:.1f} GiB per device ({plan.peak_phase} peak "
        f"{plan.peak_bytes / GiB:.1f} GiB + overhead), {plan.available_source} has "
        f"{(plan.available_bytes or 0) / GiB:.1f} GiB; "
        + (f"it fits with {fix.text}" if fix else "nothing tried makes it fit (see rlvr plan)")
    )


def dumps(plan: MemoryPlan) -> str:
    return json.dumps(plan.to_dict(), indent=2)
