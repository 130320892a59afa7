"""The patch ledger (patches/ledger.toml) is consistent, and each runtime change is active
exactly in the vLLM versions it names.

What this covers, and how (kept small on purpose):

* the ledger's shape: fields, versions inside the compat matrix, one ``.patch`` per code
  patch and version, no unlisted ``.patch`` file (``nox -s patches`` checks they apply);
* the ``kv_load_failure_policy`` config override, against the installed vLLM:
  - vLLM's default is still the one the ledger records (else the override may be moot),
    and the field still accepts the plugin's values;
  - vLLM still reads the field in ``Scheduler.__init__`` *after* creating the
    scheduler-side connector, from the same config object (a check of vLLM's source:
    otherwise the override would come too late);
  - ``KVPluginConnector.__init__`` sets it: the connector is constructed for real, with
    vLLM's own ``KVTransferConfig`` and a minimal stand-in for the rest of ``VllmConfig``;
    the role halves (``SchedulerSide``/``WorkerSide``, which need a model and KV cache
    config) are replaced by stubs, so the test depends only on the override's code path.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from test_api_surface import applies, check_entry, resolve_owner

ROOT = Path(__file__).resolve().parents[2]
LEDGER_PATH = ROOT / "patches" / "ledger.toml"
MATRIX = [e["version"] for e in tomllib.loads((ROOT / "compat" / "matrix.toml").read_text())["vllm"]]
CODE_PATCH_KEYS = {"name", "vllm_versions", "applied_by", "what", "why", "upstream"}
OVERRIDE_KEYS = {"name", "target", "vllm_default", "value", "plugin_default", "set_by", "read_by",
                 "vllm_versions", "what", "why", "upstream"}


def _ledger() -> dict:
    return tomllib.loads(LEDGER_PATH.read_text())


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _overrides() -> dict[str, dict]:
    return {o["name"]: o for o in _ledger().get("config_override", [])}


# --------------------------------------------------------------------- the ledger
def test_ledger_is_consistent():
    ledger = _ledger()
    assert ledger.get("schema") == 1
    problems = []
    listed = set()
    for p in ledger.get("code_patch", []):
        name = p.get("name", "?")
        if set(p) != CODE_PATCH_KEYS:
            problems.append(f"code_patch {name}: keys {sorted(set(p))}, expected {sorted(CODE_PATCH_KEYS)}")
            continue
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
            problems.append(f"code_patch {name}: name must be lower-case words joined by '-'")
        for version in p["vllm_versions"]:
            if version not in MATRIX:
                problems.append(f"code_patch {name}: vLLM {version} is not in compat/matrix.toml")
            path = ROOT / "patches" / f"{name}-{version}.patch"
            listed.add(path.name)
            if not path.is_file():
                problems.append(f"code_patch {name}: {path.name} is missing")
        file_part = p["applied_by"].split(":")[0]
        if not (ROOT / file_part).is_file():
            problems.append(f"code_patch {name}: applied_by {file_part} does not exist")
    for path in (ROOT / "patches").glob("*.patch"):
        if path.name not in listed:
            problems.append(f"{path.name} is not listed in patches/ledger.toml")
    for o in ledger.get("config_override", []):
        name = o.get("name", "?")
        if set(o) != OVERRIDE_KEYS:
            problems.append(f"config_override {name}: keys {sorted(set(o))}, expected {sorted(OVERRIDE_KEYS)}")
            continue
        if not any(applies(o["vllm_versions"], v) for v in MATRIX):
            problems.append(f"config_override {name}: {o['vllm_versions']} matches no matrix version")
        file_part = o["set_by"].split(":")[0]
        if not (ROOT / file_part).is_file():
            problems.append(f"config_override {name}: set_by {file_part} does not exist")
    assert not problems, "patches/ledger.toml:\n  " + "\n  ".join(problems)


def test_readme_names_every_ledger_entry():
    readme = (ROOT / "patches" / "README.md").read_text()
    ledger = _ledger()
    names = [p["name"] for p in ledger.get("code_patch", [])]
    names += [o["name"] for o in ledger.get("config_override", [])]
    assert [n for n in names if n not in readme] == []
    if not ledger.get("code_patch"):
        assert "no code patch" in readme.lower()


# ------------------------------------------------ the kv_load_failure_policy override
OVERRIDE = "kv_load_failure_policy"


def _kv_transfer_config(**kw):
    from vllm.config.kv_transfer import KVTransferConfig

    return KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both", **kw)


def test_override_target_and_vllm_default():
    o = _overrides()[OVERRIDE]
    why = check_entry({"name": o["target"], "kind": "field", "values": ["recompute", "fail"]})
    assert why is None, f"vLLM {_vllm_version()}: {o['target']} {why}"
    got = _kv_transfer_config().kv_load_failure_policy
    assert got == o["vllm_default"], (
        f"vLLM {_vllm_version()}'s default kv_load_failure_policy is {got!r}, the ledger says "
        f"{o['vllm_default']!r}: update patches/ledger.toml (is the override still needed?)")


def test_plugin_default_matches_ledger():
    from vllm_kvplugin.config import KVPluginConfig

    assert KVPluginConfig().load_failure_policy == _overrides()[OVERRIDE]["plugin_default"]


def test_vllm_reads_the_field_after_creating_the_scheduler_connector():
    """The override is set in the connector's constructor; vLLM must read it afterwards."""
    o = _overrides()[OVERRIDE]
    if not applies(o["vllm_versions"], _vllm_version()):
        pytest.skip(f"the override does not apply to vLLM {_vllm_version()}")
    owner, last = resolve_owner(o["read_by"])
    src = inspect.getsource(getattr(owner, last))
    create = re.search(r"KVConnectorFactory\.create_connector\(\s*config=self\.vllm_config,"
                       r"\s*role=KVConnectorRole\.SCHEDULER", src)
    read = re.search(r"(\w+)\.kv_load_failure_policy\b", src)
    assert create, f"vLLM {_vllm_version()}: {o['read_by']} no longer creates the scheduler connector as expected"
    assert read, f"vLLM {_vllm_version()}: {o['read_by']} no longer reads kv_load_failure_policy"
    assert create.start() < read.start(), (
        f"vLLM {_vllm_version()}: {o['read_by']} reads kv_load_failure_policy before it creates "
        "the connector, so the plugin's override comes too late")
    holder = read.group(1)
    assert re.search(rf"\b{holder}\s*=\s*self\.vllm_config\.kv_transfer_config\b", src) or \
        holder == "self.vllm_config.kv_transfer_config", (
        f"vLLM {_vllm_version()}: {o['read_by']} reads kv_load_failure_policy from {holder!r}, "
        "not from the config object the connector was given")


