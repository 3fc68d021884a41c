"""The GPU preflight's part of the ids family (`ops.registry.family_preflight`): the family's
Triton kernels are checked by `benchmarks/gpu_preflight.py`'s own checks on its shared batch;
the operations below run no Triton kernel (a CPU cache's compiled passes)."""

ON_HOST = {
    "first_bad_key": "a CPU cache's check of its keys",
    "row_dedup": "a CPU cache's dedup through its row index",
    "direct_rows": "a direct CPU cache's share on FBGEMM's CPU TBE (its distinct rows)",
    "bags_sample_major": "the indices of FBGEMM's CPU TBE (bags moved sample-major)",
}
