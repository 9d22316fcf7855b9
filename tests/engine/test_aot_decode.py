"""``compile_mode: aot``: the decode step exported and compiled ahead of time (AOTInductor) in a
child process, cached on disk and loaded without dynamo. Its logits and KV writes are bitwise
those of ``compile_mode: jit`` (the same graph), an engine on it gives jit's tokens, a second
engine reuses the cache, a damaged cache is rebuilt, and a failed build is an error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, aot, load_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 300, 42, 9, 88, 123, 7], [3, 4, 5], list(range(40, 70)),
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
CONFIG = dict(dtype="bfloat16", weights="int4", output_weights="q8_0", kv_cache_mb=4,
              max_num_seqs=8, compile=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One AOT cache for the module (each build of the tiny model's programs takes ~15-30 s)."""
    path = tmp_path_factory.mktemp("aot-cache")
    old = os.environ.get("TAILSCOPE_AOT_CACHE_DIR")
    os.environ["TAILSCOPE_AOT_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        del os.environ["TAILSCOPE_AOT_CACHE_DIR"]
    else:
        os.environ["TAILSCOPE_AOT_CACHE_DIR"] = old


def tiny():
    return load_model("tiny", "bfloat16", weights="int4", output_weights="q8_0")


def engine(mode: str) -> Engine:
    return Engine(tiny(), EngineConfig(**CONFIG, compile_mode=mode))


def built_for(e: Engine) -> Path:
    """The cache directory of an engine's programs (its model, KV pool and batch bound)."""
    kv_shape = tuple(e.runner.kv_caches[0][0].shape)
    path = aot.cache_dir() / aot.cache_key(e.model, kv_shape, CONFIG["max_num_seqs"])
    assert (path / "ranges.json").exists()
    return path


def count_calls(e: Engine) -> list[int]:
    """The batch size of every call into the engine's compiled step, from now on (each passed
    on to it)."""
    calls: list[int] = []
    real = e.model._aot

    class Counting:
        def covers(self, b, w):
            return real.covers(b, w)

        def __call__(self, *args):
            calls.append(int(args[0].shape[0]))
            return real(*args)

    e.model.use_aot_decode(Counting())
    return calls


def generate(e: Engine) -> list[list[int]]:
    reqs = e.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    return [r.output_token_ids for r in reqs]


def test_an_engine_on_the_aot_step_gives_the_jit_engines_tokens_and_reuses_its_build(cache):
    aot_engine = engine("aot")
    built = built_for(aot_engine)
    index = json.loads((built / "ranges.json").read_text())
    # a batch of one, then two up to max_num_seqs: the tiny int4 model has no dense copies
    assert index["ranges"] == [[1, 1], [2, 8]]
    calls = count_calls(aot_engine)
    tokens = generate(aot_engine)
    assert {1, 2, 3, 4} & set(calls) and len(calls) > 20  # decode steps ran through it
    assert tokens == generate(engine("jit"))
    # a second engine of the same shape loads the same build
    mtime = (built / "ranges.json").stat().st_mtime_ns
    again = engine("aot")
    assert built_for(again) == built
    assert (built / "ranges.json").stat().st_mtime_ns == mtime
    assert again.runner.compile_s < 5  # loaded, not built
    assert generate(again) == tokens


def test_aot_logits_and_kv_writes_are_bitwise_the_jit_steps(cache):
    model = tiny()
    c = model.config
    # the engines' KV pool: the programs the test above built are loaded, not built again
    n = EngineConfig(**CONFIG, compile_mode="aot").num_blocks_for(c)
    shape = (n, 16, c.num_kv_heads, c.head_dim)
    kv_jit = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16())
              for _ in range(c.num_layers)]
    kv_aot = [(k.clone(), v.clone()) for k, v in kv_jit]
    compiled = aot.load(model, kv_aot, 8)
    model.compile_decode()
    for b in (1, 2, 5, 8):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(0, c.vocab_size, (b,), generator=g)
        pos = torch.randint(3, 40, (b,), generator=g)
        slots = torch.randperm(n * 16, generator=g)[:b]
        tables = torch.randint(0, n, (b, 3), generator=g)
        with torch.inference_mode():
            want = model._compiled_decode(ids, pos, slots, tables, pos + 1, kv_jit)
            got = compiled(ids, pos, slots, tables, pos + 1, kv_aot)
        assert got.shape == (b, c.vocab_size) and torch.equal(got, want), b
        assert all(torch.equal(x, y) for p, q in zip(kv_jit, kv_aot, strict=True)
                   for x, y in zip(p, q, strict=True)), b
    assert compiled.covers(8, n) and not compiled.covers(9, 2) and not compiled.covers(2, n + 1)


