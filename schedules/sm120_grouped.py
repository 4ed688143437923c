"""SM120 MoE experts (W4A4): the default 128x128x128 tile with a grouped scheduler.

Persistent CTAs walk every expert's tiles from the device-side offsets of the tokens
sorted by expert (no host sync). A's scale factors are copied row by row (cp.async) so an
expert may start at any row of the activations' ordinary 128x4 scale layout (no
per-expert padding); B and its scales come per expert by TMA (a leading expert mode). The
tile is stored from registers, masked at the expert's last row, so there is no C staging
buffer: five stages fit in 99 KiB (three in the dense default).
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128),
                    scheduler=Scheduler(grouped=True))
