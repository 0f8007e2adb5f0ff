"""provider/config: precedence, env parsing, paths, and one clear message per bad value."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from provider.config import (
    DEFAULT_COORDINATOR_URL,
    FIELDS,
    LOOPBACK_ORIGINS,
    ConfigError,
    LogFormat,
    LogLevel,
    Settings,
    env_name,
    load_settings,
    unrecognised_env,
)
from provider.units import GiB

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "deploy" / "provider.example.toml"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_any_file(home: Path) -> None:
    s = load_settings(env={"HOME": str(home)}, platform="linux")
    assert s.coordinator_url == DEFAULT_COORDINATOR_URL
    assert s.heartbeat_interval_s == 5.0
    assert s.max_model_slots == 3
    assert s.idle_timeout_mins == 60 and s.idle_timeout_s == 3600
    assert (s.local_host, s.local_port) == ("127.0.0.1", 8484)
    assert s.local_base_url == "http://127.0.0.1:8484"
    assert s.backend == "inprocess-mlx"
    assert s.drain_timeout_s == 30
    assert s.memory_reserve_gb == 4 and s.memory_reserve_bytes == 4 * GiB
    assert s.memory_limit_gb is None and s.memory_limit_bytes is None
    assert s.auth_token is None and s.runtime_hash is None and s.dev_posture is False
    assert s.log_level is LogLevel.INFO and s.log_format is LogFormat.AUTO
    assert s.state_dir == home / ".local/share/darkbloom"


def test_state_dir_default_per_platform(home: Path) -> None:
    mac = load_settings(env={"HOME": str(home)}, platform="darwin")
    assert mac.state_dir == home / "Library/Application Support/darkbloom"
    xdg = load_settings(env={"HOME": str(home), "XDG_DATA_HOME": "/data"}, platform="linux")
    assert xdg.state_dir == Path("/data/darkbloom")


def test_precedence_defaults_file_env_flags(home: Path) -> None:
    write(
        home / ".config/darkbloom/provider.toml",
        "max_model_slots = 2\nidle_timeout_mins = 5\nlocal_port = 9000\nlog_level = 'debug'\n",
    )
    env = {"HOME": str(home), "DARKBLOOM_IDLE_TIMEOUT_MINS": "7", "DARKBLOOM_LOCAL_PORT": "9001"}
    s = load_settings(env=env, overrides={"local_port": 9002, "log_level": None})
    assert s.max_model_slots == 2  # file over default
    assert s.idle_timeout_mins == 7  # env over file
    assert s.local_port == 9002  # flag over env
    assert s.log_level is LogLevel.DEBUG  # a flag given as None is "not given"


def test_config_path_from_flag_and_env(home: Path, tmp_path: Path) -> None:
    a = write(tmp_path / "a.toml", "max_model_slots = 4\n")
    b = write(tmp_path / "b.toml", "max_model_slots = 5\n")
    env = {"HOME": str(home), "DARKBLOOM_CONFIG": str(b)}
    assert load_settings(env=env).max_model_slots == 5
    assert load_settings(config_path=a, env=env).max_model_slots == 4


def test_xdg_config_home_is_honoured(home: Path, tmp_path: Path) -> None:
    write(tmp_path / "xdg/darkbloom/provider.toml", "max_model_slots = 6\n")
    s = load_settings(env={"HOME": str(home), "XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert s.max_model_slots == 6


def test_env_lists_aliases_bools_and_secrets(home: Path) -> None:
    env = {
        "HOME": str(home),
        "DARKBLOOM_MODEL_DIRS": "~/models, /srv/models,,",
        "DARKBLOOM_ENABLED_MODELS": "org/a,b",
        "DARKBLOOM_MODEL_ALIASES": "mine=~/m/qwen, org/x=/abs/x",
        "DARKBLOOM_DEV_POSTURE": "yes",
        "DARKBLOOM_AUTH_TOKEN": "dbp_secret_token",
        "DARKBLOOM_MEMORY_LIMIT_GB": "12.5",
        "DARKBLOOM_MEMORY_RESERVE_GB": "2",
        "DARKBLOOM_LOG_FORMAT": "",  # empty means unset
    }
    s = load_settings(env=env)
    assert s.model_dirs == (home / "models", Path("/srv/models"))
    assert s.enabled_models == ("org/a", "b")
    assert s.model_aliases == {"mine": home / "m/qwen", "org/x": Path("/abs/x")}
    assert s.dev_posture is True
    assert s.auth_token is not None and s.auth_token.get_secret_value() == "dbp_secret_token"
    assert "dbp_secret_token" not in repr(s) and "dbp_secret_token" not in str(s)
    assert s.memory_limit_bytes == int(12.5 * GiB)
    assert s.memory_reserve_gb == 2
    assert s.log_format is LogFormat.AUTO


def test_memory_policy_env_vars_are_not_settings(home: Path) -> None:
    env = {"HOME": str(home), "DARKBLOOM_MEM_CAP_FRACTION": "0.5", "DARKBLOOM_ACTIVATION_RESERVE_GB": "9"}
    s = load_settings(env=env)
    assert "mem_cap_fraction" not in FIELDS and "activation_reserve_gb" not in FIELDS
    assert s == load_settings(env={"HOME": str(home)})
    assert unrecognised_env({**env, "DARKBLOOM_MAX_MODEL_SLOT": "2", "DARKBLOOM_CONFIG": "x"}) == [
        "DARKBLOOM_MAX_MODEL_SLOT"
    ]


def test_file_paths_resolve_against_home_and_the_file(home: Path, tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "etc/provider.toml",
        'model_dirs = ["~/models", "rel"]\nstate_dir = "state"\n[model_aliases]\n"org/m" = "~/x"\n',
    )
    s = load_settings(config_path=cfg, env={"HOME": str(home)})
    assert s.model_dirs == (home / "models", tmp_path / "etc/rel")
    assert s.state_dir == tmp_path / "etc/state"
    assert s.model_aliases == {"org/m": home / "x"}


def test_settings_are_frozen_and_hashable() -> None:
    s = Settings(model_aliases={"a": Path("/x")})
    with pytest.raises(ValidationError):
        s.max_model_slots = 9  # type: ignore[misc]
    assert hash(s) == hash(Settings(model_aliases={"a": Path("/x")}))
    assert s != Settings()


def test_example_file_loads_and_documents_every_key(home: Path) -> None:
    s = load_settings(config_path=EXAMPLE, env={"HOME": str(home)}, platform="linux")
    assert s == load_settings(env={"HOME": str(home)}, platform="linux")  # the example shows the defaults
    text = EXAMPLE.read_text()
    missing = [f for f in FIELDS if f not in text]
    assert missing == []


def test_readme_lists_every_env_name() -> None:
    readme = (REPO / "deploy" / "README.md").read_text()
    assert [f for f in FIELDS if f"`{env_name(f)}`" not in readme] == []


def test_coordinator_url_rules(home: Path) -> None:
    base = {"HOME": str(home)}
    ok_local = load_settings(env={**base, "DARKBLOOM_COORDINATOR_URL": "ws://127.0.0.1:8080/ws/provider"})
    assert ok_local.coordinator_url.startswith("ws://127.0.0.1")
    with pytest.raises(ConfigError, match="DARKBLOOM_COORDINATOR_URL.*'ws://coord.lan/ws'.*loopback"):
        load_settings(env={**base, "DARKBLOOM_COORDINATOR_URL": "ws://coord.lan/ws"})


def test_a_remote_ws_url_is_refused_with_the_way_out_not_a_dead_end(home: Path) -> None:
    """The error for a remote ws:// URL says to use wss://; dev_posture does not relax it (it used
    to be suggested, and then the agent refused dev_posture for a remote coordinator)."""
    for env in ({"DARKBLOOM_COORDINATOR_URL": "ws://coord.lan/ws/provider"},
                {"DARKBLOOM_COORDINATOR_URL": "ws://coord.lan/ws/provider", "DARKBLOOM_DEV_POSTURE": "1"}):
        with pytest.raises(ConfigError) as raised:
            load_settings(env={"HOME": str(home), **env})
        message = str(raised.value)
        assert "use wss:// for a remote coordinator" in message and "dev_posture" not in message
    assert load_settings(env={"HOME": str(home), "DARKBLOOM_COORDINATOR_URL": "wss://coord.lan/ws/provider"})


def test_preload_models_from_every_source(home: Path, tmp_path: Path) -> None:
    env = {"HOME": str(home), "DARKBLOOM_PRELOAD_MODELS": "org/a, b"}
    assert load_settings(env=env).preload_models == ("org/a", "b")
    path = tmp_path / "p.toml"
    path.write_text('preload_models = ["x"]\n')
    assert load_settings(config_path=path, env={"HOME": str(home)}).preload_models == ("x",)
    assert load_settings(env=env, overrides={"preload_models": ["y"]}).preload_models == ("y",)
    with pytest.raises(ConfigError, match="preload-models"):
        load_settings(env={"HOME": str(home)}, overrides={"preload_models": [" a"]})


def test_local_allowed_origins_from_every_source_and_this_machines_pages_by_default(home: Path,
                                                                                     tmp_path: Path) -> None:
    """CORS for the local server: the pages this machine serves by default (as Ollama allows them), the
    owner's list instead when set (empty: none)."""
    assert load_settings(env={"HOME": str(home)}).local_allowed_origins == LOOPBACK_ORIGINS == (
        "http://localhost:*", "http://127.0.0.1:*")
    none = write(tmp_path / "none.toml", "local_allowed_origins = []\n")
    assert load_settings(config_path=none, env={"HOME": str(home)}).local_allowed_origins == ()
    assert load_settings(env={"HOME": str(home)}, overrides={"local_allowed_origins": ["https://[::1]:*"]}
                         ).local_allowed_origins == ("https://[::1]:*",)
    env = {"HOME": str(home), "DARKBLOOM_LOCAL_ALLOWED_ORIGINS": "http://localhost:3000, https://chat.example:8443"}
    assert load_settings(env=env).local_allowed_origins == ("http://localhost:3000", "https://chat.example:8443")
    path = write(tmp_path / "o.toml", 'local_allowed_origins = ["http://127.0.0.1:5173"]\n')
    assert load_settings(config_path=path, env={"HOME": str(home)}).local_allowed_origins == ("http://127.0.0.1:5173",)
    assert load_settings(env=env, overrides={"local_allowed_origins": ["app://x"]}).local_allowed_origins == ("app://x",)
    for bad, why in (("*", "any web site"), ("http://localhost:3000/", "trailing slash"),
                     ("localhost:3000", "scheme://host"), ("http://x/app", "without a path"),
                     ("http://*.example:*", "only the port may be *"), ("http://*:8080", "only the port may be *")):
        with pytest.raises(ConfigError, match="local-allowed-origins") as raised:
            load_settings(env={"HOME": str(home)}, overrides={"local_allowed_origins": [bad]})
        assert why in str(raised.value)