class _StubSide:
    def __init__(self, *args, **kwargs):
        self.args = args


def _fake_vllm_config(extra: dict | None = None, **kv):
    return SimpleNamespace(
        kv_transfer_config=_kv_transfer_config(kv_connector_extra_config=dict(extra or {}), **kv),
        model_config=SimpleNamespace(model="tiny", revision=None, dtype="bfloat16",
                                     hf_config=SimpleNamespace()),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, world_size=1),
    )


@pytest.fixture
def connector_cls(monkeypatch):
    from vllm_kvplugin.connector import scheduler, worker
    from vllm_kvplugin.connector.connector import KVPluginConnector

    monkeypatch.setattr(scheduler, "SchedulerSide", _StubSide)
    monkeypatch.setattr(worker, "WorkerSide", _StubSide)
    return KVPluginConnector


@pytest.mark.parametrize("role_name", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("extra,expected", [({}, None), ({"load_failure_policy": "fail"}, "fail"),
                                            ({"load_failure_policy": "recompute"}, "recompute")])
def test_connector_applies_the_override(connector_cls, role_name, extra, expected):
    from vllm_kvplugin.adapters.api import KVConnectorRole

    o = _overrides()[OVERRIDE]
    version = _vllm_version()
    cfg = _fake_vllm_config(extra)
    before = cfg.kv_transfer_config.kv_load_failure_policy
    assert before == o["vllm_default"]
    connector_cls(cfg, getattr(KVConnectorRole, role_name), None)
    got = cfg.kv_transfer_config.kv_load_failure_policy
    if applies(o["vllm_versions"], version):
        want = expected or o["plugin_default"]
        assert got == want, f"vLLM {version}: the connector left kv_load_failure_policy={got!r}, expected {want!r}"
    else:
        assert got == before, (f"vLLM {version} is outside the override's versions "
                               f"({o['vllm_versions']}) but the connector changed it to {got!r}")
