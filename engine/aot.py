"""The decode step compiled ahead of time (``compile: true`` with ``compile_mode: aot``).

``compile_mode: jit`` runs ``torch.compile`` in the replica: dynamo and inductor are imported
there (~1,600 modules, ~250 MB of the replica's memory for as long as it lives) and every step
goes through inductor's Python wrapper and dynamo's guards (~1.5 ms of a 12 ms 8-row step of the
bundled model). Here the same decode step (``LlamaModel._decode_step``) is exported
(``torch.export``) and compiled with AOTInductor, torch's own ahead-of-time path, into a shared
object with a C++ wrapper, in a child process (``python -m engine.aot``), once per model shape,
engine config and source version; the replica loads it with ``AOTIModelPackageLoader`` (C++,
no dynamo or inductor import) and calls it with a flat list of tensors.

More: docs/design/engine-notes.md#engineaot."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tailscope import env

log = logging.getLogger("engine.aot")

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 1800.0
# the decode path's switches a caller may set on a loaded model (bench/packed_weights.py does):
# the child sets them on the model it loads again
SWITCHES = ("direct_decode_attention", "native_decode_attention")


def cache_dir() -> Path:
    """``$TAILSCOPE_AOT_CACHE_DIR``, else ``$TAILSCOPE_CACHE_DIR/aot`` (default
    ``~/.cache/tailscope/aot``)."""
    return env.aot_cache_dir()  # beside the built kernels by default


def tensor_slots(model) -> tuple[list[tuple[object, str | int]], list[torch.Tensor]]:
    """Where each of the model's tensors lives: (owner, attribute name or list index), in a
    fixed order (attribute order, depth first), each tensor once, walking the model's own
    objects (``engine.*`` and ``kernels.*`` classes) and lists; and the tensors held in tuples
    and dicts (the RoPE tables per base), whose places cannot be swapped: the exported program
    keeps those as constants, and ``cache_key`` hashes their values."""
    out: list[tuple[object, str | int]] = []
    fixed: list[torch.Tensor] = []
    seen_objs: set[int] = set()
    seen_tensors: set[int] = set()

    def ours(v) -> bool:
        return not isinstance(v, type) and type(v).__module__.split(".")[0] in ("engine",
                                                                               "kernels")

    def held(v) -> list[torch.Tensor]:
        if isinstance(v, torch.Tensor):
            return [v]
        if isinstance(v, (tuple, list)):
            return [t for x in v for t in held(x)]
        if isinstance(v, dict):
            return [t for x in v.values() for t in held(x)]
        return []

    def walk(obj) -> None:
        if id(obj) in seen_objs:
            return
        seen_objs.add(id(obj))
        if isinstance(obj, list):
            items = list(enumerate(obj))
        else:
            names = list(getattr(obj, "__dict__", {}))
            names += [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())
                      if hasattr(obj, s) and s not in names]
            items = [(n, getattr(obj, n)) for n in names]
        for k, v in items:
            if isinstance(v, torch.Tensor):
                if id(v) not in seen_tensors:
                    seen_tensors.add(id(v))
                    out.append((obj, k))
            elif isinstance(v, list) or ours(v):
                walk(v)
            elif isinstance(v, (tuple, dict)):
                fixed.extend(held(v))

    walk(model)
    return out, [t for t in fixed if id(t) not in seen_tensors]


def _get(owner, key):
    return owner[key] if isinstance(owner, list) else getattr(owner, key)


def _put(owner, key, value) -> None:
    if isinstance(owner, list):
        owner[key] = value
    else:
        setattr(owner, key, value)


def model_tensors(model) -> list[torch.Tensor]:
    tensors = [_get(o, k) for o, k in tensor_slots(model)[0]]
    odd = [t for t in tensors if t.layout != torch.strided or t.device.type != "cpu"]
    if odd:
        raise ValueError(f"compile_mode aot: {len(odd)} of the model's tensors are not plain "
                         f"CPU tensors (layout {odd[0].layout}, e.g. oneDNN's prepacked bf16 "
                         "weights of weights: native, or of int8's dense copy): use "
                         "weights int4 or int4a8, or compile_mode jit")
    return tensors


def batch_ranges(model, max_batch: int) -> list[tuple[int, int]]:
    """The batch sizes each program covers: 1, then 2.. up to ``max_batch``, split past each
    packed layer's ``max_rows`` where it has a dense copy (its code branches there)."""
    starts = {1, 2}
    for lw in model.layers:
        for lin in (lw.qkv, lw.o, lw.gate_up, lw.down):
            if getattr(lin, "dense", None) is not None:
                starts.add(lin.max_rows + 1)
    starts = sorted(s for s in starts if s <= max_batch)
    ends = [s - 1 for s in starts[1:]] + [max_batch]
    return list(zip(starts, ends, strict=True))


def _sources() -> list[Path]:
    from kernels import native

    return sorted([*ROOT.glob("engine/**/*.py"), *ROOT.glob("kernels/**/*.py"),
                   *native.SOURCES])


