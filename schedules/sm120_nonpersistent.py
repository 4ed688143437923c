"""One CTA per output tile (no persistent loop).

The simplest launch: no tile scheduler state, no cross-tile overlap. The baseline the
persistent schedules are measured against, and a fallback if a persistent variant misbehaves.
"""

from cute_fp4.schedule import Schedule, Scheduler, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128),
                    scheduler=Scheduler(persistent=False))
