"""128x128x64: half-depth K steps, seven stages in flight.

Each stage is 9 KiB, so seven fit: more loads in flight per CTA, at the cost of twice as
many barrier round trips per K. Good for long K with modest L2 hit rates.
"""

from cute_fp4.schedule import Schedule, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 64))
