"""deploy/k8s: every manifest against the Kubernetes JSON schemas (kubernetes-validate, strict:
unknown fields are errors), the kustomizations rendered by kustomize (kubectl's, when installed),
and what the manifests promise each other (labels, ports, probes, the journal's volume, the Redis
URL)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_files import (
    GRPC_PORT,
    K8S,
    REDIS_PORT,
    dockerfile_env,
    final_stage,
    healthcheck_in_image,
    healthcheck_module,
    k8s_base,
    k8s_resources,
    kustomizations,
    load_docs,
    tool,
)

# The oldest version with GA gRPC probes, and the newest the validator ships.
VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
SERVER_LABELS = {"app.kubernetes.io/name": "draftcache", "app.kubernetes.io/component": "server"}
SERVER = ("StatefulSet", "draftcache")


def validate(doc: dict[str, Any], version: str) -> None:
    """Strict schema validation; a kind without a schema is an error too (the CLI only warns)."""
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "path,doc",
    [pytest.param(p, d, id=f"{p.relative_to(K8S)}:{d['kind']}") for p, d in k8s_resources()],
)
def test_manifest_matches_the_kubernetes_schema(path: Path, doc: dict[str, Any], version: str) -> None:
    validate(doc, version)


def test_the_validator_rejects_broken_manifests() -> None:
    workload = k8s_base(*SERVER)
    typo = copy.deepcopy(workload)
    container = typo["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grpcc"] = container["readinessProbe"].pop("grpc")  # unknown field
    named_port = copy.deepcopy(workload)
    # gRPC probes take a number; a port name is a schema error (unlike httpGet/tcpSocket).
    named_port["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"
    wrong_type = copy.deepcopy(workload)
    wrong_type["spec"]["replicas"] = "two"
    for broken in (typo, named_port, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken, VERSIONS[-1])
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        validate({**workload, "apiVersion": "apps/v1beta9"}, VERSIONS[-1])


def test_manifests_are_namespace_agnostic() -> None:
    for path, doc in k8s_resources():
        assert "namespace" not in doc["metadata"], path
    for k in kustomizations():
        assert "namespace" not in load_docs(k)[0], k


def test_every_manifest_is_in_a_kustomization() -> None:
    listed = set()
    for k in kustomizations():
        for entry in load_docs(k)[0].get("resources", []):
            target = (k.parent / entry).resolve()
            assert target.exists(), f"{k}: {entry} does not exist"
            listed.add(target)
    # Examples are documentation, not resources (the overlay's Secret is the operator's).
    unlisted = {p for p, _ in k8s_resources() if p.resolve() not in listed and not p.name.endswith(".example.yaml")}
    assert not unlisted


def kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_default_kustomization_renders_the_service_and_its_redis() -> None:
    docs = kustomize(K8S)
    for doc in docs:
        validate(doc, VERSIONS[-1])
    assert set(by_kind(docs)) == {
        ("ConfigMap", "draftcache"),
        ("StatefulSet", "draftcache"),
        ("Service", "draftcache"),
        ("Service", "draftcache-headless"),
        ("PodDisruptionBudget", "draftcache"),
        ("Service", "draftcache-redis"),
        ("StatefulSet", "draftcache-redis"),
        ("NetworkPolicy", "draftcache-redis"),
    }


def test_the_external_redis_overlay_takes_the_url_from_a_secret() -> None:
    docs = by_kind(kustomize(K8S / "overlays" / "external-redis"))
    for doc in docs.values():
        validate(doc, VERSIONS[-1])
    assert not [key for key in docs if "redis" in key[1]], "the in-cluster Redis is removed"
    assert "DRAFTCACHE_REDIS_URL" not in docs[("ConfigMap", "draftcache")]["data"]
    workload = docs[SERVER]
    env = {e["name"]: e for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["DRAFTCACHE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    example = load_docs(K8S / "overlays" / "external-redis" / "secret.example.yaml")[0]
    assert ref["name"] == example["metadata"]["name"] and ref["key"] in example["stringData"]
    # The patch merges into the service's StatefulSet: its journal keeps its claim.
    assert journal_claim(workload) == journal_claim(k8s_base(*SERVER))


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def test_the_tls_overlay_serves_tls_and_probes_over_it() -> None:
    """Kubernetes' native grpc: probes speak plaintext only: against a server serving TLS they
    never succeed and no pod is ever ready. The overlay probes with the image's check script,
    which speaks TLS from the server's own variables, and gives it longer than its deadline."""
    script = healthcheck_module()
    docs = by_kind(kustomize(K8S / "overlays" / "tls"))
    for doc in docs.values():
        validate(doc, VERSIONS[-1])
    workload = docs[SERVER]
    pod = workload["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    for probe in PROBES:
        assert "grpc" not in c[probe], probe
        assert c[probe]["exec"]["command"] == ["python", healthcheck_in_image()], probe
        assert c[probe]["timeoutSeconds"] > script.DEFAULT_TIMEOUT_S, probe
    # The certificate and key are the Secret's (kubernetes.io/tls keys), mounted read-only.
    mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert mount["readOnly"] is True
    secret = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]
    assert secret["secretName"] == "draftcache-tls"
    assert env["DRAFTCACHE_TLS_CERT"] == f"{mount['mountPath']}/tls.crt"
    assert env["DRAFTCACHE_TLS_KEY"] == f"{mount['mountPath']}/tls.key"
    # The name checked is the Service's, which the certificate must carry.
    assert env["DRAFTCACHE_TLS_SERVER_NAME"] == docs[("Service", "draftcache")]["metadata"]["name"]
    # Files of mode 0440 under the pod's fsGroup: the non-root server can read them.
    assert secret["defaultMode"] & 0o040 and pod["securityContext"]["fsGroup"] == 10001
    assert journal_claim(workload) == journal_claim(k8s_base(*SERVER))


