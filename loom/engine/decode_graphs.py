"""Compiled decode steps, kept on disk.

Decode-only steps are the many small ones, where per-op overhead rivals the weight reads: they run
through graphs compiled ahead of time with `torch.compile(...).aot_compile`, one for each kind of
step seen (batch 1; any larger batch up to a kernel switch of the linear layers; steps whose
attention scores keys for a KV policy). Each graph is saved beside torch's compile cache, keyed by
everything its trace could have read (Loom's sources bar its user-facing packages, the model's
structure, attributes and tensor shapes, torch and the CPU): a later start of the same engine loads
it instead of tracing the model's Python again (about six seconds a graph for the 134M reference
model on a 2-core EPYC). A step runs the first graph whose guards accept its inputs; a step no
graph accepts compiles a new one, and saves it. A step shaped like the one before it runs that
one's graph unchecked (as vLLM dispatches its compiled graphs by batch size without Dynamo's
guards): the engine builds every step's inputs alike, so their shapes are all that tells steps
apart. Such a step also skips the graph's Python prologue, which gathers a couple of hundred
inputs (every weight, every pool) by attribute lookups at each call: the inputs one call passed
are kept, and the next steps put their own tensors in the same places.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import loom
from loom.kv.attention import AttentionMetadata
from loom.kv.cache import KVCache

# torch._dynamo and torch._inductor are imported where used: together they take longer to import
# than torch itself, and eager engines never need them.
if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction

logger = logging.getLogger(__name__)


def graphs_root() -> Path:
    """Beside inductor's cache, whose artifacts the graphs embed: TORCHINDUCTOR_CACHE_DIR moves
    both, and emptying it is a cold start."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "loom-decode-graphs"


# Packages no model forward calls into (the user-facing layers on top of the engine): editing
# them leaves every graph as it was.
_UNTRACED_PACKAGES = frozenset({"bench", "cli", "server", "planner"})


@cache
def _source_digest() -> str:
    """Loom's own sources: a graph traced through any other version of them is not this one."""
    h = hashlib.sha256()
    root = Path(loom.__file__).parent
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h")
                       and p.relative_to(root).parts[0] not in _UNTRACED_PACKAGES):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _attributes(module: torch.nn.Module) -> str:
    """A module's plain attributes (scales, epsilons, plans, backends) as a trace reads them,
    tensors (rotary tables, whose length is the engine's max_model_len) by shape and dtype;
    objects whose repr is only an address carry nothing a key could use."""
    skip = {"_parameters", "_buffers", "_modules", "training"}
    items = [(k, f"tensor{tuple(v.shape)}:{v.dtype}" if isinstance(v, torch.Tensor) else repr(v))
             for k, v in vars(module).items() if k not in skip]
    return ";".join(f"{k}={r}" for k, r in sorted(items) if " at 0x" not in r)


def graph_key(model: torch.nn.Module, cache: KVCache, options: dict[str, Any], extra: str) -> str:
    """What a decode graph of `model` depends on beyond its guards. Guards on the model's modules
    and parameters are skipped (a thousand checks a step), so their structure, attributes and
    shapes are in the key instead."""
    h = hashlib.sha256()
    for part in (_source_digest(), torch.__version__, sys.version, torch.backends.cpu.get_cpu_capability(),
                 repr(sorted(options.items())), extra, repr(cache.block_size), repr(cache.keys[0].dtype)):
        h.update(part.encode())
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__qualname__}:{_attributes(module)}".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.stride()}:{t.dtype}".encode())
    return h.hexdigest()[:24]


def _serializable_guards(guards: list) -> list[bool]:
    """The guards a saved graph keeps: none on the model's modules and parameters (the key covers
    them), none on globals, none of the kinds a file cannot hold (object identities)."""
    from torch._dynamo.guards import CheckFunctionManager

    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(guards)
    return [k and not g.is_global and g.guard_type not in CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
            for k, g in zip(keep, guards)]


