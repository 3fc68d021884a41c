"""The GPU preflight's part of the plan family (`ops.registry.family_preflight`): the family's
Triton kernels are checked by `benchmarks/gpu_preflight.py`'s own checks on its shared batch;
the operations below run no Triton kernel (the compiled CPU plan of a cache with a row
index)."""

ON_HOST = {
    op: "the compiled CPU plan (numba)"
    for op in ("plan_lru", "plan_lfu", "touch_lfu", "reserve", "scratch_done", "free_slots")
}