def test_the_base_probes_are_plaintext_grpc() -> None:
    """The base serves plaintext, where native grpc: probes work: no TLS setting may creep into
    it without the overlay's probes."""
    data = k8s_base("ConfigMap", "draftcache")["data"]
    assert not {k for k in data if k.startswith("DRAFTCACHE_TLS_")}
    c = server_container()
    assert all("grpc" in c[probe] for probe in PROBES)


def test_every_patch_names_a_resource_of_the_base() -> None:
    """A patch whose kind or name the base no longer has fails the overlay's build (kustomize
    finds nothing to patch): caught here without kubectl too."""
    base = {(d["kind"], d["metadata"]["name"]) for _, d in k8s_resources()}
    for k in kustomizations():
        for patch in load_docs(k)[0].get("patches", []):
            if "path" in patch:
                doc = load_docs(k.parent / patch["path"])[0]
                assert (doc["kind"], doc["metadata"]["name"]) in base, f"{k}: {patch['path']}"
            else:
                assert (patch["target"]["kind"], patch["target"]["name"]) in base, f"{k}: {patch['target']}"


def server_container() -> dict[str, Any]:
    containers = k8s_base(*SERVER)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_server_runs_two_replicas_with_grpc_health_probes() -> None:
    workload = k8s_base(*SERVER)
    assert workload["spec"]["replicas"] == 2
    assert workload["spec"]["selector"]["matchLabels"] == SERVER_LABELS
    assert workload["spec"]["template"]["metadata"]["labels"] == SERVER_LABELS
    # The replicas are independent: one that is not ready holds no other back.
    assert workload["spec"]["podManagementPolicy"] == "Parallel"
    # The governing Service (per-replica DNS names) is the headless one over the replicas.
    governing = k8s_base("Service", workload["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None" and governing["spec"]["selector"] == SERVER_LABELS
    c = server_container()
    assert c["args"] == ["serve"]
    assert {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"} in c["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # The native probe calls grpc.health.v1.Health/Check; "" (the default) is the whole server.
        assert c[probe]["grpc"] == {"port": GRPC_PORT}, probe
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), kind


def test_server_runs_as_the_image_user_on_a_read_only_root() -> None:
    pod = k8s_base(*SERVER)["spec"]["template"]["spec"]
    user = next(c.value[0] for c in final_stage() if c.cmd.upper() == "USER")
    assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == user
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = server_container()
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # What the image writes must land on a mounted volume: the numba cache, HOME / --data-dir.
    mounts = [Path(m["mountPath"]) for m in c["volumeMounts"]]
    env = dockerfile_env()
    for var in ("NUMBA_CACHE_DIR", "HOME", "DRAFTCACHE_DATA_DIR"):
        path = Path(env[var])
        assert any(path == m or m in path.parents for m in mounts), var


def test_services_select_the_replicas_on_the_grpc_port() -> None:
    plain, headless = k8s_base("Service", "draftcache"), k8s_base("Service", "draftcache-headless")
    assert plain["spec"]["type"] == "ClusterIP"
    assert headless["spec"]["clusterIP"] == "None"
    ports = {p["name"]: p["containerPort"] for p in server_container()["ports"]}
    for service in (plain, headless):
        assert service["spec"]["selector"] == SERVER_LABELS
        (port,) = service["spec"]["ports"]
        assert port["port"] == GRPC_PORT and ports[port["targetPort"]] == GRPC_PORT


def test_disruption_budget_keeps_a_replica() -> None:
    pdb = k8s_base("PodDisruptionBudget", "draftcache")
    workload = k8s_base(*SERVER)
    assert pdb["spec"]["selector"]["matchLabels"] == SERVER_LABELS
    spare = workload["spec"]["replicas"] - pdb["spec"]["minAvailable"]
    assert spare >= 1 and pdb["spec"]["minAvailable"] >= 1
    # A rollout takes replicas down no faster than the budget lets a drain (1 at a time by default).
    strategy = workload["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy.get("rollingUpdate", {}).get("maxUnavailable", 1) <= spare


# Kubernetes quantities, as a volume claim's storage request is written.
QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity)
    assert match and match.group(2) in QUANTITY_UNITS, quantity
    return int(match.group(1)) * QUANTITY_UNITS[match.group(2)]


def data_dir() -> Path:
    """``--data-dir`` in the pod: the ConfigMap's setting, else the image's."""
    var = "DRAFTCACHE_DATA_DIR"
    return Path(k8s_base("ConfigMap", "draftcache")["data"].get(var) or dockerfile_env()[var])


def journal_claim(workload: dict[str, Any]) -> dict[str, Any]:
    """The volume claim template of the volume mounted at ``--data-dir`` (the commit journal)."""
    pod = workload["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    path = data_dir()
    holding = [m for m in container["volumeMounts"] if Path(m["mountPath"]) in (path, *path.parents)]
    name = max(holding, key=lambda m: len(Path(m["mountPath"]).parts))["name"]  # the innermost
    assert name not in {v["name"] for v in pod.get("volumes", [])}, f"{path} is on pod volume {name!r}"
    claims = {c["metadata"]["name"]: c for c in workload["spec"].get("volumeClaimTemplates", [])}
    assert name in claims, f"{path} is on {name!r}, no volume claim template"
    return claims[name]


def test_the_journal_is_on_a_claim_that_outlives_the_pod() -> None:
    """--data-dir holds the journal of acknowledged commits that Redis has not taken yet. On an
    emptyDir a rollout, an eviction or a lost node would delete them with the pod; on the
    StatefulSet's claim the replica's replacement gets the same volume and replays them."""
    claim = journal_claim(k8s_base(*SERVER))
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    requested = quantity_bytes(claim["spec"]["resources"]["requests"]["storage"])
    data = k8s_base("ConfigMap", "draftcache")["data"]
    capacity_mb = int(data["DRAFTCACHE_JOURNAL_CAPACITY_MB"])
    processes = int(data.get("DRAFTCACHE_PROCESSES", 1))  # each worker journals apart
    assert requested > processes * (capacity_mb << 20)  # serve reads the capacity in MiB
    # Neither deleting the StatefulSet nor scaling it down deletes a claim still holding commits.
    retention = k8s_base(*SERVER)["spec"].get("persistentVolumeClaimRetentionPolicy", {})
    assert retention.get("whenDeleted", "Retain") == retention.get("whenScaled", "Retain") == "Retain"


def test_a_journal_on_an_empty_dir_is_caught() -> None:
    workload = copy.deepcopy(k8s_base(*SERVER))
    (claim,) = workload["spec"].pop("volumeClaimTemplates")
    workload["spec"]["template"]["spec"]["volumes"].append({"name": claim["metadata"]["name"], "emptyDir": {}})
    with pytest.raises(AssertionError, match="on pod volume"):
        journal_claim(workload)
    # Binary and decimal units, as a claim may be sized either way.
    assert quantity_bytes("64Mi") == 64 << 20 and quantity_bytes("1G") == 10**9


def test_redis_is_persistent_and_reachable_at_the_configured_url() -> None:
    redis = k8s_base("StatefulSet", "draftcache-redis")
    service = k8s_base("Service", "draftcache-redis")
    assert redis["spec"]["serviceName"] == service["metadata"]["name"]
    pod = redis["spec"]["template"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"] == redis["spec"]["selector"]["matchLabels"]
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert args[args.index("--dir") + 1] == mount["mountPath"]
    assert service["spec"]["ports"][0]["port"] == REDIS_PORT
    url = k8s_base("ConfigMap", "draftcache")["data"]["DRAFTCACHE_REDIS_URL"]
    assert url == f"redis://{service['metadata']['name']}:{REDIS_PORT}/0"


def test_redis_refuses_writes_before_its_container_is_killed() -> None:
    """noeviction acts only under a maxmemory: without one, Redis grows into the container's
    memory limit and is OOM-killed (again at every restart, loading the same AOF). Under it,
    Redis refuses writes and the service journals the commits."""
    redis = k8s_base("StatefulSet", "draftcache-redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert "--maxmemory" in args, "noeviction without --maxmemory never refuses a write"
    maxmemory = redis_bytes(args[args.index("--maxmemory") + 1])
    limit = quantity_bytes(container["resources"]["limits"]["memory"])
    # Room beside the data for an AOF rewrite's fork (copy-on-write) and the buffers.
    assert 0 < maxmemory <= 0.75 * limit


def redis_bytes(size: str) -> int:
    """Redis's memory units: ``1536mb`` is 1536 MiB, ``1g`` 10**9 bytes (as redis.conf says)."""
    match = re.fullmatch(r"(\d+)(b|k|kb|m|mb|g|gb)?", size.lower())
    assert match, size
    units = {None: 1, "b": 1, "k": 1000, "kb": 1024, "m": 10**6, "mb": 1 << 20, "g": 10**9, "gb": 1 << 30}
    return int(match.group(1)) * units[match.group(2)]
