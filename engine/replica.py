"""An engine replica: one OS process that owns a model and its KV cache.

    python -m engine.replica --id r0 --model bundled --inbox ipc:///tmp/r0.in \
        --outbox ipc:///tmp/r0.out [--engine-config '{"max_num_seqs": 8}'] [--tokenizer PATH]

It PULLs ``ToReplica`` messages and PUSHes ``FromReplica`` messages (ZeroMQ). The gateway starts
its own replicas over ``ipc://``; a replica on another host binds a ``tcp://`` inbox and
connects to the gateway's ``tcp://`` outbox, and then every message both ways is sealed for its
link (``engine.link``) with its own key (``TAILSCOPE_REPLICA_LINK_KEY``, from ``tailscope
replica-key ID``; or derived from the fleet's ``TAILSCOPE_REPLICA_KEY``): one that does not
verify, is not for its session or replays an earlier frame is dropped and counted. On a signed
link it speaks once the gateway has said ``Hello``. The loop: apply every waiting message, run
one engine step when there is work, report the step's token deltas and stats; when idle, block
on the inbox. A ``Health`` message is sent once the model is loaded and warmed up (on a signed
link: in answer to the gateway's ``Hello``), then every ``HEALTH_EVERY_S``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys
import time

import msgspec
import zmq

from engine.config import EngineConfig
from engine.cpus import format_cpus, move_threads, parse_cpus, torch_threads
from engine.link import ReplicaLink, link_key, unseal
from engine.llm_engine import Engine, RequestOutput
from engine.loader import load_configured
from engine.profiles import PRODUCT_DEFAULT
from engine.protocol import (
    MAX_MESSAGE_BYTES,
    AbortRequest,
    AddRequest,
    Health,
    Heartbeat,
    Hello,
    PauseRequest,
    ResumeRequest,
    Shutdown,
    StepReport,
    StopRequest,
    TokenDelta,
    decode_to_replica,
    encode,
)
from engine.sampling_params import SamplingParams
from tailscope import env
from tailscope.keys import check_key

log = logging.getLogger("engine.replica")
IDLE_POLL_MS = 100
HEARTBEAT_S = 0.5  # at least one message this often while the loop runs
HEALTH_EVERY_S = 5.0  # a Health in place of a heartbeat this often


def _delta(out: RequestOutput, engine: Engine, now_ns: int) -> TokenDelta:
    req = engine.get_request(out.request_id)
    return TokenDelta(
        request_id=out.request_id, token_ids=out.new_token_ids, state=out.state.name,
        finish_reason=out.finish_reason, stop_reason=req.stop_reason if req else None,
        error=out.error,
        stats=out.stats,
        logprobs=[(lp.logprob, list(lp.top)) for lp in out.new_logprobs if lp is not None]
        if any(lp is not None for lp in out.new_logprobs) else None,
        prompt_logprobs=None if out.prompt_logprobs is None else
        [None if lp is None else (lp.logprob, list(lp.top)) for lp in out.prompt_logprobs],
        step=out.step,
        sent_ms=(now_ns - req.arrival_ns) / 1e6 if req is not None else 0.0,
    )


def control(engine: Engine, msg) -> bool:
    """Apply a per-request control message (abort, stop, pause, resume) to the engine; False
    if ``msg`` is not one. Shared by the replica process and the in-process backend."""
    if isinstance(msg, AbortRequest):
        engine.abort(msg.request_id, error=msg.error)
    elif isinstance(msg, StopRequest):
        engine.stop(msg.request_id, msg.stop_reason)
    elif isinstance(msg, PauseRequest):
        engine.pause(msg.request_id)
    elif isinstance(msg, ResumeRequest):
        engine.resume(msg.request_id)
    else:
        return False
    return True


def step_report(replica_id: str, engine: Engine, outputs: list[RequestOutput],
                steps_before: int) -> StepReport | None:
    """What one ``engine.step()`` produced, as the gateway receives it (None: nothing ran and
    nothing ended). Also used by the gateway's in-process backend, so both paths agree."""
    ran = engine.step_count > steps_before
    if not outputs and not ran:
        return None
    usage = engine.kv.usage()
    now = time.monotonic_ns()
    return StepReport(
        replica_id, [_delta(o, engine, now) for o in outputs],
        engine.observer.steps[-1] if ran else None,
        running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
        kv_blocks_used=usage.blocks_used, kv_blocks_total=usage.blocks_total,
        kv_books={**dataclasses.asdict(engine.kv.pool.counters),
                  "reserved": usage.blocks_reserved, "cached": usage.blocks_cached,
                  "swaps": engine.swaps, "preemptions": engine.preemptions})


