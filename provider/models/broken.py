"""A model folder after a failed load: its fingerprint, and why it failed in a closed vocabulary.

The model manager remembers a failed load (provider/slots/broken.py) until the folder's
`folder_fingerprint` changes (a file replaced, grown, truncated, touched) or a backoff passes, so a
broken folder is loaded once, not once per request. `diagnose` names the fault from the folder itself,
never from the loader's exception text: the folder inspected again as discovery inspects it (a shard
truncated or garbled since the start is `corrupt_weights`, a shard gone is `partial`...; discovery's
`SkipReason`), then its model type against the architectures this installation's mlx-lm implements;
when the folder looks whole, the fault the loader reported (`LoadFault`).

Both read files only (stat, config.json, the safetensors headers) and block: call them off the event
loop, except `folder_fingerprint`, a handful of stats, which admission asks for a model marked broken.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from pathlib import Path

from provider.models.discovery import ModelInfo, SkippedModel, SkipReason, inspect_model
from provider.models.metadata import CONFIG_FILE


class LoadFault(enum.StrEnum):
    """Why a load failed when the folder does not say more."""

    IMPORT_FAILED = "import_failed"  # an Ollama model's import into its folder failed
    UNSUPPORTED_MODEL_TYPE = "unsupported_model_type"  # config.json's model_type is not one mlx-lm implements
    LOAD_FAILED = "load_failed"  # the loader could not build the model from a folder that looks whole
    INTERNAL_ERROR = "internal_error"  # an error of the provider's own load path (not remembered unless the folder explains it)


BrokenReason = SkipReason | LoadFault

# What each reason tells an operator or a client (fixed words; never a path or an exception's text).
REASON_WORDS: dict[str, str] = {
    SkipReason.NOT_FOUND.value: "its folder is gone",
    SkipReason.NO_CONFIG.value: "it has no config.json",
    SkipReason.BAD_CONFIG.value: "its config.json (or weight index, or tokenizer config) is not valid",
    SkipReason.NO_WEIGHTS.value: "it has no weight files",
    SkipReason.NO_TOKENIZER.value: "it has no tokenizer files",
    SkipReason.NO_CHAT_TEMPLATE.value: "it has no chat template",
    SkipReason.PARTIAL.value: "a file it names is missing",
    SkipReason.CORRUPT_WEIGHTS.value: "a weight file is truncated or not safetensors",
    SkipReason.UNSAFE_LINK.value: "a file links outside the cache",
    SkipReason.UNREADABLE.value: "its files cannot be read",
    SkipReason.NO_VISION_RUNTIME.value: "it is a vision model and the vision extra is not installed",
    LoadFault.IMPORT_FAILED.value: "its import from the Ollama store failed",
    LoadFault.UNSUPPORTED_MODEL_TYPE.value: "its model_type is not one this installation's mlx-lm implements",
    LoadFault.LOAD_FAILED.value: ("the loader could not build the model from its files (its config and weights "
                                 "disagree, or a file is damaged)"),
    LoadFault.INTERNAL_ERROR.value: "an unexpected error in the provider's load path",
}


def reason_words(reason: str) -> str:
    return REASON_WORDS.get(reason, "its load failed")


def folder_fingerprint(info: ModelInfo) -> str:
    """A digest of the name, size, modification time and inode of every file in the model's folder
    (links followed: a hub snapshot's blobs), and of the GGUF an Ollama model is imported from; it
    changes when any of them is written, replaced or removed. A few stats, no file read."""
    entries: list[tuple[str, int, int, int]] = []
    paths = [info.gguf] if info.gguf is not None else []
    try:
        if info.gguf is None:
            paths += [Path(e.path) for e in os.scandir(info.path)]
    except OSError:
        entries.append(("<folder>", -1, -1, -1))
    for path in sorted(paths):
        try:
            st = path.stat()
        except OSError:
            entries.append((path.name, -1, -1, -1))
            continue
        if not path.is_dir():
            entries.append((path.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return hashlib.sha256(repr(entries).encode()).hexdigest()


def diagnose(info: ModelInfo, fault: LoadFault) -> BrokenReason:
    """Why the load of `info` failed, from its folder as it is now (blocking; see the module docstring)."""
    if info.gguf is not None:
        return fault
    found = inspect_model(info.path, info.id, info.source)
    if isinstance(found, SkippedModel):
        return found.reason
    if not info.is_vision and not _model_type_supported(info.path):
        return LoadFault.UNSUPPORTED_MODEL_TYPE
    return fault


def _model_type_supported(folder: Path) -> bool:
    """Whether mlx-lm has an implementation of the folder's model_type (its own lookup, remappings
    included, which its loader calls: `provider.mlxlm.model_classes`)."""
    from provider.mlxlm import model_classes  # imports mlx-lm: only when a folder is checked

    try:
        config = json.loads((folder / CONFIG_FILE).read_bytes())
        model_classes(config)
    except ValueError:  # "Model type ... not supported" (a JSON error was inspect_model's to find)
        return False
    except Exception:  # anything else is the loader's to say: not a verdict on the model type
        return True
    return True


__all__ = ["REASON_WORDS", "BrokenReason", "LoadFault", "diagnose", "folder_fingerprint", "reason_words"]
