"""Provider settings: defaults < TOML file < ``DARKBLOOM_*`` environment < CLI flags.

One frozen, validated :class:`Settings` object with flat fields (``settings.coordinator_url``).
Every field has exactly one name, used everywhere:

* TOML key: the field name, at the top level of the file (``max_model_slots = 3``); the only table
  are ``[model_aliases]`` (``"my-qwen" = "~/models/qwen"``) and ``[kv_quantization_models]``
  (``"my-qwen" = "q8"``).
* Environment variable: ``DARKBLOOM_`` + the field name upper-cased (``DARKBLOOM_MAX_MODEL_SLOTS``).
  Lists are comma-separated (``DARKBLOOM_MODEL_DIRS=~/a,~/b``), aliases (and the other tables) are
  ``id=path,id2=path2``, booleans ``true/false/1/0/yes/no``. An empty variable counts as unset.
* CLI flag: ``--`` + the field name with dashes (``--max-model-slots``); the CLI passes flags it was
  given as ``overrides`` (``None`` means "not given").

The file is ``--config``, else ``$DARKBLOOM_CONFIG``, else ``$XDG_CONFIG_HOME/darkbloom/provider.toml``
(default ``~/.config/darkbloom/provider.toml``); a missing default file just means "no file".
``deploy/provider.example.toml`` lists every key with its default, ``deploy/README.md`` has
the table of environment names, and ``settings_reference()`` (``darkbloom-provider --help-settings``)
prints every setting from the fields below, which stay the one source.

Not settings: ``DARKBLOOM_MEM_CAP_FRACTION`` and ``DARKBLOOM_ACTIVATION_RESERVE_GB`` are read by
``memory/policy`` itself (it treats bad values as unset, by design of the cap).

Any bad input raises one :class:`ConfigError` whose message names where the value came from (file
and key, environment variable, or flag), the value, and what is allowed. Unknown file keys are
errors too, so a typo cannot silently fall back to a default.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import sys
import tomllib
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)

from provider.units import GiB

if TYPE_CHECKING:
    from memory import PolicySettings

ENV_PREFIX = "DARKBLOOM_"
CONFIG_ENV = "DARKBLOOM_CONFIG"  # names the TOML file; not a setting itself
# Read by memory/policy, not by this module; listed so `unrecognised_env` does not flag them.
MEMORY_POLICY_ENV = frozenset({"DARKBLOOM_MEM_CAP_FRACTION", "DARKBLOOM_ACTIVATION_RESERVE_GB"})
# Set by the launchd plist for provider/supervision (not a setting either).
SERVICE_MANAGER_ENV = "DARKBLOOM_SERVICE_MANAGER"
DEFAULT_COORDINATOR_URL = "wss://api.darkbloom.dev/ws/provider"
DEFAULT_LOCAL_PORT = 8484
# Pages this machine serves itself (a dev server, a local chat UI): allowed to call the local server by
# default, as Ollama allows them; `:*` is any port.
LOOPBACK_ORIGINS = ("http://localhost:*", "http://127.0.0.1:*")


class ConfigError(Exception):
    """A bad configuration file or value; the message is meant for the operator as is."""


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class SelfRestart(StrEnum):
    AUTO = "auto"  # on under a service manager (launchd, systemd), off otherwise
    ON = "on"
    OFF = "off"


class LogFormat(StrEnum):
    AUTO = "auto"  # console on a terminal, JSON lines otherwise (launchd, systemd)
    JSON = "json"
    CONSOLE = "console"


class ProcessType(StrEnum):
    """launchd's ``ProcessType`` for the installed service (deploy/README.md has the trade-off)."""

    BACKGROUND = "background"  # the owner's apps first: throttled CPU and I/O under contention
    STANDARD = "standard"  # no ProcessType: an ordinary process
    INTERACTIVE = "interactive"  # app-like, never throttled (Darkbloom's own agent)


def default_state_dir(home: Path, platform: str = sys.platform, env: Mapping[str, str] | None = None) -> Path:
    """Where identity keys and the KV SSD cache live."""
    if platform == "darwin":
        return home / "Library" / "Application Support" / "darkbloom"
    xdg = (env or {}).get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else home / ".local" / "share") / "darkbloom"


