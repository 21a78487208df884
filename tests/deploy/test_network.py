"""The NetworkPolicies (and compose's networks) let each service reach what it needs and keep
everything else out: evaluated with NetworkPolicy semantics over the pods of the manifests."""

from __future__ import annotations

import copy
import ipaddress
import re

import pytest

from deploy._topology import INTERNET_EXCEPT
from deploy.local_stack import SERVICES
from tests.deploy._files import ROOT, Doc, allowed, compose, network_policies, outside_pod, pod, pods

POLICIES = network_policies()
SPECIALISTS = [s.id for s in SERVICES if s.kind == "specialist"]
MCP_SERVERS = [s.id for s in SERVICES if s.kind == "mcp_server"]
DATABASE_OWNERS = {
    "coordinator",
    "worker",
    *(s.id for s in SERVICES if s.kind == "mcp_server" and s.database),
}
FLEET = [p.workload for p in pods() if p.labels["app.kubernetes.io/part-of"] == "agent-fleet"]
FLEET_WORKLOADS = [w for w in FLEET if w not in ("nats", "postgres", "qdrant", "enroll", "bootstrap")]

NEEDED: list[tuple[str, str, int]] = [
    *((w, "nats", 4222) for w in FLEET_WORKLOADS),
    *((w, "registry", 8080) for w in FLEET_WORKLOADS if w != "registry"),
    *((w, "postgres", 5432) for w in DATABASE_OWNERS),
    *(("worker", s, 8080) for s in SPECIALISTS),
    ("worker", "mcp-memory", 8080),
    *(("registry", s, 8080) for s in [*SPECIALISTS, "coordinator"]),
    *((s, "mcp-memory", 8080) for s in SPECIALISTS),
    ("console", "coordinator", 8080),
    ("mcp-memory", "qdrant", 6333),
    ("nats-peer", "nats", 6222),  # the cluster's routes
    ("enroll", "registry", 8080),  # the enroll Job
    ("bootstrap", "nats", 4222),  # the bootstrap Job
]


@pytest.mark.parametrize(("source", "target", "port"), NEEDED, ids=[f"{s}->{t}:{p}" for s, t, p in NEEDED])
def test_each_service_reaches_what_it_needs(source: str, target: str, port: int) -> None:
    source_pod = pod("nats") if source.startswith("nats-") else pod(source)
    assert allowed(POLICIES, source_pod, pod(target), port)


def _mcp_servers_named_in(package: str) -> set[str]:
    text = "".join(p.read_text() for p in (ROOT / "specialists" / package).rglob("*.py"))
    return set(re.findall(r'"(mcp-[a-z]+)"', text))


@pytest.mark.parametrize("specialist", SPECIALISTS)
def test_each_specialist_reaches_the_mcp_servers_its_code_calls_and_no_other(specialist: str) -> None:
    entry = next(s.entry for s in SERVICES if s.id == specialist)
    named = _mcp_servers_named_in(entry.split(".")[1]) | {"mcp-memory"}  # every specialist remembers
    for server in MCP_SERVERS:
        assert allowed(POLICIES, pod(specialist), pod(server), 8080) == (server in named), server


def test_nothing_but_the_database_owners_reaches_postgres() -> None:
    reach = {p.workload for p in pods() if allowed(POLICIES, p, pod("postgres"), 5432)}
    assert reach == DATABASE_OWNERS
    assert not allowed(POLICIES, outside_pod("ingress-nginx"), pod("postgres"), 5432)


def test_only_the_memory_server_reaches_qdrant_and_nobody_reaches_a_worker() -> None:
    assert {p.workload for p in pods() if allowed(POLICIES, p, pod("qdrant"), 6333)} == {"mcp-memory"}
    assert not any(allowed(POLICIES, p, pod("worker"), 8080) for p in pods())


def test_from_outside_only_the_front_doors_are_reachable_and_keda_reads_nats_monitoring() -> None:
    ingress = outside_pod("ingress-nginx")
    reach = {p.workload for p in pods() if allowed(POLICIES, ingress, p, 8080)}
    assert reach == {"registry", "coordinator", "console"}
    assert allowed(POLICIES, outside_pod("keda"), pod("nats"), 8222)
    assert not allowed(POLICIES, outside_pod("keda"), pod("nats"), 4222)


def test_the_enroll_job_reaches_only_the_registry_and_nothing_reaches_it() -> None:
    job = pod("enroll")
    targets = {
        (p.workload, port)
        for p in pods()
        for port in (4222, 5432, 6333, 8080)
        if allowed(POLICIES, job, p, port)
    }
    assert targets == {("registry", 8080)}
    assert not any(allowed(POLICIES, p, job, port) for p in pods() for port in (8080, 8181))
    assert not allowed(POLICIES, outside_pod("ingress-nginx"), job, 8080)


