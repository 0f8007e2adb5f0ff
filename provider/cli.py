"""`darkbloom-provider` command line.

    darkbloom-provider [--config PATH] [--<setting> VALUE ...] [--help-settings] COMMAND

    serve [--local]             the agent (coordinator link); --local: only the local OpenAI server
    doctor [--json] [--no-coordinator] [--timeout S] [--machine-gb N]
    models [--json] [--hash]    discovered models with size, quantization, context and fit
    status [--json]             what the running agent is doing (its local /status endpoint)
    pull ORG/NAME               download a model from the Hugging Face hub into its cache, with a progress bar
    import FILE.gguf | ollama:NAME[:TAG] [--out DIR] [--name ID] [--dtype D] [--dequantize] [--force]
                                a GGUF (or a model pulled with Ollama) as an MLX model folder it serves
    ps [--json]                 the models the running agent has loaded now: memory, requests, idle time
    unload MODEL                ask the running agent to unload an idle model now
    runtime-hash                the runtime hash sent in `register`
    service install [--no-load] [--local] [--system [--user NAME]] | uninstall [--no-load] [--system]
            | status [--system]

Every setting of `provider/config.py` is also a flag (`--max-model-slots 2`), accepted before or
after the command, overriding the environment and the file; `auth_token` is the exception (a flag
would show the token in `ps`). Lists repeat the flag (`--model-dirs A --model-dirs B`), aliases are
`--model-aliases id=path`. Each command's `--help` shows its own flags and the few settings it is
about (`_SHOWN_SETTINGS`); `--help-settings` prints every setting (`config.settings_reference`).

Exit codes: 0 fine, 1 a check failed (`doctor` found an error, `status` found no agent), 2 a bad
command line, 69 the service manager is missing or failed, 78 (EX_CONFIG) invalid configuration,
another agent already running on the state directory, or a local address that cannot be listened on
(a busy `local_port`) -- one line on stderr, no traceback; the systemd unit does not restart on 78;
141 the reader of the output went away (`status | head -1`), as a shell reports it. Under the launchd agent (which cannot be told not to restart on 78) a
configuration or command-line error is recorded for `service status` and the exit is 0
(`provider/supervision.py`).

`serve` holds the state directory's lock while it runs (`provider/state_lock.py`), which also records
where its local server listens: `status` and `doctor` find it there whatever `--local-port` they get.

`service install` carries every setting given on its command line into the service's `serve`
command (`--memory-reserve-gb 8 --model-dirs /srv/models` ...); `--local` makes it `serve --local`.
`service uninstall` and `service status` refuse settings, which they would not use. `--system`
(macOS, with sudo) is the boot-time LaunchDaemon that runs as `--user` (default: the user who ran
sudo) instead of the per-user agent.

`serve` counts its own abnormal exits in the state directory; under launchd, `crash_loop_limit` of them
within `crash_loop_window_mins` keep it down (exit 0, recorded for `service status`; `doctor` says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from provider import __version__
from provider.config import (
    FIELDS,
    LIST_FIELDS,
    NO_FLAG,
    ConfigError,
    Settings,
    default_state_dir,
    flag_name,
    load_settings,
    settings_reference,
)
from provider.units import human_bytes

if TYPE_CHECKING:
    from provider.service import ServiceStatus

EX_OK = 0
EX_FAILED = 1
EX_USAGE = 2  # argparse's own
EX_UNAVAILABLE = 69
EX_CONFIG = 78
EX_PIPE = 128 + 13  # SIGPIPE's: what a shell reports for a command whose reader left
PROG = "darkbloom-provider"
# The settings each command's --help shows (every one is accepted as a flag; --help-settings lists them all).
_SHOWN_SETTINGS: dict[str, tuple[str, ...]] = {
    "serve": ("coordinator_url", "model_dirs", "model_aliases", "hf_cache_dir", "local_port", "state_dir",
              "memory_reserve_gb"),
    "doctor": ("coordinator_url", "model_dirs", "model_aliases", "hf_cache_dir", "memory_limit_gb",
               "memory_reserve_gb"),
    "models": ("model_dirs", "model_aliases", "hf_cache_dir", "enabled_models", "memory_limit_gb",
               "memory_reserve_gb"),
    "status": ("state_dir", "local_host", "local_port"),
    "ps": ("state_dir", "local_host", "local_port"),
    "pull": ("hf_cache_dir",),
    "import": ("state_dir", "ollama_dir"),
    "unload": ("state_dir", "local_host", "local_port"),
    "runtime-hash": ("runtime_hash",),
    "install": ("model_dirs", "local_port", "drain_timeout_s", "process_type"),
}
_MORE_SETTINGS = ("Every setting is also a flag (a TOML key, a DARKBLOOM_* variable, a --flag): "
                  f"`{PROG} --help-settings` lists them all; deploy/README.md explains them.")


# --- parser


class _HelpSettings(argparse.Action):
    """`--help-settings`: print every setting (provider/config.py's own reference) and exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="list every setting: flag, environment variable, default, what is allowed")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(settings_reference())
        parser.exit()


def _settings_parent(shown: Iterable[str] = (), *, config: bool = True) -> argparse.ArgumentParser:
    """One flag per setting; SUPPRESS defaults so only flags actually given reach the namespace. Only
    the `shown` ones appear in --help (and --config, with `config`); every one is accepted."""
    shown = frozenset(shown)
    parent = argparse.ArgumentParser(add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    group = parent.add_argument_group("settings (override DARKBLOOM_* and the config file)")
    group.add_argument("--config", type=Path, metavar="PATH",
                       help="TOML configuration file" if config else argparse.SUPPRESS)
    if config:
        group.add_argument("--help-settings", action=_HelpSettings)
    for field in FIELDS:
        if field in NO_FLAG:
            continue
        info = Settings.model_fields[field]
        dest, text = f"setting_{field}", info.description if field in shown else argparse.SUPPRESS
        if field in LIST_FIELDS:
            group.add_argument(flag_name(field), dest=dest, action="append", metavar=_LIST_METAVAR[field],
                               help=text if field not in shown else f"{text} (repeatable)")
        elif field == "model_aliases":
            group.add_argument(flag_name(field), dest=dest, action="append", metavar="ID=PATH",
                               help=text if field not in shown else f"{text} (repeatable)")
        else:
            group.add_argument(flag_name(field), dest=dest, metavar=_metavar(info.annotation), help=text)
    return parent


_LIST_METAVAR = {"model_dirs": "PATH", "enabled_models": "ID", "preload_models": "ID", "serve_windows": "WINDOW",
                 "local_allowed_origins": "ORIGIN"}


def _metavar(annotation: Any) -> str:
    """What a flag takes, from its field's type: true|false, N, PATH, the choices, or VALUE."""
    types = set(get_args(annotation)) - {type(None)} or {annotation}
    if bool in types:
        return "true|false"
    if types <= {int, float}:
        return "N"
    if Path in types:
        return "PATH"
    if len(types) == 1 and isinstance(kind := next(iter(types)), type) and issubclass(kind, Enum):
        return "|".join(str(m.value) for m in kind)
    return "VALUE"


def _command(sub: Any, name: str, help_text: str, shown: Iterable[str] | None) -> argparse.ArgumentParser:
    """A subcommand that accepts every setting, showing `shown` (None: refuses them, shows none)."""
    return sub.add_parser(name, parents=[_settings_parent(shown or (), config=shown is not None)],
                          allow_abbrev=False, help=help_text, description=help_text,
                          epilog=_MORE_SETTINGS if shown is not None else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, parents=[_settings_parent()], allow_abbrev=False,
        description="Darkbloom provider agent: serve MLX models to the Darkbloom network.", epilog=_MORE_SETTINGS,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = _command(sub, "serve", "run the agent in the foreground", _SHOWN_SETTINGS["serve"])
    serve.add_argument("--local", action="store_true", default=False,
                       help="no coordinator: an OpenAI-compatible server on the loopback address only")

    doctor = _command(sub, "doctor", "check this machine, its cap, models and coordinator", _SHOWN_SETTINGS["doctor"])
    doctor.add_argument("--json", action="store_true", default=False, help="machine-readable (stable schema)")
    doctor.add_argument("--no-coordinator", action="store_true", default=False,
                        help="skip the coordinator check (local-only use)")
    doctor.add_argument("--timeout", type=float, default=5.0, metavar="S", help="coordinator check timeout")
    doctor.add_argument("--machine-gb", type=float, default=None, metavar="N",
                        help="what-if: figures and verdicts for an idle machine with N GiB instead of this one")

    models = _command(sub, "models", "list discovered models and whether they fit", _SHOWN_SETTINGS["models"])
    models.add_argument("--json", action="store_true", default=False, help="machine-readable")
    models.add_argument("--hash", action="store_true", default=False, help="also compute each weight hash")

    status = _command(sub, "status", "what the running agent is doing (found from the state directory)",
                      _SHOWN_SETTINGS["status"])
    status.add_argument("--json", action="store_true", default=False, help="its /status document")

    pull = _command(sub, "pull", "download a model from the Hugging Face hub (HF_ENDPOINT) into its cache",
                    _SHOWN_SETTINGS["pull"])
    pull.add_argument("repo_id", metavar="ORG/NAME", help="the model's repository on the hub")
    imp = _command(sub, "import", "a GGUF file, or a model pulled with Ollama (ollama:NAME[:TAG]), as an MLX model "
                   "folder in state_dir/models that models, doctor and serve take", _SHOWN_SETTINGS["import"])
    imp.add_argument("source", metavar="FILE.gguf|ollama:NAME[:TAG]", help="what to import")
    imp.add_argument("--out", type=Path, default=None, metavar="DIR", help="the folder to write (default: "
                     "state_dir/models/ID)")
    imp.add_argument("--name", default=None, metavar="ID", help="the model id it is served under (default: the "
                     "file's name, or the Ollama model's)")
    imp.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                     help="the model's float dtype (default: float16 for a quantized file, else the file's own)")
    imp.add_argument("--dequantize", action="store_true", default=False,
                     help="store every weight as floats of --dtype (default float16) instead of quantized")
    imp.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                     help="a Jinja chat template for a file that has none (or to replace its own)")
    imp.add_argument("--force", action="store_true", default=False, help="import again even if the folder is "
                     "current")
    ps = _command(sub, "ps", "the models the running agent has loaded now", _SHOWN_SETTINGS["ps"])
    ps.add_argument("--json", action="store_true", default=False, help="the loaded models as JSON")
    unload = _command(sub, "unload", "ask the running agent to unload an idle model now", _SHOWN_SETTINGS["unload"])
    unload.add_argument("model", metavar="MODEL", help="the model id, as `ps` shows it")

    _command(sub, "runtime-hash", "print the runtime hash sent in register", _SHOWN_SETTINGS["runtime-hash"])

    service = sub.add_parser("service", help="background service (launchd on macOS, systemd on Linux)",
                             description="background service (launchd on macOS, systemd on Linux)")
    actions = service.add_subparsers(dest="action", metavar="ACTION", required=True)
    install = _command(actions, "install", "write the service file and start it; every setting given here is "
                       "carried into the service's command line", _SHOWN_SETTINGS["install"])
    install.add_argument("--no-load", action="store_true", default=False, help="only write the file")
    install.add_argument("--local", action="store_true", default=False,
                         help="run `serve --local` (the OpenAI-compatible server on the loopback address) "
                              "instead of the agent")
    install.add_argument("--user", dest="run_as", metavar="NAME", default=None,
                         help="with --system: the user the agent runs as (default: the user who ran sudo)")
    uninstall = _command(actions, "uninstall", "stop the service and remove its file", None)
    uninstall.add_argument("--no-load", action="store_true", default=False,
                           help="only remove the file, do not ask the service manager")
    status_cmd = _command(actions, "status", "ask the service manager (and the agent's own count of its abnormal "
                          "exits)", None)
    for action in (install, uninstall, status_cmd):
        action.add_argument("--system", action="store_true", default=False,
                            help="the boot-time LaunchDaemon (macOS, needs sudo) rather than the per-user agent")
    return parser


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, in the shapes `load_settings(overrides=...)` accepts."""
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if not key.startswith("setting_"):
            continue
        field = key.removeprefix("setting_")
        if field == "model_aliases":
            aliases: dict[str, str] = {}
            for pair in value:
                model_id, sep, path = pair.partition("=")
                if not sep or not model_id.strip() or not path.strip():
                    raise ConfigError(f"option {flag_name(field)}: value {pair!r} is not allowed: expected ID=PATH")
                aliases[model_id.strip()] = path.strip()
            value = aliases
        out[field] = value
    return out


def settings_from(args: argparse.Namespace) -> Settings:
    return load_settings(config_path=getattr(args, "config", None), overrides=overrides_from(args))


def setting_args(settings: Settings, fields: Iterable[str]) -> list[str]:
    """`fields` of the validated `settings` as `serve` flags again (paths absolute, lists repeated),
    so a service runs with exactly what was given on the install command line."""
    argv: list[str] = []
    for field in fields:
        flag, value = flag_name(field), getattr(settings, field)
        if field in LIST_FIELDS:
            for item in value:
                argv += [flag, str(item)]
        elif field == "model_aliases":
            for model_id, path in value.items():
                argv += [flag, f"{model_id}={path}"]
        elif isinstance(value, bool):
            argv += [flag, "true" if value else "false"]
        elif isinstance(value, Enum):
            argv += [flag, str(value.value)]
        else:
            argv += [flag, str(value)]
    return argv


# --- commands


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Serve, holding the state directory's lock for the process's life (a second agent on it refuses
    to start, exit 78, naming this one: `provider/state_lock.py`), under the crash-loop guard
    (`provider/supervision.py`): a run that returns 0 or refuses its configuration was not a crash; any
    other exit code (75, a memory self-restart, included) is counted when it is returned, a kill or a
    crash at the next start, and enough of them in the window keep a launchd service down."""
    from provider import supervision
    from provider.state_lock import AlreadyRunning, StateLock

    env = dict(os.environ)
    try:  # first of all: a second agent on this state directory must not touch it
        lock = StateLock.for_serving(settings, local=args.local)
    except AlreadyRunning as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return supervision.exit_code_for(supervision.ExitReason.CONFIGURATION, EX_CONFIG, str(exc),
                                         home=_home(env), env=env)
    with lock:
        return _serve_supervised(args, settings, env)


def _serve_supervised(args: argparse.Namespace, settings: Settings, env: dict[str, str]) -> int:
    from provider import supervision

    decision = supervision.on_start(settings.state_dir, env=env, limit=settings.crash_loop_limit,
                                    window_s=settings.crash_loop_window_s)
    if decision.stay_down:
        message = decision.message(settings.crash_loop_window_mins)
        print(f"{PROG}: {message}", file=sys.stderr)
        return supervision.exit_code_for(supervision.ExitReason.CRASH_LOOP, supervision.EX_CRASH_LOOP, message,
                                         home=_home(env), env=env)
    code = _serve(args, settings)
    supervision.on_exit(settings.state_dir, code, window_s=settings.crash_loop_window_s)
    if code == EX_CONFIG:  # printed already; under launchd, no relaunch loop (as for a bad setting)
        return supervision.exit_code_for(supervision.ExitReason.CONFIGURATION, EX_CONFIG,
                                         "the agent refused to start (the reason is printed above)",
                                         home=_home(env), env=env)
    return code


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    if args.local:
        from provider.local.server import serve_local

        return serve_local(settings)
    try:
        from provider.agent import main_serve
    except ImportError:
        print(f"{PROG}: coordinator mode is not available in this build; use `serve --local`", file=sys.stderr)
        return EX_UNAVAILABLE
    return main_serve(settings)


def cmd_doctor(args: argparse.Namespace, settings: Settings) -> int:
    from provider.doctor import render_table, report_json, run_doctor

    report = run_doctor(settings, check_coordinator_url=not args.no_coordinator, timeout_s=args.timeout,
                        machine_gb=args.machine_gb)
    if args.json:
        print(json.dumps(report_json(report), indent=2))
    else:
        print(render_table(report))
    return EX_OK if report.ok else EX_FAILED


def cmd_models(args: argparse.Namespace, settings: Settings) -> int:
    from provider.doctor import quantization_text, report_json, run_doctor
    from provider.doctor.report import broken_text
    from provider.models import DigestCache, weight_hash_sync
    from provider.models.hashing import CACHE_FILE
    from provider.models.searched import no_models_lines
    from provider.progress import Progress

    report = run_doctor(settings, check_coordinator_url=False, explain_routing=False, guest=None)
    hashes: dict[str, str] = {}
    if args.hash:
        cache = DigestCache.open(settings.state_dir / CACHE_FILE)  # the agent's: shared both ways
        for r in report.models:
            if r.model.gguf is not None:  # an Ollama model: its folder (and hash) comes with its import
                continue
            with Progress(f"hashing {r.model.id}") as bar:
                hashes[r.model.id] = weight_hash_sync(r.model.path, cache=cache, progress=bar.update)
    if args.json:
        doc = report_json(report)
        for m in doc["models"]:
            if m["id"] in hashes:
                m["weight_hash"] = hashes[m["id"]]
        print(json.dumps({"models": doc["models"], "skipped": doc["skipped"], "searched": doc["searched"]}, indent=2))
        return EX_OK
    for r in report.models:
        m = r.model
        line = (f"{m.id}  {human_bytes(m.weight_bytes)}  {quantization_text(m.quantization, m.dtype.value)}  "
                f"context {m.context_length or '-'}  {r.fit.verdict.value}" + ("  tools" if m.tools else ""))
        print(line + (f"  {hashes[m.id]}" if m.id in hashes else ""))
        if m.id in report.broken:  # the running agent's load of it failed: what it remembers
            print(f"    broken: {broken_text(report.broken[m.id])}")
        print(f"    {m.path}" if m.gguf is None else f"    pulled with Ollama: imported into {m.path} on first use "
              f"(or `{PROG} import ollama:{m.id}`)")
    for s in report.inventory.skipped:
        print(f"skipped {s.id or s.path}: {s.reason.value}")
    if not report.models:
        print("\n".join(no_models_lines(report.inventory.searched, report.inventory.disabled)))
    return EX_OK


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from provider import control

    agent, urls = control.agent_urls(settings)
    for url in urls:
        try:
            status = control.fetch_status(url)
        except (OSError, ValueError):
            continue
        if args.json:
            print(json.dumps(status, indent=2))
        else:
            if agent is not None and url == agent.local_url:
                print(f"agent {agent.describe()}, since {agent.started_at}")
            print(render_status(status))
        return EX_OK
    if agent is None:
        print(f"{PROG}: no agent is running on the state directory {settings.state_dir}, and none answers on "
              f"{settings.local_base_url}/status (is `serve` running? with another --state-dir?)", file=sys.stderr)
    elif agent.local_url is None:
        print(f"{PROG}: an agent is running on {settings.state_dir} ({agent.describe()}): `status` asks its "
              "local server, which it runs only with local_enabled = true", file=sys.stderr)
    else:
        print(f"{PROG}: an agent is running on {settings.state_dir} ({agent.describe()}) but its local server "
              "does not answer", file=sys.stderr)
    return EX_FAILED


def _agent_answering(settings: Settings) -> tuple[str, dict[str, Any]] | None:
    """The running agent's local server that answers /status and its answer, or None (said on stderr)."""
    from provider import control

    found = control.find_status(settings)
    if found is not None:
        return found
    agent, urls = control.agent_urls(settings)
    where = f" ({agent.describe()})" if agent is not None else ""
    print(f"{PROG}: no running agent answers on {' or '.join(urls)}{where} (is `serve` running? with another "
          "--state-dir?)", file=sys.stderr)
    return None


def cmd_pull(args: argparse.Namespace, settings: Settings) -> int:
    """`ollama pull` for the hub: plan, check the disk, download (resumable) with a bar, hash."""
    from provider.models import default_hf_cache
    from provider.models.download import DownloadFailed, check_disk, download, failure_sentence, plan_download
    from provider.models.hashing import weight_hash_sync
    from provider.progress import Progress

    cache = settings.hf_cache_dir if settings.hf_cache_dir is not None else default_hf_cache()
    try:
        plan = plan_download(args.repo_id, cache)
        check_disk(plan, cache)
        with Progress(f"pulling {args.repo_id} ({human_bytes(plan.total_bytes)})") as bar:
            folder = download(plan, cache, bar.update)
    except DownloadFailed as failed:
        print(f"{PROG}: {failure_sentence(failed, args.repo_id)}", file=sys.stderr)
        return EX_FAILED
    print(f"{args.repo_id} {plan.commit[:12]}: {len(plan.files)} files, {human_bytes(plan.total_bytes)} "
          f"in {folder}")
    print(f"weight hash {weight_hash_sync(folder)}")
    return EX_OK


def cmd_import(args: argparse.Namespace, settings: Settings) -> int:
    from provider import importing

    return importing.command(args, settings)


def cmd_ps(args: argparse.Namespace, settings: Settings) -> int:
    from provider import control

    found = _agent_answering(settings)
    if found is None:
        return EX_FAILED
    _, status = found
    if args.json:
        print(json.dumps(control.loaded_rows(status), indent=2))
    else:
        print(control.render_ps(status))
    return EX_OK


def cmd_unload(args: argparse.Namespace, settings: Settings) -> int:
    from provider import control

    found = _agent_answering(settings)
    if found is None:
        return EX_FAILED
    url, _ = found
    try:
        code, answer = control.fetch_json(url + "/control/unload", body={"model": args.model},
                                          timeout_s=control.UNLOAD_TIMEOUT_S)
    except (OSError, ValueError):
        print(f"{PROG}: the agent did not answer the unload", file=sys.stderr)
        return EX_FAILED
    outcome = answer.get("outcome") if isinstance(answer, dict) else None
    print(f"{args.model} {control.UNLOAD_WORDS.get(outcome, 'could not be unloaded')}",
          file=sys.stdout if code == 200 else sys.stderr)
    return EX_OK if code == 200 else EX_FAILED


def render_status(status: dict[str, Any], now: float | None = None) -> str:
    lines = [f"mode {status.get('mode', '?')}, pressure {status.get('pressure', {}).get('level', '?')}, "
             f"in flight {status.get('in_flight', '?')}"]
    if isinstance(status.get("session"), dict):
        lines += render_session(status["session"], time.time() if now is None else now)
    if isinstance(status.get("availability"), dict):
        lines += render_availability(status["availability"], time.time() if now is None else now)
    for m in status.get("models", []):
        lines.append(f"  {m.get('id')}  {m.get('state')}  {human_bytes(m.get('resident_bytes'))}  "
                     f"active {m.get('active_requests', 0)}" + ("  preloaded" if m.get("preloaded") else ""))
    for model_id, reason in sorted(status.get("preload", {}).get("refused", {}).items()):
        lines.append(f"  preload of {model_id} refused: {reason}")
    for model_id, broken in sorted(status.get("models_broken", {}).items()):
        lines.append(f"  {model_id} broken: its load failed ({broken.get('reason')}); tried again when its folder "
                     f"changes, or in {broken.get('retry_in_s', 0):.0f} s")
    ledger = status.get("ledger", {})
    for kind, nbytes in sorted(ledger.get("bytes_by_kind", {}).items()):
        lines.append(f"  ledger {kind}: {human_bytes(nbytes)}")
    lines += render_memory(status.get("memory"))
    lines += render_diagnostics(status.get("diagnostics"), time.time() if now is None else now)
    kv = status.get("prefix_cache")
    if kv:
        lines.append(f"  prefix cache: {kv.get('hits', 0)} hits, {kv.get('partial_hits', 0)} partial, "
                     f"{kv.get('misses', 0)} misses; RAM {human_bytes(kv.get('ram_bytes'))}, "
                     f"disk {human_bytes(kv.get('disk_bytes'))}")
    return "\n".join(lines)


def render_memory(m: Any) -> list[str]:
    """The `memory` section of /status: MLX's bytes, the process's others and what admission counts of them."""
    if not isinstance(m, dict) or "unattributed_bytes" not in m:
        return []
    mlx = (m.get("mlx_active_bytes") or 0) + (m.get("mlx_cache_bytes") or 0)
    return [f"  memory: MLX {human_bytes(mlx)}, outside MLX {human_bytes(m.get('outside_mlx_bytes'))} "
            f"({human_bytes(m.get('host_booked_bytes'))} booked, {human_bytes(m['unattributed_bytes'])} unattributed: "
            f"counted by admission); admits {human_bytes(m.get('admits_bytes'))} more"]


def render_diagnostics(d: Any, now: float) -> list[str]:
    """The `diagnostics` section of /status: the restart verdict, the baseline, the last unloads."""
    if not isinstance(d, dict):
        return []
    restart, baseline = d.get("restart", {}), d.get("baseline", {})
    reason = f" ({restart['reason']})" if restart.get("reason") else ""
    lines = [f"  restart {restart.get('recommendation', '?')}{reason}; no-model baseline drift "
             f"{human_bytes(baseline.get('drift_bytes'))} ({baseline.get('drift_pct', 0)} % of the cap), "
             f"RSS drift {human_bytes(baseline.get('rss_drift_bytes'))}, {baseline.get('samples', 0)} samples"]
    for u in d.get("unloads", [])[:3]:
        lines.append(f"  unloaded {u.get('model')} ({u.get('cause')}) {_ago(u.get('at'), now)}: freed "
                     f"{human_bytes(u.get('freed_bytes'))} of {human_bytes(u.get('resident_bytes'))}, "
                     f"{'settled' if u.get('settled') else 'NOT settled'} in {u.get('settle_s', 0)} s")
    return lines


def _ago(at: float | None, now: float) -> str:
    return "never" if at is None else f"{max(0.0, now - at):.0f} s ago"


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items())) or "none"


