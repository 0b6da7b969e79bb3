"""The docs stay true: every event code and every controller setting is documented in
docs/reference.md, every link of the README and docs/ resolves to a file of the repository, and
every repository path docs/ cites exists.

The lists are derived from the code (the catalog module, what ``Settings.from_env`` asks its
environment for, and a scan of the controller's sources for environment reads), so adding an
event or a setting without documenting it fails here.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from domain.catalog import CATALOG
from tests.unit.recording_env import settings_variables

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reference.md"
#: The controller's packages (the agent has its own command-line options).
CONTROLLER_PACKAGES = ("application", "infrastructure", "interfaces")

_NAME = r"""["']([A-Z][A-Z0-9_]*)["']"""
#: Environment reads with a literal variable name: ``os.environ.get("X")``,
#: ``os.environ["X"]``, ``os.getenv("X")``, ``env.get("X")``, ``env["X"]``,
#: ``environment.get("X")`` and the settings helpers ``_int(env, "X", …)``.
ENV_READ_PATTERNS = (
    re.compile(r"\bos\.environ\.get\(\s*" + _NAME),
    re.compile(r"\bos\.environ\[\s*" + _NAME + r"\s*\]"),
    re.compile(r"\bos\.getenv\(\s*" + _NAME),
    re.compile(r"\b(?:env|environ|environment)\.get\(\s*" + _NAME),
    re.compile(r"\b(?:env|environ|environment)\[\s*" + _NAME + r"\s*\]"),
    re.compile(r"\b_(?:int|float|bool|str|path)\(\s*env\s*,\s*" + _NAME),
)
#: Process-environment reads whose variable name the scan above could not see.
UNSCANNABLE_ENV_READ = re.compile(r"""\bos\.(?:environ\.get\(|environ\[|getenv\()\s*(?!["'])""")
#: A citation of the retired design document (built so that this file does not match it).
RETIRED_DESIGN_DOC = re.compile("DESIGN" + r"(?:\.md|\s*§)")


def section(title: str) -> str:
    """The text of the ``## title`` section of the document, up to the next ``## ``."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"docs/reference.md has no '## {title}' section"
    return match.group(1)


def controller_sources() -> list[Path]:
    return sorted(p for package in CONTROLLER_PACKAGES for p in (ROOT / package).rglob("*.py"))


def scanned_variables() -> set[str]:
    found: set[str] = set()
    for path in controller_sources():
        source = path.read_text(encoding="utf-8")
        for pattern in ENV_READ_PATTERNS:
            found.update(pattern.findall(source))
    return found


def test_every_event_code_is_in_the_catalogue() -> None:
    codes = set(CATALOG)
    assert {"NODE_ENROLLED", "TOKEN_STREAM_CHUNK", "ENROLLMENT_TOKEN_REDEEMED"} <= codes
    text = section("Event catalogue")
    missing = sorted(code for code in codes if f"`{code}`" not in text)
    assert not missing, f"event codes missing from 'Event catalogue' in {DOC}: {missing}"


def test_the_catalogue_documents_no_unknown_code() -> None:
    rows = re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", section("Event catalogue"), re.M)
    assert len(rows) == len(set(rows)), "an event code has two rows"
    assert set(rows) == set(CATALOG), f"stale rows: {sorted(set(rows) - set(CATALOG))}"


def test_settings_reads_are_seen() -> None:
    """Both derivations find the settings, so the documentation test below can fail."""
    from_settings = settings_variables()
    scanned = scanned_variables()
    assert {"DATABASE_URL", "OFFLINE_AFTER", "DEGRADED_AFTER", "NODE_ENROLLMENT_SECRET"} <= (
        from_settings
    )
    assert from_settings <= scanned, "the source scan misses reads Settings.from_env makes"
    assert {"LOG_LEVEL", "DACP_VAR_DIR", "POSTGRES_SCHEMA"} <= scanned


def test_no_environment_read_hides_its_name() -> None:
    hidden = [
        f"{path.relative_to(ROOT)}:{source.count(chr(10), 0, match.start()) + 1}"
        for path in controller_sources()
        for source in [path.read_text(encoding="utf-8")]
        for match in UNSCANNABLE_ENV_READ.finditer(source)
    ]
    assert not hidden, f"read the environment with a literal name (or extend this test): {hidden}"


def test_every_setting_is_documented() -> None:
    variables = settings_variables() | scanned_variables()
    text = section("Configuration")
    missing = sorted(name for name in variables if f"`{name}`" not in text)
    assert not missing, f"variables missing from 'Configuration' in {DOC}: {missing}"


def repository_files() -> list[Path]:
    """Files git tracks plus new files it does not ignore; every file without git."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "var", "node_modules"}
        return [
            p
            for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
        ]
    return [ROOT / name for name in listed.decode("utf-8").split("\0") if name]


def test_no_file_cites_the_retired_design_document() -> None:
    files = repository_files()
    assert any(p.name == "architecture.md" for p in files)
    citing = [
        str(path.relative_to(ROOT))
        for path in files
        if path.is_file()
        and RETIRED_DESIGN_DOC.search(path.read_bytes().decode("utf-8", errors="replace"))
    ]
    assert not citing, f"cite docs/architecture.md instead: {citing}"


#: Markdown links: ``[text](target)``.
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A backticked repository path: ``application/job_manager.py``, ``ops/systemd/`` (a symbol after
#: ``:`` is dropped; ``module.symbol`` names a module's symbol). Only paths under a top-level
#: folder of the repository count: ``tls/`` (under the state directory) is not one.
CITED_PATH = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.*-]+)+/?)(?::[^`]*)?`")
#: Cited paths that are examples or live outside the repository on purpose (an install's files,
#: what a build or a run writes): each is checked by name, not by existence.
EXAMPLE_PATHS = frozenset[str]()


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_resolves_to_a_file_in_the_repository() -> None:
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or a heading of the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to no file of the repository: {broken}"


def test_every_cited_repository_path_exists() -> None:
    top = {p.relative_to(ROOT).parts[0] for p in repository_files() if p.parent != ROOT}
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for cited in CITED_PATH.findall(page.read_text(encoding="utf-8")):
            if cited.split("/", 1)[0] not in top or cited in EXAMPLE_PATHS:
                continue
            found = any(ROOT.glob(cited)) if "*" in cited else (ROOT / cited).exists()
            module, _, symbol = cited.rpartition(".")
            if not found and module and (ROOT / f"{module}.py").is_file():
                # ``application/timeline.job_id_forms``: a module's symbol
                found = symbol in (ROOT / f"{module}.py").read_text(encoding="utf-8")
            if not found:
                missing.append(f"{page.relative_to(ROOT)}: {cited}")
    assert not missing, f"cited paths that do not exist: {missing}"


def _contracts() -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        config = tomllib.load(f)
    return [c["name"] for c in config["tool"]["importlinter"]["contracts"]]


def test_the_architecture_page_states_exactly_the_import_contracts() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    stated = [s.rstrip(".") for s in re.findall(r"^\d+\. \*(.+?)\*", page, flags=re.MULTILINE)]
    assert stated == _contracts(), "docs/architecture.md 'The contracts' and pyproject.toml differ"
