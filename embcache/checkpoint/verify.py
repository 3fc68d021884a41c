"""Checks that a checkpoint's dense, optimizer and cache state fit the model, optimizers and
caches they are loaded into, made before `embcache.checkpoint.load` applies anything: every
tensor's shape and dtype, the type of every hyper-parameter (an ``lr`` that is a string is
refused here, not by the first step after the load), finite values unless ``allow_nonfinite``,
and slot keys that are rows of their cache's tables, in their sets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from embcache.checkpoint.files import CheckpointError, Snapshot, decode_tree
from embcache.optim.sparse import SparseOptimizer

_SCALARS = (type(None), bool, int, float, str)


def check_finite(tensor: torch.Tensor, where: str, allow_nonfinite: bool) -> None:
    """A CheckpointError naming ``where`` when a floating tensor holds NaN or Inf."""
    if allow_nonfinite or not (tensor.is_floating_point() or tensor.is_complex()):
        return
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(
            f"{where} holds NaN or Inf values (load with allow_nonfinite=True to accept them)"
        )


def dense_state(model: nn.Module, skip: type) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers outside modules of type ``skip`` (the
    cached collections, whose tables are saved row by row, never materialised whole)."""
    state = {}
    for module_name, module in model.named_modules():
        if isinstance(module, skip):
            continue  # (a DistEmbedding has no parameters: its rows live in its KV client)
        prefix = f"{module_name}." if module_name else ""
        for k, v in module.named_parameters(recurse=False):
            state[prefix + k] = v.detach().cpu().clone()
        for k, v in module.named_buffers(recurse=False):
            if k not in module._non_persistent_buffers_set:
                state[prefix + k] = v.detach().cpu().clone()
    return state


def verify_dense(
    snap: Snapshot, entry: object, own: dict[str, torch.Tensor], allow_nonfinite: bool
) -> dict[str, torch.Tensor]:
    """The saved dense state, checked against the model's (``own``: `dense_state`)."""
    dense, _ = snap.tensors(entry, "dense state")
    missing, unexpected = sorted(set(own) - set(dense)), sorted(set(dense) - set(own))
    if missing or unexpected:
        raise ValueError(f"dense state mismatch: missing {missing}, unexpected {unexpected}")
    where = snap.path / str(entry["name"])  # type: ignore[index]
    for k, v in dense.items():
        if v.shape != own[k].shape or v.dtype != own[k].dtype:
            raise CheckpointError(
                f"{where}: {k} is {tuple(v.shape)} {v.dtype}, the model's "
                f"{tuple(own[k].shape)} {own[k].dtype}"
            )
        check_finite(v, f"{where}: {k}", allow_nonfinite)
    return dense


def verify_optimizers(
    snap: Snapshot, entries: list[Any], optimizers: Sequence[Any], allow_nonfinite: bool
) -> list[Any]:
    """Each optimizer's saved state, decoded and checked against the optimizer."""
    states = []
    for i, (entry, opt) in enumerate(zip(entries, optimizers, strict=True)):
        kind = entry["kind"]
        if (kind == "sparse") != isinstance(opt, SparseOptimizer):
            raise ValueError(f"optimizers[{i}]: checkpoint holds a {kind} optimizer")
        tensors, tree = snap.tensors(entry, f"optimizers[{i}]")
        where = f"{snap.path / str(entry['name'])} (optimizers[{i}])"
        state = decode_tree(tree, tensors, where)
        try:
            if kind == "sparse":
                _check_sparse_state(opt, state, allow_nonfinite)
            else:
                _check_torch_state(opt, state, allow_nonfinite)
        except (ValueError, TypeError, KeyError) as err:
            raise CheckpointError(f"{where}: {err}") from None
        states.append(state)
    return states


def _check_value(saved: Any, own: Any, where: str, allow_nonfinite: bool) -> None:
    """``saved`` may replace the optimizer's ``own`` value: the same kind of value (any number
    for a number, a bool or None for a flag, a sequence as long for betas), finite."""
    if own is None or isinstance(own, bool):
        # A flag (``foreach``, ``fused``) may be None or a bool; an unset option any scalar.
        flag = saved is None or isinstance(saved, bool)
        ok = isinstance(saved, _SCALARS) if own is None else flag
    elif isinstance(own, int | float):
        ok = isinstance(saved, int | float) and not isinstance(saved, bool)
        if ok and not allow_nonfinite and not math.isfinite(saved):
            raise ValueError(f"{where} is {saved!r} (allow_nonfinite=True accepts it)")
    elif isinstance(own, list | tuple):
        ok = isinstance(saved, list | tuple) and len(saved) == len(own)
        for k, (a, b) in enumerate(zip(saved, own, strict=False) if ok else ()):
            _check_value(a, b, f"{where}[{k}]", allow_nonfinite)
    elif isinstance(own, torch.Tensor):
        ok = isinstance(saved, torch.Tensor) and (saved.shape, saved.dtype) == (
            own.shape,
            own.dtype,
        )
        if ok:
            check_finite(saved, where, allow_nonfinite)
    else:
        ok = type(saved) is type(own)
    if not ok:
        shown = f"a tensor {tuple(saved.shape)}" if isinstance(saved, torch.Tensor) else saved
        raise TypeError(
            f"{where} is {str(shown)[:80]!r} ({type(saved).__name__}); this optimizer's is "
            f"a {type(own).__name__}"
        )


