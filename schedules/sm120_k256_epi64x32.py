"""128x128x256 with a 64x32 epilogue tile: deep K steps that still double-buffer.

A 256-deep stage is 36 KiB. With a whole-tile epilogue buffer only one stage fits (no
overlap of loads and MMAs: the trap plan() warns about); a 64x32 epilogue tile leaves room
for two. Fewer barrier waits per K than 128x128x128.
"""

from cute_fp4.schedule import Epilogue, Schedule, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 256), epilogue=Epilogue(tile=(64, 32)))
