"""Module and gradient hooks: they tell the coordinator when a unit starts and ends.

Owns the hooks on a partitioned model, one record per module call (`_Call`: its unit, trace
positions, `CallState`, and the inputs and gradients its backward still waits for) and the
stack of running calls. It decides no policy and never changes the iteration's phase:
gathering, releasing and the lifecycle are the coordinator's.

[Note: backward] Autograd keeps leaf parameters by reference, so a module's parameters must be
gathered again before its backward runs. In forward, each module call with a gather set puts a
gradient hook on its outputs (fires before the module's backward: gather, FORWARD -> GATHERED;
the first one may begin the coordinator's backward) and on its inputs that require grad (fires
after it: GATHERED -> DONE, release per the reuse rule). A call whose inputs need no gradient
(the embedding of token ids) ends instead when its trainable parameters' gradients have been
accumulated; anything left is released when the backward ends. Backward pins
nothing past the gather: a weight evicted under budget pressure before an op reads it is
gathered again by the saved-tensor hooks, and one evicted before autograd accumulates its
gradient (accumulation checks the parameter's shape) by a tensor hook on the parameter; a
trainable parameter is released only once its gradient has been accumulated. Activation
checkpointing re-runs forwards inside backward: the pre-forward hook gathers and pins there
too, and the post-forward hook only unpins (the recomputed graph still needs the weights).
Non-reentrant checkpointing stops its recomputation with an exception, hence `always_call`.
It also keeps what the recomputed ops save, detaching only tensors that require grad, so a
frozen parameter (a LoRA base's norm weight) would be kept as the parameter itself and seen
empty once the budget evicts it: during a recomputation `GatherOnUse` hands torch functions
frozen parameters as detached views of their gathered buffers instead (a view holds its
buffer until that op's backward, as the detached view of a trainable weight does).
Autograd runs backward nodes without the caller's torch-function modes (the engine's
`GatherOnUse` is not on the stack there, whether backward came from the engine or a plain
`loss.backward()`), so a recomputed call enters it for its own duration.

[Note: saved weights] Autograd saves a leaf parameter by reference, but many ops save a view
of it instead (`F.linear` saves `weight.t()`), and a view keeps the gathered buffer alive
after release, so the memory would stay in use until backward. While the engine runs, a
`saved_tensors_hooks` pair packs any saved tensor that lives in a gathered buffer as (record,
size, stride, offset) and rebuilds the view from the parameter's current buffer on unpack,
gathering it first if needed. Released parameters therefore really free their memory, and
backward always reads the gathered copy. Where gathers alias their host homes (the CPU
device) every home is a range of one flat buffer, so a saved tensor is matched to its
parameter by address (`infinity.zero.gathered`), and its offset is kept relative to the
parameter's own.

[Note: parameters used outside their module] `GatherOnUse` is a TorchFunctionMode active
during the engine's forward and backward. A torch function that receives a parameter not
owned by the innermost running module (`F.linear(x, self.embed.weight)` in a parent) runs as
a unit of its own: its parameters are gathered right before it (the trace records the use,
so later iterations prefetch it), gradient hooks on its inputs and outputs bring them back for
its backward, and they are released right after unless reused soon. The parameter is never
held for the whole forward of the module that borrowed it.

[Note: fused kernels] `Function.apply` (TRL's fused LM head) is no torch function, and
autograd records an input parameter's shape when it is applied: the parameter must be
gathered by then. `begin_external_call` / `end_external_call` bracket such code as a call
of a unit of its own: gathered and pinned throughout, hooked for backward as a module call.

[Note: the hooks' own work] The hooks call the coordinator, whose tensor work (copies,
views) must not be taken for the model's use of a parameter. Every hook body that does such
work runs inside `ModelHooks.own_work()` (the `_own_work` decorator on whole methods), which
GatherOnUse passes through; it nests, and restores what it found.

[Note: what lives for one iteration] The stack of running calls and the gradients waited
for belong to one iteration: `reset` subscribes to the coordinator's `on_end`, so they are
forgotten whenever the iteration closes or aborts, never by hand.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils import _pytree as pytree

from infinity.accelerator import Accelerator
from infinity.zero.coordinator import Coordinator
from infinity.zero.grad_reduce import GradReducer
from infinity.zero.iteration import Phase
from infinity.zero.param import OffloadParam, ParamState
from infinity.zero.unit import ModuleUnit


class _SavedWeight:
    """A tensor autograd saved that lives in a parameter's gathered buffer."""

    __slots__ = ("rec", "size", "stride", "offset", "dtype")

    def __init__(self, rec, size, stride, offset, dtype) -> None:
        self.rec = rec
        self.size = size
        self.stride = stride
        self.offset = offset
        self.dtype = dtype


