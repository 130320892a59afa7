"""Do the compiled ops raise Python errors (and not crash) on bad input?

Each case runs in its own interpreter, so a crash (a signal) is reported
instead of ending the check.  Exit status 1 if any case crashed or did not
raise.  Run on the device machine right after the build: a toolchain whose
exception handling does not match torch's shows up here first.
"""

from __future__ import annotations

import subprocess
import sys

PRELUDE = """
import torch
from vllm_kvplugin import ops
ops.load()
def expect(fn, text):
    try:
        fn()
    except RuntimeError as e:
        assert text in str(e), str(e)
        print("raised:", str(e).splitlines()[0][:100])
        return
    raise SystemExit("did not raise")
"""

CASES = {
    "cpu op, slot out of range": """
layer = torch.zeros(4, 1, 16, 8)
out = torch.zeros(1, 1, 2, 16, 1, 4)
slots = torch.full((1, 16), 64, dtype=torch.int64)
expect(lambda: torch.ops.kvplugin.gather([layer], slots, [128, 128, 8, 128, 4, 1], 16, 16, 4, out),
       "outside the cache")
""",
    "cuda op, argument check": """
out = torch.zeros(1, 1, 2, 16, 1, 4, device="cuda")
slots = torch.zeros((1, 16), dtype=torch.int64, device="cuda")
expect(lambda: torch.ops.kvplugin.gather([], slots, [128, 128, 8, 128, 4, 1], 16, 16, 4, out),
       "layers given")
""",
    "cuda op, slot out of range": """
layer = torch.zeros(4, 1, 16, 8, device="cuda")
out = torch.zeros(1, 1, 2, 16, 1, 4, device="cuda")
slots = torch.full((1, 16), 64, dtype=torch.int64, device="cuda")
expect(lambda: torch.ops.kvplugin.gather([layer], slots, [128, 128, 8, 128, 4, 1], 16, 16, 4, out),
       "outside the cache")
""",
    "gather_multi, slot out of range": """
layer = torch.zeros(4, 1, 16, 8, device="cuda")
out = torch.zeros(1, 1, 2, 16, 1, 4, device="cuda")
slots = torch.full((1, 16), -2, dtype=torch.int64)
expect(lambda: torch.ops.kvplugin.gather_multi([layer], slots, [128, 128, 8, 128, 4, 1], 16, 16, 4,
                                               [out], 0), "outside the cache")
""",
    "gather_multi, pageable host buffer": """
layer = torch.zeros(4, 1, 16, 8, device="cuda")
out = torch.zeros(1, 1, 2, 16, 1, 4)
slots = torch.zeros((1, 16), dtype=torch.int64)
expect(lambda: torch.ops.kvplugin.gather_multi([layer], slots, [128, 128, 8, 128, 4, 1], 16, 16, 4,
                                               [out], 0), "page-locked")
""",
}


def main() -> int:
    bad = 0
    for name, body in CASES.items():
        p = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True,
                           timeout=120)
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
        status = "ok" if p.returncode == 0 else (
            f"CRASH (signal {-p.returncode})" if p.returncode < 0 else f"FAILED rc={p.returncode}")
        bad += p.returncode != 0
        print(f"{name:38s} {status:18s} {tail[0][:110]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