def default_config_path(home: Path, env: Mapping[str, str] | None = None) -> Path:
    xdg = (env or {}).get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else home / ".config") / "darkbloom" / "provider.toml"


def _allowed(text: str) -> dict[str, Any]:
    # What an error message says is allowed; also the "allowed" column of deploy/README.md.
    return {"json_schema_extra": {"allowed": text}}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseModel):
    """Everything the operator can set. Sizes are GiB (2^30 bytes), durations as the name says."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, validate_default=True)

    dev_posture: bool = Field(
        False, description="For a self-hosted coordinator on this machine: report the posture such a coordinator "
        "requires (SIP, Secure Boot, every privacy capability) whatever the host is. Loopback coordinator URLs only; "
        "it relaxes nothing else.",
        **_allowed("true or false (true only with a loopback coordinator_url)"),
    )

    # --- coordinator link
    coordinator_url: str = Field(
        DEFAULT_COORDINATOR_URL, description="Coordinator WebSocket endpoint.",
        **_allowed("a wss:// URL (ws:// only to a loopback host)"),
    )
    auth_token: SecretStr | None = Field(
        None, description="Device-linked provider token sent in `register` (links earnings to an account).",
        **_allowed("a non-empty string"),
    )
    heartbeat_interval_s: float = Field(
        5.0, gt=0, description="Seconds between heartbeats.", **_allowed("a number of seconds > 0"),
    )
    eviction_window_s: float = Field(
        90.0, gt=0, description="The coordinator forgets a provider silent this long; after a longer gap between "
        "two heartbeats (a stalled process) reconnect and register afresh.",
        **_allowed("a number of seconds > 0"),
    )
    backend: str = Field(
        "inprocess-mlx", min_length=1, max_length=64, description="`backend` string sent in `register`.",
        **_allowed("a non-empty string of at most 64 characters"),
    )
    runtime_hash: str | None = Field(
        None, min_length=1, max_length=128, description="Override for the `runtime_hash` sent in `register`.",
        **_allowed("a non-empty string of at most 128 characters"),
    )

    # --- models
    model_dirs: tuple[Path, ...] = Field(
        (), description="Extra directories scanned for MLX models (besides the HF cache).",
        **_allowed("a list of directory paths"),
    )
    hf_cache_dir: Path | None = Field(
        None, description="Hugging Face hub cache to scan; unset = huggingface_hub's default (HF_HUB_CACHE, HF_HOME).",
        **_allowed("a directory path"),
    )
    model_aliases: dict[str, Path] = Field(
        default_factory=dict, description="Model ids served from a local path: `id = path`.",
        **_allowed("a table of model id = directory path"),
    )
    ollama_models: bool = Field(
        True, description="List the models pulled with Ollama (its store: ollama_dir) and serve them through MLX, "
        "imported into state_dir/models on first use.",
        **_allowed("true or false"),
    )
    ollama_dir: Path | None = Field(
        None, description="Ollama's model store; unset = Ollama's own default (OLLAMA_MODELS, ~/.ollama/models).",
        **_allowed("a directory path"),
    )
    enabled_models: tuple[str, ...] = Field(
        (), description="Model ids to advertise; empty = every discovered model.",
        **_allowed("a list of model ids"),
    )
    preload_models: tuple[str, ...] = Field(
        (), description="Model ids loaded at start (through the load gate, never past the cap) and kept "
        "resident: idle_timeout_mins does not unload them, only memory pressure or the slot cap can.",
        **_allowed("a list of model ids"),
    )

    # --- memory (the cap fraction and activation reserve come from memory/policy's own env vars)
    memory_reserve_gb: float = Field(
        4.0, ge=0, description="Memory held back for the OS and the owner's apps (GiB).",
        **_allowed("a number of GiB >= 0"),
    )
    memory_limit_gb: float | None = Field(
        None, gt=0, description="Treat the machine as having at most this much memory (GiB); unset = physical.",
        **_allowed("a number of GiB > 0"),
    )

    # --- model slots
    max_model_slots: int = Field(
        3, ge=1, description="Most models resident at once.", **_allowed("an integer >= 1"),
    )
    max_batch_size: int = Field(
        32, ge=1, le=1024,
        description="Requests one model runs at once (the engine's decode batch); admission refuses more "
                    "with a fast 503, and the heartbeat advertises at most this many.",
        **_allowed("an integer from 1 to 1024"),
    )
    prepare_next_turn: bool = Field(
        True,
        description="Local server: after an answer, while the engine is idle, prefill the conversation with the "
                    "answer as the chat template renders it back, so the next turn prefills only the new message. "
                    "Coordinator jobs never do (the next turn may go to another provider).",
        **_allowed("true or false"),
    )
    solo_prefill: bool = Field(
        True,
        description="Prefill a burst of long prompts one at a time, each first token out as soon as its own prompt "
                    "is, the decode batch held meanwhile (bounded); which prompts are long enough is measured per "
                    "model at load. false: every prompt is prefilled in mlx-lm's batches.",
        **_allowed("true or false"),
    )
    kv_quantization: Literal["none", "q8", "q4"] = Field(
        "none",
        description="Keep every running request's KV quantized inside the batch (q8: keys and values at 8 bits; "
                    "q4: values at 4 bits, keys at 8; in groups of 32 with a scale and a bias each): about 0.56x "
                    "(q8) or 0.44x (q4) of a 16-bit model's bytes a token, so more requests fit under the cap. "
                    "Admission, the heartbeat and the prefix cache count the quantized bytes. Not for vision models "
                    "or caches with sliding-window or recurrent layers (doctor says which).",
        **_allowed("none, q8 or q4"),
    )
    kv_quantization_models: dict[str, Literal["none", "q8", "q4"]] = Field(
        default_factory=dict, description="Per-model kv_quantization: `id = q8`.",
        **_allowed("a table of model id = none, q8 or q4"),
    )
    stream_interval_ms: float = Field(
        20.0, ge=0, le=1000,
        description="While more than 8 requests decode at once, each one's text after its first token is "
                    "delivered at most this often (milliseconds), several tokens a chunk: fewer wake-ups and SSE "
                    "chunks for the event loop, which shares the GIL with the engine thread. First tokens and ends "
                    "go out at once. 0 = every token as it comes.",
        **_allowed("a number of milliseconds from 0 to 1000 (0 = every token)"),
    )
    idle_timeout_mins: float = Field(
        60.0, ge=0, description="Unload a model idle this long (minutes); 0 = never.",
        **_allowed("a number of minutes >= 0 (0 = never)"),
    )
    load_measure_budget_s: float | None = Field(
        None, ge=0,
        description="Seconds a load may spend, after reading the weights, on what it measures (the solo-prefill "
                    "threshold, the rates register reports) and warms (the shapes a first request uses). Unset: "
                    "the larger of 3 s and twice the weights' read. 0: one measuring pass, no warm-up (the first "
                    "requests build what the warm-up would have).",
        **_allowed("a number of seconds >= 0"),
    )
    load_wait_timeout_s: float = Field(
        120.0, gt=0, description="How long a request waits for a load in progress to take its next step (a part "
        "of the weights read, a measurement, a check): a load that keeps moving keeps its requests however long it "
        "takes; one that stops refuses them (503 capacity_timeout, retryable).",
        **_allowed("a number of seconds > 0"),
    )
    settle_timeout_s: float = Field(
        5.0, gt=0, description="How long an unload waits for MLX memory to settle.",
        **_allowed("a number of seconds > 0"),
    )
    template_timeout_s: float = Field(
        2.0, gt=0, description="How long a model's chat template may take to render a prompt (plus 1 s per 2 MiB "
        "of prompt text). A template that takes longer, or passes its 1 GiB memory bound, makes the model unservable "
        "(chat_template_timeout, chat_template_memory): dropped from what is served, the reason in models and doctor.",
        **_allowed("a number of seconds > 0"),
    )
    max_vision_requests: int = Field(
        2, ge=1, description="Most requests with images running or waiting per vision model; more are refused "
        "at once with a 503 (a slow consumer cannot pin vision reservations).",
        **_allowed("an integer >= 1"),
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On shutdown, how long in-flight requests may finish.",
        **_allowed("a number of seconds >= 0"),
    )
    drain_ack_timeout_s: float = Field(
        5.0, ge=0, description="On shutdown, once every request has its terminal frame, how long to wait for "
        "the coordinator to acknowledge the drain barrier (provider_drain_ack) before closing.",
        **_allowed("a number of seconds >= 0"),
    )

    # --- memory diagnostics and the restart recommendation (memory/diagnostics.py)
    restart_drift_fraction: float = Field(
        0.05, gt=0, le=1, description="Advise a restart once the no-model baseline has grown by this share of "
                                      "the effective cap (or restart_drift_gb, whichever is smaller).",
        **_allowed("a fraction in (0, 1]"),
    )
    restart_drift_gb: float = Field(
        1.0, gt=0, description="Advise a restart once the no-model baseline has grown by this many GiB "
                               "(or restart_drift_fraction of the cap, whichever is smaller).",
        **_allowed("a number of GiB > 0"),
    )
    restart_failed_settles: int = Field(
        2, ge=1, description="Advise a restart after this many unloads in a row whose memory did not settle.",
        **_allowed("an integer >= 1"),
    )
    self_restart: SelfRestart = Field(
        SelfRestart.AUTO, description="When a restart is needed: drain and exit with the restart code "
                                      "(auto = only under launchd or systemd, which start it again).",
        **_allowed("auto, on or off"),
    )

    # --- the owner's Mac: when to serve, and when to step aside (provider/guest)
    serve_windows: tuple[str, ...] = Field(
        (), description="When the Mac serves, in local time: \"[DAYS ]HH:MM-HH:MM\" entries, e.g. \"22:00-07:30\", "
        "\"sat 00:00-24:00\", \"mon-fri 19:00-23:00\"; a window crossing midnight ends the next day. Outside every "
        "window new requests get a fast 503 and the models are unloaded after pause_unload_grace_mins. Empty = always.",
        **_allowed("a list of [DAYS ]HH:MM-HH:MM windows (days: mon..sun or a range like mon-fri)"),
    )
    serve_timezone: str | None = Field(
        None, description="IANA time zone of serve_windows (e.g. Europe/Paris); unset = this machine's zone.",
        **_allowed("an IANA time zone name"),
    )
    pause_when_active_mins: float = Field(
        0.0, ge=0, description="Take no new requests until the keyboard and mouse have been idle this long "
        "(minutes); 0 = off.",
        **_allowed("a number of minutes >= 0 (0 = off)"),
    )
    pause_on_battery: bool = Field(
        False, description="Take no new requests while the Mac runs on battery (or a UPS).",
        **_allowed("true or false"),
    )
    pause_on_thermal: bool = Field(
        True, description="Take no new requests while the thermal state is serious or critical.",
        **_allowed("true or false"),
    )
    pause_unload_grace_mins: float = Field(
        5.0, ge=0, description="Outside the serving windows, or while the owner is at the keyboard, unload every "
        "model once paused this long (minutes), so the owner gets the memory back; 0 = as soon as it is idle.",
        **_allowed("a number of minutes >= 0"),
    )

    # --- local state
    state_dir: Path = Field(
        default_factory=lambda: default_state_dir(Path.home()),
        description="Identity keys, the KV SSD cache and the running agent's lock: one agent per state directory "
        "(default: ~/Library/Application Support/darkbloom on macOS, ~/.local/share/darkbloom elsewhere).",
        **_allowed("a directory path"),
    )
    kv_ssd_budget_gb: float = Field(
        16.0, ge=0, description="Disk budget of the encrypted KV SSD tier (GiB); 0 = tier off.",
        **_allowed("a number of GiB >= 0 (0 = off)"),
    )

    # --- local HTTP server (/healthz, /status, /metrics, local OpenAI API)
    local_enabled: bool = Field(
        True, description="Run the local HTTP server.", **_allowed("true or false"),
    )
    local_host: str = Field(
        "127.0.0.1", description="Local server address; loopback only.",
        **_allowed("a loopback address: any of 127.0.0.0/8 (127.0.0.1, 127.0.0.2, ...), ::1 or localhost"),
    )
    local_port: int = Field(
        DEFAULT_LOCAL_PORT, ge=1, le=65535, description="Local server port.",
        **_allowed("an integer port 1-65535"),
    )
    local_queue_s: float = Field(
        30.0, ge=0, description="serve --local: how long a request waits for room when the batch (or the memory "
        "its KV needs) is taken by requests in flight, before its 503; the owner's server has no other node to "
        "send a client to, as the coordinator does (the network front always refuses at once).",
        **_allowed("a number of seconds >= 0 (0 = refuse at once)"),
    )
    local_allowed_origins: tuple[str, ...] = Field(
        LOOPBACK_ORIGINS, description="Web origins whose pages may call the local server from a browser (CORS), "
        "e.g. https://chat.example:8443; host:* is that host on any port. By default the pages this machine "
        "serves itself (http://localhost:*, http://127.0.0.1:*), as Ollama allows; empty = none. No other: a "
        "page on any web site the owner visits could otherwise use the models and read /status.",
        **_allowed("a list of origins scheme://host[:port] or scheme://host:* (any port), no path (not *)"),
    )

    # --- the background service
    keep_awake: bool = Field(
        True, description="While the agent is available, hold a power assertion (`caffeinate -i`) so the Mac's "
        "idle sleep does not drop it (macOS).", **_allowed("true or false"),
    )
    process_type: ProcessType = Field(
        ProcessType.BACKGROUND, description="launchd ProcessType of the installed service: background (the "
        "owner's apps come first), standard, or interactive (fastest decode, competes with the owner).",
        **_allowed("background, standard or interactive"),
    )
    crash_loop_limit: int = Field(
        5, ge=1, description="Abnormal exits within crash_loop_window_mins after which the launchd service "
        "stays down instead of being relaunched.", **_allowed("an integer >= 1"),
    )
    crash_loop_window_mins: float = Field(
        10.0, gt=0, description="The window crash_loop_limit counts abnormal exits in (minutes).",
        **_allowed("a number of minutes > 0"),
    )

    # --- logs
    log_level: LogLevel = Field(
        LogLevel.INFO, description="Lowest level logged.", **_allowed("debug, info, warning or error"),
    )
    log_format: LogFormat = Field(
        LogFormat.AUTO, description="auto = console on a terminal, JSON lines otherwise.",
        **_allowed("auto, json or console"),
    )
    log_file: Path | None = Field(
        None, description="Write the log to this file instead of stderr, rotated by size (10 MiB, 3 older "
        "files kept); the launchd agent sets it. Unset = stderr.",
        **_allowed("a file path"),
    )

    @field_validator(
        "heartbeat_interval_s", "eviction_window_s", "memory_reserve_gb", "memory_limit_gb", "max_model_slots", "max_batch_size", "idle_timeout_mins",
        "load_wait_timeout_s", "settle_timeout_s", "template_timeout_s", "drain_timeout_s", "drain_ack_timeout_s",
        "restart_drift_fraction", "restart_drift_gb",
        "restart_failed_settles", "kv_ssd_budget_gb", "local_port",
        "max_vision_requests", "pause_when_active_mins", "pause_unload_grace_mins", "crash_loop_limit",
        "crash_loop_window_mins",
        mode="before",
    )
    @classmethod
    def _no_bool_numbers(cls, value: Any) -> Any:
        # pydantic reads `true` as 1; in a config file that is a mistake, not a number.
        if isinstance(value, bool):
            raise ValueError("a boolean is not a number")
        return value

    @field_validator("coordinator_url")
    @classmethod
    def _check_coordinator_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError("must be a ws:// or wss:// URL with a host")
        if parts.scheme == "ws" and not _is_loopback(parts.hostname):
            raise ValueError("plain ws:// is only allowed to a loopback host; use wss:// for a remote coordinator")
        return url

    @field_validator("auth_token")
    @classmethod
    def _check_token(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and not token.get_secret_value():
            raise ValueError("must not be empty")
        return token

    @field_validator("local_host")
    @classmethod
    def _check_local_host(cls, host: str) -> str:
        if not _is_loopback(host):
            raise ValueError("the local server listens on a loopback address only")
        return host

    @field_validator("local_allowed_origins")
    @classmethod
    def _check_origins(cls, origins: tuple[str, ...]) -> tuple[str, ...]:
        for origin in origins:
            if origin == "*":
                raise ValueError("list the origins: * would let a page on any web site use the local server")
            parts = urlsplit(origin)
            if not parts.scheme or not parts.netloc or origin != f"{parts.scheme}://{parts.netloc}":
                raise ValueError("an origin is scheme://host[:port], without a path or a trailing slash")
            if "*" in origin.removesuffix(":*"):
                raise ValueError("only the port may be * (scheme://host:*): a host is named in full")
        return origins

    @field_validator("enabled_models", "preload_models")
    @classmethod
    def _check_model_ids(cls, ids: tuple[str, ...]) -> tuple[str, ...]:
        if any(not i or i != i.strip() for i in ids):
            raise ValueError("model ids must be non-empty and have no surrounding spaces")
        return ids

    @field_validator("serve_windows")
    @classmethod
    def _check_windows(cls, windows: tuple[str, ...]) -> tuple[str, ...]:
        from provider.guest.windows import parse_windows  # pure; imported here to keep config light

        return tuple(w.text for w in parse_windows(windows))

    @field_validator("serve_timezone")
    @classmethod
    def _check_zone(cls, name: str | None) -> str | None:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        if name is not None:
            try:
                ZoneInfo(name)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError("not a known IANA time zone") from None
        return name

    @field_validator("model_aliases")
    @classmethod
    def _check_alias_ids(cls, aliases: dict[str, Path]) -> dict[str, Path]:
        if any(not i or i != i.strip() for i in aliases):
            raise ValueError("model ids must be non-empty and have no surrounding spaces")
        return aliases

    @field_validator("model_dirs", "hf_cache_dir", "ollama_dir", "model_aliases", "state_dir", "log_file")
    @classmethod
    def _expand_home(cls, value: Any) -> Any:
        # The loader already resolved `~` and relative paths per source; this covers direct use.
        if isinstance(value, Path):
            return value.expanduser()
        if isinstance(value, tuple):
            return tuple(p.expanduser() for p in value)
        if isinstance(value, dict):
            return {k: p.expanduser() for k, p in value.items()}
        return value

    def __hash__(self) -> int:  # frozen, but model_aliases is a dict: hash the dumped values
        return hash(self.model_dump_json())

    # --- derived figures, so callers do not each redo the unit arithmetic
    @property
    def memory_reserve_bytes(self) -> int:
        return int(self.memory_reserve_gb * GiB)

    @property
    def memory_limit_bytes(self) -> int | None:
        return None if self.memory_limit_gb is None else int(self.memory_limit_gb * GiB)

    @property
    def imported_models_dir(self) -> Path:
        """Where `import` writes model folders by default (scanned like a model_dirs entry)."""
        return self.state_dir / "models"

    @property
    def kv_ssd_budget_bytes(self) -> int:
        return int(self.kv_ssd_budget_gb * GiB)

    def kv_quantization_for(self, model_id: str) -> str:
        """The model's kv_quantization: its own entry in kv_quantization_models, else kv_quantization."""
        return self.kv_quantization_models.get(model_id, self.kv_quantization)

    @property
    def crash_loop_window_s(self) -> float:
        return self.crash_loop_window_mins * 60.0

    @property
    def idle_timeout_s(self) -> float | None:
        """Seconds before an idle model is unloaded; ``None`` = never."""
        return None if self.idle_timeout_mins == 0 else self.idle_timeout_mins * 60.0

    @property
    def pause_when_active_s(self) -> float | None:
        """Seconds of keyboard/mouse idleness required before serving; None = off."""
        return self.pause_when_active_mins * 60.0 or None

    @property
    def pause_unload_grace_s(self) -> float:
        return self.pause_unload_grace_mins * 60.0

    @property
    def local_base_url(self) -> str:
        host = f"[{self.local_host}]" if ":" in self.local_host else self.local_host
        return f"http://{host}:{self.local_port}"