class Replica:
    def __init__(self, replica_id: str, engine: Engine, inbox: str, outbox: str,
                 parent_pid: int | None = None, key: bytes | None = None) -> None:
        self.id = replica_id
        self.parent_pid = parent_pid
        # key: this replica's link key (None: an unsigned ipc:// link)
        self.link = ReplicaLink(replica_id, key) if key else None
        self.hello_from: bytes | None = None  # a gateway session to answer with a Health
        self.rejected = 0  # inbox messages that did not verify or replayed an earlier one
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self.last_health = 0.0
        self.engine = engine
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.inbox.bind(inbox)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(outbox)
        self.running = True
        self.last_sent = 0.0

    def warm_up(self) -> None:
        warm_up(self.engine)

    def health(self, detail: str = "") -> Health:
        import torch  # loaded with the engine already

        mc = self.engine.model.config
        return Health(self.id, True, mc.name, mc.revision, self.engine.kv.pool.num_blocks,
                      self.engine.max_model_len, detail, self.incarnation, self.rejected,
                      json.dumps(self.engine.config.as_dict(), sort_keys=True),
                      torch.get_num_threads(), self.engine.runner.compile_state)

    def _open(self, frame: bytes):
        """The message in ``frame``; None when it must be dropped (``rejected`` counts those
        that fail the link's checks)."""
        data = frame
        if self.link is not None:
            sealed = unseal(frame, lambda rid: self.link.key if rid == self.id else None)
            if sealed is None:
                return self._reject()
            data = sealed.data
        try:
            msg = decode_to_replica(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.error("replica %s: bad message: %s", self.id, exc)
            return None
        if self.link is not None:
            if not self.link.accept(sealed, isinstance(msg, Hello)):
                return self._reject()
            if isinstance(msg, Hello):
                self.hello_from = sealed.sender
        return msg

    def _reject(self) -> None:
        self.rejected += 1
        if self.rejected & (self.rejected - 1) == 0:  # 1st, 2nd, 4th, ...: not a flood
            log.warning("replica %s: dropped a message that failed its signature or replay "
                        "check (%d so far): a sender without its key, or a replay", self.id,
                        self.rejected)

    def handle(self, frame: bytes) -> None:
        msg = self._open(frame)
        if msg is None or isinstance(msg, Hello):
            return
        if control(self.engine, msg):
            pass
        elif isinstance(msg, AddRequest):
            try:  # a rejection is reported by the next step's outputs
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                        msg.deadline_s, queue_timeout_s=msg.queue_timeout_s,
                                        cache_salt=msg.cache_salt, branch_of=msg.branch_of)
            except ValueError as exc:  # duplicate live id: a gateway bug, never fatal here
                log.error("replica %s: %s", self.id, exc)
        elif isinstance(msg, Shutdown):
            self.running = False

    def send(self, msg, to: bytes | None = None) -> None:
        """Send to the gateway (on a signed link: the session ``to``, else the one it talks
        to; nothing before a gateway said Hello)."""
        for data in frames(msg, too_big=lambda rid: self.engine.abort(rid, error="too big")):
            if self.link is not None:
                data = self.link.seal(data, to)
                if data is None:
                    return
            self.outbox.send(data)
        self.last_sent = time.monotonic()
        if isinstance(msg, Health):
            self.last_health = self.last_sent

    def serve(self) -> None:
        self.send(self.health())
        while self.running:
            now = time.monotonic()
            if now - self.last_health >= HEALTH_EVERY_S:
                self.send(self.health())
            elif now - self.last_sent >= HEARTBEAT_S:
                self.send(Heartbeat(self.id, self.engine.step_count))
            if orphaned(self.parent_pid):  # the gateway died without telling us: do not linger
                log.error("replica %s: parent process %s is gone; exiting", self.id,
                          self.parent_pid)
                break
            timeout = 0 if self.engine.has_unfinished() else IDLE_POLL_MS
            if self.inbox.poll(timeout):
                while True:
                    try:
                        self.handle(self.inbox.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if self.hello_from is not None:  # once for all the Hellos that waited
                self.send(self.health(), to=self.hello_from)
                self.hello_from = None
            if not self.running:
                break
            steps_before = self.engine.step_count
            compile_state = self.engine.runner.compile_state
            report = step_report(self.id, self.engine, self.engine.step(), steps_before)
            if report is not None:  # every tick is reported: the store keeps engine_steps
                self.send(report)
            if self.engine.runner.compile_state != compile_state:  # compiled (or failed)
                self.send(self.health())
        self.engine.runner.close()
        self.inbox.close(linger=0)
        self.outbox.close(linger=1000)
        self.ctx.term()


def frames(msg, limit: int = MAX_MESSAGE_BYTES - 1024, too_big=lambda request_id: None
           ) -> list[bytes]:
    """``msg`` encoded in frames the gateway takes: a step report over ``limit`` is sent as
    several, its deltas split between them (the step's stats with the first); one delta that
    alone passes it (prompt logprobs of a prompt far past any context length) ends its
    request with an error instead, and ``too_big(request_id)`` is called."""
    data = encode(msg)
    if len(data) <= limit or not isinstance(msg, StepReport):
        return [data]
    if len(msg.deltas) > 1:
        half = len(msg.deltas) // 2
        first = msgspec.structs.replace(msg, deltas=msg.deltas[:half])
        rest = msgspec.structs.replace(msg, deltas=msg.deltas[half:], stats=None)
        return frames(first, limit, too_big) + frames(rest, limit, too_big)
    for d in msg.deltas:
        too_big(d.request_id)
    failed = [TokenDelta(d.request_id, [], "FAILED", finish_reason="error",
                         error=f"its output ({len(data)} bytes in one step) passes the replica "
                               f"link's {MAX_MESSAGE_BYTES} byte message limit")
              for d in msg.deltas]
    return [encode(msgspec.structs.replace(msg, deltas=failed))]


def warm_up(engine: Engine) -> None:
    """One short request through the engine before it serves: the first steps build what a
    replica builds lazily (our kernels, ``compile_mode: jit``'s compiled step)."""
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))


