"""SM12x MoE experts on MXFP4 (gpt-oss), W4A4: the grouped kernel with ``kind::mxf4``.

The grouped scheduler of sm120_grouped (device-side expert offsets, A's UE8M0 scales
copied row by row so an expert starts at any row) on MXFP4 activations and weights; tile K
128, one scale atom per row block and stage.
"""

from cute_fp4.schedule import Problem, Schedule, Scheduler, Tile

SCHEDULE = Schedule(target="sm_120a", tile=Tile(128, 128, 128),
                    scheduler=Scheduler(grouped=True))
PROBLEM = Problem(a_format="mxfp4", b_format="mxfp4")  # W4A4: MXFP4 activations