def test_the_bootstrap_job_reaches_only_nats_and_nothing_reaches_it() -> None:
    job = pod("bootstrap")
    targets = {
        (p.workload, port)
        for p in pods()
        for port in (4222, 5432, 6222, 6333, 8080, 8222)
        if allowed(POLICIES, job, p, port)
    }
    assert targets == {("nats", 4222)}
    assert not any(allowed(POLICIES, p, job, port) for p in pods() for port in (4222, 8080, 8181))


def test_nats_clients_are_the_services_and_the_bootstrap_job_only() -> None:
    reach = {p.workload for p in pods() if allowed(POLICIES, p, pod("nats"), 4222)}
    assert reach == {*FLEET_WORKLOADS, "bootstrap"}
    routes = {p.workload for p in pods() if allowed(POLICIES, p, pod("nats"), 6222)}
    assert routes == {"nats"}


def test_dns_is_only_the_cluster_dns_of_kube_system() -> None:
    kube_dns = {"k8s-app": "kube-dns"}
    cluster_dns = outside_pod("kube-system", kube_dns)
    impostor = outside_pod("someones-namespace", kube_dns)  # anyone may label a pod so
    for source in pods():
        if source.workload not in ("postgres", "qdrant"):  # they open no connection at all
            assert allowed(POLICIES, source, cluster_dns, 53), source.workload
        assert not allowed(POLICIES, source, impostor, 53), source.workload
        assert not allowed(POLICIES, source, outside_pod("kube-system"), 53), source.workload
    for policy in POLICIES:
        for rule in policy["spec"].get("egress", []):
            if any("kube-dns" in str(peer.get("podSelector")) for peer in rule["to"]):
                assert {"protocol": "UDP", "port": 53} in rule["ports"], policy["metadata"]["name"]


IN_CLUSTER_ADDRESSES = [
    "10.0.0.1",
    "10.255.255.254",
    "172.16.0.1",
    "172.31.255.254",
    "192.168.1.1",
    "100.64.0.1",  # CGNAT pod CIDRs (EKS custom networking, some GKE setups)
    "100.127.255.254",
    "169.254.169.254",  # cloud metadata
]


def test_internet_egress_excludes_every_in_cluster_range_of_the_one_list() -> None:
    blocks = [
        peer["ipBlock"]
        for policy in POLICIES
        for rule in policy["spec"].get("egress", [])
        for peer in rule["to"]
        if "ipBlock" in peer
    ]
    assert blocks, "some workloads reach the internet"
    for block in blocks:
        assert block == {"cidr": "0.0.0.0/0", "except": list(INTERNET_EXCEPT)}
    excepted = [ipaddress.ip_network(cidr) for cidr in INTERNET_EXCEPT]
    for address in IN_CLUSTER_ADDRESSES:
        assert any(ipaddress.ip_address(address) in net for net in excepted), address
    assert not any(ipaddress.ip_address("1.1.1.1") in net for net in excepted)
    # docs/deployment.md lists the ranges (and tells a site to add its own public pod/Service CIDRs).
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert all(f"`{cidr}`" in docs for cidr in INTERNET_EXCEPT)


def test_everything_is_denied_by_default() -> None:
    (deny,) = [p for p in POLICIES if p["metadata"]["name"] == "default-deny"]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}


def test_the_evaluator_sees_a_missing_rule() -> None:
    without: list[Doc] = copy.deepcopy(POLICIES)
    for policy in without:
        if policy["metadata"]["name"] == "postgres":
            policy["spec"]["ingress"] = []
    assert not allowed(without, pod("worker"), pod("postgres"), 5432)
    assert allowed(POLICIES, pod("worker"), pod("postgres"), 5432)
    assert not allowed(POLICIES, pod("worker"), pod("postgres"), 5433)


def test_in_compose_only_the_database_owners_share_a_network_with_postgres() -> None:
    services = compose()["services"]
    (data,) = services["postgres"]["networks"]
    on_data = {name for name, s in services.items() if data in s.get("networks", []) and name != "postgres"}
    owners = {s.id for s in SERVICES if s.database}
    assert on_data == owners
    (memory,) = services["qdrant"]["networks"]
    assert {n for n, s in services.items() if memory in s.get("networks", []) and n != "qdrant"} == {
        "mcp-memory"
    }
    (policy,) = services["opa"]["networks"]
    deciders = {
        n for n, s in services.items() if s.get("environment", {}).get("FLEET_POLICY_ENGINE") == "opa"
    }
    assert {n for n, s in services.items() if policy in s.get("networks", []) and n != "opa"} == deciders