def cache_key(model, kv_shape: tuple[int, ...], max_batch: int) -> str:
    """What the programs depend on: torch's version, the engine's and kernels' sources, the
    model's architecture, dtype and formats and its decode path's switches, every model
    tensor's shape, dtype and strides, the KV caches' shape, the largest batch and torch's
    thread count. Not the
    weights' values (they are inputs), but those of the tensors baked in (``tensor_slots``)."""
    from kernels import native

    h = hashlib.sha256()
    for part in (torch.__version__, repr(model.config), str(model.dtype), model.weight_format,
                 model.output_format, model.native_decode_attention,
                 model.direct_decode_attention, model.torch_only, native.available(),
                 env.setting("kernels") or "", kv_shape, max_batch,
                 torch.get_num_threads()):  # inductor tiles its loops for the threads it has
        h.update(repr(part).encode() + b"\0")
    for t in model_tensors(model):
        h.update(repr((tuple(t.shape), t.dtype, t.stride())).encode())
    for t in tensor_slots(model)[1]:  # baked into the programs: their values
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    for p in _sources():
        h.update(p.read_bytes())
    return h.hexdigest()[:20]


class _Step(torch.nn.Module):
    """``_decode_step`` with the model's tensors as inputs (put in their places while it
    runs, put back after)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.slots = tensor_slots(model)[0]

    def forward(self, input_ids, positions, slot_mapping, block_tables, context_lens,
                kv_flat: list[torch.Tensor], tensors: list[torch.Tensor]) -> torch.Tensor:
        old = [_get(o, k) for o, k in self.slots]
        for (o, k), t in zip(self.slots, tensors, strict=True):
            _put(o, k, t)
        try:
            kv = list(zip(kv_flat[0::2], kv_flat[1::2], strict=True))
            return self.model._decode_step(input_ids, positions, slot_mapping, block_tables,
                                           context_lens, kv)
        finally:
            for (o, k), t in zip(self.slots, old, strict=True):
                _put(o, k, t)


def export(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lo: int, hi: int):
    """The decode step exported for batches of ``lo``..``hi`` sequences and block tables of 2
    up to the pool's size (``torch.export``, non-strict)."""
    blocks = kv_caches[0][0].shape[0]
    b = lo
    args = (torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long),
            torch.arange(b), torch.zeros(b, 2, dtype=torch.long),
            torch.ones(b, dtype=torch.long), [t for pair in kv_caches for t in pair],
            model_tensors(model))
    width = torch.export.Dim("width", min=2, max=max(blocks, 3))
    batch = torch.export.Dim("batch", min=lo, max=hi) if hi > lo else None
    rows = {0: batch} if batch is not None else None
    dynamic = (rows, rows, rows, {0: batch, 1: width} if batch is not None else {1: width},
               rows, [None] * len(args[5]), [None] * len(args[6]))
    with torch.inference_mode():
        return torch.export.export(_Step(model), args, dynamic_shapes=dynamic, strict=False)