def render_session(s: dict[str, Any], now: float) -> list[str]:
    """The `session` section of /status in a few lines."""
    from provider.session.status import trust_line  # the agent's package: not imported for `--help`

    state = s.get("state", "?")
    head = f"coordinator {s.get('url', '?')}: {state}"
    if s.get("connected_since") is not None:
        head += f" (connected {_ago(s['connected_since'], now)})"
    if state == "backing_off" and s.get("backoff_delay_s") is not None:
        head += f", next attempt in {max(0.0, (s.get('next_attempt_at') or now) - now):.1f} s " \
                f"(delay {s['backoff_delay_s']:.1f} s)"
    lines = [head, f"  registrations {s.get('registrations', 0)}, reconnects {s.get('reconnects', 0)}, "
                   f"connect attempts {s.get('connect_attempts', 0)} ({s.get('connect_failures', 0)} failed"
                   + (f", last {s['last_connect_error']}" if s.get("last_connect_error") else "") + ")"
                   + f", heartbeats sent {s.get('heartbeats_sent', 0)}"]
    ch = s.get("challenges", {})
    lines.append(f"  challenges received {ch.get('received', 0)} (last {_ago(ch.get('last_received_at'), now)}), "
                 f"answered {ch.get('answered', 0)} (last {_ago(ch.get('last_answered_at'), now)})")
    rt = s.get("runtime_status", {})
    if rt.get("verified") is None:
        lines.append("  runtime_status: none received on this connection (an [A] coordinator sends it only on a mismatch)")
    elif rt["verified"]:
        lines.append("  runtime_status: verified")
    else:
        named = ", ".join(rt.get("mismatches", [])) or "no component named"
        lines.append(f"  runtime_status: NOT VERIFIED ({named}): the coordinator does not route to this "
                     "provider until its operator lists this runtime (see `darkbloom-provider doctor`)")
    lines.append("  " + trust_line(s.get("trust"), now))
    close = s.get("last_close")
    if close:
        reason = f" \"{close['reason']}\"" if close.get("reason") else ""
        lines.append(f"  last close: {close.get('code')}{reason}, {close.get('cause')}, {_ago(close.get('at'), now)}")
    if s.get("restore_waits"):
        lines.append(f"  coordinator restoring our state (1013, not a failure): {s['restore_waits']} time(s)")
    drain = s.get("last_drain")
    if drain:
        lines.append(f"  last drain barrier: {'acknowledged' if drain.get('acked') else 'NOT acknowledged'} "
                     f"after {drain.get('waited_s', 0):.1f} s, {_ago(drain.get('at'), now)}")
    r = s.get("requests", {})
    lines.append(f"  requests accepted {r.get('accepted', 0)} (completed {r.get('completed', 0)}, "
                 f"cancelled {r.get('cancelled', 0)}), refused: {_reasons(r.get('refused', {}))}, "
                 f"failed: {_reasons(r.get('failed', {}))}")
    return lines


