"""Small-N tile 128x64x128: twice the tiles when N is small.

When N is the small side (narrow projections, or A and B swapped for decode) 64-column
tiles double the number of CTAs. The accumulators halve, so the 4x2 warps each hold a
32x32 piece.
"""

from cute_fp4.schedule import Schedule, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 64, 128))
