"""vLLM's weights reloaded as one group of copies: the copies its own loader makes, recorded once and checked.

vLLM 0.26's `reload_weights` (the layerwise loader) materialises each layer anew, loads into it, and copies the
result back into the running parameters, many times slower than a raw copy of the same bytes
(docs/performance.md). For an unquantized model the loaders end in plain copies from the checkpoint's tensors
into slices of the running parameters (q, k, v into rows of qkv_proj; gate, up into gate_up_proj).
`CopyPlan.record` runs the model's own `load_weights` once and records those copies (a TorchFunctionMode sees
every `Tensor.copy_`); a later load replays them with the new tensors into the same views, the cast to the
engine's dtype included, as one `torch._foreach_copy_`.

A plan is used only once it is checked; otherwise `record` says why and the engine keeps vLLM's reload:
- every write to a parameter during the load is a copy of a whole incoming tensor (no cast, slice or
  arithmetic of its own on the way: the replay could not repeat it), or a constant fill (an embedding's
  padding rows past the vocabulary), which the replay repeats;
- the writes' targets cover every element of every parameter exactly once;
- the parameters after the recorded load equal, bit for bit, those after vLLM's own reload of the same weights.
Weights dropped by sleep mode come back at the same addresses (vLLM's CuMem allocator remaps them), so the
recorded views stay valid across sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class _Recorder(TorchFunctionMode):
    """Sees every torch call of a load: copies of a whole incoming tensor into a parameter and constant fills are
    kept, any other write to a parameter's memory is a problem."""

    WRITES = ("__setitem__",)  # besides in-place methods (a trailing underscore)
    NOT_WRITES = ("requires_grad_", "share_memory_", "retain_grad")

    def __init__(self, inputs: dict[tuple, str], params: dict[int, str]):
        super().__init__()
        self.inputs, self.params = inputs, params
        self.copies: list[tuple[str, str, torch.Tensor]] = []  # (input name, parameter name, target view)
        self.fills: list[tuple[str, torch.Tensor, float]] = []  # (parameter name, target view, constant)
        self.problems: list[str] = []

    def _param(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        return self.params.get(t.untyped_storage().data_ptr())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.startswith("_") and name not in self.NOT_WRITES
        if args and (in_place or name in self.WRITES):
            target = self._param(args[0])
            if target is not None and name in ("fill_", "zero_"):  # a loader's padding rows: repeated as they are
                value = 0 if name == "zero_" else (args[1] if len(args) > 1 else kwargs.get("value"))
                if isinstance(value, (int, float)):
                    self.fills.append((target, args[0], value))
                else:
                    self.problems.append(f"{name} into {target} with a tensor value")
            elif target is not None:
                src = args[1] if len(args) > 1 else kwargs.get("src")
                source = self.inputs.get(_key(src)) if name == "copy_" and isinstance(src, torch.Tensor) else None
                if source is None:
                    self.problems.append(f"{name} into {target} not from a whole incoming tensor")
                else:
                    self.copies.append((source, target, args[0]))
        return func(*args, **kwargs)


@dataclass
class CopyPlan:
    sources: list[str]  # incoming tensor names, one per copy (a name may feed several targets)
    targets: list[torch.Tensor]  # views of the running parameters
    fills: list[tuple[torch.Tensor, float]]  # constants the loader writes (an embedding's padding rows)

    @classmethod
    def record(cls, model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> tuple[CopyPlan | None, str]:
        """Load `items` with the model's own `load_weights`, recording its copies. Call it right after vLLM's
        reload of the same `items`: the parameters must come out unchanged. (plan, "") or (None, why not)."""
        params = dict(model.named_parameters())
        storages = {n: p.untyped_storage().data_ptr() for n, p in params.items()}
        before = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        rec = _Recorder({_key(t): n for n, t in items}, {ptr: n for n, ptr in storages.items()})
        with torch.no_grad(), rec:
            model.load_weights(iter(items))
        moved = [n for n, p in model.named_parameters() if storages.get(n) != p.untyped_storage().data_ptr()]
        if moved:
            return None, f"the load gave {moved[0]} new memory (the recorded views would point at the old)"
        if rec.problems:
            return None, f"{len(rec.problems)} write(s) a replay cannot repeat, e.g. {rec.problems[0]}"
        fills = [(view, value) for _, view, value in rec.fills if view.numel()]
        spans = [(name, view) for _, name, view in rec.copies] + [(name, view) for name, view, _ in rec.fills]
        if why := _uncovered(params, spans):
            return None, why
        changed = [n for n, p in params.items() if not torch.equal(p.detach().cpu(), before[n])]
        if changed:
            return None, f"the model's load_weights gave other values than vLLM's reload for {changed[0]}"
        return cls([s for s, _, _ in rec.copies], [t for _, _, t in rec.copies], fills), ""

    def apply(self, state: dict[str, torch.Tensor]) -> None:
        for view, value in self.fills:  # disjoint from the copies' targets (checked): order does not matter
            view.fill_(value)
        sources = [state[n] for n in self.sources]
        device = self.targets[0].device
        if all(s.device == device for s in sources):
            torch._foreach_copy_(self.targets, sources)  # one group of launches, the casts included
        else:  # host tensors (the object-store path): one copy each, bound by the transfer anyway
            for t, s in zip(self.targets, sources):
                t.copy_(s)


def _uncovered(params: dict[str, torch.Tensor], writes: list[tuple[str, torch.Tensor]]) -> str:
    """Why the writes' targets (parameter name, view) do not cover every parameter element exactly once; "" when
    they do."""
    spans: dict[str, list[tuple[int, int]]] = {n: [] for n in params}
    for name, view in writes:
        if not view.numel():
            continue
        if not view.is_contiguous():
            return f"a write into {name} targets a non-contiguous view"
        first = view.storage_offset() - params[name].storage_offset()
        spans[name].append((first, first + view.numel()))
    for name, parts in spans.items():
        end = 0
        for lo, hi in sorted(parts):
            if lo != end:
                return f"the writes into {name} {'overlap' if lo < end else 'leave a gap'} at element {min(lo, end)}"
            end = hi
        if end != params[name].numel():
            return f"the writes into {name} cover {end} of its {params[name].numel()} elements"
    return ""
