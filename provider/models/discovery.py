"""Find MLX models on disk and describe them: the inventory the agent advertises and loads from.

Sources, highest precedence first (a lower source's model with an id already taken is reported as
skipped with DUPLICATE_ID):

1. aliases: `id -> path`, so a local directory is served under the coordinator's catalog id. The
   path may be a model directory or a hub-cache repo directory (`models--org--name`).
2. model_dirs: each is a model directory itself (id = its name), or holds model directories
   (id = `name`) or one level of organisation folders (id = `org/name`). Symlinks are followed:
   the operator chose these folders.
3. imported: `<state_dir>/models`, where `darkbloom-provider import` writes folders; each holds its id in
   its `darkbloom-import.json` (Ollama's names have a `:`, some a `/`).
4. ollama: the models pulled with Ollama (`provider/models/ollama.py`) that have no current import: each
   is listed from its GGUF's header at the size it will have once imported (`ModelInfo.gguf` is the file;
   the first load imports it into `path`, provider/importing.py). One imported from an older blob than
   the store's tag names now is listed as the Ollama model again, so the next load imports it anew.
5. hf_cache: the Hugging Face hub cache (`<cache>/models--org--name/snapshots/<rev>/`, id `org/name`).
   The snapshot served is the one `refs/main` names when that snapshot exists, otherwise the most
   recently modified snapshot directory. Snapshot files are symlinks into `blobs/`; a link that
   resolves outside the cache root makes the model UNSAFE_LINK and nothing of it is read.

A model directory needs what `mlx_lm.load` and the chat path need: config.json (a JSON object with
a model_type); at least one weight file matching mlx-lm's `model*.safetensors`, every shard named by
`model.safetensors.index.json` present and every weight file a complete safetensors file; tokenizer
files (`tokenizer.json`, a sentencepiece/tiktoken model, `vocab.txt`, or `vocab.json` +
`merges.txt`); and a chat template (`chat_template.jinja`, `chat_template.json`, or a
`chat_template` in `tokenizer_config.json`), since every request is rendered through it. A
vision-language model (a `vision_config` plus a processor or preprocessor config,
`provider/models/vision.py`) gets a `ModelInfo.vision`, and its vision tower's weights count in
`weight_bytes` like every other tensor. Anything else is a SkippedModel with a closed reason and a
short message, so a folder that cannot serve is never advertised. Nothing raised while inspecting
one model escapes `discover()`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from kvcache.bits import KvBits
from memory.activation import ActivationProfile, ModelShape
from memory.policy import DEFAULT_ACTIVATION_RESERVE_BYTES
from provider.models import gguf_source, metadata
from provider.models.gguf import GgufError
from provider.models.kv import KvConfigError, KvLayout, kv_layout, kv_quantization_bits, quantization_refusal, quantized
from provider.models.metadata import DType, MetadataError, MetadataProblem, Quantization
from provider.models.vision import VisionInfo, vision_info, vision_runtime_available

if TYPE_CHECKING:
    from provider.config import Settings

log = structlog.get_logger(__name__)

_HF_REPO_PREFIX = "models--"
# Any one of these is a tokenizer transformers' AutoTokenizer (mlx-lm's loader) can build from.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "tiktoken.model", "vocab.txt")
_TOKENIZER_PAIR = ("vocab.json", "merges.txt")  # a byte-level BPE without tokenizer.json
_TOKENIZER_CONFIG = "tokenizer_config.json"
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class ModelSource(enum.Enum):
    ALIAS = "alias"
    MODEL_DIR = "model_dir"
    IMPORTED = "imported"
    OLLAMA = "ollama"
    HF_CACHE = "hf_cache"


class SkipReason(enum.Enum):
    NOT_FOUND = "not_found"  # an alias path that does not exist or is not a directory
    NO_SNAPSHOT = "no_snapshot"  # a hub-cache repo with no snapshot directory
    NO_CONFIG = "no_config"
    BAD_CONFIG = "bad_config"  # config.json unreadable as a JSON object with model_type / KV fields
    NO_WEIGHTS = "no_weights"
    NO_TOKENIZER = "no_tokenizer"  # no tokenizer file the loader can read
    NO_CHAT_TEMPLATE = "no_chat_template"  # requests are chat messages: they need the model's template
    PARTIAL = "partial"  # a shard named by the index, or a linked blob, is missing
    CORRUPT_WEIGHTS = "corrupt_weights"  # a weight file is truncated or not safetensors
    UNSAFE_LINK = "unsafe_link"  # a hub-cache symlink resolves outside the cache root
    DUPLICATE_ID = "duplicate_id"  # id already provided by a higher-precedence source
    UNREADABLE = "unreadable"  # an OS error (permissions, I/O) while reading
    NO_VISION_RUNTIME = "no_vision_runtime"  # a vision model, but mlx-vlm (the `vision` extra) is not installed
    # Found after discovery, by rendering (provider/models/template_check.py): the chat template passed a bound.
    CHAT_TEMPLATE_TIMEOUT = "chat_template_timeout"
    CHAT_TEMPLATE_MEMORY = "chat_template_memory"
    UNSUPPORTED_GGUF = "unsupported_gguf"  # an Ollama model this provider cannot import (the message says why)


@dataclass(frozen=True, slots=True)
class SkippedModel:
    path: Path
    reason: SkipReason
    message: str
    id: str | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    path: Path  # the directory to hand to mlx_lm.load
    source: ModelSource
    revision: str | None  # hub-cache snapshot name (a commit hash); None elsewhere
    weight_files: tuple[Path, ...]
    weight_bytes: int  # sum of the weight files' sizes, symlinks followed
    model_type: str
    quantization: Quantization | None
    dtype: DType  # activation and KV-cache dtype
    context_length: int | None
    kv: KvLayout
    vision: VisionInfo | None = None  # a vision-language model (served through mlx-vlm)
    # Calls tools (mlx-lm has a tool parser for its family: models/tools.py); None: its tokenizer was
    # not read (discovery reads files only; `template_check.check_inventory` fills it in).
    tools: bool | None = None
    # Why the kv_quantization setting asked for is not applied to it ("" when it is, or none was asked).
    kv_quantization_refused: str = ""
    # A GGUF (an Ollama model) the first load imports into `path`; None: `path` is the model folder.
    gguf: Path | None = None
    # What its config says about its passes' size (None: a field is missing); the activation reserve's
    # figures (memory/activation.py): measured at a load, kept from one, or the config's estimate
    # (provider/models/activation.py); None: the fixed reserve.
    shape: ModelShape | None = None
    activation: ActivationProfile | None = None

    @property
    def is_vision(self) -> bool:
        return self.vision is not None

    @property
    def activation_reserve_bytes(self) -> int:
        """What its passes hold at most beside its weights and KV (its prefill window at its context)."""
        if self.activation is None:
            return DEFAULT_ACTIVATION_RESERVE_BYTES
        return self.activation.reserve_bytes(self.context_length)

    @property
    def kv_bytes_per_token(self) -> int:
        """Per-token KV growth of the full-attention layers (see KvLayout for windows)."""
        return self.kv.bytes_per_token

    @property
    def kv_bits(self) -> KvBits | None:
        """The form its KV is kept in inside the batch (kv_quantization); None: its dtype."""
        return self.kv.kv_bits


def on_disk(info: ModelInfo) -> bool:
    """The model's folder and every weight file are still there (a few stats: cheap enough to ask
    before each cold load; a folder deleted since discovery would only fail the load)."""
    if info.gguf is not None:
        return info.gguf.is_file()
    return info.path.is_dir() and all(f.is_file() for f in info.weight_files)


_PLACE_LABEL = {ModelSource.HF_CACHE: "Hugging Face cache", ModelSource.MODEL_DIR: "model_dirs",
                ModelSource.IMPORTED: "imported models", ModelSource.OLLAMA: "Ollama store"}


@dataclass(frozen=True, slots=True)
class SearchedPlace:
    """A place `discover()` looked in (`provider/models/searched.py` says them to the operator)."""

    source: ModelSource
    path: Path
    exists: bool  # a directory is there
    id: str | None = None  # the model id an alias names

    @property
    def label(self) -> str:
        return f"alias {self.id}" if self.source is ModelSource.ALIAS else _PLACE_LABEL[self.source]

    @property
    def state(self) -> str:
        return "exists" if self.exists else "missing"

    @property
    def words(self) -> str:
        """E.g. "model_dirs /srv/models (missing)"."""
        return f"{self.label} {self.path} ({self.state})"

    def as_json(self) -> dict[str, Any]:
        return {"source": self.source.value, "id": self.id, "path": str(self.path), "exists": self.exists}


@dataclass(frozen=True, slots=True)
class Inventory:
    models: tuple[ModelInfo, ...]
    skipped: tuple[SkippedModel, ...]
    disabled: tuple[str, ...] = ()  # found, but not in enabled_ids
    missing: tuple[str, ...] = ()  # in enabled_ids, but found nowhere
    searched: tuple[SearchedPlace, ...] = ()  # where discover() looked, in its order of precedence

    def get(self, model_id: str) -> ModelInfo | None:
        return next((m for m in self.models if m.id == model_id), None)


@dataclass(frozen=True, slots=True)
class _Candidate:
    id: str
    path: Path
    source: ModelSource
    revision: str | None = None
    link_root: Path | None = None  # symlinks must resolve inside this directory
    gguf: Path | None = None  # an Ollama model's GGUF, imported into `path` on first load


@dataclass(slots=True)
class _Collector:
    candidates: list[_Candidate] = field(default_factory=list)
    skipped: list[SkippedModel] = field(default_factory=list)


def default_hf_cache() -> Path:
    """The hub cache huggingface_hub would use (HF_HUB_CACHE, HF_HOME, or ~/.cache/huggingface/hub)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def discover(
    *,
    hf_cache: Path | None,
    model_dirs: Sequence[Path] = (),
    aliases: Mapping[str, Path] | None = None,
    enabled_ids: Collection[str] | None = None,
    imported: Path | None = None,
    ollama: Path | None = None,
) -> Inventory:
    """Scan every source and inspect each model found. Blocking file I/O: call it off the loop
    (`await asyncio.to_thread(discover, ...)`). Only models whose id is in `enabled_ids` are
    inspected when it is given."""
    found = _Collector()
    searched: list[SearchedPlace] = []
    for model_id, path in (aliases or {}).items():
        searched.append(_add_alias(found, model_id, Path(path)))
    for root in model_dirs:
        searched.append(_scan_model_dir(found, Path(root)))
    if imported is not None:
        searched.append(_scan_imported(found, imported))
    if ollama is not None:
        searched.append(_scan_ollama(found, ollama, imported))
    if hf_cache is not None:
        searched.append(_scan_hf_cache(found, Path(hf_cache)))

    models: list[ModelInfo] = []
    skipped: list[SkippedModel] = []
    taken: dict[str, ModelSource] = {}
    disabled: list[str] = []
    for early in found.skipped:
        if enabled_ids is None or early.id is None or early.id in enabled_ids:
            skipped.append(early)
        else:
            disabled.append(early.id)
    for cand in found.candidates:
        if cand.id in taken:
            skipped.append(SkippedModel(cand.path, SkipReason.DUPLICATE_ID,
                                        f"id already provided by {taken[cand.id].value}", cand.id))
            continue
        # The first source to name an id owns it, even if its copy turns out broken: a broken
        # alias must not be silently replaced by another directory.
        taken[cand.id] = cand.source
        if enabled_ids is not None and cand.id not in enabled_ids:
            disabled.append(cand.id)
            continue
        result = _inspect_candidate(cand)
        if isinstance(result, ModelInfo):
            models.append(result)
        else:
            skipped.append(result)
    missing = sorted(set(enabled_ids or ()) - set(taken)
                     - {s.id for s in skipped if s.id is not None})
    return Inventory(tuple(models), tuple(skipped), tuple(sorted(set(disabled))), tuple(missing), tuple(searched))


