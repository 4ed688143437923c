"""Scale factors loaded with cp.async instead of TMA.

The scale-factor tiles are small (1 KiB per operand per stage); some drivers and tools
handle TMA descriptors of 16-bit-viewed scale tensors poorly. This loads them with 16-byte
cp.async copies by the producer warp into the same shared-memory layout and barrier, so the
two paths can be compared (and one kept as a fallback).
"""

from cute_fp4.schedule import Schedule, SFLoad, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128), sf_load=SFLoad.CP_ASYNC)
