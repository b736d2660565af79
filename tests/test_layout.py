"""The house rules, checked on the source: no import cycle; nothing of the product imports a
measurement (`jspec.bench`); no module sets another module's upper-case global (kernel and path
choices are arguments and config fields, not switches); no file of jspec/ over 600 lines; every
package is installed; docs/architecture.md names every module there is and no other; nothing in
the repository refers to a task list."""

import ast
import pathlib
import re
import subprocess

import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jspec"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(path: pathlib.Path) -> set[str]:
    """The jspec modules `path` imports anywhere in it (inside functions too); `from a import b`
    counts as module a.b when that is a module, else as a."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jspec")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jspec"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in MODULES else node.module)
    return out


def test_no_import_cycle():
    """A module's own packages (its __init__ files) do not count: Python runs them first anyway."""
    graph = {
        m: {d for d in imported(p) if d in MODULES and not m.startswith(d + ".")}
        for m, p in MODULES.items()
    }
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_the_product_imports_no_measurement():
    bad = {
        m: sorted(d for d in imported(p) if d.startswith("jspec.bench"))
        for m, p in MODULES.items()
        if not m.startswith("jspec.bench")
    }
    assert not {m: d for m, d in bad.items() if d}


def globals_set_from_outside(path: pathlib.Path) -> list[str]:
    """`module.NAME = ...` or `setattr(module, "NAME", ...)` / `monkeypatch.setattr(module,
    "NAME", ...)` on an imported jspec module and an upper-case NAME."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jspec"):
            modules |= {
                a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES
            }
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.startswith("jspec")}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                if t.value.id in modules and t.attr.isupper():
                    found.append(f"{path.name}:{node.lineno} {t.value.id}.{t.attr} =")
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        module, attribute = node.args[:2]
        if (
            name == "setattr"
            and isinstance(module, ast.Name)
            and module.id in modules
            and isinstance(attribute, ast.Constant)
            and str(attribute.value).isupper()
        ):
            found.append(f"{path.name}:{node.lineno} setattr({module.id}, {attribute.value!r})")
    return found


def test_no_module_sets_another_modules_switch():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *ROOT.glob("notebooks/*")]
    found = [hit for f in files if f.suffix == ".py" for hit in globals_set_from_outside(f)]
    assert not found, found


def test_no_file_of_the_package_is_over_600_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_every_package_is_installed():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")} | {"jspec.configs"}
    assert listed == packages


ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def architecture_modules() -> set[str]:
    """The files the module block of docs/architecture.md names: `room/  a.py b.py` lines (the
    next lines, indented further, continue the room) and the package's own files."""
    block = ARCHITECTURE.split("```\njspec/\n", 1)[1].split("```", 1)[0]
    named, room = set(), ""
    for line in block.splitlines():
        words = line.split()
        indent = len(line) - len(line.lstrip())
        if words and words[0].endswith("/"):
            room, words = words[0], words[1:]
        elif indent <= 2:
            room = ""
        named |= {f"jspec/{room}{w}" for w in words}
    return named


def test_the_architecture_names_every_module():
    named = architecture_modules()
    files = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert not files - named, f"docs/architecture.md does not name {sorted(files - named)}"
    assert not named - files, f"docs/architecture.md names missing {sorted(named - files)}"


def test_each_room_imports_only_what_the_architecture_allows():
    allowed = {}
    for room, rooms in re.findall(r"^\| `jspec\.(\w+)` \| ([^|]+) \|", ARCHITECTURE, re.M):
        allowed[room] = None if rooms.strip() == "every room" else set(re.findall(r"\w+", rooms))
        if rooms.strip() == "nothing of jspec":
            allowed[room] = set()
    room_of = lambda m: m.split(".")[1]
    found = {}
    for m, p in MODULES.items():
        if m == "jspec":
            continue
        assert room_of(m) in allowed, f"docs/architecture.md has no room for {m}"
        if allowed[room_of(m)] is None:
            continue
        bad = (
            {room_of(d) for d in imported(p) if d in MODULES and d != "jspec"}
            - allowed[room_of(m)]
            - {room_of(m)}
        )
        if bad:
            found[m] = sorted(bad)
    assert not found, found


# Files that quote task-list wording to refuse it.
SAY_WHAT_THEY_REFUSE = ("tests/test_layout.py", "tests/test_benchmarks_doc.py")


def test_nothing_refers_to_a_task_list():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    pattern = re.compile(r"\b(issue|task|item)s? ?#?\d+\b|#\d+\b|\bacceptance (item|list)", re.I)
    hits = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".yaml", ".toml", ".ipynb") or not path.is_file():
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and name not in SAY_WHAT_THEY_REFUSE:
                hits.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not hits, hits
