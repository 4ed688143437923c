"""Planning rules, one module per kernel family (``sm120``, ``sm90``) over ``common``.

Each family module is pure arithmetic: the shared-memory regions its kernels allocate, the
threads and setmaxnreg register split of its CTA, and small named checks saying what the
family refuses (each returns reasons with numbers). ``cute_fp4.plan`` is the driver: it
picks the module of the schedule's target family and runs it; it never branches on the
family itself.
"""
