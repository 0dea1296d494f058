"""The backends this machine has: the native kernel when it builds here (built once per session
if torch's extension cache does not hold it yet), and which of mha's own tiled backends auto
picks where torch's kernel declines: native when built, else flash. Dispatch tests expect these."""

from mha.kernels import native

NATIVE = native.native_available()
ALL = ("math", "sdpa", "flash", *(("native",) if NATIVE else ()))
TILED = "native" if NATIVE else "flash"
TILED_REASON = {"native": "native applies every term tile by tile, compiled",
                "flash": "flash applies every term tile by tile"}[TILED]