FIELDS: tuple[str, ...] = tuple(Settings.model_fields)
_PATH_FIELDS = frozenset({"model_dirs", "hf_cache_dir", "ollama_dir", "state_dir", "log_file"})
_SECRET_FIELDS = frozenset({"auth_token"})


def env_name(field: str) -> str:
    """The environment variable that sets ``field``."""
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def allowed_text(field: str) -> str:
    extra = Settings.model_fields[field].json_schema_extra
    assert isinstance(extra, dict)
    return str(extra["allowed"])


NO_FLAG = frozenset({"auth_token"})  # secrets: environment or file only (a flag would show in `ps`)
LIST_FIELDS = frozenset({"model_dirs", "enabled_models", "preload_models", "serve_windows", "local_allowed_origins"})


def default_text(field: str) -> str:
    """A field's default as the operator would write it (``unset``, ``empty``, ``true``, ``8484``)."""
    info = Settings.model_fields[field]
    if info.default_factory is not None and field == "state_dir":
        return "per platform (below)"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, dict)) and not value:
        return "empty"
    if isinstance(value, tuple):
        return ", ".join(map(str, value))
    if isinstance(value, StrEnum):
        return value.value
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings_reference(width: int = 100) -> str:
    """Every setting: its flag, environment variable, default, what it does and what is allowed
    (`darkbloom-provider --help-settings`)."""
    import textwrap

    lines = [
        "Every setting is a TOML key (in ~/.config/darkbloom/provider.toml, or the file --config PATH or",
        "DARKBLOOM_CONFIG names), a DARKBLOOM_* environment variable and a --flag given before or after the",
        "command; a flag overrides the variable, which overrides the file. Lists repeat the flag",
        "(--model-dirs A --model-dirs B; comma-separated in the variable), aliases are --model-aliases ID=PATH,",
        "sizes are GiB. deploy/README.md (\"Configuration\") has the same table with more on each.",
        "",
    ]
    for field in FIELDS:
        info = Settings.model_fields[field]
        flag = "(no flag: a secret)" if field in NO_FLAG else flag_name(field)
        lines.append(f"{flag}  {env_name(field)}  key {field}, default: {default_text(field)}")
        text = f"{info.description} Allowed: {allowed_text(field)}."
        lines += textwrap.wrap(text, width=width, initial_indent="    ", subsequent_indent="    ",
                               break_on_hyphens=False)
    return "\n".join(lines)