def _in(seconds: float | None) -> str:
    if seconds is None:
        return "not foreseeable"
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


def _local(at: float, zone: str | None) -> str:
    """`at` as a weekday and time in the windows' zone (this machine's when it is not a known name)."""
    from datetime import datetime
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return datetime.fromtimestamp(at, ZoneInfo(zone or "")).strftime("%a %H:%M")
    except (ZoneInfoNotFoundError, ValueError):
        return time.strftime("%a %H:%M", time.localtime(at))


def render_availability(a: dict[str, Any], now: float) -> list[str]:
    """The `availability` section of /status (provider/guest) in a few lines."""
    if a.get("state") == "paused":
        head = f"availability: PAUSED ({a.get('reason')}), serves again in {_in(a.get('retry_after_s'))}"
        if a.get("memory_released"):
            head += "; models unloaded"
        elif a.get("release_at") is not None:
            head += f"; models unloaded in {_in(a['release_at'] - now)}"
    else:
        head = "availability: serving"
    windows = a.get("windows") or []
    line = f"  windows: {', '.join(windows) if windows else 'always'} ({a.get('timezone', '?')})"
    if a.get("next_window_change") is not None:
        line += f", {'closes' if a.get('window_open') else 'opens'} {_local(a['next_window_change'], a.get('timezone'))} " \
                f"(in {_in(a['next_window_change'] - now)})"
    sig = a.get("signals", {})
    idle = sig.get("idle_s")
    signals = (f"  signals: idle {'-' if idle is None else f'{idle:.0f} s'} ({sig.get('idle_source', 'off')}), "
               f"on battery {sig.get('on_battery')} ({sig.get('power_source', 'off')}), thermal {sig.get('thermal')}")
    return [head, line, signals]


