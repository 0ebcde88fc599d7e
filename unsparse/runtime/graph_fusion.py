"""Fusing a ReLU into the convolution before it by rewriting the model's FX graph.

A ReLU after a convolution is a read and a write of every ofmap element; a convolution that applies it as it stores
its output (a generated kernel's epilogue, cuDNN's ``torch.cudnn_convolution_relu``) saves that pass. VGG's ReLUs are
modules of an ``nn.Sequential``, which a layer-level rewrite can fuse; ResNet's and GoogLeNet's are calls in a
``forward``: torchvision's ``BasicBlock``/``Bottleneck`` call one shared ``self.relu = nn.ReLU(inplace=True)`` after
``bn1``, ``bn2`` and the residual add, and GoogLeNet's ``BasicConv2d`` calls
``F.relu(self.bn(self.conv(x)), inplace=True)``. Once their BatchNorms are folded into the convolutions
(:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`, which leaves an ``nn.Identity`` in each one's place),
a ReLU reads a convolution's output through that Identity; :func:`fuse_following_relu` traces the forward with
``torch.fx``, hands each such convolution to the caller, and drops the ReLU's call from the graph.

A residual block ends in ``relu(conv3(...) + identity)`` (``Bottleneck``'s ``out += identity``, traced as an add):
three passes over the ofmap after the convolution (its bias, the add, the ReLU), which cuDNN's
``torch.cudnn_convolution_add_relu`` makes part of the convolution's own call. With a ``fuse_residual`` callback,
:func:`fuse_following_relu` also hands each convolution whose output is such an add's operand to the caller, passes
the add's other operand to its call as a second argument, and drops the add and the ReLU.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

log = logging.getLogger(__name__)

_RELU_CALLS = {("call_function", torch.relu), ("call_function", torch.relu_), ("call_method", "relu"),
               ("call_method", "relu_")}
"""The ReLU calls of one tensor argument and no options, as (``fx.Node.op``, ``fx.Node.target``)."""

_ADD_CALLS = {("call_function", operator.add), ("call_function", operator.iadd), ("call_function", torch.add),
              ("call_method", "add"), ("call_method", "add_")}
"""The adds of two arguments (no ``alpha``, no ``out``), as (``fx.Node.op``, ``fx.Node.target``)."""

_IN_PLACE_ADDS = {("call_function", operator.iadd), ("call_method", "add_")}
"""The adds that write their first argument: a convolution's output may only be that one (the other operand, read
elsewhere too, would no longer be changed once the add is gone)."""


class LeafTracer(fx.Tracer):
    """An FX tracer that keeps each module of the types ``leaves`` as one call (``call_module``), as it keeps
    ``torch.nn``'s own modules; e.g. a :class:`~unsparse.runtime.modules.SparseConv`, whose forward dispatches to a
    backend. ``leaves`` has a default because unpickling a GraphModule (``torch.load``) builds its graph's tracer
    class with no arguments."""

    def __init__(self, leaves: tuple[type[nn.Module], ...] = ()) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, self.leaves) or super().is_leaf_module(module, qualified_name)


class FusedGraphModule(fx.GraphModule):
    """The ``fx.GraphModule`` :func:`fuse_following_relu` returns: a deep copy keeps its public plain attributes
    (``unsparse_spec``, the folded-BatchNorm names), which ``fx.GraphModule``'s own deep copy drops."""

    def __deepcopy__(self, memo: dict[int, Any]) -> fx.GraphModule:
        copied = super().__deepcopy__(memo)
        for name, value in _public_attributes(self).items():
            if not hasattr(copied, name):
                setattr(copied, name, copy.deepcopy(value, memo))
        return copied


def name_counts(model: nn.Module) -> Counter[nn.Module]:
    """How many qualified names each module of ``model`` has (``named_modules(remove_duplicate=False)``): more than
    one for a module reachable under several names, which a rewrite of one of its places would change everywhere."""
    return Counter(module for _, module in model.named_modules(remove_duplicate=False))


