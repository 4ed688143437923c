"""An SM100 tile ported to SM120 as-is: 256x128x256. Kept to show the refusal.

SM100 has 227 KiB of shared memory per block; SM120 has 99 KiB. This tile needs 54 KiB per
stage plus a 64 KiB epilogue buffer: it cannot fit even one stage, and libraries that
shipped such configurations to SM120 failed to launch or returned garbage. plan() refuses
it with the byte counts before anything is compiled.
"""

from cute_fp4.schedule import Schedule, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(256, 128, 256))