def cmd_runtime_hash(args: argparse.Namespace, settings: Settings) -> int:
    from provider.doctor import runtime_hash_of

    value = runtime_hash_of(settings)
    if value is None:
        print(f"{PROG}: the runtime hash is not available in this build", file=sys.stderr)
        return EX_UNAVAILABLE
    print(value)
    return EX_OK


def cmd_service(args: argparse.Namespace, settings: Settings) -> int:
    from provider import service, supervision
    from provider.state_lock import running_agent

    env = dict(os.environ)
    given = list(overrides_from(args))
    if args.action != "install" and (given or getattr(args, "config", None) is not None):
        flags = [flag_name(f) for f in given] + (["--config"] if getattr(args, "config", None) else [])
        raise ConfigError(f"`service {args.action}` does not use settings ({', '.join(flags)}); "
                          "give them to `service install`")
    user = system_user(args, env) if args.system else None
    home = _user_home(user) if user is not None else Path.home()
    # The agent's state directory: under sudo, the one the agent will use as that user.
    state_dir = settings.state_dir if user is None or "state_dir" in given else default_state_dir(home)
    if args.action == "install":
        done = service.install(home=home, env=env, load=not args.no_load, config_path=getattr(args, "config", None),
                               args=setting_args(settings, given), drain_timeout_s=settings.drain_timeout_s,
                               process_type=settings.process_type, crash_loop_limit=settings.crash_loop_limit,
                               crash_loop_window_s=settings.crash_loop_window_s, system_user=user, local=args.local)
        supervision.reset_abnormal_exits(state_dir)  # started again on purpose: a crash-loop count starts afresh
        print(f"wrote {done.path} ({done.kind.value}{', boot-time daemon running as ' + user if user else ''})")
        print("runs: serve --local (the OpenAI-compatible server on " + settings.local_base_url + "/v1)" if args.local
              else f"runs: serve (the agent, coordinator {settings.coordinator_url})")
        if (other := running_agent(state_dir)) is not None:
            print(f"note: an agent is already running on {state_dir} ({other.describe()}); the service's refuses "
                  "to start until it stops")
        if given:
            print(f"carried settings: {', '.join(flag_name(f) for f in given)}")
        if done.env_names:
            print(f"carried environment: {', '.join(done.env_names)}")
        print("started" if done.commands else "not started (--no-load)")
        if done.log_dir is not None:
            print(f"logs: {done.log_dir}")
    elif args.action == "uninstall":
        gone = service.uninstall(home=home, env=env, load=not args.no_load, system=args.system)
        print(f"removed {gone.path}" if gone.removed else f"nothing installed at {gone.path}")
        if gone.manager_error is not None:
            print(f"{PROG}: {gone.manager_error}", file=sys.stderr)
            return EX_UNAVAILABLE
    else:
        st = service.status(home=home, env=env, system=args.system, state_dir=state_dir,
                            crash_loop_window_s=settings.crash_loop_window_s)
        print("\n".join(service_status_lines(st, settings)))
        return EX_OK if st.running else EX_FAILED
    return EX_OK