def module_calls(graph: fx.Graph) -> tuple[Counter[str], set[str]]:
    """How many times ``graph`` calls each module (``call_module`` nodes, by qualified name), and the modules whose
    attributes it reads directly (``get_attr`` nodes and every module above them: ``self.conv.weight`` in a forward
    reads ``conv``)."""
    calls: Counter[str] = Counter()
    read: set[str] = set()
    for node in graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] += 1
        elif node.op == "get_attr":
            parts = str(node.target).split(".")
            read.update(".".join(parts[:end]) for end in range(1, len(parts)))
    return calls, read


def fuse_following_relu(model: nn.Module, tracer: fx.Tracer, fuse: Callable[[str, nn.Module], nn.Module | None],
                        fuse_residual: Callable[[str, nn.Module], nn.Module | None] | None = None,
                        ) -> tuple[nn.Module, list[str]]:
    """Fuse each module call of ``model`` that a ReLU follows with that ReLU, by a rewrite of ``model``'s FX graph
    (traced with ``tracer`` in ``model``'s current mode: a ``self.training`` branch is taken as it stands).

    A call fuses where its module is called once in the graph, is reachable under one name, has no hooks and has no
    attribute read by the graph (``self.conv.weight`` in a forward), and its output's one reader, after a chain of
    exactly ``nn.Identity`` calls without hooks (a folded BatchNorm's place), is a ReLU of it alone: a call of an
    exactly ``nn.ReLU`` module without hooks (the module may be shared and called elsewhere, as ResNet's is: only this
    call goes), of ``torch.relu``, ``torch.relu_`` or ``F.relu`` (either ``inplace``), or of the tensor methods
    ``relu``/``relu_``. Every call in the chain has one reader, so an in-place ReLU whose input is read elsewhere
    stays. For each, ``fuse(qualified_name, module)`` returns the module to put at that name, one that applies the
    ReLU to its output (it may be ``module`` itself, mutated), or None to leave the call and its ReLU as they are;
    the ReLU's readers then read the module's output. Shapes are unchanged.

    With ``fuse_residual``, a call that fuses no ReLU so, but whose output (past the same chain of Identity calls) is
    one operand of an add of two arguments (``+``, ``+=``, ``torch.add`` or the tensor methods ``add``/``add_``,
    without ``alpha``; an in-place add only on the call's output, its first operand) whose one reader is such a ReLU
    of the sum, and between which and the call the graph runs only attribute reads and calls of ``torch.nn``'s or
    this package's modules without ``inplace=True`` or hooks (so that no operation in between changes the call's
    input or the residual), is handed to ``fuse_residual(qualified_name, module)``, which returns the module to put
    at that name, one called with the add's other operand as a second argument (the residual) and returning
    ``relu(module(x) + residual)``, or None to leave the call, the add and the ReLU as they are. The call is then
    moved after the residual's node where it came before it (ResNet's downsample runs after ``conv3``), and the
    add's and the ReLU's readers read its output.

    Returns:
        A new :class:`FusedGraphModule` built from ``model`` and the rewritten graph, in ``model``'s mode, and the
        qualified names fused, in ``model``'s module order. It shares its modules with ``model`` except the ones
        ``fuse`` replaced (mutated ones are shared too: ``model`` itself then applies their ReLU twice, which
        computes the same); it holds the modules the graph calls under their qualified names (their containers
        become plain ``nn.Module``s) and ``model``'s public plain attributes (``unsparse_spec``, say). Where nothing
        fuses, ``model`` itself and ``[]``; so too, with the reason logged at INFO, for a model FX cannot trace
        (data-dependent control flow), and for one with hooks on a module the trace went through rather than
        calling it (``model`` itself, a residual block, a module of its own without submodules), which the
        GraphModule would not run.
    """
    try:
        graph = tracer.trace(model)
    except Exception as error:  # FX raises TraceError, TypeError, NotImplementedError, ... for untraceable code
        log.info("fuse_following_relu: FX cannot trace %s (%s: %s); no ReLU fused", type(model).__name__,
                 type(error).__name__, error)
        return model, []
    names = name_counts(model)
    calls, read = module_calls(graph)
    hooked = [name or type(model).__name__ for name, module in model.named_modules()
              if name not in calls and _has_hooks(module)]  # traced through: the GraphModule never calls it
    if hooked:
        log.info("fuse_following_relu: %s has hooks, which a GraphModule would not run; no ReLU fused",
                 ", ".join(hooked))
        return model, []
    replacements: dict[str, nn.Module] = {}
    erased: set[fx.Node] = set()
    for node in list(graph.nodes):  # a copy: a call that takes a residual moves
        if node.op != "call_module" or calls[node.target] != 1 or node.target in read or node in erased:
            continue
        module = model.get_submodule(node.target)
        if names[module] != 1 or _has_hooks(module):
            continue
        relu = _following_relu(node, model)
        replacement = None if relu is None else fuse(node.target, module)
        if replacement is not None:
            replacements[node.target] = replacement
            relu.replace_all_uses_with(relu.args[0])
            graph.erase_node(relu)
            erased.add(relu)
            continue
        found = None if fuse_residual is None or relu is not None else _following_add_relu(node, model)
        replacement = None if found is None else fuse_residual(node.target, module)
        if replacement is not None:
            replacements[node.target] = replacement
            erased.update(_take_residual(graph, node, *found))
    if not replacements:
        return model, []
    fused = FusedGraphModule(model, graph, type(model).__name__)  # holds the modules the graph still calls
    for name, replacement in replacements.items():
        fused.set_submodule(name, replacement)
    fused.recompile()
    position = {name: index for index, (name, _) in enumerate(model.named_modules())}
    for name, module in fused.named_modules():
        if type(module) is nn.Module:  # a container fx.GraphModule made, in training mode
            module.training = model.get_submodule(name).training
        prefix = f"{name}." if name else ""  # model's order (a call that takes a residual moved); a replacement's own
        module._modules = dict(sorted(module._modules.items(),  # submodules after, in their order
                                      key=lambda item: position.get(prefix + item[0], len(position))))
    for name, value in _public_attributes(model).items():
        if not hasattr(fused, name):
            setattr(fused, name, value)
    return fused, sorted(replacements, key=position.__getitem__)


