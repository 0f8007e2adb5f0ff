"""Models pulled with Ollama, served through MLX: the store read as Ollama writes it, listed with fit
verdicts at the size they will have once imported, imported by `import ollama:NAME` or by the first
request that names one, and imported again when the store's tag moves to another blob."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from gguf_files import export_gguf
from local_server import running_server
from provider import cli
from provider.importing import ImportFailed, resolve
from provider.models import ModelSource, discover
from provider.models.gguf import read_marker
from provider.models.ollama import default_store, list_models, manifest_path

MODEL_LAYER = "application/vnd.ollama.image.model"


def pull(store: Path, name: str, gguf: Path, *extra_layers: str) -> str:
    """What `ollama pull NAME` leaves: the GGUF as a blob named by its digest, and a manifest."""
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf, store / "blobs" / f"sha256-{digest}")
    layers = [{"mediaType": MODEL_LAYER, "digest": f"sha256:{digest}", "size": gguf.stat().st_size}]
    layers += [{"mediaType": media, "digest": "sha256:" + "1" * 64, "size": 1} for media in extra_layers]
    manifest = manifest_path(store, name)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return digest


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model_path) -> Path:
    return export_gguf(tiny_model_path, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_store_reads_as_ollama_names_it(tmp_path, tiny_gguf):
    store = tmp_path / "store"
    pull(store, "tinyllama", tiny_gguf)
    pull(store, "someone/tiny:q8", tiny_gguf)
    pull(store, "hf.co/org/repo:Q4_K_M", tiny_gguf)
    pull(store, "llava:7b", tiny_gguf, "application/vnd.ollama.image.projector")
    found = {m.name: m for m in list_models(store)}
    assert sorted(found) == ["hf.co/org/repo:Q4_K_M", "llava:7b", "someone/tiny:q8", "tinyllama:latest"]
    assert found["llava:7b"].problem and "vision" in found["llava:7b"].problem
    assert found["tinyllama:latest"].blob is not None and found["tinyllama:latest"].problem is None
    assert resolve("ollama:tinyllama", store).model_id == "tinyllama:latest"
    with pytest.raises(ImportFailed, match="not in the Ollama store"):
        resolve("ollama:nothing:here", store)
    with pytest.raises(ImportFailed, match="vision model"):
        resolve("ollama:llava:7b", store)
    assert default_store({"OLLAMA_MODELS": str(store)}) == store
    assert default_store({}, home=tmp_path) == tmp_path / ".ollama" / "models"


def test_a_missing_blob_is_said(tmp_path, tiny_gguf):
    store = tmp_path / "store"
    digest = pull(store, "gone:1b", tiny_gguf)
    (store / "blobs" / f"sha256-{digest}").unlink()
    (model,) = list_models(store)
    assert model.problem == "its GGUF blob is missing (an interrupted pull?)"


def test_ollama_models_are_listed_at_their_imported_size_and_imported_once(tmp_path, tiny_gguf, capsys):
    store, models = tmp_path / "store", tmp_path / "state" / "models"
    pull(store, "tiny:1b", tiny_gguf)
    pull(store, "llava:7b", tiny_gguf, "application/vnd.ollama.image.projector")
    inventory = discover(hf_cache=None, imported=models, ollama=store)
    (pending,) = inventory.models
    assert pending.id == "tiny:1b" and pending.source is ModelSource.OLLAMA and pending.gguf is not None
    assert [(s.id, s.reason.value) for s in inventory.skipped] == [("llava:7b", "unsupported_gguf")]
    parsed = cli.build_parser().parse_args(["import", "ollama:tiny:1b", "--state-dir", str(tmp_path / "state"),
                                            "--ollama-dir", str(store)])
    assert cli.cmd_import(parsed, cli.settings_from(parsed)) == 0
    assert "importing ollama:tiny:1b" in capsys.readouterr().out
    (imported,) = discover(hf_cache=None, imported=models, ollama=store).models
    assert imported.source is ModelSource.IMPORTED and imported.gguf is None and imported.id == "tiny:1b"
    # listed before at the size it has now, but for the safetensors header (the tensors' names and offsets)
    assert 0 <= imported.weight_bytes - pending.weight_bytes <= 64 << 10
    assert read_marker(imported.path)["source"]["sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()


def test_an_import_from_an_older_blob_is_replaced_by_the_store_s_model(tmp_path, tiny_gguf, small_model_path):
    store, models = tmp_path / "store", tmp_path / "state" / "models"
    pull(store, "tiny:1b", tiny_gguf)
    resolved = resolve("ollama:tiny:1b", store)
    from provider.importing import run

    run(resolved, models / "tiny:1b", "tiny:1b")
    pull(store, "tiny:1b", export_gguf(small_model_path, tmp_path / "small.gguf"))  # the tag moved on
    (model,) = discover(hf_cache=None, imported=models, ollama=store).models
    assert model.source is ModelSource.OLLAMA and model.gguf is not None


def test_the_first_request_for_an_ollama_model_imports_and_answers_it(tmp_path, tiny_gguf, tiny_model_path):
    store = tmp_path / "store"
    pull(store, "tiny:1b", tiny_gguf)
    with running_server(tmp_path, tiny_model_path, env_extra={"OLLAMA_MODELS": str(store)}) as server:
        client = server.client()
        listed = {m.id for m in client.models.list().data}
        assert "tiny:1b" in listed
        ask = [{"role": "user", "content": "Say something."}]
        ours = client.chat.completions.create(model="tiny:1b", messages=ask, max_tokens=12, temperature=0)
        same = client.chat.completions.create(model="demo/tiny", messages=ask, max_tokens=12, temperature=0)
        assert ours.choices[0].message.content == same.choices[0].message.content  # the same weights, imported
        again = client.chat.completions.create(model="tiny:1b", messages=ask, max_tokens=12, temperature=0)
        assert again.choices[0].message.content == ours.choices[0].message.content
        code, log = server.stop()
    assert code == 0
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events].count("model_imported") == 1
    folder = tmp_path / ".local" / "share" / "darkbloom" / "models" / "tiny:1b"
    assert read_marker(folder)["model_id"] == "tiny:1b"
    assert not any(p.name.endswith(".importing") for p in folder.parent.iterdir())
    assert os.environ["OLLAMA_MODELS"] != str(store)  # the suite's own processes never see this store
