"""`serve --local` listens without reading a weight byte.

The agent advertises each model's weight hash in `register`, so it hashes before it connects (14 s
for an 8B model's first hash). The owner's server advertises nothing: it binds its prefix cache to
a file fingerprint (name, path, size, modification time) and never hashes, so a model is served as
soon as it is loaded. Seen from outside: no per-file digest is ever cached in the state directory,
while requests are answered and the prefix cache reuses what it stored."""

from __future__ import annotations

import httpx

from local_server import MODEL, start_server
from provider.models.hashing import CACHE_FILE, weight_fingerprint_sync, weight_hash_sync


def test_serve_local_never_hashes_weights_and_its_prefix_cache_still_works(tmp_path, tiny_model_path):
    state = tmp_path / "state"
    srv = start_server(tmp_path, tiny_model_path, "--state-dir", str(state))
    try:
        assert not (state / CACHE_FILE).exists()  # listening, nothing hashed
        ask = {"model": MODEL, "messages": [{"role": "user", "content": "the same question twice"}],
               "max_tokens": 4, "temperature": 0}
        for _ in range(2):
            assert httpx.post(srv.base_url + "/v1/chat/completions", json=ask, timeout=60).status_code == 200
        reused = httpx.get(srv.base_url + "/status").json()["prefix_cache"]["reused_tokens"]
    finally:
        code, _ = srv.stop()
    assert code == 0 and reused > 0
    assert not (state / CACHE_FILE).exists()  # served, loaded and cached: still never hashed


def test_the_fingerprint_follows_the_files_without_reading_them(tmp_path, tiny_model_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_path, copy)
    first = weight_fingerprint_sync(copy)
    assert first.startswith("fingerprint-") and first != weight_hash_sync(copy)
    assert weight_fingerprint_sync(copy) == first
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert weight_fingerprint_sync(copy) != first
