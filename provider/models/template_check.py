"""Whether a model folder's chat template stays within its bounds, and the inventory without the
ones that do not.

The agent checks every model it could serve at start-up (`provider.request.tokens.PromptCounter.warm`
renders `PROBES` in the bounded renderer, and measures its per-message bound from the same renders);
`doctor` and `models` repeat the check on the folders they find (`check_inventory`), so all three say
the same. A template that passes a bound — then, or later on a request — makes its model unservable:
`without_unservable` moves it from the inventory's models to its skipped ones, with the bound as the
reason (``chat_template_timeout``, ``chat_template_memory``), where the ``model_skipped`` log line,
`models` and `doctor` report it like any other folder that cannot be served.

The same tokenizer says whether the model calls tools (`provider.models.tools.ToolFormat`, as the
agent's prompt counter reads it): `check_inventory` records it on each model (`ModelInfo.tools`) for
`doctor` and `models`. A vision model is served through mlx-vlm's processor, which is never offered
tools: it does not call them here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from provider.models.discovery import Inventory, SkippedModel, SkipReason
from provider.models.template import (
    DEFAULT_TIMEOUT_S,
    MEMORY_BYTES,
    ChatTemplate,
    Lane,
    TemplateBound,
    TemplateExceeded,
    TemplateFailed,
    renderer,
)
from provider.models.tools import ToolFormat

_USER, _ASSISTANT = {"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}
# (messages, add_generation_prompt): what every template must render within its bounds. The last
# two also measure the template tokens one message adds (provider/request/bounds.py).
PROBES: tuple[tuple[tuple[Mapping[str, str], ...], bool], ...] = (
    ((_USER,), True), ((_USER,), False), ((_USER, _ASSISTANT, _USER), False))

_REASON = {TemplateBound.TIMEOUT: SkipReason.CHAT_TEMPLATE_TIMEOUT, TemplateBound.MEMORY: SkipReason.CHAT_TEMPLATE_MEMORY}


def skip_message(bound: TemplateBound, timeout_s: float) -> str:
    if bound is TemplateBound.TIMEOUT:
        return f"the chat template ran past its {timeout_s:g} s bound (template_timeout_s)"
    return f"the chat template passed its {MEMORY_BYTES >> 20} MiB memory bound"


def without_unservable(inventory: Inventory, unservable: Mapping[str, TemplateBound], *,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> Inventory:
    """`inventory` with these models moved from its models to its skipped ones."""
    if not unservable:
        return inventory
    skipped = tuple(SkippedModel(m.path, _REASON[unservable[m.id]], skip_message(unservable[m.id], timeout_s), m.id)
                    for m in inventory.models if m.id in unservable)
    return dataclasses.replace(inventory, models=tuple(m for m in inventory.models if m.id not in unservable),
                               skipped=inventory.skipped + skipped)


@dataclass(frozen=True, slots=True)
class FolderCheck:
    bound: TemplateBound | None  # the bound its template passed; None: within the bounds
    tools: bool  # its family calls tools (mlx-lm has a parser for it)


def check_folder(path: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> FolderCheck:
    """The start-up check on one model folder: its tokenizer loaded as the agent loads it, `PROBES`
    rendered in the bounded renderer. Blocking. `bound` None: within the bounds (or rendered by
    mlx-lm's own code, which is not the folder's)."""
    from mlx_lm.utils import load_tokenizer  # deferred: importing mlx-lm costs ~1 s

    tokenizer = load_tokenizer(path)
    tools = ToolFormat.of(tokenizer) is not None
    template = ChatTemplate.of(tokenizer)
    if template is None:
        return FolderCheck(None, tools)
    for messages, generation in PROBES:
        try:
            renderer(Lane.INTERACTIVE).render(template, messages, add_generation_prompt=generation, timeout_s=timeout_s)
        except TemplateExceeded as exc:
            return FolderCheck(exc.bound, tools)
        except TemplateFailed:  # refuses a probe: requests of that shape fail as client errors, as they would
            continue
    return FolderCheck(None, tools)


def check_inventory(inventory: Inventory, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Inventory:
    """`check_folder` on every model; the ones past a bound become skipped, the others say whether
    they call tools (`ModelInfo.tools`). Blocking. A folder whose tokenizer does not load is left as
    it is (the agent reports that when it warms it)."""
    if inventory.models:
        renderer(Lane.INTERACTIVE).start()  # its imports overlap the first tokenizer's
    found: dict[str, TemplateBound] = {}
    models = []
    for model in inventory.models:
        if model.gguf is not None:  # an Ollama model not imported yet: its folder does not exist yet
            models.append(model)
            continue
        try:
            check = check_folder(model.path, timeout_s=timeout_s)
        except Exception:  # an edge: a folder's tokenizer files are the folder's problem, reported elsewhere
            models.append(model)
            continue
        if check.bound is not None:
            found[model.id] = check.bound
        models.append(dataclasses.replace(model, tools=check.tools and not model.is_vision))
    return without_unservable(dataclasses.replace(inventory, models=tuple(models)), found, timeout_s=timeout_s)


__all__ = ["PROBES", "FolderCheck", "check_folder", "check_inventory", "skip_message", "without_unservable"]