def unrecognised_env(env: Mapping[str, str]) -> list[str]:
    """``DARKBLOOM_*`` variables that nothing reads (likely typos), for `doctor` to point out."""
    known = {env_name(f) for f in FIELDS} | MEMORY_POLICY_ENV | {CONFIG_ENV, SERVICE_MANAGER_ENV}
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)


def policy_settings(settings: Settings, env: Mapping[str, str] | None = None) -> PolicySettings:
    """The memory policy's inputs for these settings (env `None` = `os.environ`): `memory/policy`
    resolves them, logs each env value it rejects or clamps, and keeps those in `.adjustments`."""
    from memory import resolve_settings  # imported here: `--help` and `--version` load this module

    return resolve_settings(env, memory_reserve_gb=settings.memory_reserve_gb,
                            memory_limit_gb=settings.memory_limit_gb)


def resolve_config_path(config_path: Path | None, env: Mapping[str, str], home: Path) -> tuple[Path, bool]:
    """The TOML file to read and whether it must exist (it must when named explicitly)."""
    if config_path is not None:
        return config_path.expanduser(), True
    if env.get(CONFIG_ENV):
        return _expand(env[CONFIG_ENV], home, Path.cwd()), True
    return default_config_path(home, env), False


def load_settings(
    *,
    config_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    platform: str = sys.platform,
) -> Settings:
    """Build the settings: defaults < TOML file < ``DARKBLOOM_*`` env < ``overrides`` (CLI flags)."""
    env = os.environ if env is None else env
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    values: dict[str, Any] = {"state_dir": default_state_dir(home, platform, env)}
    origins: dict[str, str] = {}

    path, required = resolve_config_path(config_path, env, home)
    for key, value in _read_toml(path, required, home).items():
        values[key], origins[key] = value, f"{path}: key '{key}{{sub}}'"
    for key, value in _read_env(env, home).items():
        values[key], origins[key] = value, f"environment variable {env_name(key)}{{sub}}"
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in Settings.model_fields:
            raise ConfigError(f"unknown setting {flag_name(key)} (known: {', '.join(FIELDS)})")
        values[key] = _normalise_paths(key, value, home, Path.cwd())
        origins[key] = f"option {flag_name(key)}{{sub}}"

    try:
        return Settings.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, values, origins)) from None