class CallState(enum.Enum):
    """Where one module call stands in the backward (see [Note: backward])."""

    FORWARD = "forward"
    """It ran forward; no gradient has reached its outputs yet."""
    GATHERED = "gathered"
    """A gradient reached its outputs: its parameters were gathered for its backward."""
    DONE = "done"
    """Its backward ran: its parameters were settled, except those in `grads_pending`,
    which are settled when autograd has accumulated their gradients."""


class _Call:
    """One call of one module: everything the hooks know about it."""

    __slots__ = (
        "unit",
        "pos",
        "bw_pos",
        "state",
        "inputs_pending",
        "grads_pending",
        "entered_mode",
    )

    def __init__(self, unit: ModuleUnit, pos: int | None) -> None:
        self.unit = unit
        self.pos = pos
        """Trace position of its forward gather (None off the trace)."""
        self.bw_pos: int | None = None
        """Trace position of its backward gather: where its parameters are settled from."""
        self.state = CallState.FORWARD
        self.inputs_pending = 0
        """Inputs needing gradients whose gradient autograd has not computed yet."""
        self.grads_pending: set[OffloadParam] = set()
        """Trainable parameters of its unit whose gradient has not been accumulated yet."""
        self.entered_mode = False
        """Its pre-forward hook entered GatherOnUse (a recomputation inside backward)."""


def _own_work(method):
    """Run a `ModelHooks` method as the hooks' own work (see [Note: the hooks' own work])."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.own_work():
            return method(self, *args, **kwargs)

    return run


def _grad_tensors(obj, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors requiring grad in `obj` (tensors, and tuples/lists/dicts of them, walked by
    `torch.utils._pytree`), appended to `out`. Parameters are left out: a hook on one would
    outlive the iteration."""
    for t in pytree.tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.requires_grad and not isinstance(t, nn.Parameter):
            out.append(t)
    return out


