"""Model discovery and inventory: which MLX models are on disk, what they cost, what they are.

* `discover()` -> `Inventory(models, skipped, disabled, missing, searched)` (discovery.py), and
  `discover_models(settings)` with the settings' sources; the words for where it looked
  (`searched: SearchedPlace`) are in searched.py
* `ModelInfo`, `SkippedModel(path, reason: SkipReason, message)` (discovery.py)
* `kv_bytes_for_tokens(info.kv, tokens)` and `KvLayout` (kv.py)
* `weight_hash(path)` (hashing.py)
* a folder's chat template is its code: `renderer(lane).render(ChatTemplate.of(tokenizer), messages, ...)`
  renders it in a bounded child process (template.py; renderer.py and _template_child.py: the
  processes, their bounds, pipelined renders); `check_inventory` and
  `without_unservable` (template_check.py) make one that passes a bound a skipped folder
"""

from provider.models.discovery import (
    Inventory,
    ModelInfo,
    ModelSource,
    SearchedPlace,
    SkippedModel,
    SkipReason,
    default_hf_cache,
    discover,
    discover_models,
    inspect_model,
    newest_snapshot,
    on_disk,
)
from provider.models.hashing import HASHED_PATTERNS, DigestCache, weight_hash, weight_hash_sync
from provider.models.kv import (
    ALLOC_STEP,
    KvAccuracy,
    KvConfigError,
    KvLayout,
    SlidingGroup,
    kv_bytes_for_tokens,
    kv_layout,
)
from provider.models.metadata import DType, Quantization, QuantMode
from provider.models.vision import VisionInfo

__all__ = [
    "ALLOC_STEP", "HASHED_PATTERNS", "DType", "DigestCache", "Inventory", "KvAccuracy",
    "KvConfigError", "KvLayout", "ModelInfo", "ModelSource", "QuantMode", "Quantization",
    "SearchedPlace", "SkipReason", "SkippedModel", "SlidingGroup", "VisionInfo", "default_hf_cache", "discover",
    "discover_models", "inspect_model", "kv_bytes_for_tokens", "kv_layout", "newest_snapshot",
    "on_disk", "weight_hash", "weight_hash_sync",
]