def discover_models(settings: Settings) -> Inventory:
    """`discover` with the settings' sources (the Hugging Face cache default when unset), each model's
    KV kept as its kv_quantization asks (`with_kv_quantization`)."""
    inventory = discover(
        hf_cache=settings.hf_cache_dir if settings.hf_cache_dir is not None else default_hf_cache(),
        model_dirs=settings.model_dirs,
        aliases=settings.model_aliases,
        enabled_ids=settings.enabled_models or None,
        imported=settings.imported_models_dir,
        ollama=ollama_store(settings),
    )
    models = tuple(with_kv_quantization(m, settings.kv_quantization_for(m.id)) for m in inventory.models)
    return dataclasses.replace(inventory, models=models)


def ollama_store(settings: Settings) -> Path | None:
    """The Ollama store discovery reads (None: `ollama_models` is off)."""
    if not settings.ollama_models:
        return None
    from provider.models.ollama import default_store

    return settings.ollama_dir if settings.ollama_dir is not None else default_store()


def with_kv_quantization(info: ModelInfo, setting: str) -> ModelInfo:
    """`info` with its KV layout kept quantized as `setting` asks (admission, the heartbeat and the
    engine's load then count and keep the quantized bytes); where the model cannot (a vision model: mlx-vlm
    keeps its own KV; a cache that is not plain KV), as it is, with the reason in `kv_quantization_refused`."""
    bits = kv_quantization_bits(setting)
    if bits is None:
        return info
    refused = ("a vision model: mlx-vlm keeps its KV as the model's dtype" if info.is_vision
               else quantization_refusal(info.kv, bits.group_size))
    if refused is not None:
        return dataclasses.replace(info, kv_quantization_refused=refused)
    return dataclasses.replace(info, kv=quantized(info.kv, bits))


