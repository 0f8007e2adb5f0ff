"""Discovery on a synthetic Hugging Face hub cache, model folders and aliases: what is found,
what is skipped and why."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from model_folders import REV_NEW, REV_OLD, model_files, write_dir, write_hf_repo
from provider.models import (
    DType,
    ModelInfo,
    ModelSource,
    QuantMode,
    SkipReason,
    discover,
    inspect_model,
    newest_snapshot,
)

T0 = 1_700_000_000 * 10**9


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    cache = tmp_path / "hub"
    good = model_files()
    # refs/main names the older snapshot: it wins over the newer mtime.
    write_hf_repo(cache, "org-a/pinned", {REV_OLD: good, REV_NEW: model_files(mx.float32)},
                  main=REV_OLD, mtimes={REV_OLD: T0, REV_NEW: T0 + 10**9})
    # no refs: the newest snapshot by mtime wins.
    write_hf_repo(cache, "org-b/newest", {REV_OLD: good, REV_NEW: model_files(mx.float16)},
                  mtimes={REV_OLD: T0 + 5 * 10**9, REV_NEW: T0 + 9 * 10**9})
    # refs/main naming a snapshot that is not there falls back to mtime.
    write_hf_repo(cache, "org-b/stale-ref", {REV_NEW: good}, main="c" * 40)
    write_hf_repo(cache, "org-q/quant-4bit", {REV_NEW: model_files(mx.float16, quantized=True)})
    write_hf_repo(cache, "org-s/sharded", {REV_NEW: model_files(shards=3)})
    write_hf_repo(cache, "gpt-mini", {REV_NEW: good})  # a repo without an org

    no_weights = {k: v for k, v in good.items() if not k.endswith(".safetensors")
                  and k != "model.safetensors.index.json"}
    write_hf_repo(cache, "broken/no-weights", {REV_NEW: no_weights})
    write_hf_repo(cache, "broken/bad-json", {REV_NEW: {**good, "config.json": b"{not json"}})
    write_hf_repo(cache, "broken/no-model-type",
                  {REV_NEW: {**good, "config.json": b'{"hidden_size": 64}'}})
    sharded = model_files(shards=3)
    del sharded["model-00002-of-00003.safetensors"]
    write_hf_repo(cache, "broken/missing-shard", {REV_NEW: sharded})
    truncated = dict(good)
    truncated["model.safetensors"] = good["model.safetensors"][:-10]
    write_hf_repo(cache, "broken/truncated", {REV_NEW: truncated})
    dangling = write_hf_repo(cache, "broken/dangling-blob", {REV_NEW: good})
    (dangling / "snapshots" / REV_NEW / "model.safetensors").resolve().unlink()
    escape = write_hf_repo(cache, "broken/escape", {REV_NEW: good})
    secret = tmp_path / "secret.txt"
    secret.write_text("not for you")
    (escape / "snapshots" / REV_NEW / "tokenizer.json").unlink()
    (escape / "snapshots" / REV_NEW / "tokenizer.json").symlink_to(secret)
    (cache / "models--broken--empty" / "snapshots").mkdir(parents=True)
    (cache / "datasets--someone--data").mkdir()  # not a model repo: ignored

    local = write_dir(tmp_path / "local" / "my-finetune", model_files())
    models = tmp_path / "models"
    write_dir(models / "plain", model_files(mx.float32))
    write_dir(models / "mlx-community" / "nested-4bit", model_files(quantized=True))
    write_dir(models / "half-done", {"model.safetensors": good["model.safetensors"]})
    (models / "not-a-model").mkdir()
    (models / "not-a-model" / "notes.txt").write_text("hello")
    return {"cache": cache, "local": local, "models": models, "tmp": tmp_path}


def test_discovery_finds_exactly_the_servable_models_and_says_why_others_are_skipped(world) -> None:
    inv = discover(
        hf_cache=world["cache"],
        model_dirs=[world["models"]],
        aliases={"catalog/served-name": world["local"],
                 "org-b/newest": world["local"],  # an alias overrides the hub copy's id
                 "catalog/ghost": world["tmp"] / "nowhere"},
    )
    found = {m.id: m for m in inv.models}
    assert set(found) == {
        "catalog/served-name", "org-b/newest", "org-a/pinned", "org-b/stale-ref",
        "org-q/quant-4bit", "org-s/sharded", "gpt-mini", "plain", "mlx-community/nested-4bit",
    }
    skipped = {s.id: s.reason for s in inv.skipped}
    assert skipped == {
        "catalog/ghost": SkipReason.NOT_FOUND,
        "org-b/newest": SkipReason.DUPLICATE_ID,
        "broken/no-weights": SkipReason.NO_WEIGHTS,
        "broken/bad-json": SkipReason.BAD_CONFIG,
        "broken/no-model-type": SkipReason.BAD_CONFIG,
        "broken/missing-shard": SkipReason.PARTIAL,
        "broken/truncated": SkipReason.CORRUPT_WEIGHTS,
        "broken/dangling-blob": SkipReason.PARTIAL,
        "broken/escape": SkipReason.UNSAFE_LINK,
        "broken/empty": SkipReason.NO_SNAPSHOT,
        "half-done": SkipReason.NO_CONFIG,
    }
    assert all(s.message for s in inv.skipped)
    by_id = {s.id: s for s in inv.skipped}
    assert "model-00002-of-00003.safetensors" in by_id["broken/missing-shard"].message
    assert by_id["org-b/newest"].path.parent.parent.name == "models--org-b--newest"
    assert inv.disabled == () and inv.missing == ()

    # snapshot choice: refs/main first, else the newest mtime; a stale ref falls back to mtime
    assert found["org-a/pinned"].revision == REV_OLD
    assert found["org-a/pinned"].dtype is DType.BFLOAT16
    assert found["org-b/stale-ref"].revision == REV_NEW
    # sources
    assert found["catalog/served-name"].source is ModelSource.ALIAS
    assert found["catalog/served-name"].path == world["local"]
    assert found["org-b/newest"].source is ModelSource.ALIAS
    assert found["plain"].source is ModelSource.MODEL_DIR and found["plain"].dtype is DType.FLOAT32
    assert found["gpt-mini"].source is ModelSource.HF_CACHE


def test_newest_snapshot_by_mtime_without_refs(world) -> None:
    repo = world["cache"] / "models--org-b--newest"
    assert newest_snapshot(repo) == repo / "snapshots" / REV_NEW
    # hub copy of org-b/newest, looked at directly: float16 from its newer snapshot
    info = inspect_model(newest_snapshot(repo), "org-b/newest")
    assert isinstance(info, ModelInfo) and info.dtype is DType.FLOAT16


def test_model_facts_from_config_and_weights(world) -> None:
    inv = discover(hf_cache=world["cache"], model_dirs=[world["models"]], aliases={})
    found = {m.id: m for m in inv.models}

    pinned = found["org-a/pinned"]
    snapshot = world["cache"] / "models--org-a--pinned" / "snapshots" / REV_OLD
    assert pinned.path == snapshot
    # weight bytes follow the symlinks to the blobs
    assert pinned.weight_bytes == (snapshot / "model.safetensors").stat().st_size > 1000
    assert pinned.model_type == "llama" and pinned.quantization is None
    assert pinned.context_length == 4096
    assert pinned.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2  # layers, kv heads, head dim, K+V, bf16

    quant = found["org-q/quant-4bit"]
    assert quant.quantization is not None
    assert (quant.quantization.bits, quant.quantization.group_size) == (4, 64)
    assert quant.quantization.mode is QuantMode.AFFINE
    # activations (and the KV cache) follow the scales' dtype, not the config's torch_dtype
    assert quant.dtype is DType.FLOAT16 and quant.kv.dtype_bytes == 2

    sharded = found["org-s/sharded"]
    assert len(sharded.weight_files) == 3
    assert sharded.weight_bytes == sum(p.stat().st_size for p in sharded.weight_files)


def test_enabled_ids_filter_and_report_missing(world) -> None:
    inv = discover(hf_cache=world["cache"], model_dirs=[world["models"]],
                   aliases={"catalog/served-name": world["local"]},
                   enabled_ids={"catalog/served-name", "plain", "broken/bad-json", "not/anywhere"})
    assert {m.id for m in inv.models} == {"catalog/served-name", "plain"}
    assert {s.id for s in inv.skipped} == {"broken/bad-json"}  # other broken ones not inspected
    assert inv.missing == ("not/anywhere",)
    assert "org-a/pinned" in inv.disabled and "broken/escape" in inv.disabled


def test_broken_alias_is_not_silently_replaced_by_another_source(world, tmp_path) -> None:
    broken = write_dir(tmp_path / "broken-alias", {"config.json": b"[]"})
    inv = discover(hf_cache=world["cache"], aliases={"org-a/pinned": broken})
    assert "org-a/pinned" not in {m.id for m in inv.models}
    reasons = sorted((s.reason.value, str(s.path)) for s in inv.skipped if s.id == "org-a/pinned")
    assert [r for r, _ in reasons] == [SkipReason.BAD_CONFIG.value, SkipReason.DUPLICATE_ID.value]


def test_alias_to_a_hub_cache_repo_dir_uses_its_snapshot(world) -> None:
    repo = world["cache"] / "models--org-a--pinned"
    inv = discover(hf_cache=None, aliases={"catalog/pinned": repo})
    (info,) = inv.models
    assert info.id == "catalog/pinned" and info.revision == REV_OLD


def test_a_model_dir_that_is_itself_a_model(world) -> None:
    inv = discover(hf_cache=None, model_dirs=[world["models"] / "plain"])
    assert [m.id for m in inv.models] == ["plain"]


def test_missing_sources_are_not_a_crash(tmp_path) -> None:
    inv = discover(hf_cache=tmp_path / "no-hub", model_dirs=[tmp_path / "no-models"], aliases={})
    assert inv.models == ()
    assert [(s.reason, s.path) for s in inv.skipped] == [(SkipReason.NOT_FOUND, tmp_path / "no-models")]


def test_unreadable_config_is_reported(tmp_path) -> None:
    # config.json that cannot be read as a file (an OS error, as with missing permissions)
    files = {k: v for k, v in model_files().items() if k != "config.json"}
    path = write_dir(tmp_path / "odd", files)
    (path / "config.json").mkdir()
    result = inspect_model(path, "odd")
    assert not isinstance(result, ModelInfo) and result.reason is SkipReason.UNREADABLE
    assert "IsADirectoryError" in result.message


@pytest.mark.parametrize("index", [b"{", b'{"weight_map": 3}', b'{"weight_map": {"w": "../x.safetensors"}}'])
def test_invalid_weight_index_is_bad_config(tmp_path, index: bytes) -> None:
    path = write_dir(tmp_path / "m", {**model_files(), "model.safetensors.index.json": index})
    result = inspect_model(path, "m")
    assert not isinstance(result, ModelInfo) and result.reason is SkipReason.BAD_CONFIG


def test_the_real_tiny_model_is_described_as_it_loads(tiny_model_path, quantized_model_path) -> None:
    inv = discover(hf_cache=None, model_dirs=[], aliases={"tiny": tiny_model_path,
                                                          "tiny-q4": quantized_model_path})
    found = {m.id: m for m in inv.models}
    assert inv.skipped == ()
    config = json.loads((tiny_model_path / "config.json").read_text())
    tiny = found["tiny"]
    assert tiny.dtype is DType.FLOAT32 and tiny.quantization is None
    assert tiny.context_length == config["max_position_embeddings"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert tiny.kv_bytes_per_token == (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4)
    q4 = found["tiny-q4"]
    assert q4.quantization is not None and q4.quantization.bits == 4
    assert q4.weight_bytes < tiny.weight_bytes / 4