def _reader_past_identities(node: fx.Node, model: nn.Module) -> tuple[list[fx.Node], fx.Node] | None:
    """``(chain, reader)``: the one reader of ``node``'s output past a chain of exactly ``nn.Identity`` calls without
    hooks, each the one reader of the output before it (``chain``, in order; empty where ``reader`` reads ``node``);
    None where an output has several readers or none, or a chain's call takes other arguments."""
    chain: list[fx.Node] = []
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_module" or type(model.get_submodule(user.target)) is not nn.Identity:
            return chain, user
        if user.args != (node,) or user.kwargs or _has_hooks(model.get_submodule(user.target)):
            return None
        chain.append(user)
        node = user
    return None


def _is_relu_of(user: fx.Node, node: fx.Node, model: nn.Module) -> bool:
    """Whether ``user`` is a ReLU of ``node``'s output alone (see :func:`fuse_following_relu`)."""
    if user.op == "call_module":
        module = model.get_submodule(user.target)
        return type(module) is nn.ReLU and user.args == (node,) and not user.kwargs and not _has_hooks(module)
    if user.op == "call_function" and user.target is F.relu:  # F.relu(x, inplace)
        options = [*user.args[1:], *user.kwargs.values()]
        return (user.args[:1] == (node,) and set(user.kwargs) <= {"inplace"} and len(options) <= 1
                and all(isinstance(option, bool) for option in options))
    return (user.op, user.target) in _RELU_CALLS and user.args == (node,) and not user.kwargs