# --- bad input: one message naming the source, the value and what is allowed


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("max_model_slots = 0", r"key 'max_model_slots': value 0 .*Allowed: an integer >= 1\."),
        ("max_model_slots = true", r"key 'max_model_slots': value True .*boolean"),
        ("local_port = 70000", r"key 'local_port': value 70000 .*Allowed: an integer port 1-65535"),
        ("memory_reserve_gb = -1.5", r"key 'memory_reserve_gb': value -1.5 .*Allowed: a number of GiB >= 0"),
        ("memory_limit_gb = 0", r"key 'memory_limit_gb': value 0 .*Allowed: a number of GiB > 0"),
        ("heartbeat_interval_s = nan", r"key 'heartbeat_interval_s': value nan"),
        ("log_level = 'loud'", r"key 'log_level': value 'loud' .*Allowed: debug, info, warning or error"),
        ("log_format = 'xml'", r"key 'log_format': value 'xml' .*Allowed: auto, json or console"),
        ("coordinator_url = 'https://x.dev'", r"key 'coordinator_url': value 'https://x.dev' .*ws:// or wss://"),
        ("local_host = '0.0.0.0'", r"key 'local_host': value '0.0.0.0' .*loopback"),
        ("model_dirs = ['a', 3]", r"key 'model_dirs\[1\]': value 3 .*Allowed: a list of directory paths"),
        ("enabled_models = 'org/a'", r"key 'enabled_models': value 'org/a' .*Allowed: a list of model ids"),
    ],
)
def test_bad_file_value_names_file_key_value_and_allowed(home: Path, tmp_path: Path, toml: str, expected: str) -> None:
    cfg = write(tmp_path / "p.toml", toml + "\n")
    with pytest.raises(ConfigError, match=expected) as info:
        load_settings(config_path=cfg, env={"HOME": str(home)})
    assert str(info.value).startswith(str(cfg))
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained traceback


