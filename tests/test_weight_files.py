"""rlvr.rollout.weight_files writes the safetensors format itself (streamed, cast through one
scratch buffer): safetensors' own reader must read back exactly the tensors given, cast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlvr.rollout.weight_files import write_safetensors, write_shards


def tensors() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    wide = torch.randn(6, 4)
    return [
        ("a.weight", torch.randn(3, 5)),
        ("b.weight", wide.t()),  # not contiguous
        ("c.bias", torch.randn(7, dtype=torch.float64)),
        ("positions", torch.arange(10)),  # int64 buffer: kept as it is
        ("mask", torch.tensor([True, False, True])),
        ("scale", torch.tensor(2.5)),  # 0-dim
        ("empty", torch.zeros(0, 3)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_safetensors_reads_back_what_was_written(tmp_path: Path, dtype: torch.dtype) -> None:
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors(), dtype)
    back = load_file(str(path))
    assert list(back) == [name for name, _ in tensors()]  # all of them, in order
    for name, tensor in tensors():
        want = tensor.to(dtype) if tensor.is_floating_point() else tensor
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_shards_split_by_size_and_hold_every_tensor(tmp_path: Path) -> None:
    rows = [(f"layer.{i}.weight", torch.full((256,), float(i))) for i in range(10)]
    files = write_shards(rows, tmp_path, torch.bfloat16, shard_bytes=1024)  # 2 bf16 rows a shard
    assert [f.name for f in files] == [f"model-{k:05d}.safetensors" for k in range(1, 6)]
    back: dict[str, torch.Tensor] = {}
    for file in files:
        back.update(load_file(str(file)))
    assert sorted(back) == sorted(name for name, _ in rows)
    assert all(torch.equal(back[n], t.to(torch.bfloat16)) for n, t in rows)


def test_a_lora_policy_is_merged_one_matrix_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merged sync (generator.weight_sync: full with LoRA) writes W + scale * B @ A for every
    adapted layer, as peft's merge_and_unload gives, making each merged matrix only when it is
    written: no two are alive at once (all at once were ~26 GB at 7B on an fp32 base)."""
    import copy
    import gc
    import weakref

    from rlvr.models import TINY_ALIAS, LoraSettings, load_policy
    from rlvr.rollout import server

    policy = load_policy(TINY_ALIAS, lora=LoraSettings(r=4), device="cpu")
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    expected = copy.deepcopy(policy.model).merge_and_unload().state_dict()
    made: list[weakref.ref[torch.Tensor]] = []
    real = server.merged_weight

    def tracked(module: object, weight: torch.Tensor) -> torch.Tensor:
        gc.collect()
        assert all(ref() is None for ref in made), "an earlier merged matrix is still alive"
        out = real(module, weight)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(server, "merged_weight", tracked)
    server.save_full(policy, str(tmp_path), dtype=torch.float32)
    written = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        written.update(load_file(str(file)))
    assert len(made) >= 7  # every adapted projection of the tiny model's layers
    assert set(written) == set(expected)  # the tied head too (write_tied_head's own file)
    for name, tensor in written.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
