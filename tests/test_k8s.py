"""The Kubernetes manifests under deploy/k8s: every document validates against the Kubernetes
API schemas (kubernetes-validate, offline, strict), and what they wire together agrees: the
configuration they mount loads in Tailscope's own loaders, the remote gateway names exactly
the replica pods that connect to its outbox, probes and scrape annotations point at real
endpoints."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
VERSION = "1.37"


def documents() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


def test_every_manifest_validates_and_the_validator_can_fail():
    docs = documents()
    assert {"Deployment/tailscope-gateway", "Service/tailscope-gateway",
            "StatefulSet/tailscope-replica", "Service/tailscope-replica",
            "Deployment/tailscope-remote-gateway", "Service/tailscope-remote-gateway",
            "ConfigMap/tailscope-config", "NetworkPolicy/tailscope-gateway",
            "NetworkPolicy/tailscope-remote-gateway", "NetworkPolicy/tailscope-replica"
            } <= set(docs)
    for doc in docs.values():
        kubernetes_validate.validate(doc, VERSION, strict=True)
    broken = copy.deepcopy(docs["Deployment/tailscope-gateway"])
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readynessProbe"] = container.pop("readinessProbe")  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in K8S.glob("*.yaml")} - {
        "kustomization.yaml"}


def _replica_args(argv: list[str]):
    from engine.replica import parser

    return parser().parse_args(argv)  # exits (SystemExit) on a flag it does not know


def test_the_systemd_unit_runs_a_replica_command_the_replica_takes():
    import configparser

    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str
    unit.read(ROOT / "deploy" / "systemd" / "tailscope-replica@.service")
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[1:3] == ["-m", "engine.replica"] and unit["Service"]["Restart"] == "always"
    env = {"${TAILSCOPE_REPLICA_INBOX}": "tcp://0.0.0.0:5601",
           "${TAILSCOPE_GATEWAY_OUTBOX}": "tcp://gateway:5600", "%i": "gpu1"}
    args = _replica_args([env.get(a, a) for a in argv[3:]])
    assert (args.id, args.parent_pid, args.inbox) == ("gpu1", 0, "tcp://0.0.0.0:5601")
    assert args.engine_config_file == "/etc/tailscope/engine.yaml"
    service = unit["Service"]  # sandboxed: no privilege, a read-only system, private networks
    for directive, value in (("NoNewPrivileges", "true"), ("ProtectSystem", "strict"),
                             ("ProtectHome", "true"), ("PrivateDevices", "true"),
                             ("CapabilityBoundingSet", ""), ("IPAddressDeny", "any")):
        assert service[directive] == value, directive
    assert not {"any", "0.0.0.0/0", "::/0"} & set(service.get("IPAddressAllow", "").split())


def _container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def test_the_gateways_probe_scrape_and_load_the_mounted_config(tmp_path):
    from gateway.tenants import TenantRegistry
    from tailscope.engine_config import load

    docs = documents()
    data = docs["ConfigMap/tailscope-config"]["data"]
    (tmp_path / "engine.yaml").write_text(data["engine.yaml"])
    assert load(tmp_path / "engine.yaml").engine  # Tailscope's own loaders take them
    assert not TenantRegistry.from_file(K8S / "tenants.example.toml").open
    for name in ("Deployment/tailscope-gateway", "Deployment/tailscope-remote-gateway"):
        doc = docs[name]
        c = _container(doc)
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        ann = doc["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert "/etc/tailscope/engine.yaml" in c["command"]
        assert {"secretRef": {"name": "tailscope-secrets"}} in c["envFrom"]
        config = c["command"][c["command"].index("--config") + 1]
        mount = next(m for m in c["volumeMounts"] if config.startswith(m["mountPath"] + "/"))
        volume = next(v for v in doc["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "tailscope-tenants"  # API keys: a Secret
        env = {e["name"]: e for e in c["env"]}
        assert env["TAILSCOPE_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.name"  # one id per pod


def _secret_names(node) -> set[str]:
    """Every Secret a manifest refers to (env, envFrom, volumes)."""
    if isinstance(node, list):
        return set().union(*map(_secret_names, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    out = set().union(*map(_secret_names, node.values())) if node else set()
    for key in ("secretRef", "secretKeyRef"):
        if isinstance(node.get(key), dict):
            out.add(node[key]["name"])
    if isinstance(node.get("secret"), dict):
        out.add(node["secret"]["secretName"])
    return out


def test_no_secret_is_defined_only_referred_to():
    """Applying the files never overwrites the real secrets with placeholders: they define
    none, hold no placeholder, and refer only to the two Secrets config.yaml says to create."""
    docs = documents()
    assert not [name for name in docs if name.startswith("Secret/")]
    for path in K8S.glob("*.yaml"):
        assert "REPLACE-ME" not in path.read_text(), path
    assert _secret_names(list(docs.values())) == {"tailscope-secrets", "tailscope-tenants"}
    notes = (K8S / "config.yaml").read_text()
    assert "kubectl create secret generic tailscope-secrets" in notes
    assert "kubectl create secret generic tailscope-tenants" in notes


def _pods(docs: dict) -> dict[str, dict]:
    return {name: doc["spec"]["template"]["spec"] for name, doc in docs.items()
            if doc["kind"] in ("Deployment", "StatefulSet")}


def test_every_pod_runs_unprivileged_without_an_api_token():
    for name, pod in _pods(documents()).items():
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), (name, c["name"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "\nUSER 10001\n" in dockerfile  # the uid the pods name


def test_the_replica_link_ports_take_only_their_peers():
    docs = documents()
    policies = {n: d["spec"] for n, d in docs.items() if d["kind"] == "NetworkPolicy"}

    def allowed(pod_labels: dict, port: int) -> list:
        """The sources the policies selecting ``pod_labels`` allow on ``port``."""
        out = []
        for spec in policies.values():
            if spec["podSelector"]["matchLabels"].items() <= pod_labels.items():
                for rule in spec["ingress"]:
                    if any(p["port"] == port for p in rule["ports"]):
                        out.append(rule.get("from"))
        return out

    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in docs.items()
              if d["kind"] in ("Deployment", "StatefulSet")}
    replica = labels["StatefulSet/tailscope-replica"]
    remote = labels["Deployment/tailscope-remote-gateway"]
    assert allowed(replica, 5601) == [[{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "tailscope-remote-gateway"}}}]]
    assert allowed(remote, 5600) == [[{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "tailscope-replica"}}}]]
    assert allowed(remote, 8000) == [None]  # the API: anyone
    assert allowed(labels["Deployment/tailscope-gateway"], 8000) == [None]
    assert all(labels[n]["app.kubernetes.io/name"] for n in labels)


def test_the_remote_gateway_names_exactly_the_replica_pods_that_connect_to_it():
    docs = documents()
    sts = docs["StatefulSet/tailscope-replica"]
    gw = _container(docs["Deployment/tailscope-remote-gateway"])
    cmd = gw["command"]
    remotes = dict(cmd[i + 1].split("=", 1) for i, a in enumerate(cmd)
                   if a == "--remote-replica")
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    assert list(remotes) == pods
    assert all(addr == f"tcp://{pod}.{sts['spec']['serviceName']}:5601"
               for pod, addr in remotes.items())
    replica = shlex.split(_container(sts)["command"][-1])
    args = dict(zip(replica[::2], replica[1::2], strict=True))
    _replica_args(replica[replica.index("engine.replica") + 1:])  # the replica takes them
    outbox = args["--outbox"]
    service = docs["Service/tailscope-remote-gateway"]
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "outbox")
    assert outbox == f"tcp://{service['metadata']['name']}:{port}"
    env = {e["name"]: e for e in gw["env"]}
    assert env["TAILSCOPE_REPLICA_OUTBOX"]["value"] == f"tcp://0.0.0.0:{port}"
    assert args["--engine-config-file"] == "/etc/tailscope/engine.yaml"  # the gateway's file
    assert {e["name"] for e in _container(sts)["env"]} >= {"TAILSCOPE_REPLICA_KEY"}


# what a build's cache key or location depends on, besides the command line's model and engine
CACHE_ENV = ("TAILSCOPE_THREADS", "TAILSCOPE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
             "TAILSCOPE_AOT_CACHE_DIR", "TAILSCOPE_NATIVE_KERNELS")


def env(c: dict) -> dict:
    return {e["name"]: e.get("value") for e in c["env"]}


def test_the_replica_pods_prepare_their_caches_for_the_replica_that_runs_there():
    """The init container builds (``--prepare-only``) for the replica's own model, engine config
    and threads, into the cache volume the replica reads: a build for other settings would have
    another cache key and the replica would build again."""
    docs = documents()
    sts = docs["StatefulSet/tailscope-replica"]["spec"]["template"]["spec"]
    (init,) = sts["initContainers"]
    replica = _container(docs["StatefulSet/tailscope-replica"])
    prep = _replica_args(init["command"][init["command"].index("engine.replica") + 1:])
    argv = shlex.split(replica["command"][-1])
    run = _replica_args(argv[argv.index("engine.replica") + 1:])
    assert prep.prepare_only and not run.prepare_only
    assert (prep.model, prep.engine_config_file, prep.cpus) == \
        (run.model, run.engine_config_file, run.cpus)
    assert {k: env(init).get(k) for k in CACHE_ENV} == {k: env(replica).get(k) for k in CACHE_ENV}
    cache = env(init)["TAILSCOPE_CACHE_DIR"]
    for c in (init, replica):
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == cache]
        assert mount["name"] == "cache" and not mount.get("readOnly")
    assert env(init)["TORCHINDUCTOR_CACHE_DIR"].startswith(cache + "/")
    assert {"name": "cache", "emptyDir": {}} in sts["volumes"]


def test_the_gateway_pods_prepare_their_replicas_with_the_gateways_own_flags():
    """A gateway's own replicas: its init container (``tailscope serve --prepare-only``)
    prepares for the gateway's own serve flags (model, engine file, replica count) and
    settings, on the pod's volume that the gateway's container reads (a restarted container
    starts on a fresh filesystem and finds them there too)."""
    from tailscope.cli import build_parser

    gw = documents()["Deployment/tailscope-gateway"]
    pod = gw["spec"]["template"]["spec"]
    (gw_init,) = pod["initContainers"]
    serving = _container(gw)
    flags = [vars(build_parser().parse_args(c["command"][1:])) for c in (gw_init, serving)]
    assert flags[0].pop("prepare_only") and not flags[1].pop("prepare_only")
    for f in flags:  # what only the server uses
        for k in ("host", "port", "config", "access_log"):
            f.pop(k)
    assert flags[0] == flags[1] and flags[0]["engine_config"] == "/etc/tailscope/engine.yaml"
    keep = (*CACHE_ENV, "TAILSCOPE_MODEL", "TAILSCOPE_REPLICA_CPUS")
    assert {k: env(gw_init).get(k) for k in keep} == {k: env(serving).get(k) for k in keep}
    assert env(serving)["TAILSCOPE_THREADS"]  # torch's default would be every CPU of the node
    assert gw_init["envFrom"] == serving["envFrom"]
    gw_env = env(serving)
    for c in (gw_init, serving):
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == gw_env["TAILSCOPE_CACHE_DIR"]]
        assert {"name": mount["name"], "emptyDir": {}} in pod["volumes"]
        assert not mount.get("readOnly")
        assert any(m["name"] == "config" and m["mountPath"] == "/etc/tailscope"
                   for m in c["volumeMounts"])
    assert gw_env["TORCHINDUCTOR_CACHE_DIR"].startswith(gw_env["TAILSCOPE_CACHE_DIR"] + "/")