def _decode_step(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
    """What a decode graph traces: the model's forward, every pool's slot count declared equal.
    (Each pool's is marked dynamic, and marked sizes get a symbol each: a graph would read all 24
    of a 12-layer model's sizes and pass them on at every call, about 0.1 ms a step.)"""
    for keys, values in cache.pools():
        for pool in (*keys, *values):
            torch._check(pool.shape[0] == cache.keys[0].shape[0])
    return model.forward(ids, positions, cache, meta)


def _step_tensors(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor]:
    """Every tensor a decode step brings of its own, the block tables among them (the rest of a
    graph's inputs are the model's and the cache's)."""
    rows, _ = meta.decode_dims()
    return [ids, positions, *(t for t, _ in rows)]


def _persistent_tensors(model: torch.nn.Module, cache: KVCache) -> dict[int, torch.Tensor]:
    """The tensors every step's graph reads as they are, by id: the model's parameters, buffers
    and tensor attributes, and the KV pools. (Held here, so that no later tensor takes the id of
    one of them.)"""
    tensors = [*model.parameters(), *model.buffers(), *(p for pair in cache.pools() for pools in pair for p in pools)]
    tensors += [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return {id(t): t for t in tensors}


@dataclass
class _ShapedStep:
    """The graph serving steps of one shape and, where it could be recorded, the flat input list
    its prologue builds: the persistent tensors and sizes as they were, and the places of the
    step's own tensors (`places`: input slot, index into `_step_tensors`)."""
    shapes: tuple
    graph: AOTCompiledFunction
    compiled: Callable[..., Any] | None = None  # what the prologue calls with the flat inputs
    inputs: list[Any] | None = None
    places: list[tuple[int, int]] | None = None
    output: int = 0  # which of the compiled graph's outputs the step returns

    def run(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The step whose `_step_tensors` are `tensors`."""
        inputs = self.inputs.copy()
        for slot, k in self.places:
            inputs[slot] = tensors[k]
        return self.compiled(*inputs)[self.output]


def _step_shapes(meta: AttentionMetadata, tensors: list[torch.Tensor]) -> tuple:
    """What can differ between two decode steps' inputs as the engine builds them: the sizes of
    the step's tensors (`_step_tensors`: the block tables, whose width moves too, among them) and
    which optional inputs are there (their dtypes, devices and layouts are the same at every step;
    the pools never change)."""
    return (meta.decode_scores is None, meta.row_exchange is None, *(t.shape for t in tensors))


class DecodeGraphs:
    """The compiled decode steps of one engine's model: `graphs(ids, positions, meta)` runs the
    step through the first graph that accepts it."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, options: dict[str, Any], extra_key: str) -> None:
        self.model, self.cache = model, cache
        self.dir = graphs_root() / graph_key(model, cache, options, extra_key)
        self.saving = not torch.compiler.config.force_disable_caches
        # Sizes are dynamic where a graph's inputs are marked so, never learned from an earlier
        # trace (which could be another engine's model).
        self._compile = torch.compile(_decode_step, fullgraph=True,
                                      options={**options, "guard_filter_fn": _serializable_guards})
        self.graphs: list[AOTCompiledFunction] = []
        # The last step's shapes and how they ran: checking the guards again costs about 0.1 ms of
        # a 2.8 ms batch-1 step, their data cold after the forward's weights, and the prologue
        # about as much again.
        self._last: _ShapedStep | None = None
        self._persistent = _persistent_tensors(model, cache)
        self.num_compiled = 0  # graphs this engine traced, rather than loaded
        for path in sorted(self.dir.glob("*.graph")) if self.saving else ():
            self._load(path)

    @torch.inference_mode()  # as steps run: guards built outside it expect autograd's dispatch keys
    def _load(self, path: Path) -> None:
        try:
            with path.open("rb") as f:
                graph = torch.compiler.load_compiled_function(f)
        except Exception as error:  # a file of another torch, or truncated: compile again
            logger.warning("decode graph %s not loaded (%s: %s); compiling instead", path, type(error).__name__, error)
            return
        graph.disable_guard_check()  # checked before each call instead: see _find
        self.graphs.append(graph)

    def _find(self, args: tuple) -> AOTCompiledFunction | None:
        for i, graph in enumerate(self.graphs):
            if graph.guard_check(*args):
                if i:  # most recently used first: consecutive steps are mostly alike
                    self.graphs.insert(0, self.graphs.pop(i))
                return graph
        return None

    def prepare(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Makes sure some graph serves a step of these inputs (loaded, or compiled now)."""
        self._graph_for(ids, positions, meta)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tensors = _step_tensors(ids, positions, meta)
        shapes, last = _step_shapes(meta, tensors), self._last
        if last is not None and last.shapes == shapes:
            if last.inputs is not None:
                return last.run(tensors)
            return last.graph(self.model, ids, positions, self.cache, meta)
        self._last = _ShapedStep(shapes, self._graph_for(ids, positions, meta))
        return self._record(self._last, tensors, ids, positions, meta)

    def _graph_for(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> AOTCompiledFunction:
        """The first graph whose guards accept these inputs, else one compiled now."""
        args = (self.model, ids, positions, self.cache, meta)
        graph = self._find(args)
        if graph is None:
            graph = self._add(ids, positions, meta)
            if not graph.guard_check(*args):
                raise RuntimeError("a decode graph compiled for this step's inputs does not accept them")
        return graph

    def _record(self, step: _ShapedStep, tensors: list[torch.Tensor], ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Runs a step through `step.graph`'s prologue, recording the flat inputs it passes: kept in
        `step` for later steps of its shape if each is a persistent tensor, a size, or one of the
        step's own tensors (else those steps run the prologue too)."""
        # The prologue is `graph.fn`, whose globals name the compiled graph it calls (torch 2.13's
        # AOTCompiledFunction keeps that name in its artifacts): swapped for a recorder this once.
        names, name = step.graph.fn.__globals__, step.graph._artifacts.backend_id
        compiled, seen = names[name], []

        def record(*inputs: Any) -> Any:
            seen[:] = [inputs, compiled(*inputs)]
            return seen[1]

        names[name] = record
        try:
            out = step.graph(self.model, ids, positions, self.cache, meta)
        finally:
            names[name] = compiled
        (inputs, outputs), own = seen, {id(t): k for k, t in enumerate(tensors)}
        places = [(slot, own[id(x)]) for slot, x in enumerate(inputs) if id(x) in own]
        kept = all(id(x) in own or id(x) in self._persistent if isinstance(x, torch.Tensor) else type(x) is int
                   for x in inputs)
        output = next((j for j, o in enumerate(outputs) if o is out), None)
        if kept and output is not None:
            step.compiled, step.inputs, step.places, step.output = compiled, list(inputs), places, output
            for slot, _ in places:  # the step's tensors are not kept alive past it
                step.inputs[slot] = None
        else:
            logger.debug("decode graph inputs not kept for steps shaped %s: each runs the prologue", step.shapes)
        return out

    @torch.inference_mode()
    def _add(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> AOTCompiledFunction:
        """Compiles a graph for steps like this one: of its batch size if it has one row, else of
        any batch size the same kernels serve; the block tables' width is always free."""
        ids, positions, meta = ids.clone(), positions.clone(), copy.deepcopy(meta)  # marks stay off the step's
        rows, widths = meta.decode_dims()
        for t, dim in widths:
            torch._dynamo.decorators.mark_unbacked(t, dim)
        # The pool's size is any: graphs serve engines of other memory budgets too. (Named by
        # source, not marked on the tensors: a graph loaded from disk expects no marks on them.)
        dynamic = [r"L\['cache'\]\.(keys|values|key_scales|value_scales)\[\d+\]:0"]
        if ids.shape[0] > 1:
            for t, dim in [(ids, 0), (positions, 0), *rows]:
                if t.shape[dim] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, dim)
            if meta.num_decode_tokens > 1:
                dynamic.append("L['meta'].num_decode_tokens")
        with torch.compiler.config.patch(dynamic_sources=",".join(dynamic)), \
                torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            graph = self._compile.aot_compile(((self.model, ids, positions, self.cache, meta), {}))
        self.num_compiled += 1
        if self.saving:
            self._save(graph)
        graph.disable_guard_check()
        self.graphs.insert(0, graph)
        return graph

    def _save(self, graph: AOTCompiledFunction) -> None:
        """Writes the graph beside the engine's others, under a name of its own (written whole, then
        renamed: a process loading it never reads a partial file)."""
        try:
            data = type(graph).serialize(graph).serialized_data
        except Exception as error:
            logger.warning("decode graph not saved (%s: %s); the next start compiles it again",
                           type(error).__name__, error)
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{hashlib.sha256(data).hexdigest()[:16]}.graph"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