def test_bad_env_value_names_the_variable(home: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"HOME": str(home), "DARKBLOOM_MAX_MODEL_SLOTS": "three"})
    msg = str(info.value)
    assert msg.startswith("environment variable DARKBLOOM_MAX_MODEL_SLOTS: value 'three' is not allowed")
    assert "Allowed: an integer >= 1." in msg


def test_bad_flag_value_names_the_flag(home: Path) -> None:
    with pytest.raises(ConfigError, match=r"^option --idle-timeout-mins: value -1 .*>= 0"):
        load_settings(env={"HOME": str(home)}, overrides={"idle_timeout_mins": -1})
    with pytest.raises(ConfigError, match="unknown setting --max-slots"):
        load_settings(env={"HOME": str(home)}, overrides={"max_slots": 2})


def test_every_problem_is_listed_once(home: Path, tmp_path: Path) -> None:
    cfg = write(tmp_path / "p.toml", "max_model_slots = 0\nlocal_port = 0\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config_path=cfg, env={"HOME": str(home), "DARKBLOOM_DRAIN_TIMEOUT_S": "-3"})
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid configuration:"
    assert len(lines) == 4
    assert any("DARKBLOOM_DRAIN_TIMEOUT_S: value '-3'" in line for line in lines)


def test_unknown_file_key_is_an_error_with_a_suggestion(home: Path, tmp_path: Path) -> None:
    cfg = write(tmp_path / "p.toml", "max_model_slot = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'max_model_slot' \(did you mean 'max_model_slots'\?"):
        load_settings(config_path=cfg, env={"HOME": str(home)})
    nested = write(tmp_path / "n.toml", "[coordinator]\nurl = 'wss://x'\n")
    with pytest.raises(ConfigError, match="unknown key 'coordinator'"):
        load_settings(config_path=nested, env={"HOME": str(home)})


def test_unreadable_files(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="configuration file not found"):
        load_settings(config_path=tmp_path / "missing.toml", env={"HOME": str(home)})
    with pytest.raises(ConfigError, match=r"not valid TOML: .*line 1"):
        load_settings(config_path=write(tmp_path / "bad.toml", "max_model_slots = = 2\n"), env={"HOME": str(home)})
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read configuration file"):
        load_settings(config_path=binary, env={"HOME": str(home)})


def test_bad_alias_env_and_secret_never_echoed(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"DARKBLOOM_MODEL_ALIASES: value 'justapath' .*id=path"):
        load_settings(env={"HOME": str(home), "DARKBLOOM_MODEL_ALIASES": "a=/x,justapath"})
    cfg = write(tmp_path / "p.toml", "auth_token = 12345678\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config_path=cfg, env={"HOME": str(home)})
    assert "12345678" not in str(info.value) and "'***'" in str(info.value)


def test_kv_quantization_and_its_per_model_table(home: Path, tmp_path: Path) -> None:
    cfg = write(tmp_path / "q.toml", 'kv_quantization = "q8"\n[kv_quantization_models]\n"a/b" = "none"\n')
    s = load_settings(config_path=cfg, env={"HOME": str(home)})
    assert (s.kv_quantization_for("a/b"), s.kv_quantization_for("c/d")) == ("none", "q8")
    s = load_settings(env={"HOME": str(home), "DARKBLOOM_KV_QUANTIZATION_MODELS": "x=q4, y=none"})
    assert (s.kv_quantization_for("x"), s.kv_quantization_for("y"), s.kv_quantization_for("z")) == ("q4", "none", "none")
    with pytest.raises(ConfigError, match=r"DARKBLOOM_KV_QUANTIZATION: value 'q6' .*none, q8 or q4"):
        load_settings(env={"HOME": str(home), "DARKBLOOM_KV_QUANTIZATION": "q6"})
    with pytest.raises(ConfigError, match=r"kv_quantization_models.*'q2'"):
        load_settings(config_path=write(tmp_path / "bad.toml", '[kv_quantization_models]\n"a" = "q2"\n'),
                      env={"HOME": str(home)})