def _following_relu(node: fx.Node, model: nn.Module) -> fx.Node | None:
    """The ReLU call that alone reads ``node``'s output, past ``nn.Identity`` calls, each the one reader of the
    previous call's output (see :func:`fuse_following_relu`), or None."""
    found = _reader_past_identities(node, model)
    if found is None:
        return None
    chain, reader = found
    return reader if _is_relu_of(reader, chain[-1] if chain else node, model) else None


def _following_add_relu(node: fx.Node,
                        model: nn.Module) -> tuple[list[fx.Node], fx.Node, fx.Node, fx.Node] | None:
    """``(chain, add, residual, relu)``: the Identity calls between ``node`` and the add that alone reads its output
    past them, that add, its other operand, and the ReLU that alone reads the sum (see :func:`fuse_following_relu`),
    or None."""
    found = _reader_past_identities(node, model)
    if found is None:
        return None
    chain, add = found
    last = chain[-1] if chain else node
    if (add.op, add.target) not in _ADD_CALLS or add.kwargs or len(add.args) != 2 or len(add.users) != 1:
        return None
    first, second = add.args
    if first is last and isinstance(second, fx.Node) and second is not last:
        residual = second
    elif second is last and isinstance(first, fx.Node) and (add.op, add.target) not in _IN_PLACE_ADDS:
        residual = first
    else:
        return None
    (relu,) = add.users
    if not _is_relu_of(relu, add, model) or not _leaves_inputs_alone_between(node, add, chain, model):
        return None
    return chain, add, residual, relu


def _leaves_inputs_alone_between(node: fx.Node, add: fx.Node, chain: list[fx.Node], model: nn.Module) -> bool:
    """Whether every node after ``node`` and before ``add`` in the graph's order, the Identity calls ``chain``
    apart, is an attribute read or a call of a module that leaves its inputs as they are: one of ``torch.nn``'s or
    of this package (a convolution, a BatchNorm, an Identity, a ``SparseConv``) without ``inplace=True`` and without
    hooks. Only then may the call of ``node`` move after the residual's node and read the residual at the add's
    place: an in-place operation in between (``nn.ReLU(inplace=True)`` on the conv's input, ``identity.mul_(3)``)
    would change what one of them reads."""
    skipped = set(chain)
    current = node.next
    while current is not add:
        if current not in skipped and current.op != "get_attr":
            if current.op != "call_module":
                return False
            module = model.get_submodule(current.target)
            if (getattr(module, "inplace", False) or _has_hooks(module)
                    or not type(module).__module__.startswith(("torch.nn.", "unsparse."))):
                return False
        current = current.next
    return True


def _take_residual(graph: fx.Graph, node: fx.Node, chain: list[fx.Node], add: fx.Node, residual: fx.Node,
                   relu: fx.Node) -> tuple[fx.Node, ...]:
    """Rewrite ``graph`` so that ``node`` (a module call) takes ``residual`` as its second argument in place of the
    add and the ReLU after it: their readers read ``node``, they and the Identity calls ``chain`` between leave the
    graph (readers first; returned), and ``node`` moves after ``residual`` where it came before it (``residual``
    comes before the add, which reads both, so only the nodes between ``node`` and the add are looked at)."""
    between = node.next
    while between is not add and between is not residual:
        between = between.next
    relu.replace_all_uses_with(node)
    dead = (relu, add, *reversed(chain))
    for gone in dead:
        graph.erase_node(gone)
    if between is residual:
        residual.append(node)
    node.args = (*node.args, residual)
    return dead


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_hooks)


def _public_attributes(module: nn.Module) -> dict[str, Any]:
    """The entries of ``vars(module)`` whose name starts with no ``_``, ``training`` apart."""
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and name != "training"}
