"""The device's memory bandwidth, against which a decoding run's weight reads are set (the memory roofline).

Decoding a batch reads every target weight once per target forward, so weight bytes x forwards per second, over the
device's bandwidth, is the fraction of the roofline a run reaches. Known accelerators take their data-sheet peak;
any other device (a CPU) is measured once with a large array copy and cached under `$SPECJAX_CACHE/bandwidth`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.host import cached_measurement
from specjax.measure.timing import median_seconds

# `device_kind` (lowercase) -> peak memory bandwidth in bytes/s, from the vendors' data sheets.
KNOWN_BANDWIDTH = {
    "nvidia h200": 4.8e12,
    "nvidia h200 nvl": 4.8e12,
    "nvidia h100 80gb hbm3": 3.35e12,  # H100 SXM
    "nvidia h100 nvl": 3.9e12,
    "nvidia h100 pcie": 2.0e12,
    "nvidia a100-sxm4-80gb": 2.039e12,
    "nvidia a100 80gb pcie": 1.935e12,
    "nvidia a100-sxm4-40gb": 1.555e12,
    "nvidia l4": 0.3e12,
    "nvidia a10g": 0.6e12,
    "tpu v4": 1.2e12,
    "tpu v5 lite": 0.819e12,  # TPU v5e
    "tpu v5": 2.765e12,  # TPU v5p
    "tpu v6 lite": 1.64e12,  # TPU v6e (Trillium)
}
COPY_BYTES = 256 * 2**20  # the measured copy: far past any CPU cache
COPY_METHOD = "in-place add"  # part of the cache key: a figure measured another way is measured again


def device_bandwidth() -> tuple[float, str]:
    """(bytes/s, "data sheet" or "measured") of the first device."""
    known = KNOWN_BANDWIDTH.get(jax.devices()[0].device_kind.lower())
    if known:
        return known, "data sheet"
    return cached_measurement("bandwidth", {"method": COPY_METHOD}, copy_bandwidth), "measured"


def copy_bandwidth(nbytes: int = COPY_BYTES, reps: int = 5) -> float:
    """Bytes/s of a large array copy on the device (each byte read once and written once), median of `reps`.

    The array is donated, so every copy writes into memory already touched: a fresh 256 MB output per call spends
    most of its time in page faults (on a 2-core CPU, 3.5 GB/s against 46 GB/s in place)."""
    add = jax.jit(lambda a: a + 1, donate_argnums=0)  # an add, so that XLA cannot turn the copy into an alias
    state = [jnp.ones((nbytes // 4,), jnp.float32)]

    def copy():
        state[0] = add(state[0])
        return state[0]

    return 2 * nbytes / median_seconds(copy, reps)