def _read_toml(path: Path, required: bool, home: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: configuration file not found") from None
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read configuration file ({type(exc).__name__})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for key in data:
        if key not in Settings.model_fields:
            close = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"{path}: unknown key '{key}' ({hint}known keys: {', '.join(FIELDS)})")
    return {k: _normalise_paths(k, v, home, path.parent) for k, v in data.items()}


def _read_env(env: Mapping[str, str], home: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in FIELDS:
        raw = env.get(env_name(field))
        if raw is None or raw.strip() == "":
            continue
        value: Any = raw.strip()
        if field in LIST_FIELDS:
            value = [item.strip() for item in raw.split(",") if item.strip()]
        elif field in _TABLE_EXAMPLES:
            value = _parse_aliases(raw, env_name(field), _TABLE_EXAMPLES[field])
        out[field] = _normalise_paths(field, value, home, Path.cwd())
    return out


# A table's environment form, `id=value,id2=value2`, and how to say it.
_TABLE_EXAMPLES = {"model_aliases": "id=path pairs separated by commas (e.g. my-model=~/models/a,other=/srv/b)",
                   "kv_quantization_models": "id=setting pairs separated by commas (e.g. my-model=q8,other=none)"}


def _parse_aliases(raw: str, source: str, expected: str) -> dict[str, str]:
    """``id=value,id2=value2`` (a table's environment form)."""
    aliases: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in raw.split(","))):
        model_id, sep, value = pair.partition("=")
        if not sep or not model_id.strip() or not value.strip():
            raise ConfigError(
                f"environment variable {source}: value {_show(pair)} is not allowed: expected {expected}"
            )
        aliases[model_id.strip()] = value.strip()
    return aliases