def service_status_lines(st: ServiceStatus, settings: Settings) -> list[str]:
    """What `service status` prints: the manager's view, the agent's own count of its abnormal exits
    (and what they were), and why the last start failed."""
    lines = [f"{st.kind.value}{' (boot-time daemon)' if st.system else ''}: installed={st.installed} "
             f"loaded={st.loaded} running={st.running}"
             + (f" pid={st.pid}" if st.pid else "") + f" ({st.detail})"
             + (f" last exit code {st.last_exit_code}" if st.last_exit_code is not None and not st.running else "")]
    if st.command is not None:
        lines.append(f"runs: {st.command}" + (" (the OpenAI-compatible server)" if st.command.endswith("--local")
                                             else " (the agent)"))
    exits = st.crash_loop
    if exits is not None and exits.abnormal_exits:
        lines.append(f"abnormal exits: {len(exits.abnormal_exits)} in the last {settings.crash_loop_window_mins:g} "
                     f"minutes ({exits.kinds()}; the service stays down at {settings.crash_loop_limit}); "
                     f"last at {exits.abnormal_exits[-1].at}")
    if st.last_error:
        lines.append(f"last start failed: {st.last_error}")
        lines.append("fix it, then run `darkbloom-provider service install` again")
    return lines


def system_user(args: argparse.Namespace, env: Mapping[str, str], *, daemon: Path | None = None) -> str:
    """The user a boot-time daemon runs as. `install`: --user, else whoever ran sudo; never root.
    `status`, `uninstall`: the ``UserName`` of the installed daemon's plist (`daemon`), else whoever
    ran sudo, else whoever asks (no sudo needed to ask)."""
    if args.action == "install":
        user = args.run_as or env.get("SUDO_USER")
        if not user or user == "root":
            raise ConfigError("--system: name the user the agent runs as with --user NAME (or run the command "
                              "with sudo from that user's account); the agent never runs as root")
        return user
    import getpass
    import plistlib

    from provider.service import daemon_path

    try:
        named = plistlib.loads((daemon or daemon_path()).read_bytes()).get("UserName")
    except (OSError, ValueError, AttributeError):
        named = None
    return named if isinstance(named, str) and named else env.get("SUDO_USER") or getpass.getuser()