def build(model, kv_shape: tuple[int, ...], max_batch: int, out: Path) -> None:
    """Export and compile every batch range's program into ``out`` (``decode-LO-HI.pt2``,
    ``ranges.json``), written to a temporary directory beside it and renamed into place."""
    kv_caches = [(torch.empty(kv_shape, dtype=model.dtype),
                  torch.empty(kv_shape, dtype=model.dtype)) for _ in model.layers]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        ranges = batch_ranges(model, max_batch)
        for lo, hi in ranges:
            t = time.perf_counter()
            ep = export(model, kv_caches, lo, hi)
            torch._inductor.aoti_compile_and_package(
                ep, package_path=str(tmp / f"decode-{lo}-{hi}.pt2"))
            log.info("decode step for batches %d-%d compiled ahead of time in %.1f s", lo, hi,
                     time.perf_counter() - t)
        (tmp / "ranges.json").write_text(json.dumps({"ranges": ranges,
                                                     "max_width": max(kv_shape[0], 3)}))
        try:
            tmp.rename(out)
        except OSError:  # another process built it first: theirs is the same
            if not (out / "ranges.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class AotDecode:
    """The compiled programs of one model and KV pool, loaded; called as ``_decode_step``
    is, on one step's inputs (block tables at least two wide)."""

    def __init__(self, model, directory: Path) -> None:
        index = json.loads((directory / "ranges.json").read_text())
        self.tensors = model_tensors(model)  # passed at every call (the programs' inputs)
        self.programs = [(lo, hi, torch._C._aoti.AOTIModelPackageLoader(
            str(directory / f"decode-{lo}-{hi}.pt2"), "model", False, 1, -1))
            for lo, hi in index["ranges"]]
        self.max_batch = max(hi for _, hi, _ in self.programs)
        self.max_width = index["max_width"]

    def covers(self, batch: int, width: int) -> bool:
        return 1 <= batch <= self.max_batch and width <= self.max_width

    def __call__(self, input_ids, positions, slot_mapping, block_tables, context_lens,
                 kv_caches) -> torch.Tensor:
        b = input_ids.shape[0]
        program = next(p for lo, hi, p in self.programs if lo <= b <= hi)
        (logits,) = program.boxed_run([input_ids, positions, slot_mapping, block_tables,
                                       context_lens, *[t for pair in kv_caches for t in pair],
                                       *self.tensors])
        return logits


def is_built(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_batch: int
             ) -> bool:
    """Whether the cache holds this model's programs for this KV pool (``load`` is quick)."""
    key = cache_key(model, tuple(kv_caches[0][0].shape), max_batch)
    return (cache_dir() / key / "ranges.json").exists()


def load(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_batch: int,
         build: Build | None = None) -> AotDecode:
    """The model's compiled decode programs for this KV pool, built first in a child process
    (``python -m engine.aot``) when the cache has none. The child loads the model again from
    ``model.source`` (what ``load_model`` was given). ``build``: where the child is kept
    while it runs (``Build.cancel`` stops it)."""
    source = getattr(model, "source", None)
    if source is None:
        raise ValueError("compile_mode aot needs a model from engine.load_model (the build runs "
                         "in a child process that loads it again)")
    kv_shape = tuple(kv_caches[0][0].shape)
    key = cache_key(model, kv_shape, max_batch)
    directory = cache_dir() / key
    directory.parent.mkdir(parents=True, exist_ok=True)
    # one build per key at a time: replicas of one gateway start together, and a second
    # build of the same programs would only take the first's CPU (the lock goes with the
    # process, however it ends)
    with open(directory.parent / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _load_or_build(model, source, directory, kv_shape, max_batch, key,
                              build or Build())


def _parent_death_signal():
    """A function for the build child to run before exec: a replica killed outright takes its
    build with it (Linux's parent-death signal) instead of leaving minutes of compiling
    behind. Resolved here, in the parent: after a fork beside other threads the child must not
    import anything. None where there is no prctl (the replica's close() still stops it)."""
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Build:
    """The build child of one ``load``, while it runs: ``cancel`` (from another thread) kills
    it, and ``load`` then raises ``BuildCancelled``."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.cancelled = False

    def run(self, cmd: list[str]) -> tuple[int, str]:
        """(exit code, stderr) of the child."""
        if self.cancelled:
            raise BuildCancelled("stopped: its engine closed")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True,
                                     preexec_fn=_parent_death_signal())
        try:
            _, err = self.proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if self.cancelled:
            raise BuildCancelled("stopped: its engine closed")
        return self.proc.returncode, err

    def cancel(self) -> None:
        self.cancelled = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


class BuildCancelled(Exception):
    pass


def _load_or_build(model, source: dict, directory: Path, kv_shape: tuple[int, ...],
                   max_batch: int, key: str, build: Build) -> AotDecode:
    for attempt in (0, 1):
        if not (directory / "ranges.json").exists():
            t = time.perf_counter()
            log.info("compiling the decode step ahead of time into %s (a child process; a few "
                     "minutes the first time)", directory)
            cmd = [sys.executable, "-m", "engine.aot", "--out", str(directory),
                   "--source", json.dumps(source), "--kv-shape", json.dumps(kv_shape),
                   "--max-batch", str(max_batch), "--key", key,
                   "--threads", str(torch.get_num_threads()),
                   "--switches", json.dumps({k: getattr(model, k) for k in SWITCHES})]
            code, err = build.run(cmd)
            if code != 0:
                raise RuntimeError(f"compile_mode aot: the build failed (exit "
                                   f"{code}): {err[-3000:]}")
            for line in err.splitlines():  # the child's own progress lines
                if " aot " in line:
                    log.info("build: %s", line.split(" aot ", 1)[1])
            log.info("decode step compiled ahead of time in %.1f s", time.perf_counter() - t)
        try:
            return AotDecode(model, directory)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            if attempt:
                raise
            log.warning("compiled decode step at %s does not load (%s): building it again",
                        directory, exc)
            shutil.rmtree(directory, ignore_errors=True)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile a model's decode step ahead of time "
                                            "(AOTInductor) into a directory of packages.")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--source", required=True, help="load_model's arguments, JSON")
    p.add_argument("--kv-shape", required=True, help="one KV cache tensor's shape, JSON")
    p.add_argument("--max-batch", required=True, type=int)
    p.add_argument("--key", help="the cache key the model loaded again must have (the parent's "
                                 "model's): a build for another model is refused")
    p.add_argument("--switches", default="{}", help="the decode path's switches set on the "
                                                    "parent's model after loading, JSON")
    p.add_argument("--threads", type=int, default=0, help="torch's threads in the process "
                                                          "that will run the programs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s aot %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine import load_model

    model = load_model(**json.loads(args.source))
    for name, value in json.loads(args.switches).items():
        if name not in SWITCHES:
            p.error(f"--switches: unknown {name!r}")
        setattr(model, name, value)
    kv_shape = tuple(json.loads(args.kv_shape))
    if args.key and cache_key(model, kv_shape, args.max_batch) != args.key:
        print("aot: the model loaded again here differs from the one to compile for (its "
              "tensors' shapes or formats, the kernels found, or an environment switch such as "
              "TAILSCOPE_NATIVE_KERNELS): not built", file=sys.stderr)
        return 3
    build(model, kv_shape, args.max_batch, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
