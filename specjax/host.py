"""Facts about the host that every layer may read: the device's identity, the cache folder, cached measurements,
and the status lines of long steps.

The ground floor: it imports nothing else from specjax but its errors. Every file specjax writes goes through
`write_file` or `append_text`: atomic where it replaces, never through a link, one OutputError line when the disk
refuses. A measurement is cached under a key that names the device
(`machine`) and everything else it depends on, so a figure taken on one machine is never read on another.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from specjax.errors import OutputError

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


def start_distributed(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None):
    """Joins a multi-process run (`jax.distributed.initialize`): with a coordinator HOST:PORT given, or one named by
    JAX_COORDINATOR_ADDRESS (the rest auto-detected on TPU pods, SLURM, MPI, Kubernetes); a single-process run
    otherwise. Call before anything touches a device."""
    if coordinator is None and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # how CPU devices of processes reduce
    jax.distributed.initialize(coordinator, num_processes, process_id)


def cache_dir() -> Path:
    """The specjax cache: `$SPECJAX_CACHE`, else `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`. A cache is an
    optimisation: when that folder cannot be made or written, a warning and a temporary folder for this process."""
    if os.environ.get("SPECJAX_CACHE"):
        return _usable_cache(os.environ["SPECJAX_CACHE"])
    return _usable_cache(str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specjax"))


@functools.cache
def _usable_cache(folder: str) -> Path:
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        return Path(folder)
    except OSError as e:
        fallback = Path(tempfile.mkdtemp(prefix="specjax-cache-"))
        log.warning(f"warning: the cache {folder} is unusable ({e.strerror}); this run caches in {fallback}")
        return fallback


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
    now and written there, beside the signature it was taken under. An unreadable entry is measured again and
    rewritten; one that cannot be written is a warning."""
    signature = {"machine": machine(), **signature}
    key = hashlib.sha256(f"{kind} {json.dumps(signature, sort_keys=True)}".encode()).hexdigest()[:20]
    path = cache_dir() / kind / f"{key}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))["value"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            log.warning(f"warning: ignoring the unreadable cache entry {path}; measuring again")
    value = measure()
    try:
        write_file(path, json.dumps({**signature, "value": value}, indent=1))
    except OutputError as e:
        log.warning(f"warning: {e}; the {kind} is not cached")
    return value


_UMASK = os.umask(0)
os.umask(_UMASK)


def write_file(path: str | os.PathLike, content: str | bytes | Callable[[str], None]) -> None:
    """Writes `path` (and its folder) atomically, never through a link: into a fresh temporary file beside it
    (created exclusively), then renamed over `path`, which replaces a link there rather than following it.

    Args:
      path: the file.
      content: text (UTF-8), bytes, or a function that writes the file whose name it is given (the name ends in
        `path`'s suffix, for writers that read the format from it).
    Raises:
      OutputError naming the file when the disk refuses (full, read-only, no permission); `path` is then untouched.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            if not callable(content):
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
        if callable(content):
            content(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def append_text(path: str | os.PathLike, text: str) -> None:
    """Appends `text` to `path` (created if absent), never through a link; OutputError when the disk refuses."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OutputError(f"{path} is a symbolic link; specjax does not write through links: remove it") from None
        raise OutputError(f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror}") from None


GIB = 2**30


def device_memory() -> int:
    """Bytes the device can hold: its allocator's limit on a GPU or TPU, the machine's available RAM on the CPU."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"])
    with open("/proc/meminfo", encoding="utf-8") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib * 1024
