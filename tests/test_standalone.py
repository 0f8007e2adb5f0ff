"""The repository stands alone: a plain clone tests itself with nothing beside it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VECTOR_FILES = ("provider_to_coordinator.json", "coordinator_to_provider.json", "nacl_box.json", "protocol_md_frames.json",
                "vocabularies.json")


def test_the_fixture_loader_works_in_a_clone_with_no_shared_folder(tmp_path):
    """Copy the loader and its data alone into an empty tree (no references folder anywhere near it) and load
    every vector from a fresh interpreter."""
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "tests" / "vectors", clone / "tests" / "vectors")
    assert not (tmp_path / SHARED).exists() and not (clone.parent.parent / SHARED).exists()
    code = ("import sys; sys.path.insert(0, 'tests'); from vectors import load; "
            f"names = {VECTOR_FILES!r}; "
            "print(sum(len(load(n).get('cases', load(n).get('vocabularies', load(n).get('frames', ())))) for n in names))")
    out = subprocess.run([sys.executable, "-c", code], cwd=clone, capture_output=True, text=True, check=True)
    assert int(out.stdout) > 10


# The folder of references the project was created beside. Its name is assembled here so that this
# guard, which must spell out what it looks for, does not itself read as a file that reads it.
SHARED = "".join(("sha", "red"))
# A path built to that folder: `/ "<name>"`, `"<name>" /`, "../<name>", "<name>/reference".
_READS_SHARED = re.compile(rf"""/\s*["']{SHARED}["']|["']{SHARED}["']\s*/|\.\./{SHARED}|{SHARED}/reference""")


def _tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return [ROOT / line for line in listed.stdout.splitlines()]
    return [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts]


def test_no_build_test_demo_or_benchmark_file_reads_the_shared_folder():
    """Docs may cite where a fact came from; code, tests, the Makefile and CI may not read it."""
    offenders = []
    for path in _tracked_files():
        if path.suffix not in {".py", ".toml", ".cfg", ".sh", ".ini"} and path.name not in {"Makefile", "run"}:
            continue
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if _READS_SHARED.search(text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_the_readmes_do_not_send_a_newcomer_outside_the_repository():
    """A clone has nothing beside it: the layout and the references a reader needs are in the repo."""
    for readme in (ROOT / "README.md", ROOT / "deploy" / "README.md"):
        assert f"../{SHARED}" not in readme.read_text(encoding="utf-8"), readme
