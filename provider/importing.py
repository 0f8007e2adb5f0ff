"""Importing a GGUF (a file, or a model pulled with Ollama) as a model folder the provider serves.

    darkbloom-provider import FILE.gguf | ollama:NAME[:TAG] [--out DIR] [--name ID] [--dtype D]
                                        [--dequantize] [--chat-template FILE] [--force]

The folder goes to `--out`, else `<state_dir>/models/<id>`, which discovery scans: `models`, `doctor`
and `serve` see it at once under its id (`--name`, else the file's name; for Ollama the model's name,
`llama3.2:3b`). The work is `provider/models/gguf`'s; this module resolves the source, checks the
disk, skips an import whose folder is current (same source file, same options), and says what it did.

`import_for_load` is the same import without the printing, for a request that names an Ollama model
not imported yet (the model manager's load calls it on a worker thread).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from provider.models import ModelInfo, ModelSource, SkippedModel, inspect_model
from provider.models.gguf import (
    GgufError,
    is_current,
    opened,
    plan_import,
    read_marker,
    source_fingerprint,
    write_tokenizer_folder,
)
from provider.models.gguf import write_folder as _write_folder
from provider.models.gguf_source import folder_name
from provider.models.ollama import PREFIX, OllamaError, default_store, find
from provider.units import human_bytes

log = structlog.get_logger(__name__)

DISK_MARGIN = 1.05  # the folder's size plus 5 % (tokenizer files, the filesystem's own rounding)


class ImportFailed(Exception):
    """One line for the operator: what is wrong with the source, the destination or the disk."""


@dataclass(frozen=True, slots=True)
class Source:
    path: Path  # the GGUF
    model_id: str  # the id it is served under unless --name says otherwise
    digest: str | None = None  # Ollama's sha256 of the blob


@dataclass(frozen=True, slots=True)
class Imported:
    folder: Path
    model_id: str
    output_bytes: int
    seconds: float
    skipped: bool  # the folder was current already
    notes: tuple[str, ...] = ()


def resolve(source: str, ollama_store: Path | None = None) -> Source:
    """`FILE.gguf` or `ollama:NAME[:TAG]` as the file to read and a default id."""
    if source.startswith(PREFIX):
        name = source[len(PREFIX):]
        try:
            found = find(ollama_store or default_store(), name)
        except OllamaError as exc:
            raise ImportFailed(str(exc)) from None
        assert found.blob is not None
        tagged = found.name if ":" in found.name.rsplit("/", 1)[-1] else f"{found.name}:latest"
        return Source(found.blob, tagged, found.digest)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ImportFailed(f"{source}: no such file" if not path.exists() else f"{source}: not a file")
    return Source(path, path.name.removesuffix(".gguf"))


def default_id(source: Source, dtype: str | None, dequantize: bool) -> str:
    return f"{source.model_id}-{dtype or 'float16'}" if dequantize else source.model_id


def _check_destination(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or (read_marker(out) is None and any(out.iterdir()))):
        raise ImportFailed(f"{out} exists and is not a folder this command imported: choose another --out, "
                           "or move it away")
    del force  # an earlier import of ours is replaced whether or not it is current, with --force


def _check_disk(out: Path, nbytes: int) -> None:
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < nbytes * DISK_MARGIN:
        raise ImportFailed(f"not enough disk for the import: {human_bytes(int(nbytes * DISK_MARGIN))} needed in "
                           f"{parent}, {human_bytes(free)} free")


def run(source: Source, out: Path, model_id: str, *, dtype: str | None = None, dequantize: bool = False,
        chat_template: str | None = None, force: bool = False,
        on_plan: Callable[[Any], None] | None = None,
        progress: Callable[[int, int], None] | None = None) -> Imported:
    """Import `source` into `out` (skipped when `out` holds it with these options already)."""
    started = time.monotonic()
    _check_destination(out, force)
    fingerprint = source_fingerprint(source.path, source.digest)
    try:
        with opened(source.path) as (header, view):
            plan = plan_import(header, view, dtype=dtype, dequantize=dequantize, chat_template=chat_template)
            if not force and is_current(out, fingerprint, plan.options):
                return Imported(out, model_id, plan.output_bytes, time.monotonic() - started, True)
            if on_plan is not None:
                on_plan(plan)
            _check_disk(out, plan.output_bytes)
            _write_folder(plan, view, out, model_id=model_id, source=fingerprint, progress=progress)
    except GgufError as exc:
        raise ImportFailed(str(exc)) from None
    except OSError as exc:
        raise ImportFailed(f"the import failed writing {out} ({exc.strerror or type(exc).__name__})") from None
    return Imported(out, model_id, plan.output_bytes, time.monotonic() - started, False, tuple(plan.notes()))


def command(args: Any, settings: Any) -> int:
    """`darkbloom-provider import`: one line of what is imported, the notes, a progress bar, the result."""
    import sys

    from provider.models.hashing import weight_hash_sync
    from provider.progress import Progress

    prog = "darkbloom-provider"
    try:
        template = args.chat_template.read_text(encoding="utf-8") if args.chat_template is not None else None
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{prog}: import: --chat-template {args.chat_template}: cannot be read ({type(exc).__name__})",
              file=sys.stderr)
        return 1
    bar: list[Progress] = []

    def on_plan(plan: Any) -> None:
        header = plan.header
        print(f"importing {header.path.name if source.digest is None else 'ollama:' + source.model_id} "
              f"({header.architecture}, {human_bytes(header.file_bytes)}, {len(header.tensors)} tensors) "
              f"as {model_id}")
        for note in plan.notes():
            print(f"  {note}")
        bar.append(Progress(f"writing {human_bytes(plan.output_bytes)}"))

    def progress(done: int, total: int) -> None:
        if bar:
            bar[0].update(done, total)

    try:
        source = resolve(args.source, settings.ollama_dir)
        model_id = args.name or default_id(source, args.dtype, args.dequantize)
        out = args.out.expanduser() if args.out is not None else settings.imported_models_dir / folder_name(model_id)
        done = run(source, out, model_id, dtype=args.dtype, dequantize=args.dequantize, chat_template=template,
                   force=args.force, on_plan=on_plan, progress=progress)
    except ImportFailed as exc:
        print(f"{prog}: import: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar:
            bar[0].close()
    if done.skipped:
        print(f"{model_id}: already imported from this file with these options, in {done.folder} (--force imports "
              "it again)")
    else:
        print(f"{model_id}: {human_bytes(done.output_bytes)} in {done.folder} ({done.seconds:.1f} s)")
    print(f"weight hash {weight_hash_sync(done.folder)}")
    if args.out is not None and not done.folder.resolve().is_relative_to(settings.imported_models_dir.resolve()):
        print(f"serve it: add {done.folder.parent} to model_dirs, or --model-aliases {model_id}={done.folder}")
    return 0


TOKENIZERS = ".tokenizers"  # under state_dir/models: the tokenizer halves of Ollama models not imported yet


def tokenizer_folder(gguf: Path, models_dir: Path) -> Path:
    """A folder with the tokenizer (and config.json) of a GGUF not imported yet, for counting and templating
    the requests that name it before its import; made once per file version (the name holds its size and
    mtime), in `models_dir`'s hidden `.tokenizers`. Blocking. Raises ImportFailed."""
    stat = gguf.stat()
    out = models_dir / TOKENIZERS / f"{gguf.name}-{stat.st_size}-{stat.st_mtime_ns}"
    if (out / "tokenizer_config.json").is_file():
        return out
    try:
        with opened(gguf) as (header, view):
            write_tokenizer_folder(plan_import(header, view), out)
    except GgufError as exc:
        raise ImportFailed(str(exc)) from None
    return out


def import_for_load(info: ModelInfo, progress: Callable[[int, int], None] | None = None) -> ModelInfo:
    """An Ollama model's `ModelInfo` once its GGUF is imported into `info.path` as `import ollama:NAME`
    would (a current import is kept): the folder's weight files, the rest as discovery planned it.
    Blocking: the model manager's load runs it on a worker thread (`progress`: after each tensor, from
    that thread). Raises ImportFailed."""
    assert info.gguf is not None
    done = run(Source(info.gguf, info.id, info.revision), info.path, info.id, progress=progress)
    found = inspect_model(done.folder, info.id, ModelSource.IMPORTED)
    if isinstance(found, SkippedModel):
        raise ImportFailed(f"the imported folder cannot be served ({found.reason.value})")
    log.info("model_imported", model=info.id, bytes=done.output_bytes, seconds=round(done.seconds, 3),
             skipped=done.skipped)
    return dataclasses.replace(info, path=done.folder, weight_files=found.weight_files,
                               weight_bytes=found.weight_bytes, gguf=None)


__all__ = ["ImportFailed", "Imported", "Source", "command", "default_id", "import_for_load", "resolve", "run",
           "tokenizer_folder"]