def orphaned(parent_pid: int | None) -> bool:
    """Whether the process that started this replica is gone. Its pid is compared with our
    parent's *now*: a reparented process (to init or a subreaper) has another parent pid. The pid
    must be the one the spawner passed (``--parent-pid``), not ``getppid()`` read after the slow
    start (imports, model load, warm-up): a parent that died during the start would be missed."""
    return parent_pid is not None and os.getppid() != parent_pid


def replica_key(replica_id: str) -> bytes | None:
    """This replica's link key: ``TAILSCOPE_REPLICA_LINK_KEY`` as given, else derived from the
    fleet's ``TAILSCOPE_REPLICA_KEY`` (which could speak for any replica); None: neither."""
    own, fleet = env.replica_keys()
    check_key("TAILSCOPE_REPLICA_LINK_KEY", own)
    check_key("TAILSCOPE_REPLICA_KEY", fleet)
    if own:
        return own.encode()
    return link_key(fleet.encode(), replica_id) if fleet else None


def _cpus_arg(spec: str) -> frozenset[int]:
    try:
        return parse_cpus(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    """The command line (the deployment files' commands are checked against it)."""
    p = argparse.ArgumentParser(description="Tailscope engine replica process")
    p.add_argument("--id", required=True)
    p.add_argument("--model", default="bundled")
    p.add_argument("--engine-config", default="{}",
                   help="the EngineConfig as JSON (omitted settings keep their defaults; the "
                        "profile's is fast, or TAILSCOPE_PROFILE's)")
    p.add_argument("--engine-config-file", metavar="FILE",
                   help="a `tailscope serve --engine-config` file: its engine settings (a remote "
                        "replica must run its gateway's)")
    p.add_argument("--tokenizer", help="tokenizer (GGUF/HF dir) enabling response_format")
    p.add_argument("--cpus", type=_cpus_arg, metavar="LIST",
                   help="run on these CPUs only (a list like 2 or 0-3,6; the gateway passes "
                        "each replica its part of TAILSCOPE_REPLICA_CPUS), one torch thread "
                        "per CPU unless TAILSCOPE_THREADS is set")
    p.add_argument("--inbox", help="the address to PULL messages on (required unless "
                                    "--prepare-only)")
    p.add_argument("--outbox", help="the gateway's address to PUSH messages to (required "
                                     "unless --prepare-only)")
    p.add_argument("--prepare-only", action="store_true",
                   help="build what this replica's start needs and exit 0: the model loaded, "
                        "the engine made (compile_mode aot's build, cached under "
                        "TAILSCOPE_AOT_CACHE_DIR) and warmed up (our kernels and jit's "
                        "compiled step, cached under TAILSCOPE_CACHE_DIR and inductor's cache), "
                        "with no sockets bound: an init container's or deploy step's command, "
                        "so that a replica (re)starting on the same caches loads in seconds")
    p.add_argument("--parent-pid", type=int,
                   help="exit when this process is no longer our parent (the gateway passes its "
                        "own pid); default: the parent at start. 0 turns the check off")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not args.prepare_only and not (args.inbox and args.outbox):
        p.error("--inbox and --outbox are required (unless --prepare-only)")
    try:
        key = replica_key(args.id)
    except ValueError as exc:
        p.error(str(exc))
    if not key and any(a.startswith("tcp://") for a in (args.inbox or "", args.outbox or "")):
        p.error("a tcp:// inbox or outbox needs TAILSCOPE_REPLICA_LINK_KEY (`tailscope "
                "replica-key ID` prints it) or the fleet's TAILSCOPE_REPLICA_KEY: every "
                "message is signed with it")
    parent_pid = None if args.parent_pid == 0 else (args.parent_pid or os.getppid())
    if orphaned(parent_pid):
        return 1
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s replica {args.id} %(message)s")
    if args.cpus is not None:
        try:  # every thread (importing torch started some), before torch's pool exists
            move_threads(args.cpus)
        except OSError as exc:  # a CPU this host does not have (or cgroups do not allow)
            p.error(f"--cpus {format_cpus(args.cpus)}: {exc.strerror}")
    threads = torch_threads(args.cpus)
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        values = json.loads(args.engine_config)
        if args.engine_config_file:  # the gateway's config file: the same settings, one source
            import yaml

            with open(args.engine_config_file) as f:
                values = (yaml.safe_load(f) or {}).get("engine") or {}
        if not isinstance(values, dict):
            raise ValueError("--engine-config must be a JSON object")
        # the product's profile (or TAILSCOPE_PROFILE's) unless the config names one (the
        # gateway's always does)
        profile = env.profile() or PRODUCT_DEFAULT
        config = EngineConfig.from_mapping({"profile": profile, **values}, "--engine-config")
    except (ValueError, OSError) as exc:  # json's errors are ValueErrors too
        p.error(str(exc))
    except Exception as exc:  # a YAML syntax error in the file
        p.error(f"--engine-config-file {args.engine_config_file}: {exc}")
    model = load_configured(args.model, config)
    grammar = None
    if args.tokenizer:
        from engine.constrained import GrammarCompiler
        from engine.text import load_tokenizer

        grammar = GrammarCompiler.from_tokenizer(load_tokenizer(args.tokenizer),
                                                 model.config.vocab_size)
    if orphaned(parent_pid):  # died while we loaded: do not bind, warm up or serve
        log.error("replica %s: parent process %s is gone; exiting", args.id, parent_pid)
        return 1
    # a replica serves as soon as it is warm; the compiled step builds meanwhile (prepare
    # builds it here, to exit with the cache filled)
    engine = Engine(model, config, grammar=grammar, defer_compile=not args.prepare_only)
    if args.prepare_only:
        t = time.perf_counter()
        warm_up(engine)
        c = engine.config
        log.info("replica %s: prepared (model %s, dtype %s, weights %s, compile %s: built or "
                 "loaded in %.1f s; warm-up %.1f s): exiting", args.id, model.config.name,
                 c.dtype, c.weights, c.compile_mode if c.compile else "off",
                 engine.runner.compile_s, time.perf_counter() - t)
        return 0
    replica = Replica(args.id, engine, args.inbox, args.outbox, parent_pid, key)
    replica.warm_up()
    engine.runner.start_compile()  # loaded now if cached, else built in the background
    # Everything loaded so far (torch, the model, the tokenizer index) lives as long as the
    # process: keep it out of the collector's full passes, which otherwise walked it all between
    # two engine steps and stalled the step loop for 40-120 ms at a time under load (every
    # request waiting then, seen in bench/policies.py's light tenant's tail).
    gc.collect()
    gc.freeze()
    replica.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