def inspect_model(
    path: Path, model_id: str, source: ModelSource = ModelSource.MODEL_DIR
) -> ModelInfo | SkippedModel:
    """Describe one model directory, or say why it cannot be served. Never raises."""
    return _inspect_candidate(_Candidate(model_id, Path(path), source))


def _inspect_candidate(cand: _Candidate) -> ModelInfo | SkippedModel:
    def skip(reason: SkipReason, message: str) -> SkippedModel:
        return SkippedModel(cand.path, reason, message, cand.id)

    try:
        if cand.gguf is not None:
            return _inspect_gguf(cand)
        return _inspect(cand)
    except GgufError as exc:
        return skip(SkipReason.UNSUPPORTED_GGUF, str(exc))
    except _Skip as exc:
        return skip(exc.reason, exc.message)
    except MetadataError as exc:
        reason = (SkipReason.BAD_CONFIG if exc.kind is MetadataProblem.BAD_CONFIG
                  else SkipReason.CORRUPT_WEIGHTS)
        return skip(reason, exc.message)
    except KvConfigError as exc:
        return skip(SkipReason.BAD_CONFIG, str(exc))
    except OSError as exc:
        return skip(SkipReason.UNREADABLE, f"cannot read model files ({type(exc).__name__})")
    except Exception:  # the edge: one odd model must not take discovery down
        log.exception("model_inspection_failed", path=str(cand.path))
        return skip(SkipReason.UNREADABLE, "unexpected error while inspecting the model")