def _user_home(user: str) -> Path:
    import pwd

    try:
        return Path(pwd.getpwnam(user).pw_dir)
    except KeyError:
        raise ConfigError(f"--user: no such user {user!r}") from None


_COMMANDS = {
    "serve": cmd_serve,
    "doctor": cmd_doctor,
    "models": cmd_models,
    "status": cmd_status,
    "ps": cmd_ps,
    "pull": cmd_pull,
    "import": cmd_import,
    "unload": cmd_unload,
    "runtime-hash": cmd_runtime_hash,
    "service": cmd_service,
}


# --- entry point


def _config_error(exc: ConfigError, env: dict[str, str]) -> int:
    from provider import supervision

    print(f"{PROG}: {exc}", file=sys.stderr)
    return supervision.exit_code_for(supervision.ExitReason.CONFIGURATION, EX_CONFIG, str(exc),
                                     home=_home(env), env=env)


def _home(env: dict[str, str]) -> Path:
    return Path(env["HOME"]) if env.get("HOME") else Path.home()


def _reader_left() -> int:
    """The reader of our output went away (`darkbloom-provider status | head -1`): nothing is wrong, so
    no traceback; what is still buffered goes nowhere, and the exit is the shell's for a closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
    os.close(devnull)
    return EX_PIPE


def main(argv: list[str] | None = None) -> int:
    # Only what the parser needs is imported before parsing, so `--help` and `--version` answer at once;
    # each command imports what it uses (the engine and MLX only for those that serve).
    env = dict(os.environ)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage and the error
        if exc.code != EX_USAGE:
            raise
        from provider import supervision

        return supervision.exit_code_for(supervision.ExitReason.USAGE, EX_USAGE, "invalid command line (see "
                                         "provider.stderr.log)", home=_home(env), env=env)
    if args.command is None:
        parser.print_help()
        return EX_OK
    try:
        settings = settings_from(args)
    except ConfigError as exc:
        return _config_error(exc, env)
    from provider import supervision

    supervision.started(home=_home(env), env=env)

    from provider.service import ServiceError
    from provider.telemetry import configure_logging

    configure_logging(settings.log_level, settings.log_format, log_file=settings.log_file)
    try:
        code = _COMMANDS[args.command](args, settings)
        sys.stdout.flush()  # here, not at exit, so that a reader that left is handled below
        return code
    except BrokenPipeError:
        return _reader_left()
    except ConfigError as exc:
        return _config_error(exc, env)
    except ServiceError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EX_UNAVAILABLE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
