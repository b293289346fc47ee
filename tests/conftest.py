import os

# Tests run on the CPU in float32; XLA must not grab all cores' worth of threads per process beyond what is there.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