def _expand(raw: str, home: Path, base: Path) -> Path:
    """``~`` against the configured home, relative paths against ``base`` (the file's directory)."""
    path = home / raw[2:] if raw == "~" or raw.startswith("~/") else Path(raw)
    return path if path.is_absolute() else base / path


def _normalise_paths(field: str, value: Any, home: Path, base: Path) -> Any:
    # Only well-typed strings are touched; anything else is left for validation to reject by name.
    if field in _PATH_FIELDS:
        if isinstance(value, str) and value:
            return _expand(value, home, base)
        if isinstance(value, list):
            return [_expand(v, home, base) if isinstance(v, str) and v else v for v in value]
    if field == "model_aliases" and isinstance(value, dict):
        return {k: _expand(v, home, base) if isinstance(v, str) and v else v for k, v in value.items()}
    return value


def _show(value: Any) -> str:
    text = repr(str(value) if isinstance(value, Path) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(exc: ValidationError, values: Mapping[str, Any], origins: Mapping[str, str]) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        loc = err["loc"]
        field = str(loc[0]) if loc else "?"
        sub = "".join(f"[{part!r}]" for part in loc[1:])
        where = origins.get(field, f"default of '{field}{{sub}}'").replace("{sub}", sub)
        shown = "'***'" if field in _SECRET_FIELDS else _show(err.get("input", values.get(field)))
        reason = str(err["msg"]).removeprefix("Value error, ")
        reason = reason[:1].lower() + reason[1:]
        allowed = allowed_text(field) if field in Settings.model_fields else "see deploy/README.md"
        lines.append(f"{where}: value {shown} is not allowed: {reason}. Allowed: {allowed}.")
    return "\n".join(lines) if len(lines) == 1 else "invalid configuration:\n  " + "\n  ".join(lines)
