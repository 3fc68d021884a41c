"""The GPU preflight's part of the rows family (`ops.registry.family_preflight`): the family's
Triton kernels are checked by `benchmarks/gpu_preflight.py`'s own checks on its shared batch;
the operations below run no Triton kernel (on a GPU cache, torch ops; on a CPU, the compiled
passes)."""

ON_HOST = {
    op: "a write, unlock, draw or grouping on the host (torch ops on a GPU cache)"
    for op in (
        "fill_at", "add_at", "copy_rows", "scatter_split", "gather_join", "unlocks_checked",
        "unlock_slots", "hashed_uniform", "group_by_table",
    )
}  # fmt: skip