def _check_group(saved: Any, own: dict[str, Any], where: str, allow_nonfinite: bool) -> None:
    """A saved param group's hyper-parameters against the optimizer's own group (a key the
    optimizer lacks, such as a scheduler's ``initial_lr``, may hold a JSON scalar)."""
    if not isinstance(saved, dict):
        raise ValueError(f"{where} is not a parameter group")
    for k, v in saved.items():
        if k == "params":
            continue
        if not isinstance(k, str):
            raise ValueError(f"{where} has the key {k!r}")
        if k in own:
            _check_value(v, own[k], f"{where}[{k!r}]", allow_nonfinite)
        elif not isinstance(v, _SCALARS):
            raise TypeError(f"{where}[{k!r}] is a {type(v).__name__}, not a JSON scalar")
        elif isinstance(v, float) and not allow_nonfinite and not math.isfinite(v):
            raise ValueError(f"{where}[{k!r}] is {v!r} (allow_nonfinite=True accepts it)")


def _check_sparse_state(opt: SparseOptimizer, state: Any, allow_nonfinite: bool) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("steps"), list):
        raise ValueError("not the state of a sparse optimizer")
    opt.check_hyper_state_dict(state)
    groups = state.get("param_groups", [])
    if not isinstance(groups, list) or len(groups) > 1:
        raise ValueError("param_groups is not a list of one group")
    for group in groups:
        _check_group(group, opt.param_groups[0], "param_groups[0]", allow_nonfinite)
    for module, steps in zip(opt.modules, state["steps"], strict=True):
        names = {t.name for t in module.sparse_tables()}
        if not isinstance(steps, dict) or not all(
            t in names and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for t, n in steps.items()
        ):
            raise ValueError(f"step counts {str(steps)[:80]!r} are not table -> count")


def _check_torch_state(opt: torch.optim.Optimizer, state: Any, allow_nonfinite: bool) -> None:
    """``state`` fits ``opt``: its groups list the same parameters with hyper-parameters of the
    same types, and each parameter's state has the keys, shapes and dtypes of the state the
    optimizer holds (or, before its first step, tensors of the parameter's shape or one
    element such as ``step``)."""
    if not isinstance(state, dict) or set(state) != {"state", "param_groups"}:
        raise ValueError("not a torch optimizer state_dict")
    own = opt.state_dict()
    groups = state["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(own["param_groups"]):
        raise ValueError(
            f"{len(groups)} parameter groups, the optimizer has {len(opt.param_groups)}"
        )
    for g, (saved, mine) in enumerate(zip(groups, own["param_groups"], strict=True)):
        if not isinstance(saved, dict) or saved.get("params") != mine["params"]:
            raise ValueError(f"parameter group {g} lists other parameters")
        _check_group(saved, mine, f"param_groups[{g}]", allow_nonfinite)
    params = [p for group in opt.param_groups for p in group["params"]]
    if not isinstance(state["state"], dict):
        raise ValueError("'state' is not a dict")
    for index, saved in state["state"].items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"state of parameter {index!r}, which the optimizer lacks")
        if not isinstance(saved, dict):
            raise ValueError(f"state[{index}] is not a dict")
        live, param = own["state"].get(index), params[index]
        if live is not None and set(saved) != set(live):
            raise ValueError(f"state[{index}] holds {sorted(saved)}, the optimizer {sorted(live)}")
        for key, value in saved.items():
            where = f"state[{index}][{key!r}]"
            if live is not None:
                _check_value(value, live[key], where, allow_nonfinite)
            elif isinstance(value, torch.Tensor):
                if value.numel() != 1 and (
                    value.shape != param.shape or value.dtype != param.dtype
                ):
                    raise ValueError(
                        f"{where} is {tuple(value.shape)} {value.dtype}, the parameter "
                        f"{tuple(param.shape)} {param.dtype}"
                    )
                check_finite(value, where, allow_nonfinite)
            else:
                _check_group({key: value}, {}, f"state[{index}]", allow_nonfinite)


def verify_caches(
    snap: Snapshot, manifest: dict[str, Any], holders: dict[str, Any]
) -> list[tuple[Any, dict[str, torch.Tensor], dict[str, Any]]]:
    """The caches' saved states, checked (`HotCache.check_policy_state`), with the caches they
    belong to. A module whose tables were saved in another order (its caches' slot keys
    number tables by position) or whose caches differ, or a checkpoint written before caches
    were saved, restores none: those caches start empty."""
    saved_order: dict[str, list[str]] = {}
    for entry in manifest["tables"]:
        saved_order.setdefault(entry["module"], []).append(entry["table"])
    out = []
    for k, entry in enumerate(manifest.get("caches", [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("cache"), int):
            raise CheckpointError(f"{snap.path / 'manifest.json'}: malformed cache entry {k}")
        holder = holders.get(entry.get("module"))  # type: ignore[arg-type]
        if holder is None or saved_order.get(entry["module"]) != holder.tables:
            continue
        caches = holder.caches()
        if not 0 <= entry["cache"] < len(caches):
            continue
        tensors, meta = snap.tensors(entry, f"cache {k}")
        cache = caches[entry["cache"]]
        where = snap.path / str(entry["name"])
        if not isinstance(meta, dict):
            raise CheckpointError(f"{where}: malformed cache state")
        try:
            fits = cache.check_policy_state(tensors, meta)
        except ValueError as err:
            raise CheckpointError(f"{where}: {err}") from None
        if fits:
            out.append((cache, tensors, meta))
    return out
