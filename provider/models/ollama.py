"""Ollama's model store as a source of GGUF files: what a Mac owner has pulled with `ollama pull`.

The store (`$OLLAMA_MODELS`, else `~/.ollama/models`) holds content-addressed blobs and one manifest
per pulled tag:

    manifests/<registry>/<namespace>/<model>/<tag>    a Docker-style JSON manifest
    blobs/sha256-<hex>                                every layer, named by its digest

A manifest's layer of media type `application/vnd.ollama.image.model` is the GGUF. Names read as
Ollama writes them: `registry.ollama.ai/library/llama3.2/3b` is `llama3.2:3b`, another namespace keeps
it (`user/model:tag`), another registry keeps both (`hf.co/org/repo:tag`). A manifest that also names
a projector (a vision model) or an adapter is listed as not importable: the import takes one GGUF.

Nothing here writes to the store; reading it needs no Ollama running.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
_UNSUPPORTED_LAYERS = {
    "application/vnd.ollama.image.projector": "a vision model (its projector is a second GGUF)",
    "application/vnd.ollama.image.adapter": "an adapter on top of a base model",
}
PREFIX = "ollama:"  # `import ollama:NAME[:TAG]`
MAX_MANIFEST_BYTES = 1 << 20


class OllamaError(Exception):
    """A name the store does not hold, or a manifest it cannot use; one line."""


@dataclass(frozen=True, slots=True)
class OllamaModel:
    name: str  # as `ollama list` shows it: llama3.2:3b
    manifest: Path
    blob: Path | None  # the GGUF (None with `problem`)
    digest: str | None  # its sha256, hex
    size: int
    problem: str | None = None  # why it cannot be imported


def default_store(env: Mapping[str, str] | None = None, home: Path | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("OLLAMA_MODELS"):
        return Path(env["OLLAMA_MODELS"]).expanduser()
    return (home or Path.home()) / ".ollama" / "models"


def display_name(registry: str, namespace: str, model: str, tag: str) -> str:
    if registry == DEFAULT_REGISTRY and namespace == DEFAULT_NAMESPACE:
        return f"{model}:{tag}"
    if registry == DEFAULT_REGISTRY:
        return f"{namespace}/{model}:{tag}"
    return f"{registry}/{namespace}/{model}:{tag}"


def manifest_path(store: Path, name: str) -> Path:
    """Where the manifest of `name` (`model`, `model:tag`, `ns/model:tag`, `host/ns/model:tag`) lives."""
    base, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", DEFAULT_TAG)
    parts = [p for p in base.split("/") if p]
    if not parts or len(parts) > 3 or any(p in (".", "..") for p in parts + [tag]) or not tag:
        raise OllamaError(f"{name!r} is not an Ollama model name (NAME[:TAG])")
    registry, namespace = DEFAULT_REGISTRY, DEFAULT_NAMESPACE
    if len(parts) == 3:
        registry, namespace = parts[0], parts[1]
    elif len(parts) == 2:
        namespace = parts[0]
    return store / "manifests" / registry / namespace / parts[-1] / tag


def read_manifest(store: Path, manifest: Path, name: str) -> OllamaModel:
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:
            raise OllamaError(f"ollama:{name}: its manifest is not one Ollama writes (too large)")
        document = json.loads(manifest.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OllamaError(f"ollama:{name}: not in the Ollama store {store} (`ollama pull {name}` first)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise OllamaError(f"ollama:{name}: its manifest cannot be read ({type(exc).__name__})") from None
    layers = document.get("layers") if isinstance(document, dict) else None
    if not isinstance(layers, list):
        raise OllamaError(f"ollama:{name}: its manifest lists no layers")
    problem = next((why for layer in layers if isinstance(layer, dict)
                    for media, why in _UNSUPPORTED_LAYERS.items() if layer.get("mediaType") == media), None)
    models = [layer for layer in layers if isinstance(layer, dict) and layer.get("mediaType") == MODEL_LAYER]
    if len(models) != 1:
        return OllamaModel(name, manifest, None, None, 0, problem or f"{len(models)} model layers")
    digest = str(models[0].get("digest", ""))
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise OllamaError(f"ollama:{name}: its model layer has no sha256 digest")
    blob = store / "blobs" / f"sha256-{hexdigest}"
    try:
        size = blob.stat().st_size
    except OSError:
        return OllamaModel(name, manifest, None, hexdigest, 0, "its GGUF blob is missing (an interrupted pull?)")
    return OllamaModel(name, manifest, blob, hexdigest, size, problem)


def find(store: Path, name: str) -> OllamaModel:
    """The model `name` names; OllamaError when the store does not hold an importable one."""
    found = read_manifest(store, manifest_path(store, name), name)
    if found.problem is not None:
        raise OllamaError(f"ollama:{name}: {found.problem}: not imported")
    return found


def list_models(store: Path) -> list[OllamaModel]:
    """Every tag the store holds (importable or not, each with its reason), by name."""
    root = store / "manifests"
    found = []
    for manifest in sorted(root.glob("*/*/*/*")) if root.is_dir() else []:
        if not manifest.is_file() or manifest.name.startswith("."):
            continue
        registry, namespace, model, tag = manifest.relative_to(root).parts
        name = display_name(registry, namespace, model, tag)
        try:
            found.append(read_manifest(store, manifest, name))
        except OllamaError as exc:
            found.append(OllamaModel(name, manifest, None, None, 0, str(exc).split(": ", 1)[-1]))
    return sorted(found, key=lambda m: m.name)


__all__ = ["OllamaError", "OllamaModel", "PREFIX", "default_store", "display_name", "find", "list_models",
           "manifest_path", "read_manifest"]