class ModelHooks:
    """All hooks on one partitioned model."""

    def __init__(
        self,
        model: nn.Module,
        units: dict[nn.Module, ModuleUnit],
        by_param: dict[nn.Parameter, OffloadParam],
        coordinator: Coordinator,
        *,
        enter_backward: Callable[[], object],
    ) -> None:
        """`enter_backward` is called with the first gradient that reaches a module's
        outputs (`BackwardEntry.enter`, the one place a backward begins)."""
        self.units = units
        self.by_param = by_param
        self.coord = coordinator
        self.enter_backward = enter_backward
        self.stack: list[_Call] = []
        self.busy = False
        """True while a hook does its own work (see [Note: the hooks' own work])."""
        self._external: dict[object, ModuleUnit] = {}  # parameter(s) used outside -> unit
        self._waiting: dict[OffloadParam, list[_Call]] = {}
        """Per trainable parameter, the calls whose `grads_pending` holds it: how an
        accumulated gradient finds its calls (their state is on the calls)."""
        self._accumulated: set[OffloadParam] = set()
        """Parameters whose gradient this backward has accumulated."""
        self._handles: list = []
        for module in model.modules():
            self._handles.append(
                module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
            )
            # always_call: a forward that raises still ends its call (non-reentrant activation
            # checkpointing stops its recomputation early with an exception).
            self._handles.append(
                module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
            )
        self.mode = GatherOnUse(self)
        coordinator.on_end.append(self.reset)

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
        """The hooks' own tensor work runs inside: GatherOnUse lets it through."""
        before, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = before

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget running calls: the iteration ended (see [Note: what lives for one
        iteration])."""
        self.stack.clear()
        self._waiting.clear()
        self._accumulated.clear()

    # ---- forward ----------------------------------------------------------------------

    @_own_work
    def _pre_forward(self, module: nn.Module, args, kwargs):
        call = self._enter(self.units[module], args, kwargs)
        if self.coord.phase is Phase.BACKWARD and not self.mode.active():
            self.mode.__enter__()  # a recomputation after a plain loss.backward()
            call.entered_mode = True
        self.stack.append(call)

    def _enter(self, unit: ModuleUnit, args, kwargs) -> _Call:
        pos = self.coord.gather(unit) if unit.records else None
        call = _Call(unit, pos)
        if unit.records and torch.is_grad_enabled():
            inputs = _grad_tensors(kwargs, _grad_tensors(args, []))
            call.inputs_pending = len(inputs)
            for t in inputs:
                t.register_hook(self._input_hook(call))
        return call

    def _post_forward(self, module: nn.Module, args, kwargs, output):
        if not self.stack or self.stack[-1].unit is not self.units[module]:
            return  # its pre-forward hook raised (the error in flight says why): no call to end
        call = self.stack.pop()
        try:
            with self.own_work():
                self._exit(call, output)
        finally:
            if call.entered_mode:
                self.mode.__exit__(None, None, None)

    def _exit(self, call: _Call, output) -> None:
        unit = call.unit
        if not unit.records:
            return
        if torch.is_grad_enabled():
            outputs = _grad_tensors(output, [])
            if outputs:
                hook = self._output_hook(call)
                for t in outputs:
                    t.register_hook(hook)
        self.coord.done(unit, call.pos, release=self.coord.phase is not Phase.BACKWARD)

    # ---- backward ---------------------------------------------------------------------

    def _output_hook(self, call: _Call):
        def hook(grad: torch.Tensor) -> None:
            if call.state is not CallState.FORWARD:
                return
            with self.own_work():
                # The first gradient may reach a module before the engine's entry sees it:
                # the root module's outputs are the engine's, and tensor hooks run in order.
                try:
                    self.enter_backward()
                except RuntimeError as e:
                    raise RuntimeError(f"backward of module {call.unit.name!r}: {e}") from None
                call.state = CallState.GATHERED
                call.bw_pos = self.coord.gather(call.unit, pin=False)
            pending = {r for r in call.unit.records if r.trainable and r not in self._accumulated}
            call.grads_pending = pending
            # With no input needing a gradient (the embedding of token ids) the call ends
            # when its gradients have been accumulated, or with the backward if it has none.
            for rec in pending:
                self._waiting.setdefault(rec, []).append(call)

        return hook

    def _input_hook(self, call: _Call):
        def hook(grad: torch.Tensor) -> None:
            call.inputs_pending -= 1
            if call.inputs_pending == 0 and call.state is CallState.GATHERED:
                self._finish(call)

        return hook

    @_own_work
    def _finish(self, call: _Call) -> None:
        """The call's backward is over. A trainable parameter whose gradient autograd has not
        accumulated yet stays gathered until it has (accumulation needs its shape); it may
        still be evicted under budget pressure and is gathered again for accumulation then."""
        call.state = CallState.DONE
        for rec in call.unit.records:
            if rec not in call.grads_pending:
                self.coord.settle(rec, call.bw_pos)

    def before_accumulate(self, rec: OffloadParam) -> None:
        """Autograd is about to accumulate `rec`'s gradient, which needs its shape: gather it
        if it was evicted meanwhile (it is settled again right after)."""
        if rec.state is ParamState.LIVE:
            return
        with self.own_work():
            self.coord.gather_one(rec)

    def grad_accumulated(self, rec: OffloadParam) -> None:
        """`rec`'s gradient left the device: calls waiting only on gradients end, and once
        no running call needs `rec` it is settled from the furthest backward position of the
        calls that waited for it (one gathered for the accumulation alone is settled too)."""
        self._accumulated.add(rec)
        calls = self._waiting.pop(rec, [])
        for call in calls:
            call.grads_pending.discard(rec)
            if call.state is CallState.GATHERED and not (call.inputs_pending or call.grads_pending):
                self._finish(call)  # it waited on its gradients only
        if any(call.state is CallState.GATHERED for call in calls):
            return  # a running call settles rec when it ends
        positions = [call.bw_pos for call in calls if call.bw_pos is not None]
        if rec.state is ParamState.LIVE:
            with self.own_work():
                self.coord.settle(rec, max(positions, default=None))

    # ---- saved tensors ------------------------------------------------------------------

    def saved_tensors(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that stores saved weights by reference (see [Note: saved weights])."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        gathered = self.coord.gathered
        if t.device.type == "meta" or not gathered:
            return t
        rec = gathered.find(t)
        if rec is None:
            return t
        # The offset from the parameter's own: an alias starts inside a shared flat buffer.
        offset = t.storage_offset() - rec.param.storage_offset()
        return _SavedWeight(rec, t.size(), t.stride(), offset, t.dtype)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedWeight):
            return saved
        rec = saved.rec
        if rec.state is not ParamState.LIVE:
            with self.own_work():
                self.coord.gather_one(rec)
        data = rec.param.detach()
        if saved.size == data.size() and saved.stride == data.stride() and not saved.offset:
            return data
        return data.as_strided(saved.size, saved.stride, data.storage_offset() + saved.offset)

    # ---- parameters used outside their module -----------------------------------------

    def external_call(self, recs: list[OffloadParam], func, args, kwargs):
        """Run one torch function that uses parameters of other modules, as if it were a
        module of its own: gathered (and traced, so prefetched) right before, hooked for
        backward, released per the reuse rule right after."""
        with self.own_work():
            call = self._enter(self._external_unit(recs), args, kwargs)
        out = func(*args, **kwargs)
        with self.own_work():
            self._exit(call, out)
        return out

    def _external_unit(self, recs: list[OffloadParam]) -> ModuleUnit:
        key = recs[0] if len(recs) == 1 else tuple(recs)
        unit = self._external.get(key)
        if unit is None:
            unit = self._external[key] = ModuleUnit("+".join(r.name for r in recs) + "@use", recs)
        return unit

    @_own_work
    def begin_external_call(self, params: Iterable[nn.Parameter], inputs: tuple) -> _Call:
        """Begin code that reads `params` outside torch functions, with `inputs`: they stay
        gathered and pinned until `end_external_call` (see [Note: fused kernels])."""
        recs = list(dict.fromkeys(self.by_param[p] for p in params))
        call = self._enter(self._external_unit(recs), inputs, {})
        self.stack.append(call)
        return call

    def end_external_call(self, call: _Call, output) -> None:
        """End `call` with its `output` (None when the code raised), hooked for backward."""
        if not self.stack or self.stack[-1] is not call:
            raise RuntimeError(
                f"end_external_call of {call.unit.name!r}: it is not the innermost running "
                "call; end external calls in the reverse order of their beginnings"
            )
        self.stack.pop()
        with self.own_work():
            self._exit(call, output)


class GatherOnUse(TorchFunctionMode):
    """Gathers a released parameter the moment a torch function receives it."""

    def __init__(self, hooks: ModelHooks) -> None:
        super().__init__()
        self.hooks = hooks

    def active(self) -> bool:
        """Whether torch functions called now reach the mode (not inside autograd's backward
        nodes, which run without the caller's modes)."""
        return self in _get_current_function_mode_stack()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hooks = self.hooks
        if hooks.busy or not hooks.stack:  # the hooks' own tensor work, or outside the model
            return func(*args, **kwargs)
        own = hooks.stack[-1].unit
        by_param = hooks.by_param
        found = None
        for a in (*args, *kwargs.values()):
            if isinstance(a, nn.Parameter):
                rec = by_param.get(a)
                if rec is not None and rec not in own:
                    found = [rec] if found is None else [*found, rec]
            elif type(a) in (list, tuple):
                for b in a:
                    if isinstance(b, nn.Parameter):
                        rec = by_param.get(b)
                        if rec is not None and rec not in own:
                            found = [rec] if found is None else [*found, rec]
        if hooks.coord.phase is Phase.BACKWARD:  # a recomputation (see [Note: backward])
            func = _frozen_detached(func)
        if found is None:
            return func(*args, **kwargs)
        return hooks.external_call(found, func, args, kwargs)


def _frozen_detached(func):
    """`func` receiving frozen parameters as detached views of their current buffers (taken
    at call time, after `external_call` has gathered them)."""

    def run(*args, **kwargs):
        return func(
            *(_detach_frozen(a) for a in args), **{k: _detach_frozen(v) for k, v in kwargs.items()}
        )

    return run


def _detach_frozen(a):
    if isinstance(a, nn.Parameter):
        return a if a.requires_grad else a.detach()
    if type(a) in (list, tuple) and any(isinstance(b, nn.Parameter) for b in a):
        return type(a)(_detach_frozen(b) for b in a)
    return a


def install_grad_hooks(
    records: Iterable[OffloadParam],
    accumulate: Callable[[int, torch.Tensor], None],
    hooks: ModelHooks,
    accelerator: Accelerator,
    reducer: GradReducer | None = None,
) -> list:
    """Move each trainable parameter's gradient into its fp32 sum as soon as autograd
    has accumulated it (`accumulate(slot, flat_grad)`: `GradOffload.add`, which adds it on
    the CPU device and copies it off a GPU asynchronously, see [Note: staged gradient
    copies]), and drop the parameter's reference to it at once. With several ranks, `reducer`
    takes the full device gradient instead and reduce-scatters it in buckets into the slots
    (see [Note: gradient buckets] in grad_reduce.py). Accumulation checks the
    gradient against the parameter's shape, so a tensor hook gathers a released parameter
    just before (see `ModelHooks.before_accumulate`)."""
    handles = []
    for rec in records:
        if rec.slot is None:
            continue

        def hook(param: nn.Parameter, rec=rec) -> None:
            grad = param.grad
            if grad is not None:
                with accelerator.range("infinity::zero::accumulate_grad"):
                    flat = grad.reshape(-1)
                    if reducer is not None:
                        reducer.add(rec.slot, flat)
                    else:
                        accumulate(rec.slot, flat)
                param.grad = None
            hooks.grad_accumulated(rec)

        def before(grad: torch.Tensor, rec=rec) -> None:
            hooks.before_accumulate(rec)

        handles.append(rec.param.register_hook(before))
        handles.append(rec.param.register_post_accumulate_grad_hook(hook))
    return handles
