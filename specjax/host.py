"""Facts about the host that every layer may read: the device's identity, the cache folder, cached measurements,
and the status lines of long steps.

The ground floor: it imports nothing else from specjax. A measurement is cached under a key that names the device
(`machine`) and everything else it depends on, so a figure taken on one machine is never read on another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

# The vector extensions that decide a CPU's matmul speed. Cloud CPUs often share one model name ("AMD EPYC")
# across generations that differ 2-3x per token, so the key names them too.
CPU_ISA_MARKERS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "asimd", "sve")


# Steps that take more than a few seconds (loading, converting, compiling, calibrating) say so on stderr, one line
# each, through the "specjax" logger: `logging.getLogger("specjax").setLevel(logging.WARNING)` silences them.
log = logging.getLogger("specjax")
if not log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(message)s]"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def status(message: str) -> None:
    """One line on stderr saying what a long step is doing (see `log`)."""
    log.info(message)


def cache_dir() -> Path:
    """The specjax cache: `$SPECJAX_CACHE`, else `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`."""
    if os.environ.get("SPECJAX_CACHE"):
        return Path(os.environ["SPECJAX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specjax"


def machine(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The device this process computes on: the accelerator kind, or the CPU model, core count and vector
    extensions."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.platform}:{device.device_kind}"
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            info = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in f)}
    except OSError:
        info = {}
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", info.get("Features", "")).split())  # x86 / ARM
    isa = ",".join(m for m in CPU_ISA_MARKERS if m in flags)
    return f"cpu:{model}:{os.cpu_count()}:{isa}"


def cached_measurement(kind: str, signature: dict[str, Any], measure: Callable[[], Any]) -> Any:
    """The value `measure()` returned for this signature on this machine: read from `cache_dir()/kind`, else measured
    now and written there atomically, beside the signature it was taken under."""
    signature = {"machine": machine(), **signature}
    key = hashlib.sha256(f"{kind} {json.dumps(signature, sort_keys=True)}".encode()).hexdigest()[:20]
    path = cache_dir() / kind / f"{key}.json"
    if path.is_file():
        return json.loads(path.read_text())["value"]
    value = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**signature, "value": value}, indent=1))
    os.replace(tmp, path)
    return value