def test_a_replica_process_on_the_aot_step_never_imports_dynamo(cache):
    engine("aot")  # built (or already there)
    code = ("import sys, json; from engine import Engine, EngineConfig, SamplingParams, "
            "load_model\n"
            "m = load_model('tiny', 'bfloat16', weights='int4', output_weights='q8_0')\n"
            f"e = Engine(m, EngineConfig(**json.loads({json.dumps(json.dumps(CONFIG))}), "
            "compile_mode='aot'))\n"
            "r = e.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))\n"
            "print(json.dumps([len(r[0].output_token_ids), m._aot is not None, "
            "'torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [8, True, False, False]


def test_a_damaged_build_is_built_again(cache):
    model = tiny()
    e = engine("aot")
    built = built_for(e)
    for pt2 in built.glob("*.pt2"):
        pt2.write_bytes(b"not a package")
    again = Engine(model, EngineConfig(**CONFIG, compile_mode="aot"))
    assert all(p.stat().st_size > 1000 for p in built.glob("*.pt2"))
    assert generate(again) == generate(e)


def test_refusals_and_a_failed_build(cache, tmp_path):
    with pytest.raises(ValueError, match="compile_mode aot needs compile: true"):
        EngineConfig(compile_mode="aot")
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        EngineConfig(compile=True, compile_mode="ahead")
    bare = tiny()
    del bare.source  # as a model built by hand: nothing the child could load again
    with pytest.raises(ValueError, match="needs a model from engine.load_model"):
        Engine(bare, EngineConfig(compile=True, compile_mode="aot", kv_cache_mb=4))
    model = tiny()
    kv = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))]
    model.source = {**model.source, "model": str(tmp_path / "missing.gguf")}
    with pytest.raises(RuntimeError, match="(?s)the build failed.*missing.gguf does not exist"):
        aot.load(model, kv, 4)
    # the child loads another model than the parent's (here int4a8 weights for an int4
    # model): refused, not built under the parent's key
    model.source = {**model.source, "model": "tiny", "weights": "int4a8"}
    with pytest.raises(RuntimeError, match="differs from the one to compile for"):
        aot.load(model, kv, 4)
    assert not any(p.name.endswith(".pt2") for p in cache.rglob("*")
                   if aot.cache_key(model, (4, 16, 2, 16), 4) in str(p))
    # oneDNN's prepacked bf16 weights (weights: native) are opaque tensors: refused by name
    from kernels.linear import bf16_matmul_supported

    if bf16_matmul_supported():  # (elsewhere they stay plain tensors)
        with pytest.raises(ValueError, match="not plain CPU tensors"):
            aot.model_tensors(load_model("tiny", "bfloat16"))


def test_the_key_follows_what_the_programs_depend_on():
    model = tiny()
    shape = (4, 16, model.config.num_kv_heads, model.config.head_dim)
    key = aot.cache_key(model, shape, 4)
    assert aot.cache_key(tiny(), shape, 4) == key  # the same model again
    assert aot.cache_key(model, (8, *shape[1:]), 4) != key  # another KV pool
    assert aot.cache_key(model, shape, 5) != key  # another batch bound
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads % 2 + 1)  # inductor tiles for the threads it has
        assert aot.cache_key(model, shape, 4) != key
    finally:
        torch.set_num_threads(threads)
    model.direct_decode_attention = not model.direct_decode_attention
    assert aot.cache_key(model, shape, 4) != key
    int4a8 = load_model("tiny", "bfloat16", weights="int4a8", output_weights="int4")
    assert aot.cache_key(int4a8, shape, 4) != key


def test_two_engines_starting_together_build_once(cache, caplog):
    """Replicas of one gateway start together: the second waits for the first's build (a lock
    per key) and loads it."""
    import logging
    import threading

    caplog.set_level(logging.INFO, logger="engine.aot")
    models = [tiny(), tiny()]
    shape = (6, 16, models[0].config.num_kv_heads, models[0].config.head_dim)
    loaded, errors = [None, None], []

    def start(i: int) -> None:
        try:
            kv = [(torch.zeros(shape, dtype=torch.bfloat16),
                   torch.zeros(shape, dtype=torch.bfloat16)) for _ in models[i].layers]
            loaded[i] = aot.load(models[i], kv, 3)  # a batch bound no other test uses
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    builds = [r for r in caplog.records if "compiling the decode step" in r.getMessage()]
    assert len(builds) == 1, [r.getMessage() for r in builds]
    assert all(d is not None and d.covers(3, 6) and not d.covers(4, 2) for d in loaded)