class _Skip(Exception):
    def __init__(self, reason: SkipReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _inspect(cand: _Candidate) -> ModelInfo:
    directory = cand.path
    if cand.link_root is not None:
        _check_links(directory, cand.link_root)
    config_path = directory / metadata.CONFIG_FILE
    if not config_path.exists():
        if config_path.is_symlink():
            raise _Skip(SkipReason.PARTIAL, "config.json is a link to a missing blob")
        raise _Skip(SkipReason.NO_CONFIG, "no config.json")
    config = metadata.read_config(directory)

    weight_files = tuple(sorted(directory.glob(metadata.WEIGHT_GLOB)))
    dangling = [p.name for p in weight_files if not p.exists()]
    if dangling:
        raise _Skip(SkipReason.PARTIAL, f"weight file {dangling[0]} is a link to a missing blob")
    _check_index(directory)
    if not weight_files:
        raise _Skip(SkipReason.NO_WEIGHTS, "no model*.safetensors weight files")

    _check_tokenizer(directory)

    vision = vision_info(directory, config, weight_files)
    if vision is not None and not vision_runtime_available():
        raise _Skip(SkipReason.NO_VISION_RUNTIME,
                    "a vision model: install the vision extra (pip install 'darkbloom-provider[vision]')")
    weight_bytes = sum(p.stat().st_size for p in weight_files)
    dtype = metadata.activation_dtype(weight_files, config)
    return ModelInfo(
        id=cand.id,
        path=directory,
        source=cand.source,
        revision=cand.revision,
        weight_files=weight_files,
        weight_bytes=weight_bytes,
        model_type=config["model_type"],
        quantization=metadata.quantization(config),
        dtype=dtype,
        context_length=metadata.context_length(config),
        kv=kv_layout(config, dtype.nbytes),
        vision=vision,
        shape=metadata.model_shape(config, dtype.nbytes),
    )


def _inspect_gguf(cand: _Candidate) -> ModelInfo:
    """An Ollama model not imported yet, as it will be once imported (its size, dtype and KV)."""
    assert cand.gguf is not None
    found = gguf_source.summary(cand.gguf)
    dtype = DType(found.dtype)
    return ModelInfo(
        id=cand.id, path=cand.path, source=cand.source, revision=cand.revision, weight_files=(),
        weight_bytes=found.output_bytes, model_type=found.config["model_type"],
        quantization=metadata.quantization(found.config), dtype=dtype,
        context_length=metadata.context_length(found.config), kv=kv_layout(found.config, dtype.nbytes),
        gguf=cand.gguf, shape=metadata.model_shape(found.config, dtype.nbytes),
    )


def _present(directory: Path, name: str) -> bool:
    """A usable file; a hub-cache link to a missing blob makes the model PARTIAL."""
    path = directory / name
    if path.is_symlink() and not path.exists():
        raise _Skip(SkipReason.PARTIAL, f"{name} is a link to a missing blob")
    return path.is_file()


def _check_tokenizer(directory: Path) -> None:
    """The tokenizer and chat template the loader and every request need (presence, not content)."""
    has_tokenizer = (any(_present(directory, n) for n in _TOKENIZER_FILES)
                     or all(_present(directory, n) for n in _TOKENIZER_PAIR)
                     or any(p.is_file() for p in directory.glob("*.tiktoken")))
    if not has_tokenizer:
        raise _Skip(SkipReason.NO_TOKENIZER,
                    "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json + merges.txt, ...)")
    if any(_present(directory, n) for n in _TEMPLATE_FILES):
        return
    template = None
    if _present(directory, _TOKENIZER_CONFIG):
        try:
            config = json.loads((directory / _TOKENIZER_CONFIG).read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _Skip(SkipReason.BAD_CONFIG, "tokenizer_config.json is not valid JSON") from exc
        template = config.get("chat_template") if isinstance(config, dict) else None
    if not template:
        raise _Skip(SkipReason.NO_CHAT_TEMPLATE,
                    "no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)")


def _check_index(directory: Path) -> None:
    index_path = directory / metadata.INDEX_FILE
    if not index_path.exists():
        if index_path.is_symlink():
            raise _Skip(SkipReason.PARTIAL, "the weight index is a link to a missing blob")
        return
    try:
        index = json.loads(index_path.read_bytes())
        weight_map = index["weight_map"]
        shards = set(weight_map.values())
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise _Skip(SkipReason.BAD_CONFIG, "the weight index is not valid") from exc
    for shard in sorted(shards):
        if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
            raise _Skip(SkipReason.BAD_CONFIG, "the weight index names an invalid file")
        if not (directory / shard).exists():
            raise _Skip(SkipReason.PARTIAL, f"shard {shard} named by the weight index is missing")


def _check_links(directory: Path, root: Path) -> None:
    """Refuse a snapshot with any entry whose link target leaves `root` (checked before reading)."""
    real_root = root.resolve()
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        for name in dirnames + filenames:
            entry = Path(dirpath, name)
            if not entry.is_symlink():
                continue
            target = entry.resolve()  # non-strict: a dangling link still has a target path
            if not target.is_relative_to(real_root):
                raise _Skip(SkipReason.UNSAFE_LINK,
                            f"{entry.relative_to(directory)} links outside the cache")


def _add_alias(found: _Collector, model_id: str, path: Path) -> SearchedPlace:
    path = path.expanduser()
    place = SearchedPlace(ModelSource.ALIAS, path, path.is_dir(), model_id)
    if not place.exists:
        found.skipped.append(SkippedModel(path, SkipReason.NOT_FOUND,
                                          "alias path is not a directory", model_id))
    elif (path / "snapshots").is_dir() and not (path / metadata.CONFIG_FILE).exists():
        _add_hf_repo(found, path, path.parent, model_id, ModelSource.ALIAS)
    else:
        found.candidates.append(_Candidate(model_id, path, ModelSource.ALIAS))
    return place


def _scan_model_dir(found: _Collector, root: Path) -> SearchedPlace:
    root = root.expanduser()
    place = SearchedPlace(ModelSource.MODEL_DIR, root, root.is_dir())
    if not place.exists:
        found.skipped.append(SkippedModel(root, SkipReason.NOT_FOUND, "model directory not found"))
    elif _looks_like_model(root):
        found.candidates.append(_Candidate(root.name, root, ModelSource.MODEL_DIR))
    else:
        _scan_children(found, root)
    return place


def _scan_children(found: _Collector, root: Path) -> None:
    for child in _subdirs(root):
        if _looks_like_model(child):
            found.candidates.append(_Candidate(child.name, child, ModelSource.MODEL_DIR))
            continue
        for grandchild in _subdirs(child):
            if _looks_like_model(grandchild):
                found.candidates.append(_Candidate(f"{child.name}/{grandchild.name}", grandchild,
                                                   ModelSource.MODEL_DIR))


def _scan_imported(found: _Collector, root: Path) -> SearchedPlace:
    root = root.expanduser()
    place = SearchedPlace(ModelSource.IMPORTED, root, root.is_dir())
    for model_id, folder in gguf_source.imported_folders(root) if place.exists else []:
        found.candidates.append(_Candidate(model_id, folder, ModelSource.IMPORTED))
    return place


def _scan_ollama(found: _Collector, store: Path, imported: Path | None) -> SearchedPlace:
    """Each Ollama model without a current import in `imported` (one imported from another blob is
    replaced: the store's tag moved on)."""
    store = store.expanduser()
    place = SearchedPlace(ModelSource.OLLAMA, store, store.is_dir())
    for model in gguf_source.ollama_models(store) if place.exists else []:
        if model.problem is not None:
            found.skipped.append(SkippedModel(model.manifest, SkipReason.UNSUPPORTED_GGUF, model.problem,
                                              model.name))
            continue
        folder = (imported or store) / gguf_source.folder_name(model.name)
        current = next((c for c in found.candidates if c.id == model.name and c.source is ModelSource.IMPORTED), None)
        if current is not None and gguf_source.imported_from(current.path) == model.digest:
            continue  # served from its import
        if current is not None:
            found.candidates.remove(current)
        found.candidates.append(_Candidate(model.name, folder, ModelSource.OLLAMA, model.digest, gguf=model.blob))
    return place


def _looks_like_model(path: Path) -> bool:
    """A directory meant to be a model: config.json or weights present (either may be broken)."""
    return (path / metadata.CONFIG_FILE).is_file() or any(path.glob("*.safetensors"))


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def _scan_hf_cache(found: _Collector, cache: Path) -> SearchedPlace:
    cache = cache.expanduser()
    place = SearchedPlace(ModelSource.HF_CACHE, cache, cache.is_dir())
    for repo in _subdirs(cache) if place.exists else []:
        if repo.name.startswith(_HF_REPO_PREFIX):
            model_id = repo.name[len(_HF_REPO_PREFIX):].replace("--", "/")
            _add_hf_repo(found, repo, cache, model_id, ModelSource.HF_CACHE)
    return place


def _add_hf_repo(found: _Collector, repo: Path, link_root: Path, model_id: str,
                 source: ModelSource) -> None:
    snapshot = newest_snapshot(repo)
    if snapshot is None:
        found.skipped.append(SkippedModel(repo, SkipReason.NO_SNAPSHOT, "no snapshot", model_id))
        return
    found.candidates.append(_Candidate(model_id, snapshot, source, snapshot.name, link_root))


def newest_snapshot(repo: Path) -> Path | None:
    """`refs/main`'s snapshot when it exists, else the most recently modified snapshot directory."""
    snapshots = repo / "snapshots"
    try:
        ref = (repo / "refs" / "main").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        ref = ""
    if ref and "/" not in ref and ref not in (".", "..") and (snapshots / ref).is_dir():
        return snapshots / ref
    candidates = _subdirs(snapshots) if snapshots.is_dir() else []
    if not candidates:
        return None
    return max(candidates, key=lambda p: (p.stat().st_mtime_ns, p.name))