def test_a_replica_prepared_ahead_loads_its_build_without_building(cache, tmp_path, monkeypatch,
                                                                   capsys):
    """``tailscope serve --prepare-only`` (an init container's command) runs each local
    replica's start ahead (``python -m engine.replica ... --prepare-only``, the pool's own
    command line): it builds what the start needs, binds nothing and exits 0, once for replicas
    that share the model, engine config and threads; an engine starting later on the same
    cache loads that build instead of compiling (its start in seconds, not minutes)."""
    from engine.replica import main as replica_main

    with pytest.raises(SystemExit):  # serving needs both addresses
        replica_main(["--id", "x", "--model", "tiny"])
    assert "--inbox and --outbox are required (unless --prepare-only)" in capsys.readouterr().err
    config = {**CONFIG, "max_num_seqs": 6, "compile_mode": "aot"}  # a key of its own
    fresh = tmp_path / "aot"
    engine_file = tmp_path / "engine.yaml"
    engine_file.write_text(json.dumps({"engine": config}))  # YAML reads JSON
    env = {**os.environ, "TAILSCOPE_AOT_CACHE_DIR": str(fresh), "TAILSCOPE_INSTANCE_ID": "gw",
           "TAILSCOPE_THREADS": str(torch.get_num_threads())}  # the key holds the threads
    env.pop("TAILSCOPE_REPLICA_CPUS", None)

    def prepare(model: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tailscope.cli", "serve", "--prepare-only",
                               "--model", model, "--tokenizer", "bundled", "--replicas", "2",
                               "--engine-config", str(engine_file)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)

    failed = prepare("tiny")  # a replica that cannot start: its error, and the status
    assert failed.returncode == 1 and "vocab size too small" in failed.stderr
    assert "replica gw/r0: preparing failed (exit status 1)" in failed.stderr
    model = "tiny:49152"  # sized for the bundled tokenizer, as the gateway's tests serve it
    proc = prepare(model)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(": prepared (") == 1 and "compile aot" in proc.stderr
    assert "replica gw/r0: prepared (" in proc.stderr
    assert "replica gw/r1: prepared by gw/r0 (same model, engine and threads)" in proc.stderr
    (built,) = [p.parent for p in fresh.glob("*/ranges.json")]
    mtime = (built / "ranges.json").stat().st_mtime_ns
    monkeypatch.setenv("TAILSCOPE_AOT_CACHE_DIR", str(fresh))
    e = Engine(load_model(model, "bfloat16", weights="int4", output_weights="q8_0"),
               EngineConfig(**config))
    assert e.runner.compile_s < 5  # loaded, not built
    assert (built / "ranges.json").stat().st_mtime_ns == mtime
    assert [p.parent for p in fresh.glob("*/ranges.json")] == [built]
    calls = count_calls(e)  # it decodes through them (their tokens are jit's: the first test)
    assert all(len(t) == 24 for t in generate(e)) and len(calls) > 20


def test_an_engine_serves_eagerly_while_its_step_builds_then_swaps_it_in(cache):
    """A replica's start: ``defer_compile`` then ``start_compile`` builds in the background
    (a build of its own: a batch bound no other test uses) while requests run on the eager
    step; ``poll_compile`` between two steps swaps the build in, and no request is lost."""
    config = EngineConfig(**{**CONFIG, "max_num_seqs": 5}, compile_mode="aot")
    e = Engine(tiny(), config, defer_compile=True)
    assert e.runner.compile_state == "deferred" and e.model._aot is None
    e.runner.start_compile()
    assert e.runner.compile_state in ("compiling", "compiled")
    served = generate(e)  # steps run meanwhile (eagerly, while it builds)
    assert [len(t) for t in served] == [24] * len(PROMPTS)
    build = e.runner._build
    if build is not None:
        build[1].join(600)
    e.step()  # an idle step swaps it in
    assert e.runner.compile_state == "compiled" and e.runner._build is None
    calls = count_calls(e)
    assert [len(t) for t in generate(e)] == [24] * len(PROMPTS) and len(calls) > 20
    # a second engine of the same shape finds the build and loads it at start_compile
    again = Engine(tiny(), config, defer_compile=True)
    again.runner.start_compile()
    assert again.runner.compile_state == "compiled" and again.model._aot is not None


def test_a_background_build_stops_with_its_engine_and_a_failed_one_leaves_it_eager(
        cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TAILSCOPE_AOT_CACHE_DIR", str(tmp_path / "aot"))
    e = Engine(tiny(), EngineConfig(**CONFIG, compile_mode="aot"), defer_compile=True)
    e.runner.start_compile()
    build, thread, _ = e.runner._build
    assert e.runner.compile_state == "compiling"
    while build.proc is None and thread.is_alive():  # the child is being started
        thread.join(0.05)
    e.runner.close()  # a replica shutting down: the child goes with it
    thread.join(60)
    assert not thread.is_alive() and build.proc.poll() is not None
    e.step()
    assert e.runner.compile_state.startswith("failed") and e.model._aot is None
    assert not any((tmp_path / "aot").glob("*/ranges.json"))
    assert [len(t) for t in generate(e)] == [24] * len(PROMPTS)  # still serving, eagerly
