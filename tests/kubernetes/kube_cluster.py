"""A one-node Kubernetes for tests/tests/kubernetes_job.rs (and tests/tests/kubectl_fake.rs, the real kubectl
against it): an API server and a kubelet in one process, whose pods are real containers of the local
Docker Engine.

No cluster can be pulled on the test machine (kind and k3s need images from a registry), so this keeps
the objects the kubernetes backend creates and does what the control plane and a kubelet would do with
them, for the calls `infra/k8s/rbac.yaml` grants (the backend's tests check that set against the code):

- the API server (namespace `physalia` only, as infra/k8s makes it) speaks HTTPS (a CA made for the run; its certificate names the address it listens on)
  on the pod network's gateway, which this machine and the pods reach. It keeps Jobs (batch/v1), Pods,
  Secrets, Services, Events and ServiceAccounts of any namespace, and RBAC's Roles, RoleBindings,
  ClusterRoles and ClusterRoleBindings; create, get, list (label selectors: equality, `!=`, `in`,
  `notin`, exists; field selectors on the fields the real server converts, 400 on others), patch (JSON
  merge, strategic merge, JSON patch), update (PUT, 409 on a stale resourceVersion), delete (with the
  garbage collector's cascade to objects whose owner reference names a deleted object, a Job's pods)
  and pod logs; Namespaces and the nodes below read-only. resourceVersions count up over all objects (a list's is the newest), and a
  watch (`?watch=true`, from a `resourceVersion` or, without one, the current objects as ADDED) streams
  ADDED/MODIFIED/DELETED events as newline-delimited JSON over chunked transfer until `timeoutSeconds`
  (410 Expired for a resourceVersion older than the last 20,000 events). It serves what a real client
  reads first: discovery (`/api`, `/apis`, each group's APIResourceList, and aggregated discovery,
  apidiscovery.k8s.io/v2, to a client that asks for it), `/version`, an OpenAPI v3 document of the
  operations (no schemas: kubectl learns from it that the server validates fields, and
  `fieldValidation=Strict` refuses unknown top-level and metadata fields, Warn warns), Tables for
  server-side printing (`kubectl get`'s columns, `-o wide`'s), and the protobuf bodies typed clients
  send for the access reviews, RBAC objects, ServiceAccounts and Secrets (other kinds' are 415: kubectl
  1.32's `kubectl create job` fails; 1.20's, which sends JSON, and `kubectl create -f job.yaml` work). A
  Job gets the Job API's defaulted selector and template labels; a Secret's stringData is folded into
  its data.
  Every request must carry a bearer token: the user's (kubeconfig; user `physalia-test-user` in group
  `system:masters`, which the bootstrap `cluster-admin` binding allows everything) or an existing
  ServiceAccount's (`sa.NS.NAME`; any other token is 401). Requests are authorized by RBAC over the
  stored Roles and bindings: the bootstrap ClusterRoles that matter (cluster-admin, system:basic-user,
  system:discovery, system:public-info-viewer) and `infra/k8s/rbac.yaml`'s objects, loaded at start;
  refused 403 Forbidden, worded as RBAC words it. `Impersonate-User`/`-Group`/`-Uid`/`-Extra-*` act as
  that identity where the caller may `impersonate` each part (users, groups, serviceaccounts in their
  namespace, uids, userextras), 403 otherwise; SelfSubjectAccessReview, SubjectAccessReview,
  SelfSubjectRulesReview and SelfSubjectReview are answered from the same RBAC, so `kubectl auth can-i`
  (with `--as`, `--list`) and `kubectl auth whoami` work. `/_fake/requests` lists
  `(who, user, verb, resource)` for the test (`who`: the token's principal, `user`: who it acted as),
  `/_fake/objects` what was made since start and `/_fake/object/RES/NAME` one object.
- the Job controller: a Job that is not suspended gets its pods (one per completion index for an Indexed
  Job, hostnames `<job>-<index>`, the completion-index annotation; one for a plain Job), never more:
  `backoffLimit`/`backoffLimitPerIndex` are 0 for every Job physalia makes, so a failed pod is not
  replaced. Job status counts succeeded and failed pods and gets a `Complete` or `Failed` condition.
- the kubelet: each pod runs as one container of its image (IfNotPresent: a missing image leaves the pod
  waiting with `ErrImageNeverPull`) on a Docker network made for the run, at its pod IP, with the
  DNS names its subdomain gives it (`<host>.<subdomain>.<ns>.svc[.cluster.local]`, network aliases), the
  downward API's `status.podIP` and annotation fields, a Secret volume's items written as files (mode
  `defaultMode`, group `fsGroup`, which the container gets as a supplementary group) and mounted at
  `subPathExpr`, and, unless `automountServiceAccountToken: false`, the ServiceAccount's token, the CA and
  the namespace at /var/run/secrets/kubernetes.io/serviceaccount with KUBERNETES_SERVICE_HOST/PORT (what
  an in-cluster client reads). Pod phase follows the container: Pending, Running, Succeeded or Failed
  with the exit code. Deleting a pod removes its container.
- the coordinator's cloud identity, as EKS Pod Identity gives it to the pods of an associated
  ServiceAccount (`physalia-coordinator` here): AWS_CONTAINER_CREDENTIALS_FULL_URI and
  AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE, answered by this process with moto's test credentials, and
  moto (S3, bucket `physalia-jobs`, for the job store) at AWS_ENDPOINT_URL.

- the scheduler, over the nodes of NODES (node pools shaped as GKE, EKS and AKS document theirs: the
  well-known `node.kubernetes.io/instance-type` label, each distribution's GPU labels and taints, and
  allocatable CPU, memory and `nvidia.com/gpu` by its documented reservations): a pod is bound to a
  node whose labels match its `nodeSelector` and required node affinity (`In`, `NotIn`, `Exists`),
  whose NoSchedule/NoExecute taints it tolerates, and whose allocatable less the requests of the pods
  bound there holds its requests. A pod that fits no node stays Pending with the PodScheduled condition
  False, reason Unschedulable, as kube-scheduler words it; `/_fake/nodes` lists the nodes, and
  `GET /api/v1/nodes` (the preflight's) serves them to the user (a ServiceAccount gets 403: RBAC's
  Roles are namespaced).

NetworkPolicy (networking.k8s.io/v1, stored and served like the other kinds), enforced as a network
plugin that implements it (Calico, Cilium, Azure CNI, GKE Dataplane V2) does: a pod that a policy of its
namespace selects for Ingress takes only what the selecting policies' ingress rules allow (`from`
podSelector / namespaceSelector / ipBlock peers, `ports` by number and protocol), every other pod takes
everything, and the node (this machine) always reaches its pods. The rules are netfilter rules per pod
address (tests/firewall.py), in place before its container starts and rewritten when pods or policies
change. The fake starts with infra/k8s/network-policy.yaml applied (`--network-policy FILE` applies
FILE instead), so a job whose pods that policy does not admit fails here as it would on the cluster.

`--throttle-every N` makes the API server throttle as API Priority and Fairness does when a principal's
priority level is saturated: every Nth request of each principal (bearer token) is answered 429
TooManyRequests with `Retry-After: 1` and not carried out; `/_fake/throttled` counts them per principal.

Not done: NetworkPolicy egress rules, named ports and ipBlock `except` (such a policy is refused, 422); resource
limits, ResourceQuota, ttlSecondsAfterFinished; server-side apply (415: `kubectl apply --server-side`;
client-side `kubectl apply` works, through strategic merge patches, which know the merge keys of the lists
of these kinds only), dry runs, deletecollection, graceful deletion (a delete is immediate), status
subresources (a patch may change status), watch bookmarks and the WatchList stream, schemas (`kubectl
explain`; OpenAPI v2 is an empty document, which kubectl 1.20 reads before `create -f`), RBAC's escalation
checks on creating Roles and bindings, following pod logs (`kubectl logs -f` gets what is there and
ends), exec, attach and port-forward.

Prints one JSON line (`kubeconfig`, the path of a kubeconfig for this machine's user; `endpoint`, moto's
URL; `region`; `bucket`; `network`; `api`, the API server's URL), then serves until its standard input
closes, and removes every container, file and network it made.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import ipaddress
import json
import os
import random
import re
import select
import shutil
import socket
import ssl
import string
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.parse
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import firewall  # noqa: E402  (tests/firewall.py: netfilter rules per pod)

LABEL = f"physalia.kube-fake={os.getpid()}"
REGION = "us-east-1"
BUCKET = "physalia-jobs"
USER_TOKEN = "physalia-test-user"
# the ServiceAccount EKS Pod Identity associates with an IAM role in infra/k8s's set-up
POD_IDENTITY_SA = "physalia-coordinator"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# infra/k8s/namespace.yaml's
NAMESPACES = {"physalia"}
RBAC = os.path.join(os.path.dirname(__file__), "..", "..", "infra", "k8s", "rbac.yaml")
# the NetworkPolicy infra/k8s applies (`--network-policy FILE` replaces it)
NETWORK_POLICY = os.path.join(os.path.dirname(__file__), "..", "..", "infra", "k8s", "network-policy.yaml")
POD_IDENTITY_DIR = "/var/run/secrets/pods.eks.amazonaws.com/serviceaccount"


def node(name: str, instance_type: str, cpu_m: int, memory_mi: int, gpus: int = 0,
         labels: dict | None = None, taints: list | None = None) -> dict:
    alloc = {"cpu": f"{cpu_m}m", "memory": f"{memory_mi}Mi", "pods": "110"}
    if gpus:
        alloc["nvidia.com/gpu"] = str(gpus)
    return {
        "metadata": {"name": name, "labels": {
            "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "kubernetes.io/hostname": name, "node.kubernetes.io/instance-type": instance_type,
            **(labels or {})}},
        "spec": {"taints": taints or []},
        "status": {"allocatable": alloc},
    }


# Allocatable by each provider's documented reservations (infra/catalog/kubernetes.yaml's comment):
# AKS 1.29+: CPU by its table, memory min(20 MB x 250 pods + 50 MB, 25%) + 100 Mi eviction;
# GKE: its tiered CPU and memory percentages + 100 Mi eviction; EKS AMI: CPU as GKE, memory
# 11 Mi x 58 pods + 255 Mi + 100 Mi eviction from a g5.xlarge's MemTotal (15,785 Mi, as the ECS
# harness registers it).
GKE_GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
AKS_GPU_TAINT = {"key": "sku", "value": "gpu", "effect": "NoSchedule"}
NODES = (
    [node(f"aks-system-{i}", "Standard_D4s_v5", 3860, 12188,
          labels={"kubernetes.azure.com/agentpool": "system", "kubernetes.azure.com/mode": "system"})
     for i in range(2)]
    + [node(f"aks-cpu-{i}", "Standard_D16s_v5", 15740, 60386,
            labels={"kubernetes.azure.com/agentpool": "cpu", "kubernetes.azure.com/mode": "user"})
       for i in range(6)]
    + [node(f"gke-l4-{i}", "g2-standard-8", 7910, 29022, gpus=1,
            labels={"cloud.google.com/gke-nodepool": "l4",
                     "cloud.google.com/gke-accelerator": "nvidia-l4",
                     "cloud.google.com/gke-gpu": "true"},
            taints=[GKE_GPU_TAINT]) for i in range(3)]
    + [node(f"eks-a10g-{i}", "g5.xlarge", 3920, 14792, gpus=1,
            labels={"eks.amazonaws.com/nodegroup": "gpu", "eks.amazonaws.com/capacityType": "ON_DEMAND",
                    "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-A10G",
                    "nvidia.com/gpu.count": "1"}) for i in range(3)]
    + [node(f"aks-t4-{i}", "Standard_NC4as_T4_v3", 3860, 23522, gpus=1,
            labels={"kubernetes.azure.com/agentpool": "gput4", "kubernetes.azure.com/mode": "user",
                    "kubernetes.azure.com/accelerator": "nvidia"},
            taints=[AKS_GPU_TAINT]) for i in range(3)]
)


def quantity(q: str | int | float | None) -> float:
    """A Kubernetes quantity as a number (CPU in cores, memory in bytes)."""
    if q is None:
        return 0.0
    q = str(q)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6,
             "G": 1e9, "T": 1e12}
    for suffix in ("Ki", "Mi", "Gi", "Ti", "m", "k", "M", "G", "T"):
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * units[suffix]
    return float(q)


def pod_requests(pod: dict) -> dict[str, float]:
    """The pod's requests as the scheduler counts them: its containers' sum, or an init container's
    if larger; a limit without a request requests the limit."""
    def of(c: dict) -> dict[str, float]:
        r = c.get("resources") or {}
        want = dict(r.get("limits") or {})
        want.update(r.get("requests") or {})
        return {k: quantity(v) for k, v in want.items()}
    total: dict[str, float] = {}
    for c in pod["spec"].get("containers", []):
        for k, v in of(c).items():
            total[k] = total.get(k, 0.0) + v
    for c in pod["spec"].get("initContainers") or []:
        for k, v in of(c).items():
            total[k] = max(total.get(k, 0.0), v)
    return total


def tolerates(tolerations: list, taint: dict) -> bool:
    for t in tolerations or []:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        op = t.get("operator", "Equal")
        if op == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if op == "Equal" and t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def affinity_matches(pod: dict, labels: dict) -> bool:
    required = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if not required:
        return True
    def term_ok(term: dict) -> bool:
        for e in term.get("matchExpressions") or []:
            have, op, values = labels.get(e["key"]), e["operator"], e.get("values") or []
            ok = {"In": have in values, "NotIn": have not in values,
                  "Exists": have is not None, "DoesNotExist": have is None}.get(op)
            if not ok:
                return False
        return True
    return any(term_ok(t) for t in required.get("nodeSelectorTerms") or [])


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_network() -> tuple[str, ipaddress.IPv4Network]:
    """The pod network: a free /24 of 10.244.0.0/16 (several clusters may run at once)."""
    name = f"physalia-kube-fake-{os.getpid()}"
    last = ""
    for third in firewall.subnet_order(0, 250):
        net = ipaddress.IPv4Network(f"10.244.{third}.0/24")
        r = docker("network", "create", "--label", LABEL, "--subnet", str(net),
                   "--gateway", str(net.network_address + 1), name, check=False)
        if r.returncode == 0:
            return name, net
        last = r.stderr.strip()
    raise SystemExit(f"no free /24 in 10.244.0.0/16 for a Docker network: {last}")


def make_tls(ip: str, folder: str) -> tuple[str, str, str]:
    """A CA and the API server's certificate for `ip`; returns (ca.crt, server.crt, server.key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    end = start + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("kube-fake-ca")).issuer_name(name("kube-fake-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("kube-apiserver")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address(ip)), x509.DNSName("kubernetes.default.svc")]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = [os.path.join(folder, f) for f in ("ca.crt", "server.crt", "server.key")]
    pem = serialization.Encoding.PEM
    with open(paths[0], "wb") as f:
        f.write(ca.public_bytes(pem))
    with open(paths[1], "wb") as f:
        f.write(cert.public_bytes(pem))
    with open(paths[2], "wb") as f:
        f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return paths[0], paths[1], paths[2]


def rand5() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


class Cluster:
    """The stored objects, and what the controllers and the kubelet do with them."""

    def __init__(self, network: str, subnet: ipaddress.IPv4Network, api_host: str, api_port: int,
                 ca_path: str, files: str, policies: str = NETWORK_POLICY):
        self.lock = threading.RLock()
        # (namespace, resource, name) -> object
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.requests: list[dict] = []
        # --throttle-every N: every Nth API request of a principal is answered 429 (0: never)
        self.throttle_every = 0
        self.seen: dict[str, int] = {}
        self.throttled: dict[str, int] = {}
        self.network = network
        self.hosts = subnet.hosts()
        next(self.hosts)  # the gateway
        self.api_host = api_host
        self.api_port = api_port
        self.ca_path = ca_path
        self.files = files
        self.version = 0
        self.creds_url = ""
        self.moto_url = ""
        # pod key -> container name, for pods that got one
        self.containers: dict[tuple[str, str, str], str] = {}
        self.done = threading.Event()
        # what a watch replays: (resourceVersion, ADDED/MODIFIED/DELETED, namespace, resource, object)
        self.started = now()
        self.history: list[tuple[int, str, str, str, dict]] = []
        self.changed = threading.Condition()
        for ns in sorted(NAMESPACES):
            self.create("", "namespaces", {"metadata": {"name": ns}, "spec": {"finalizers": ["kubernetes"]},
                                           "status": {"phase": "Active"}})
            # the ServiceAccount every namespace gets
            self.create(ns, "serviceaccounts", {"metadata": {"name": "default"}})
        # the pods' firewall (set by main; None: NetworkPolicies are stored but not enforced) and what
        # it holds: each started pod's address, and the rules applied to it (None: not isolated)
        self.firewall: firewall.Firewall | None = None
        self.addresses: dict[tuple[str, str, str], str] = {}
        self.applied: dict[str, list | None] = {}
        for kind, ns, obj in builtin_rbac() + load_manifests(RBAC) + load_manifests(policies):
            code, out = self.create(ns, kind, obj)
            if code >= 300:
                raise SystemExit(f"{policies if kind == 'networkpolicies' else RBAC}: {out['message']}")
        # what the API server starts with (not what a test made: /_fake/objects leaves it out)
        self.seeded = set(self.objects)

    # --- the API --------------------------------------------------------------------------------

    def stamp(self, obj: dict, event: str = "MODIFIED") -> None:
        """A new resourceVersion for a stored object that changed, and the watch event saying so."""
        with self.lock:
            self.version += 1
            meta = obj.setdefault("metadata", {})
            meta["resourceVersion"] = str(self.version)
            if not obj.get("_res"):
                return  # not a stored object: nothing watches it
            self.history.append((self.version, event, meta.get("namespace", ""), obj["_res"],
                                 clean(obj)))
            if len(self.history) > HISTORY:
                del self.history[: len(self.history) - HISTORY]
            if obj["_res"] in ("networkpolicies", "pods"):
                self.enforce()
        with self.changed:
            self.changed.notify_all()

    # --- NetworkPolicy, as a network plugin that enforces it does ------------------------------------

    def ingress(self, ns: str, labels: dict) -> list | None:
        """The inbound rules of a pod of `ns` with `labels`: None where no NetworkPolicy of its
        namespace selects it for Ingress (it takes everything), else what the selecting policies'
        ingress rules allow, together (a selected pod with no allowing rule takes nothing)."""
        selecting = [o for (pns, res, _), o in self.objects.items()
                     if res == "networkpolicies" and pns == ns and "Ingress" in policy_types(o)
                     and selector_matches((o.get("spec") or {}).get("podSelector"), labels)]
        if not selecting:
            return None
        rules = []
        for policy in selecting:
            for rule in policy["spec"].get("ingress") or []:
                sources = self.peers(ns, rule.get("from"))
                for port in rule.get("ports") or [None]:
                    proto, lo, hi = "all", None, None
                    if port:
                        proto = port.get("protocol", "TCP").lower()
                        if "port" in port:
                            lo = port["port"]
                            hi = port.get("endPort", lo)
                    rules += [firewall.Rule(True, proto, lo, hi, src, policy["metadata"]["name"])
                              for src in sources]
        return rules

    def peers(self, ns: str, peers: list | None) -> list[str]:
        """The sources (CIDRs) an ingress rule's `from` names, for a policy of `ns`: every source
        where it names none; else the started pods its podSelector / namespaceSelector pairs select
        (the policy's namespace without a namespaceSelector) and its ipBlocks."""
        if not peers:
            return ["0.0.0.0/0"]
        out = []
        for peer in peers:
            if "ipBlock" in peer:
                out.append(peer["ipBlock"]["cidr"])
                continue
            for key, ip in self.addresses.items():
                pod = self.objects.get(key)
                if pod is None:
                    continue
                if "namespaceSelector" in peer:
                    space = self.objects.get(("", "namespaces", key[0])) or {"metadata": {}}
                    space_labels = {"kubernetes.io/metadata.name": key[0],
                                    **(space["metadata"].get("labels") or {})}
                    if not selector_matches(peer["namespaceSelector"], space_labels):
                        continue
                elif key[0] != ns:
                    continue
                if "podSelector" in peer and not selector_matches(
                        peer["podSelector"], pod["metadata"].get("labels") or {}):
                    continue
                out.append(f"{ip}/32")
        return out

    def enforce(self) -> None:
        """Every started pod's inbound rules as the stored NetworkPolicies and pods now make them;
        this machine (the node) always reaches its pods, as Kubernetes specifies."""
        if self.firewall is None:
            return
        with self.lock:
            for key, ip in list(self.addresses.items()):
                pod = self.objects.get(key)
                if pod is None:
                    continue
                rules = self.ingress(key[0], pod["metadata"].get("labels") or {})
                if ip in self.applied and self.applied[ip] == rules:
                    continue
                if rules is None:
                    self.firewall.release(ip)
                else:
                    self.firewall.guard(ip, rules, from_host=True)
                self.applied[ip] = rules

    def create(self, ns: str, res: str, obj: dict) -> tuple[int, dict]:
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + rand5()
            meta["name"] = name
        if not name:
            return 422, status(422, "Invalid", f"{res}: metadata.name: Required value")
        key = (ns, res, name)
        if res == "networkpolicies" and (why := unenforceable(obj)):
            return 422, status(422, "Invalid", why)
        with self.lock:
            if key in self.objects:
                return 409, status(409, "AlreadyExists", f'{qualified(res)} "{name}" already exists',
                                   {"name": name, "group": RESOURCES[res].group, "kind": res})
            if ns:
                meta["namespace"] = ns
            else:
                meta.pop("namespace", None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now()
            for k in ("resourceVersion", "deletionTimestamp", "selfLink"):
                meta.pop(k, None)
            if res == "secrets":
                fold_string_data(obj)
            if res == "jobs":
                obj.setdefault("status", {})
                # the Job API's defaulting: a selector on the controller's uid, which the template's
                # labels (and so the pods') carry
                spec = obj.setdefault("spec", {})
                if not spec.get("selector") and not spec.get("manualSelector"):
                    spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": meta["uid"]}}
                    labels = spec.setdefault("template", {}).setdefault("metadata", {}).setdefault(
                        "labels", {})
                    for k, v in (("batch.kubernetes.io/controller-uid", meta["uid"]),
                                 ("batch.kubernetes.io/job-name", name), ("controller-uid", meta["uid"]),
                                 ("job-name", name)):
                        labels.setdefault(k, v)
                template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels")
                if template_labels and not meta.get("labels"):
                    meta["labels"] = dict(template_labels)
            if res == "pods":
                obj["status"] = {"phase": "Pending"}
            obj["apiVersion"], obj["kind"] = RESOURCES[res].api_version, RESOURCES[res].kind
            obj["_res"] = res
            self.objects[key] = obj
            self.stamp(obj, "ADDED")
            return 201, obj

    def get(self, ns: str, res: str, name: str) -> dict | None:
        with self.lock:
            return self.objects.get((ns, res, name))

    def list(self, ns: str, res: str, selector: str, fields: str = "") -> list[dict]:
        """The objects of `res` (in `ns`, or every namespace for ""), by label and field selector;
        ValueError where a selector does not parse or names a field the resource cannot select by."""
        labels_ok = label_selector(selector)
        fields_ok = field_selector(res, fields)
        with self.lock:
            out = []
            for (o_ns, o_res, _), obj in sorted(self.objects.items()):
                if o_res != res or (ns and o_ns != ns):
                    continue
                if labels_ok(obj.get("metadata", {}).get("labels") or {}) and fields_ok(obj):
                    out.append(obj)
            return out

    def patch(self, ns: str, res: str, name: str, patch, kind: str = "merge") -> dict | None:
        """A JSON merge (`merge`), strategic merge (`strategic`) or JSON (`json`) patch; the name,
        namespace, uid and creation time stay. ValueError where a JSON patch fails."""
        with self.lock:
            obj = self.objects.get((ns, res, name))
            if obj is None:
                return None
            own = {k: v for k, v in obj.items() if k.startswith("_")}
            fixed = {k: obj["metadata"][k] for k in ("name", "namespace", "uid", "creationTimestamp")
                     if k in obj["metadata"]}
            if kind == "json":
                new = json_patch(clean(obj), patch)
            else:
                new = clean(obj)
                (strategic_patch if kind == "strategic" else merge_patch)(new, patch)
            if res == "networkpolicies" and (why := unenforceable(new)):
                raise ValueError(why)
            obj.clear()
            obj.update(new)
            obj.update(own)
            obj.setdefault("metadata", {}).update(fixed)
            self.stamp(obj)
            return obj

    def replace(self, ns: str, res: str, name: str, new: dict) -> tuple[int, dict]:
        """PUT: the whole object, if its resourceVersion (where given) is still the stored one."""
        with self.lock:
            obj = self.objects.get((ns, res, name))
            if obj is None:
                return 404, status(404, "NotFound", f'{qualified(res)} "{name}" not found',
                                   {"name": name, "group": RESOURCES[res].group, "kind": res})
            if res == "networkpolicies" and (why := unenforceable(new)):
                return 422, status(422, "Invalid", why)
            meta = new.setdefault("metadata", {})
            if meta.get("name", name) != name:
                return 400, status(400, "BadRequest", "the name of the object does not match the URL")
            rv = meta.get("resourceVersion")
            if rv and rv != obj["metadata"]["resourceVersion"]:
                return 409, status(409, "Conflict", f'Operation cannot be fulfilled on {qualified(res)} '
                                   f'"{name}": the object has been modified; please apply your changes '
                                   f'to the latest version and try again',
                                   {"name": name, "group": RESOURCES[res].group, "kind": res})
            keep = {k: v for k, v in obj.items() if k.startswith("_") or k == "status"}
            for k in ("uid", "creationTimestamp", "namespace"):
                if k in obj["metadata"]:
                    meta[k] = obj["metadata"][k]
                else:
                    meta.pop(k, None)
            meta["name"] = name
            if res == "secrets":
                fold_string_data(new)
            obj.clear()
            obj.update(new)
            obj.update(keep)
            obj["apiVersion"], obj["kind"] = RESOURCES[res].api_version, RESOURCES[res].kind
            self.stamp(obj)
            return 200, obj

    def delete(self, ns: str, res: str, name: str) -> dict | None:
        with self.lock:
            obj = self.objects.pop((ns, res, name), None)
            if obj is None:
                return None
            if res == "pods":
                ip = self.addresses.pop((ns, res, name), None)
                if ip and self.firewall is not None:
                    self.firewall.release(ip)
                    self.applied.pop(ip, None)
            obj["metadata"]["deletionTimestamp"] = now()
            self.stamp(obj, "DELETED")
            uid = obj["metadata"]["uid"]
            # the garbage collector: every object this one owns goes too
            owned = [k for k, o in self.objects.items()
                     if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])]
            for k in owned:
                self.delete(*k)
            if res == "pods":
                container = self.containers.pop((ns, res, name), None)
                if container:
                    threading.Thread(target=docker, args=("rm", "-f", container),
                                     kwargs={"check": False}, daemon=True).start()
            return obj

    def events_after(self, rv: int) -> list[tuple[int, str, str, str, dict]] | None:
        """The watch events after resourceVersion `rv`; None where those are no longer kept (410 Gone)."""
        with self.lock:
            if self.history and rv < self.history[0][0] - 1:
                return None
            return [e for e in self.history if e[0] > rv]

    # --- authentication and RBAC ------------------------------------------------------------------

    def authenticate(self, token: str) -> tuple[str, list[str]] | None:
        """The user and groups a bearer token names: the kubeconfig's administrator, or an existing
        ServiceAccount (its token, `sa.NS.NAME`, is what the kubelet mounts); None for anything else."""
        if token == USER_TOKEN:
            return USER_NAME, list(USER_GROUPS)
        parts = token.split(".", 2)
        if len(parts) == 3 and parts[0] == "sa" and self.get(parts[1], "serviceaccounts", parts[2]):
            return (f"system:serviceaccount:{parts[1]}:{parts[2]}",
                    ["system:serviceaccounts", f"system:serviceaccounts:{parts[1]}",
                     "system:authenticated"])
        return None

    def bindings(self, user: str, groups: list[str], ns: str) -> list[tuple[str, list[dict]]]:
        """(how RBAC words the grant, the rules) of each ClusterRoleBinding, and each RoleBinding of
        `ns`, that names the user or one of its groups."""
        out = []
        with self.lock:
            for (b_ns, res, name), b in sorted(self.objects.items()):
                if not (res == "clusterrolebindings" or (res == "rolebindings" and ns and b_ns == ns)):
                    continue
                subject = next((s for s in b.get("subjects") or []
                                if subject_matches(s, user, groups, b_ns)), None)
                ref = b.get("roleRef") or {}
                if subject is None:
                    continue
                if ref.get("kind") == "Role" and res == "rolebindings":
                    role = self.objects.get((b_ns, "roles", ref.get("name")))
                elif ref.get("kind") == "ClusterRole":
                    role = self.objects.get(("", "clusterroles", ref.get("name")))
                else:
                    role = None
                if role is None:
                    continue
                kind = "RoleBinding" if res == "rolebindings" else "ClusterRoleBinding"
                shown = f"{name}/{b_ns}" if b_ns else name
                why = (f'RBAC: allowed by {kind} "{shown}" of {ref["kind"]} "{ref["name"]}" to '
                       f'{describe_subject(subject, b_ns)}')
                out.append((why, role.get("rules") or []))
        return out

    def authorize(self, user: str, groups: list[str], a: dict) -> tuple[bool, str]:
        """RBAC's decision on request attributes `a` (verb, group, resource, subresource, namespace,
        name; or verb and path) and its reason."""
        for why, rules in self.bindings(user, groups, "" if "path" in a else a.get("namespace", "")):
            if any(rule_allows(r, a) for r in rules):
                return True, why
        return False, ""

    def rules(self, user: str, groups: list[str], ns: str) -> dict:
        """A SelfSubjectRulesReview's status: every rule the user's bindings grant in `ns`."""
        resource, nonresource = [], []
        for _, rules in self.bindings(user, groups, ns):
            for r in rules:
                if r.get("nonResourceURLs"):
                    nonresource.append({"verbs": r.get("verbs") or [],
                                        "nonResourceURLs": r["nonResourceURLs"]})
                else:
                    rule = {"verbs": r.get("verbs") or [], "apiGroups": r.get("apiGroups") or [],
                            "resources": r.get("resources") or []}
                    if r.get("resourceNames"):
                        rule["resourceNames"] = r["resourceNames"]
                    resource.append(rule)
        return {"resourceRules": resource, "nonResourceRules": nonresource, "incomplete": False}

    # --- the Job controller and the kubelet ------------------------------------------------------

    def loop(self) -> None:
        while not self.done.is_set():
            try:
                self.tick()
            except Exception as e:  # keep serving; the test sees the consequence
                print(f"kube fake: {e!r}", file=sys.stderr, flush=True)
            time.sleep(0.25)

    def tick(self) -> None:
        with self.lock:
            jobs = [o for (_, r, _), o in self.objects.items() if r == "jobs"]
            for job in jobs:
                self.sync_job(job)
            pods = [(k, o) for k, o in self.objects.items() if k[1] == "pods"]
        for key, pod in pods:
            if key not in self.containers and pod["status"]["phase"] == "Pending" \
                    and not pod.get("_starting") and self.schedule(key, pod):
                pod["_starting"] = True
                threading.Thread(target=self.start_pod, args=(key, pod), daemon=True).start()
            elif key in self.containers and pod["status"]["phase"] == "Running":
                self.observe(key, pod)

    def schedule(self, key, pod: dict) -> bool:
        """Binds the pod to a node (True), or records why none fits (False), as kube-scheduler does."""
        if pod["spec"].get("nodeName"):
            return True
        want = pod_requests(pod)
        why: dict[str, int] = {}
        with self.lock:
            bound = [o for (_, r, _), o in self.objects.items() if r == "pods"
                     and o["spec"].get("nodeName") and o["status"]["phase"] in ("Pending", "Running")]
            for n in NODES:
                labels, name = n["metadata"]["labels"], n["metadata"]["name"]
                selector = pod["spec"].get("nodeSelector") or {}
                if any(labels.get(k) != v for k, v in selector.items()) \
                        or not affinity_matches(pod, labels):
                    reason = "node(s) didn't match Pod's node affinity/selector"
                elif any(t["effect"] in ("NoSchedule", "NoExecute")
                         and not tolerates(pod["spec"].get("tolerations"), t)
                         for t in n["spec"]["taints"]):
                    t = next(t for t in n["spec"]["taints"]
                             if not tolerates(pod["spec"].get("tolerations"), t))
                    reason = f"node(s) had untolerated taint {{{t['key']}: {t.get('value', '')}}}"
                else:
                    used: dict[str, float] = {}
                    for o in bound:
                        if o["spec"]["nodeName"] == name:
                            for k, v in pod_requests(o).items():
                                used[k] = used.get(k, 0.0) + v
                    alloc = {k: quantity(v) for k, v in n["status"]["allocatable"].items()}
                    short = [k for k, v in want.items()
                             if v > alloc.get(k, 0.0) - used.get(k, 0.0) + 1e-9]
                    if not short:
                        pod["spec"]["nodeName"] = name
                        pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True",
                                                        "lastTransitionTime": now()}]
                        self.stamp(pod)
                        return True
                    reason = f"Insufficient {short[0]}"
                why[reason] = why.get(reason, 0) + 1
            message = f"0/{len(NODES)} nodes are available: " + ", ".join(
                f"{c} {r}" for r, c in sorted(why.items())) + "."
            cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": message}
            old = (pod["status"].get("conditions") or [{}])[0]
            if old.get("reason") != "Unschedulable" or old.get("message") != message:
                pod["status"]["conditions"] = [dict(cond, lastTransitionTime=now())]
                self.stamp(pod)
            return False

    def sync_job(self, job: dict) -> None:
        spec = job.get("spec", {})
        meta = job["metadata"]
        ns, name = meta["namespace"], meta["name"]
        pods = [p for p in self.list(ns, "pods", f"batch.kubernetes.io/job-name={name}")
                if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences", []))]
        phases = [p["status"]["phase"] for p in pods]
        st = job.setdefault("status", {})
        before = json.dumps(st, sort_keys=True)
        succeeded, failed = phases.count("Succeeded"), phases.count("Failed")
        st["active"] = phases.count("Running") + phases.count("Pending")
        st["succeeded"], st["failed"] = succeeded, failed
        completions = spec.get("completions", 1)
        if not spec.get("suspend") and not st.get("startTime"):
            st["startTime"] = now()
        if not st.get("conditions"):
            if failed > 0:
                st["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                     "message": "Job has reached the specified backoff limit",
                                     "lastTransitionTime": now()}]
            elif succeeded >= completions:
                st["conditions"] = [{"type": "Complete", "status": "True", "lastTransitionTime": now()}]
                st["completionTime"] = now()
        if json.dumps(st, sort_keys=True) != before:
            self.stamp(job)
        if spec.get("suspend") or st.get("conditions"):
            return
        indexed = spec.get("completionMode") == "Indexed"
        have = {p["metadata"].get("annotations", {}).get("batch.kubernetes.io/job-completion-index")
                for p in pods}
        for index in range(completions if indexed else 1):
            if (str(index) if indexed else None) in have or (not indexed and pods):
                continue
            self.new_pod(job, index if indexed else None)

    def new_pod(self, job: dict, index: int | None) -> None:
        meta = job["metadata"]
        template = json.loads(json.dumps(job["spec"]["template"]))
        pmeta = template.get("metadata") or {}
        labels = dict(pmeta.get("labels") or {})
        labels["batch.kubernetes.io/job-name"] = meta["name"]
        labels["job-name"] = meta["name"]
        labels["batch.kubernetes.io/controller-uid"] = meta["uid"]
        annotations = dict(pmeta.get("annotations") or {})
        spec = template["spec"]
        if index is not None:
            annotations["batch.kubernetes.io/job-completion-index"] = str(index)
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
            spec["hostname"] = f"{meta['name']}-{index}"
            base = f"{meta['name']}-{index}-"
        else:
            base = f"{meta['name']}-"
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": base + rand5(), "labels": labels, "annotations": annotations,
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                              "name": meta["name"], "uid": meta["uid"],
                                              "controller": True, "blockOwnerDeletion": True}]},
            "spec": spec,
        }
        self.create(meta["namespace"], "pods", pod)

    def start_pod(self, key: tuple[str, str, str], pod: dict) -> None:
        ns, _, name = key
        spec = pod["spec"]
        c = spec["containers"][0]
        image = c["image"]
        if docker("image", "inspect", image, check=False).returncode != 0:
            with self.lock:
                pod["status"]["containerStatuses"] = [{
                    "name": c["name"], "image": image, "imageID": "", "ready": False,
                    "restartCount": 0, "state": {"waiting": {
                        "reason": "ErrImageNeverPull",
                        "message": f'Container image "{image}" is not present with pull policy of Never'}}}]
                self.stamp(pod)
            return
        with self.lock:
            ip = str(next(self.hosts))
        folder = os.path.join(self.files, name)
        os.makedirs(folder)
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        env: dict[str, str] = {}
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "valueFrom" in e and "fieldRef" in e["valueFrom"]:
                env[e["name"]] = field(pod, e["valueFrom"]["fieldRef"]["fieldPath"], ip)
        args = ["create", "--name", f"kube-{ns}-{name}", "--label", LABEL,
                "--network", self.network, "--ip", ip, "--hostname", spec.get("hostname", name)]
        sub = spec.get("subdomain")
        if sub and spec.get("hostname"):
            for suffix in ("", ".cluster.local"):
                args += ["--network-alias", f"{spec['hostname']}.{sub}.{ns}.svc{suffix}"]
        if fs_group is not None:
            args += ["--group-add", str(fs_group)]
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for m in c.get("volumeMounts") or []:
            v = volumes[m["name"]]
            if "secret" not in v:
                raise ValueError(f"pod {name}: volume {m['name']}: only secret volumes are supported")
            src = self.secret_volume(ns, name, v["secret"], fs_group)
            if src is None:
                self.fail_pod(key, pod, "CreateContainerConfigError",
                              f'secret "{v["secret"]["secretName"]}" not found')
                return
            if m.get("subPathExpr"):
                src = os.path.join(src, expand(m["subPathExpr"], env))
            elif m.get("subPath"):
                src = os.path.join(src, m["subPath"])
            args += ["-v", f"{src}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}"]
        if spec.get("automountServiceAccountToken") is not False:
            sa = spec.get("serviceAccountName") or "default"
            sa_dir = os.path.join(folder, "serviceaccount")
            os.makedirs(sa_dir)
            for f, text in (("token", sa_token(ns, sa)), ("namespace", ns),
                            ("ca.crt", open(self.ca_path).read())):
                with open(os.path.join(sa_dir, f), "w") as out:
                    out.write(text)
                os.chmod(os.path.join(sa_dir, f), 0o644)
            args += ["-v", f"{sa_dir}:{SA_DIR}:ro",
                     "-e", f"KUBERNETES_SERVICE_HOST={self.api_host}",
                     "-e", f"KUBERNETES_SERVICE_PORT={self.api_port}"]
            if sa == POD_IDENTITY_SA:
                pi_dir = os.path.join(folder, "pod-identity")
                os.makedirs(pi_dir)
                with open(os.path.join(pi_dir, "eks-pod-identity-token"), "w") as out:
                    out.write(sa_token(ns, sa))
                os.chmod(os.path.join(pi_dir, "eks-pod-identity-token"), 0o644)
                args += ["-v", f"{pi_dir}:{POD_IDENTITY_DIR}:ro",
                         "-e", f"AWS_CONTAINER_CREDENTIALS_FULL_URI={self.creds_url}",
                         "-e", f"AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE={POD_IDENTITY_DIR}/eks-pod-identity-token",
                         # the credentials endpoint's CA (see `creds` in main)
                         "-e", f"SSL_CERT_FILE={SA_DIR}/ca.crt",
                         "-e", f"AWS_REGION={REGION}", "-e", f"AWS_DEFAULT_REGION={REGION}",
                         # this test's AWS is moto, in plain HTTP
                         "-e", f"AWS_ENDPOINT_URL={self.moto_url}", "-e", "AWS_ALLOW_HTTP=true"]
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        command = c.get("command") or []
        if command:
            args += ["--entrypoint", command[0]]
        args.append(image)
        args += command[1:] + [expand(a, env) for a in c.get("args") or []]
        container = f"kube-{ns}-{name}"
        with self.lock:
            if (ns, "pods", name) not in self.objects:
                return  # deleted meanwhile
            self.containers[key] = container
        r = docker(*args, check=False)
        if r.returncode == 0:
            # the NetworkPolicies' rules for it, and for the pods it may now reach, before it starts
            with self.lock:
                if (ns, "pods", name) in self.objects:
                    self.addresses[key] = ip
                    self.enforce()
            r = docker("start", container, check=False)
        if r.returncode != 0:
            self.fail_pod(key, pod, "CreateContainerError", r.stderr.strip()[-300:])
            return
        with self.lock:
            if (ns, "pods", name) not in self.objects:
                docker("rm", "-f", container, check=False)
                return
            pod["status"].update({
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": self.api_host,
                "startTime": now(),
                "containerStatuses": [{"name": c["name"], "image": image, "imageID": image,
                                       "ready": True, "started": True, "restartCount": 0,
                                       "state": {"running": {"startedAt": now()}}}]})
            self.stamp(pod)

    def secret_volume(self, ns: str, pod: str, vol: dict, fs_group: int | None) -> str | None:
        secret = self.get(ns, "secrets", vol["secretName"])
        if secret is None:
            return None
        root = os.path.join(self.files, pod, "secret-" + vol["secretName"])
        mode = vol.get("defaultMode", 0o644)
        data = secret.get("data") or {}
        items = vol.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            path = os.path.join(root, item["path"])
            os.makedirs(os.path.dirname(path), exist_ok=True, mode=0o755)
            with open(path, "wb") as f:
                f.write(base64.b64decode(data[item["key"]]))
            if fs_group is not None:
                os.chown(path, 0, fs_group)
            os.chmod(path, item.get("mode", mode))
        for dirpath, _, _ in os.walk(root):
            os.chmod(dirpath, 0o755)
        return root

    def fail_pod(self, key, pod: dict, reason: str, message: str) -> None:
        with self.lock:
            pod["status"]["containerStatuses"] = [{
                "name": pod["spec"]["containers"][0]["name"], "image": pod["spec"]["containers"][0]["image"],
                "imageID": "", "ready": False, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}}}]
            self.stamp(pod)

    def observe(self, key, pod: dict) -> None:
        container = self.containers.get(key)
        if container is None:
            return
        r = docker("inspect", "-f", "{{.State.Running}} {{.State.ExitCode}} {{.State.OOMKilled}}",
                   container, check=False)
        if r.returncode != 0:
            return
        running, code, oom = r.stdout.split()
        if running == "true":
            return
        code = int(code)
        reason = "OOMKilled" if oom == "true" else ("Completed" if code == 0 else "Error")
        with self.lock:
            if key not in self.objects:
                return
            c = pod["status"]["containerStatuses"][0]
            started = c["state"].get("running", {}).get("startedAt", now())
            c["state"] = {"terminated": {"exitCode": code, "reason": reason, "startedAt": started,
                                         "finishedAt": now()}}
            c["ready"] = False
            pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            self.stamp(pod)

    def logs(self, key, query: dict) -> str | None:
        container = self.containers.get(key)
        if container is None:
            return None
        args = ["logs"]
        if "tailLines" in query:
            args += ["--tail", query["tailLines"][0]]
        r = subprocess.run(["docker", *args, container], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, check=False)
        return r.stdout

    def shutdown(self) -> None:
        self.done.set()


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in values, args and subPathExpr."""
    out = text
    for k, v in env.items():
        out = out.replace(f"$({k})", v)
    return out


def field(pod: dict, path: str, ip: str) -> str:
    """The downward API's fieldRef."""
    if path == "status.podIP":
        return ip
    if path == "metadata.name":
        return pod["metadata"]["name"]
    if path == "metadata.namespace":
        return pod["metadata"]["namespace"]
    for kind in ("annotations", "labels"):
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return (pod["metadata"].get(kind) or {}).get(path[len(prefix):-2], "")
    raise ValueError(f"fieldRef {path} is not supported")


def sa_token(ns: str, sa: str) -> str:
    return f"sa.{ns}.{sa}"


# how many watch events the API server keeps (older resourceVersions: 410 Gone, as etcd's compaction)
HISTORY = 20000
RBAC_GROUP = "rbac.authorization.k8s.io"
# The user of the kubeconfig: an administrator, as the one a managed cluster's creator gets
USER_NAME = "physalia-test-user"
USER_GROUPS = ["system:masters", "system:authenticated"]


class Res(typing.NamedTuple):
    """A resource the API server serves, as its discovery document describes it."""
    group: str
    version: str
    kind: str
    namespaced: bool
    verbs: tuple
    short: tuple = ()
    categories: tuple = ()
    # subresource -> its verbs
    subresources: tuple = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


# the verbs every stored resource serves (no deletecollection; patch: JSON merge patches only)
CRUD = ("create", "delete", "get", "list", "patch", "update", "watch")
RESOURCES = {
    "namespaces": Res("", "v1", "Namespace", False, ("get", "list", "watch"), ("ns",)),
    "nodes": Res("", "v1", "Node", False, ("get", "list"), ("no",)),
    "pods": Res("", "v1", "Pod", True, CRUD, ("po",), ("all",), (("log", ("get",)),)),
    "secrets": Res("", "v1", "Secret", True, CRUD),
    "services": Res("", "v1", "Service", True, CRUD, ("svc",), ("all",)),
    "events": Res("", "v1", "Event", True, CRUD, ("ev",)),
    "serviceaccounts": Res("", "v1", "ServiceAccount", True, CRUD, ("sa",)),
    "selfsubjectreviews": Res("authentication.k8s.io", "v1", "SelfSubjectReview", False, ("create",)),
    "selfsubjectaccessreviews": Res("authorization.k8s.io", "v1", "SelfSubjectAccessReview", False,
                                    ("create",)),
    "selfsubjectrulesreviews": Res("authorization.k8s.io", "v1", "SelfSubjectRulesReview", False,
                                   ("create",)),
    "subjectaccessreviews": Res("authorization.k8s.io", "v1", "SubjectAccessReview", False, ("create",)),
    "jobs": Res("batch", "v1", "Job", True, CRUD, (), ("all",)),
    "networkpolicies": Res("networking.k8s.io", "v1", "NetworkPolicy", True, CRUD, ("netpol",)),
    "clusterrolebindings": Res(RBAC_GROUP, "v1", "ClusterRoleBinding", False, CRUD),
    "clusterroles": Res(RBAC_GROUP, "v1", "ClusterRole", False, CRUD),
    "rolebindings": Res(RBAC_GROUP, "v1", "RoleBinding", True, CRUD),
    "roles": Res(RBAC_GROUP, "v1", "Role", True, CRUD),
}
# the groups in the order /apis lists them
GROUPS = ["authentication.k8s.io", "authorization.k8s.io", "batch", "networking.k8s.io", RBAC_GROUP]
KINDS = {(r.api_version, r.kind): name for name, r in RESOURCES.items()}
REVIEWS = {"selfsubjectreviews", "selfsubjectaccessreviews", "selfsubjectrulesreviews",
           "subjectaccessreviews"}
# the fields each resource can be selected by beyond metadata.name and metadata.namespace (the API
# server's field label conversions; another field is a 400)
FIELDS = {
    "pods": {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
             "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"},
    "events": {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
               "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
               "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"},
    "secrets": {"type"},
    "jobs": {"status.successful"},
    "namespaces": {"status.phase"},
}


def fold_string_data(secret: dict) -> None:
    """A Secret's stringData written into its data (base64), as the API server stores it."""
    for k, v in (secret.pop("stringData", None) or {}).items():
        secret.setdefault("data", {})[k] = base64.b64encode(str(v).encode()).decode()


def qualified(res: str) -> str:
    """A resource as API errors name it: `pods`, `jobs.batch`."""
    group = RESOURCES[res].group if res in RESOURCES else ""
    return f"{res}.{group}" if group else res


def policy_types(policy: dict) -> list[str]:
    """A NetworkPolicy's policyTypes, defaulted as the API server does (Ingress, and Egress where it
    has egress rules)."""
    spec = policy.get("spec") or {}
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if spec.get("egress") else []))


def unenforceable(policy: dict) -> str | None:
    """Why this fake cannot enforce a NetworkPolicy as a network plugin would (refused, 422, rather than
    stored and not enforced): named ports, ipBlock `except`, selector operators it does not know."""
    name = (policy.get("metadata") or {}).get("name", "")
    spec = policy.get("spec") or {}
    selectors = [spec.get("podSelector")]
    for rule in spec.get("ingress") or []:
        for port in rule.get("ports") or []:
            if "port" in port and not isinstance(port["port"], int):
                return f"NetworkPolicy {name}: named ports are not done in this fake"
        for peer in rule.get("from") or []:
            if (peer.get("ipBlock") or {}).get("except"):
                return f"NetworkPolicy {name}: ipBlock.except is not done in this fake"
            selectors += [peer.get("podSelector"), peer.get("namespaceSelector")]
    for sel in selectors:
        for e in (sel or {}).get("matchExpressions") or []:
            if e.get("operator") not in ("In", "NotIn", "Exists", "DoesNotExist"):
                return f"NetworkPolicy {name}: label selector operator {e.get('operator')!r}"
    return None


def selector_matches(sel: dict | None, labels: dict) -> bool:
    """A LabelSelector (`matchLabels`, `matchExpressions` In / NotIn / Exists / DoesNotExist) on
    `labels`; an empty one selects everything."""
    sel = sel or {}
    if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        k, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": k in labels and labels[k] in values, "NotIn": labels.get(k) not in values,
              "Exists": k in labels, "DoesNotExist": k not in labels}.get(op)
        if ok is None:
            raise ValueError(f"label selector operator {op!r}")
        if not ok:
            return False
    return True


def load_manifests(path: str) -> list[tuple[str, str, dict]]:
    """The objects of a manifest file (infra/k8s/rbac.yaml) as (resource, namespace, object)."""
    import yaml

    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    out = []
    for d in docs:
        res = KINDS.get((d.get("apiVersion"), d.get("kind")))
        if res is None:
            raise SystemExit(f"{path}: {d.get('apiVersion')} {d.get('kind')} is not a kind this fake keeps")
        ns = d["metadata"].get("namespace", "default") if RESOURCES[res].namespaced else ""
        out.append((res, ns, d))
    return out


def builtin_rbac() -> list[tuple[str, str, dict]]:
    """The ClusterRoles and ClusterRoleBindings the API server bootstraps that matter here: the
    administrators' (group system:masters), and what every authenticated user may do (discovery,
    reviews of its own access)."""
    labels = {"kubernetes.io/bootstrapping": "rbac-defaults"}

    def role(name: str, rules: list) -> tuple[str, str, dict]:
        return ("clusterroles", "", {"metadata": {"name": name, "labels": labels}, "rules": rules})

    def binding(name: str, groups: list[str]) -> tuple[str, str, dict]:
        return ("clusterrolebindings", "", {
            "metadata": {"name": name, "labels": labels},
            "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "Group", "apiGroup": RBAC_GROUP, "name": g} for g in groups]})

    return [
        role("cluster-admin", [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
                               {"nonResourceURLs": ["*"], "verbs": ["*"]}]),
        binding("cluster-admin", ["system:masters"]),
        role("system:basic-user", [
            {"apiGroups": ["authorization.k8s.io"],
             "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"], "verbs": ["create"]},
            {"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"],
             "verbs": ["create"]}]),
        binding("system:basic-user", ["system:authenticated"]),
        role("system:discovery", [{"nonResourceURLs": [
            "/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi", "/openapi/*",
            "/readyz", "/version", "/version/"], "verbs": ["get"]}]),
        binding("system:discovery", ["system:authenticated"]),
        role("system:public-info-viewer", [{"nonResourceURLs": [
            "/healthz", "/livez", "/readyz", "/version", "/version/"], "verbs": ["get"]}]),
        binding("system:public-info-viewer", ["system:authenticated", "system:unauthenticated"]),
    ]


def rule_allows(rule: dict, a: dict) -> bool:
    """Whether an RBAC PolicyRule allows the request `a` (RBAC's own matching: `*`, `*/sub`,
    resourceNames, nonResourceURLs with a trailing `*`)."""
    verbs = rule.get("verbs") or []
    if "*" not in verbs and a["verb"] not in verbs:
        return False
    if "path" in a:
        return any(u == "*" or u == a["path"] or (u.endswith("*") and a["path"].startswith(u[:-1]))
                   for u in rule.get("nonResourceURLs") or [])
    groups = rule.get("apiGroups") or []
    if "*" not in groups and a["group"] not in groups:
        return False
    sub = a.get("subresource") or ""
    combined = a["resource"] + (f"/{sub}" if sub else "")
    if not any(r == "*" or r == combined or (sub and r == f"*/{sub}") for r in rule.get("resources") or []):
        return False
    names = rule.get("resourceNames") or []
    return not names or a.get("name", "") in names


def subject_matches(s: dict, user: str, groups: list[str], binding_ns: str) -> bool:
    kind = s.get("kind")
    if kind == "User":
        return s.get("name") == user
    if kind == "Group":
        return s.get("name") in groups
    if kind == "ServiceAccount":
        return user == f"system:serviceaccount:{s.get('namespace') or binding_ns}:{s.get('name')}"
    return False


def describe_subject(s: dict, binding_ns: str) -> str:
    if s.get("kind") == "ServiceAccount":
        return f'ServiceAccount "{s.get("name")}/{s.get("namespace") or binding_ns}"'
    return f'{s.get("kind")} "{s.get("name")}"'


def status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    out = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code}
    if details:
        out["details"] = details
    return out


def forbidden(user: str, a: dict) -> dict:
    """RBAC's 403, worded as the API server words it."""
    if "path" in a:
        return status(403, "Forbidden", f'forbidden: User "{user}" cannot {a["verb"]} path "{a["path"]}"')
    res, sub, name = a["resource"], a.get("subresource") or "", a.get("name") or ""
    gr = f"{res}.{a['group']}" if a["group"] else res
    what = f'{gr} "{name}"' if name else gr
    where = f'in the namespace "{a["namespace"]}"' if a.get("namespace") else "at the cluster scope"
    full = res + (f"/{sub}" if sub else "")
    return status(403, "Forbidden",
                  f'{what} is forbidden: User "{user}" cannot {a["verb"]} resource "{full}" in API '
                  f'group "{a["group"]}" {where}',
                  {"name": name, "group": a["group"], "kind": res} if name else
                  {"group": a["group"], "kind": res})


# --- selectors -----------------------------------------------------------------------------------

def split_terms(text: str) -> list[str]:
    """A selector's comma-separated terms (commas inside `in (...)` do not split)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [t.strip() for t in out if t.strip()]


LABEL_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"


def label_selector(text: str):
    """A predicate on an object's labels for a label selector (`k=v`, `k==v`, `k!=v`, `k in (a,b)`,
    `k notin (a)`, `k`, `!k`); ValueError where it does not parse."""
    terms = []
    for t in split_terms(text or ""):
        m = re.fullmatch(rf"({LABEL_KEY})\s+(in|notin)\s+\(([^)]*)\)", t)
        if m:
            k, op = m.group(1), m.group(2)
            vals = {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                terms.append(lambda ls, k=k, vals=vals: ls.get(k) in vals)
            else:
                terms.append(lambda ls, k=k, vals=vals: ls.get(k) not in vals)
            continue
        m = re.fullmatch(rf"({LABEL_KEY})\s*(==|=|!=)\s*([-A-Za-z0-9_.]*)", t)
        if m:
            k, op, v = m.groups()
            if op == "!=":
                terms.append(lambda ls, k=k, v=v: ls.get(k) != v)
            else:
                terms.append(lambda ls, k=k, v=v: ls.get(k) == v)
            continue
        m = re.fullmatch(rf"(!?)\s*({LABEL_KEY})", t)
        if m:
            neg, k = m.groups()
            terms.append(lambda ls, k=k, neg=bool(neg): (k in ls) != neg)
            continue
        raise ValueError(f"unable to parse requirement: {t!r}")
    return lambda labels: all(term(labels) for term in terms)


def field_value(obj: dict, path: str) -> str:
    have = obj
    for part in path.split("."):
        have = have.get(part) if isinstance(have, dict) else None
    if path == "source" and isinstance(have, dict):
        have = have.get("component")
    if isinstance(have, bool):
        return "true" if have else "false"
    return "" if have is None or isinstance(have, dict) else str(have)


def field_selector(res: str, text: str):
    """A predicate on an object for a field selector (`f=v`, `f==v`, `f!=v`) over the fields the
    resource can be selected by; ValueError otherwise."""
    terms = []
    for t in split_terms(text or ""):
        m = re.fullmatch(r"([A-Za-z.]+)\s*(==|=|!=)\s*(.*)", t)
        if not m:
            raise ValueError(f"invalid selector: '{text}'; can't understand '{t}'")
        k, op, v = m.groups()
        if k not in ("metadata.name", "metadata.namespace") and k not in FIELDS.get(res, ()):
            raise ValueError(f'field label not supported: {k}')
        terms.append((k, op == "!=", v))
    return lambda obj: all((field_value(obj, k) == v) != neg for k, neg, v in terms)


# --- Tables (server-side printing: what `kubectl get` shows) -----------------------------------

def human_duration(s: float) -> str:
    """apimachinery's HumanDuration."""
    s = int(s)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = s // 3600
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 192:
        return f"{h // 24}d{h % 24}h" if h % 24 else f"{h // 24}d"
    if h < 24 * 365 * 2:
        return f"{h // 24}d"
    return f"{h // (24 * 365)}y"


def seconds_since(ts: str | None, until: str | None = None) -> float | None:
    if not ts:
        return None
    parse = lambda t: datetime.datetime.strptime(t, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc)
    end = parse(until) if until else datetime.datetime.now(datetime.timezone.utc)
    return (end - parse(ts)).total_seconds()


def age(obj: dict) -> str:
    s = seconds_since(obj.get("metadata", {}).get("creationTimestamp"))
    return "<unknown>" if s is None else human_duration(s)


def pod_cells(p: dict) -> list:
    st, spec = p.get("status") or {}, p.get("spec") or {}
    reason = st.get("reason") or st.get("phase") or "Unknown"
    ready = restarts = 0
    running = False
    for c in reversed(st.get("containerStatuses") or []):
        restarts += c.get("restartCount", 0)
        state = c.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif (state.get("terminated") or {}).get("reason"):
            reason = state["terminated"]["reason"]
        elif "terminated" in state:
            t = state["terminated"]
            reason = f"Signal:{t['signal']}" if t.get("signal") else f"ExitCode:{t.get('exitCode', 0)}"
        elif c.get("ready") and "running" in state:
            running = True
            ready += 1
    if reason == "Completed" and running:
        reason = "Running"
    if p["metadata"].get("deletionTimestamp"):
        reason = "Terminating"
    return [p["metadata"]["name"], f"{ready}/{len(spec.get('containers') or [])}", reason, str(restarts),
            age(p), st.get("podIP") or "<none>", spec.get("nodeName") or "<none>",
            st.get("nominatedNodeName") or "<none>", "<none>"]


def job_cells(j: dict) -> list:
    spec, st = j.get("spec") or {}, j.get("status") or {}
    conds = {c.get("type"): c.get("status") for c in st.get("conditions") or []}
    if conds.get("Complete") == "True":
        state = "Complete"
    elif conds.get("Failed") == "True":
        state = "Failed"
    elif j["metadata"].get("deletionTimestamp"):
        state = "Terminating"
    elif conds.get("FailureTarget") == "True":
        state = "FailureTarget"
    elif spec.get("suspend") or conds.get("Suspended") == "True":
        state = "Suspended"
    else:
        state = "Running"
    succeeded = st.get("succeeded", 0)
    if spec.get("completions") is not None:
        completions = f"{succeeded}/{spec['completions']}"
    elif (spec.get("parallelism") or 1) > 1:
        completions = f"{succeeded}/1 of {spec['parallelism']}"
    else:
        completions = f"{succeeded}/1"
    took = seconds_since(st.get("startTime"), st.get("completionTime"))
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    selector = ",".join(f"{k}={v}" for k, v in
                        sorted(((spec.get("selector") or {}).get("matchLabels") or {}).items()))
    return [j["metadata"]["name"], state, completions, "" if took is None else human_duration(took),
            age(j), ",".join(c.get("name", "") for c in containers),
            ",".join(c.get("image", "") for c in containers), selector or "<none>"]


def service_cells(s: dict) -> list:
    spec = s.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or [])
    selector = ",".join(f"{k}={v}" for k, v in sorted((spec.get("selector") or {}).items()))
    return [s["metadata"]["name"], spec.get("type", "ClusterIP"), spec.get("clusterIP") or "<none>",
            "<none>", ports or "<none>", age(s), selector or "<none>"]


def binding_cells(b: dict) -> list:
    ref = b.get("roleRef") or {}
    subjects = b.get("subjects") or []
    ns = b["metadata"].get("namespace", "")
    of = lambda kind: ", ".join(
        (f"{s.get('namespace') or ns}/{s['name']}" if kind == "ServiceAccount" else s["name"])
        for s in subjects if s.get("kind") == kind)
    return [b["metadata"]["name"], f"{ref.get('kind')}/{ref.get('name')}", age(b), of("User"),
            of("Group"), of("ServiceAccount")]


def event_cells(e: dict) -> list:
    last = e.get("lastTimestamp") or e.get("eventTime") or e["metadata"].get("creationTimestamp")
    s = seconds_since(last[:19] + "Z" if last else None)
    o = e.get("involvedObject") or {}
    return ["<unknown>" if s is None else human_duration(s), e.get("type", ""), e.get("reason", ""),
            f"{(o.get('kind') or '').lower()}/{o.get('name', '')}", e.get("message", "")]


# resource -> ([(column, type, priority)], cells); columns as the API server's printers name them
TABLES = {
    "pods": ([("Name", "string", 0), ("Ready", "string", 0), ("Status", "string", 0),
              ("Restarts", "string", 0), ("Age", "string", 0), ("IP", "string", 1),
              ("Node", "string", 1), ("Nominated Node", "string", 1), ("Readiness Gates", "string", 1)],
             pod_cells),
    "jobs": ([("Name", "string", 0), ("Status", "string", 0), ("Completions", "string", 0),
              ("Duration", "string", 0), ("Age", "string", 0), ("Containers", "string", 1),
              ("Images", "string", 1), ("Selector", "string", 1)], job_cells),
    "services": ([("Name", "string", 0), ("Type", "string", 0), ("Cluster-IP", "string", 0),
                  ("External-IP", "string", 0), ("Port(s)", "string", 0), ("Age", "string", 0),
                  ("Selector", "string", 1)], service_cells),
    "secrets": ([("Name", "string", 0), ("Type", "string", 0), ("Data", "integer", 0),
                 ("Age", "string", 0)],
                lambda s: [s["metadata"]["name"], s.get("type", "Opaque"), len(s.get("data") or {}),
                           age(s)]),
    "events": ([("Last Seen", "string", 0), ("Type", "string", 0), ("Reason", "string", 0),
                ("Object", "string", 0), ("Message", "string", 0)], event_cells),
    "namespaces": ([("Name", "string", 0), ("Status", "string", 0), ("Age", "string", 0)],
                   lambda n: [n["metadata"]["name"], (n.get("status") or {}).get("phase", ""), age(n)]),
    "nodes": ([("Name", "string", 0), ("Status", "string", 0), ("Roles", "string", 0),
               ("Age", "string", 0), ("Version", "string", 0)],
              lambda n: [n["metadata"]["name"], "Ready", "<none>", age(n), ""]),
    "serviceaccounts": ([("Name", "string", 0), ("Secrets", "string", 0), ("Age", "string", 0)],
                        lambda s: [s["metadata"]["name"], len(s.get("secrets") or []), age(s)]),
    "rolebindings": ([("Name", "string", 0), ("Role", "string", 0), ("Age", "string", 0),
                      ("Users", "string", 1), ("Groups", "string", 1),
                      ("ServiceAccounts", "string", 1)], binding_cells),
    "clusterrolebindings": ([("Name", "string", 0), ("Role", "string", 0), ("Age", "string", 0),
                             ("Users", "string", 1), ("Groups", "string", 1),
                             ("ServiceAccounts", "string", 1)], binding_cells),
}
# what the API server's default table convertor shows for the rest (Roles, ClusterRoles)
DEFAULT_TABLE = ([("Name", "string", 0), ("Created At", "date", 0)],
                 lambda o: [o["metadata"]["name"], o["metadata"].get("creationTimestamp", "")])


def table(res: str, objs: list[dict], include: str, rv: str | None = None) -> dict:
    """`objs` as a meta.k8s.io/v1 Table, each row's object as `includeObject` asks (Metadata by default)."""
    columns, cells = TABLES.get(res, DEFAULT_TABLE)
    rows = []
    for o in objs:
        row = {"cells": cells(o)}
        if include == "Object":
            row["object"] = o
        elif include != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": o.get("metadata", {})}
        rows.append(row)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": rv} if rv else {},
            "columnDefinitions": [{"name": n, "type": t, "format": "name" if n == "Name" else "",
                                   "description": "", "priority": p} for n, t, p in columns],
            "rows": rows}


# --- discovery ----------------------------------------------------------------------------------

def resource_list(group: str) -> dict:
    """APIResourceList of `group`/v1 (the legacy discovery document)."""
    out = []
    for name, r in RESOURCES.items():
        if r.group != group:
            continue
        entry = {"name": name, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                 "kind": r.kind, "verbs": list(r.verbs)}
        if r.short:
            entry["shortNames"] = list(r.short)
        if r.categories:
            entry["categories"] = list(r.categories)
        out.append(entry)
        for sub, verbs in r.subresources:
            out.append({"name": f"{name}/{sub}", "singularName": "", "namespaced": r.namespaced,
                        "kind": r.kind, "verbs": list(verbs)})
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/v1" if group else "v1", "resources": out}


def api_group(group: str) -> dict:
    gv = {"groupVersion": f"{group}/v1", "version": "v1"}
    return {"name": group, "versions": [gv], "preferredVersion": gv}


def aggregated(groups: list[str]) -> dict:
    """apidiscovery.k8s.io/v2 APIGroupDiscoveryList of `groups` ("" for /api)."""
    items = []
    for group in groups:
        resources = []
        for name, r in RESOURCES.items():
            if r.group != group:
                continue
            kind = {"group": group, "version": "v1", "kind": r.kind}
            entry = {"resource": name, "responseKind": kind,
                     "scope": "Namespaced" if r.namespaced else "Cluster",
                     "singularResource": r.kind.lower(), "verbs": list(r.verbs)}
            if r.short:
                entry["shortNames"] = list(r.short)
            if r.categories:
                entry["categories"] = list(r.categories)
            if r.subresources:
                entry["subresources"] = [{"subresource": sub, "responseKind": kind, "verbs": list(v)}
                                         for sub, v in r.subresources]
            resources.append(entry)
        meta = {"name": group, "creationTimestamp": None} if group else {"creationTimestamp": None}
        items.append({"metadata": meta,
                      "versions": [{"version": "v1", "resources": resources, "freshness": "Current"}]})
    return {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2",
            "metadata": {}, "items": items}


AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"


def accepts(accept: str, g: str, v: str, as_: str) -> bool:
    """Whether an Accept header names application/json with these g, v and as parameters."""
    for part in accept.split(","):
        fields = [f.strip() for f in part.split(";")]
        params = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
        if fields[0] == "application/json" and params.get("g") == g and params.get("as") == as_ \
                and params.get("v") == v:
            return True
    return False


VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0+physalia.fake", "gitCommit": "",
           "gitTreeState": "clean", "buildDate": "2024-12-11T00:00:00Z", "goVersion": "",
           "compiler": "gc", "platform": "linux/amd64"}


# --- OpenAPI v3 (paths only: what kubectl reads to learn that the server validates fields) ------

def gv_path(group: str) -> str:
    return f"apis/{group}/v1" if group else "api/v1"


def openapi_root() -> dict:
    return {"paths": {gv_path(g): {"serverRelativeURL": f"/openapi/v3/{gv_path(g)}?hash=fake"}
                      for g in [""] + GROUPS}}


FIELD_VALIDATION = {"name": "fieldValidation", "in": "query", "schema": {"type": "string"},
                    "description": "Ignore, Warn (the default) or Strict: what the server does with a "
                                   "field it does not know (this fake knows the top-level and metadata "
                                   "fields only)"}


def openapi_doc(group: str) -> dict | None:
    """The OpenAPI v3 document of `group`/v1: its operations, no schemas."""
    if group not in [""] + GROUPS:
        return None
    paths = {}
    for name, r in RESOURCES.items():
        if r.group != group:
            continue
        base = "/" + gv_path(group) + ("/namespaces/{namespace}/" if r.namespaced else "/") + name
        gvk = {"group": group, "version": "v1", "kind": r.kind}
        op_name = r.kind + ("" if not r.namespaced else "Namespaced")

        def op(action: str, validates: bool = False) -> dict:
            out = {"operationId": f"{action}{op_name}", "x-kubernetes-action": action,
                   "x-kubernetes-group-version-kind": gvk,
                   "responses": {"200": {"description": "OK"}}}
            if validates:
                out["parameters"] = [FIELD_VALIDATION]
            return out

        collection, item = {}, {}
        if "list" in r.verbs:
            collection["get"] = op("list")
        if "create" in r.verbs:
            collection["post"] = op("create", True)
        if "get" in r.verbs:
            item["get"] = op("get")
        if "update" in r.verbs:
            item["put"] = op("replace", True)
        if "patch" in r.verbs:
            item["patch"] = op("patch", True)
        if "delete" in r.verbs:
            item["delete"] = op("delete")
        if collection:
            paths[base] = collection
        if item:
            paths[base + "/{name}"] = item
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": VERSION["gitVersion"]},
            "paths": paths, "components": {"schemas": {}}}


# --- OpenAPI v2 (empty: what a kubectl before 1.27 reads before it creates from a file) ------------

# what kube-openapi answers (clients ask for `...spec.v2@v1.0+protobuf`, which Go's mime parser refuses
# as a response's type)
OPENAPI_V2_PB = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"


def openapi_v2_protobuf() -> bytes:
    """An OpenAPI v2 document with no definitions, as gnostic's openapi_v2.Document in protobuf:
    `swagger` (1), `info` (2: title 1, version 2), `paths` (8, empty). Older kubectl validates a file
    against the definitions of its kind and, finding none, skips it (the server validates instead)."""
    def field(num: int, payload: bytes) -> bytes:
        n, length = len(payload), b""
        while True:
            length += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                break
        return bytes([num << 3 | 2]) + length + payload

    info = field(1, b"Kubernetes") + field(2, VERSION["gitVersion"].encode())
    return field(1, b"2.0") + field(2, info) + field(8, b"")


META_FIELDS = {"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
               "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
               "annotations", "ownerReferences", "finalizers", "managedFields"}
TOP_FIELDS = {
    "pods": {"spec", "status"}, "jobs": {"spec", "status"}, "services": {"spec", "status"},
    "namespaces": {"spec", "status"}, "secrets": {"data", "stringData", "type", "immutable"},
    "events": {"involvedObject", "reason", "message", "source", "firstTimestamp", "lastTimestamp",
               "count", "type", "eventTime", "series", "action", "related", "reportingComponent",
               "reportingInstance"},
    "serviceaccounts": {"secrets", "imagePullSecrets", "automountServiceAccountToken"},
    "roles": {"rules"}, "clusterroles": {"rules", "aggregationRule"}, "networkpolicies": {"spec"},
    "rolebindings": {"roleRef", "subjects"}, "clusterrolebindings": {"roleRef", "subjects"},
}


def unknown_fields(res: str, obj: dict) -> list[str]:
    """The fields of `obj` its kind does not have, at the top level and in metadata (deeper fields
    are not checked)."""
    known = {"apiVersion", "kind", "metadata"} | TOP_FIELDS.get(res, set())
    out = [k for k in obj if k not in known]
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        out += [f"metadata.{k}" for k in meta if k not in META_FIELDS]
    return out


# --- protobuf bodies (what typed clients send: kubectl's access reviews) --------------------------

class UnsupportedBody(Exception):
    """A request body this fake cannot read (415)."""


def proto_fields(data: bytes) -> dict[int, list]:
    """A protobuf message's fields by number (wire types 0, 1, 2 and 5)."""
    def varint(i: int) -> tuple[int, int]:
        n = shift = 0
        while True:
            b = data[i]
            n |= (b & 0x7F) << shift
            i += 1
            if b < 0x80:
                return n, i
            shift += 7

    out: dict[int, list] = {}
    i = 0
    while i < len(data):
        key, i = varint(i)
        wire = key & 7
        if wire == 0:
            v, i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            v, i = data[i:i + n], i + n
        elif wire in (1, 5):
            v, i = data[i:i + (8 if wire == 1 else 4)], i + (8 if wire == 1 else 4)
        else:
            raise UnsupportedBody(f"protobuf wire type {wire}")
        out.setdefault(key >> 3, []).append(v)
    return out


def from_proto(data: bytes, schema: dict) -> dict:
    """A message as JSON by `schema` (field -> (JSON name, "str" | "[str]" | "bool" | "map" | "skip" |
    a nested schema, or a list of one for a repeated message)); a field outside the schema is a body
    this fake cannot read, rather than one it would read wrong."""
    out: dict = {}
    for num, values in proto_fields(data).items():
        if num not in schema:
            raise UnsupportedBody(f"protobuf field {num} of a message this fake reads only in part")
        name, kind = schema[num]
        if kind == "skip":
            continue
        if kind == "str":
            if values[-1]:
                out[name] = values[-1].decode()
        elif kind == "[str]":
            out[name] = [v.decode() for v in values]
        elif kind == "bool":
            out[name] = bool(values[-1])
        elif kind == "map":
            out[name] = {e.get("k", ""): e.get("v", "") for e in
                         (from_proto(v, {1: ("k", "str"), 2: ("v", "str")}) for v in values)}
        elif kind == "bytes-map":
            out[name] = {e.get("k", ""): base64.b64encode(e.get("v", b"")).decode() for e in
                         (from_proto(v, {1: ("k", "str"), 2: ("v", "bytes")}) for v in values)}
        elif kind == "bytes":
            out[name] = values[-1]
        elif isinstance(kind, list):
            out[name] = [from_proto(v, kind[0]) for v in values]
        else:
            out[name] = from_proto(values[-1], kind)
    return out


# k8s.io/api's generated.proto field numbers of the kinds typed clients (kubectl auth, kubectl create
# role|rolebinding|clusterrole|clusterrolebinding|serviceaccount|secret) POST here; the others (`kubectl
# create job`, a protobuf Job) are 415
RESOURCE_ATTRIBUTES = {1: ("namespace", "str"), 2: ("verb", "str"), 3: ("group", "str"),
                       4: ("version", "str"), 5: ("resource", "str"), 6: ("subresource", "str"),
                       7: ("name", "str")}
NON_RESOURCE_ATTRIBUTES = {1: ("path", "str"), 2: ("verb", "str")}
# selfLink, uid, resourceVersion, generation, creationTimestamp, deletionTimestamp and
# deletionGracePeriodSeconds are the server's to set: read and dropped
OBJECT_META = {1: ("name", "str"), 2: ("generateName", "str"), 3: ("namespace", "str"),
               **{n: ("", "skip") for n in range(4, 11)},
               11: ("labels", "map"), 12: ("annotations", "map")}
POLICY_RULE = {1: ("verbs", "[str]"), 2: ("apiGroups", "[str]"), 3: ("resources", "[str]"),
               4: ("resourceNames", "[str]"), 5: ("nonResourceURLs", "[str]")}
SUBJECT = {1: ("kind", "str"), 2: ("apiGroup", "str"), 3: ("name", "str"), 4: ("namespace", "str")}
ROLE_REF = {1: ("apiGroup", "str"), 2: ("kind", "str"), 3: ("name", "str")}
BINDING = {1: ("metadata", OBJECT_META), 2: ("subjects", [SUBJECT]), 3: ("roleRef", ROLE_REF)}
# (a review's status, the server's to write, is read and dropped; so is a SubjectAccessReview's extra,
# which RBAC does not read)
PROTO_KINDS = {
    "SelfSubjectAccessReview": {1: ("metadata", OBJECT_META), 2: ("spec", {
        1: ("resourceAttributes", RESOURCE_ATTRIBUTES), 2: ("nonResourceAttributes", NON_RESOURCE_ATTRIBUTES)}),
        3: ("", "skip")},
    "SubjectAccessReview": {1: ("metadata", OBJECT_META), 2: ("spec", {
        1: ("resourceAttributes", RESOURCE_ATTRIBUTES), 2: ("nonResourceAttributes", NON_RESOURCE_ATTRIBUTES),
        3: ("user", "str"), 4: ("groups", "[str]"), 5: ("", "skip"), 6: ("uid", "str")}),
        3: ("", "skip")},
    "SelfSubjectRulesReview": {1: ("metadata", OBJECT_META), 2: ("spec", {1: ("namespace", "str")}),
                               3: ("", "skip")},
    "SelfSubjectReview": {1: ("metadata", OBJECT_META), 2: ("", "skip")},
    "Role": {1: ("metadata", OBJECT_META), 2: ("rules", [POLICY_RULE])},
    "ClusterRole": {1: ("metadata", OBJECT_META), 2: ("rules", [POLICY_RULE])},
    "RoleBinding": BINDING,
    "ClusterRoleBinding": BINDING,
    "ServiceAccount": {1: ("metadata", OBJECT_META)},
    "Secret": {1: ("metadata", OBJECT_META), 2: ("data", "bytes-map"), 3: ("type", "str"),
               4: ("stringData", "map"), 5: ("immutable", "bool")},
}


def decode_protobuf(data: bytes) -> dict:
    """A `application/vnd.kubernetes.protobuf` body: the `k8s\\0` envelope (runtime.Unknown) around
    a message of one of PROTO_KINDS."""
    if not data.startswith(b"k8s\x00"):
        raise UnsupportedBody("no k8s protobuf envelope")
    unknown = proto_fields(data[4:])
    type_meta = from_proto((unknown.get(1) or [b""])[-1], {1: ("apiVersion", "str"), 2: ("kind", "str")})
    schema = PROTO_KINDS.get(type_meta.get("kind", ""))
    if schema is None:
        raise UnsupportedBody(f"a protobuf {type_meta.get('kind')}")
    return dict(type_meta, **from_proto((unknown.get(2) or [b""])[-1], schema))


# --- patches ------------------------------------------------------------------------------------

def merge_patch(dst: dict, src: dict) -> None:
    """RFC 7386 JSON merge patch, in place."""
    for k, v in src.items():
        if v is None:
            dst.pop(k, None)
        elif isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge_patch(dst[k], v)
        else:
            dst[k] = json.loads(json.dumps(v))


# Strategic merge: the lists k8s.io/api merges by a key (patchMergeKey) in the kinds kept here; `ports`
# by containerPort in a container, by port in a Service; other lists are replaced, as theirs are
SMP_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
            "env": "name", "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
            "imagePullSecrets": "name", "ownerReferences": "uid", "conditions": "type",
            "hostAliases": "ip", "secrets": "name", "resourceClaims": "name",
            "schedulingGates": "name", "topologySpreadConstraints": "topologyKey"}
# lists of scalars merged as sets
SMP_SETS = {"finalizers"}


def strategic_patch(dst: dict, src: dict) -> dict:
    """A strategic merge patch applied to `dst` (in place; returns it): merge-keyed lists merge item
    by item, `$patch: replace|delete`, `$retainKeys`, `$deleteFromPrimitiveList/`; `$setElementOrder/`
    is read and ignored (order is the original's, then the patch's)."""
    if src.get("$patch") == "replace":
        dst.clear()
        dst.update({k: v for k, v in src.items() if k != "$patch"})
        return dst
    for k, v in src.items():
        if k.startswith("$setElementOrder/") or k in ("$patch", "$retainKeys"):
            continue
        if k.startswith("$deleteFromPrimitiveList/"):
            field = k.split("/", 1)[1]
            if isinstance(dst.get(field), list):
                dst[field] = [x for x in dst[field] if x not in v]
            continue
        if v is None:
            dst.pop(k, None)
        elif isinstance(v, dict):
            if v.get("$patch") == "delete":
                dst.pop(k, None)
            elif isinstance(dst.get(k), dict):
                strategic_patch(dst[k], v)
            else:
                dst[k] = strategic_patch({}, v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            key = SMP_KEYS.get(k)
            if k == "ports":
                key = "containerPort" if any("containerPort" in p for p in v + dst[k]
                                             if isinstance(p, dict)) else "port"
            if any(isinstance(x, dict) and x.get("$patch") == "replace" for x in v):
                dst[k] = [x for x in v if not (isinstance(x, dict) and "$patch" in x)]
            elif key:
                out = dst[k]
                for item in v:
                    at = next((i for i, o in enumerate(out) if isinstance(o, dict) and isinstance(item, dict)
                               and o.get(key) == item.get(key)), None)
                    if isinstance(item, dict) and item.get("$patch") == "delete":
                        if at is not None:
                            out.pop(at)
                    elif at is not None:
                        strategic_patch(out[at], item)
                    else:
                        out.append(strategic_patch({}, item) if isinstance(item, dict) else item)
            elif k in SMP_SETS:
                dst[k] = dst[k] + [x for x in v if x not in dst[k]]
            else:
                dst[k] = json.loads(json.dumps(v))
        else:
            dst[k] = json.loads(json.dumps(v))
    if "$retainKeys" in src:
        for k in list(dst):
            if k not in src["$retainKeys"]:
                dst.pop(k)
    return dst


def json_patch(doc: dict, ops: list) -> dict:
    """RFC 6902 JSON patch; ValueError where an operation fails (the whole patch then fails)."""
    doc = json.loads(json.dumps(doc))

    def walk(path: str) -> tuple[object, str]:
        if not path.startswith("/"):
            raise ValueError(f"invalid path {path!r}")
        parts = [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]
        node = doc
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        return node, parts[-1]

    def get(path: str):
        node, last = walk(path)
        return node[int(last)] if isinstance(node, list) else node[last]

    def remove(path: str):
        node, last = walk(path)
        return node.pop(int(last)) if isinstance(node, list) else node.pop(last)

    def add(path: str, value) -> None:
        node, last = walk(path)
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), value)
        else:
            node[last] = value

    for op in ops:
        try:
            kind, path = op["op"], op["path"]
            if kind == "add":
                add(path, op["value"])
            elif kind == "remove":
                remove(path)
            elif kind == "replace":
                get(path)
                node, last = walk(path)
                node[int(last) if isinstance(node, list) else last] = op["value"]
            elif kind == "move":
                add(path, remove(op["from"]))
            elif kind == "copy":
                add(path, json.loads(json.dumps(get(op["from"]))))
            elif kind == "test":
                if get(path) != op["value"]:
                    raise ValueError(f"testing value {path} failed")
            else:
                raise ValueError(f"unexpected kind of operation {kind!r}")
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"the operation {op} failed: {e!r}") from None
    return doc


class Api(http.server.BaseHTTPRequestHandler):
    cluster: Cluster
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    # the warnings (`Warning: 299 - "..."` headers) of the request being answered
    warnings: list[str] = []

    def reply(self, code: int, body, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (
            body.encode() if isinstance(body, str) else json.dumps(body).encode())
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        for w in self.warnings:
            self.send_header("Warning", "299 - " + json.dumps(w))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def drain(self) -> None:
        """Reads the body of a request answered without it."""
        self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n)
        if "protobuf" in self.headers.get("Content-Type", ""):
            return decode_protobuf(data)
        try:
            return json.loads(data or b"{}")
        except ValueError as e:
            raise UnsupportedBody(f"not JSON: {e}") from None

    def fake_endpoint(self, path: str) -> bool:
        """The test's own view (`/_fake/...`, no credentials): whether `path` was one."""
        c = self.cluster
        if path == "/_fake/objects":
            with c.lock:
                live = [{"namespace": ns, "resource": r, "name": n} for (ns, r, n) in sorted(c.objects)
                        if (ns, r, n) not in c.seeded]
            self.reply(200, live)
        elif path.startswith("/_fake/object/"):
            _, _, _, res, name = path.split("/", 4)
            with c.lock:
                obj = next((o for (_, r, n), o in c.objects.items() if r == res and n == name), None)
                self.reply(200, clean(obj) if obj else None)
        elif path == "/_fake/nodes":
            self.reply(200, NODES)
        elif path == "/_fake/requests":
            with c.lock:
                self.reply(200, list(c.requests))
        elif path == "/_fake/throttled":
            with c.lock:
                self.reply(200, dict(c.throttled))
        else:
            return False
        return True

    def throttled(self, who: str, method: str) -> bool:
        """API Priority and Fairness rejecting a request whose priority level's queues are full: 429
        with Retry-After, the request not carried out."""
        c = self.cluster
        if not c.throttle_every:
            return False
        with c.lock:
            c.seen[who] = c.seen.get(who, 0) + 1
            throttle = c.seen[who] % c.throttle_every == 0
            if throttle:
                c.throttled[who] = c.throttled.get(who, 0) + 1
        if not throttle:
            return False
        if method in ("POST", "PUT", "PATCH", "DELETE"):
            self.drain()
        self.send_response(429)
        data = json.dumps(status(429, "TooManyRequests",
                                 "Too many requests, please try again later.")).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return True

    def impersonate(self, user: str, groups: list[str]) -> tuple[str, list[str]] | dict:
        """The identity the request acts as: the caller's, or (Impersonate-User, -Group, -Uid,
        -Extra-*) the one it impersonates where RBAC lets the caller `impersonate` each part; a
        Status (403, or 500 for groups without a user, as the API server answers) otherwise."""
        as_user = self.headers.get("Impersonate-User")
        as_groups = self.headers.get_all("Impersonate-Group") or []
        as_uid = self.headers.get("Impersonate-Uid")
        extras = [(k[len("Impersonate-Extra-"):].lower(), v) for k, v in self.headers.items()
                  if k.lower().startswith("impersonate-extra-")]
        if as_user is None and not (as_groups or as_uid or extras):
            return user, groups
        if as_user is None:
            asked = [f"{{Group {g}}}" for g in as_groups] + ([f"{{UID {as_uid}}}"] if as_uid else [])
            return status(500, "InternalError",
                          f"Internal error occurred: requested [{' '.join(asked)}] without "
                          f"impersonating a user")
        checks = []
        account = as_user.split(":")
        if as_user.startswith("system:serviceaccount:") and len(account) == 4:
            checks.append({"verb": "impersonate", "group": "", "resource": "serviceaccounts",
                           "namespace": account[2], "name": account[3]})
            new_groups = list(as_groups) or ["system:serviceaccounts",
                                             f"system:serviceaccounts:{account[2]}"]
        else:
            checks.append({"verb": "impersonate", "group": "", "resource": "users", "name": as_user})
            new_groups = list(as_groups)
        for g in as_groups:
            checks.append({"verb": "impersonate", "group": "", "resource": "groups", "name": g})
        for key, value in extras:
            checks.append({"verb": "impersonate", "group": "authentication.k8s.io",
                           "resource": "userextras", "subresource": key, "name": value})
        if as_uid:
            checks.append({"verb": "impersonate", "group": "authentication.k8s.io", "resource": "uids",
                           "name": as_uid})
        for a in checks:
            if not self.cluster.authorize(user, groups, a)[0]:
                return forbidden(user, a)
        if as_user != "system:anonymous" and "system:authenticated" not in new_groups:
            new_groups.append("system:authenticated")
        return as_user, new_groups

    def validate(self, res: str, obj: dict, query: dict) -> dict | None:
        """Field validation: `fieldValidation=Strict` refuses a field the kind does not have (400),
        Warn (the default) answers with a warning, Ignore ignores it."""
        mode = query.get("fieldValidation") or "Warn"
        if mode not in ("Ignore", "Warn", "Strict"):
            return status(400, "BadRequest", f'fieldValidation: Unsupported value: "{mode}": supported '
                                             f'values: "Ignore", "Strict", "Warn"')
        unknown = unknown_fields(res, obj) if mode != "Ignore" else []
        if mode == "Strict" and unknown:
            kind = RESOURCES[res].kind
            return status(400, "BadRequest",
                          f'{kind} in version "v1" cannot be handled as a {kind}: strict decoding '
                          f'error: ' + ", ".join(f'unknown field "{u}"' for u in unknown))
        self.warnings = [f'unknown field "{u}"' for u in unknown]
        return None

    def route(self, method: str) -> None:
        self.warnings = []
        url = urllib.parse.urlparse(self.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
        if self.fake_endpoint(url.path):
            return
        c = self.cluster
        auth = self.headers.get("Authorization", "")
        who = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        identity = c.authenticate(who) if who else None
        if identity is None:
            if method in ("POST", "PUT", "PATCH"):
                self.drain()
            return self.reply(401, status(401, "Unauthorized", "Unauthorized"))
        if self.throttled(who, method):
            return
        acting = self.impersonate(*identity)
        if isinstance(acting, dict):
            if method in ("POST", "PUT", "PATCH"):
                self.drain()
            return self.reply(acting["code"], acting)
        user, groups = acting
        parts = url.path.strip("/").split("/")
        resource_request = (parts[:2] == ["api", "v1"] and len(parts) > 2) or \
            (parts[0] == "apis" and len(parts) > 3)
        if not resource_request:
            a = {"verb": method.lower(), "path": url.path}
            if not c.authorize(user, groups, a)[0]:
                return self.reply(403, forbidden(user, a))
            return self.nonresource(method, url.path)
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        not_found = status(404, "NotFound", "the server could not find the requested resource")
        if parts[0] == "apis" and (group not in GROUPS or parts[2] != "v1"):
            return self.reply(404, not_found)
        if rest[0] == "namespaces" and len(rest) >= 3:
            ns, rest = rest[1], rest[2:]
        else:
            ns = ""
        res, name, sub = rest[0], (rest[1] if len(rest) > 1 else ""), (rest[2] if len(rest) > 2 else "")
        r = RESOURCES.get(res)
        if r is None or r.group != group or len(rest) > 3 or (ns and not r.namespaced) \
                or (sub and sub not in dict(r.subresources)):
            return self.reply(404, not_found)
        watch = query.get("watch") in ("true", "1")
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}.get(
            method, "watch" if watch else ("get" if name else "list"))
        a = {"verb": verb, "group": group, "resource": res, "subresource": sub, "namespace": ns,
             "name": name}
        with c.lock:
            c.requests.append({"who": who, "user": user, "verb": verb, "group": group,
                               "resource": res + (f"/{sub}" if sub else ""), "namespace": ns})
        if not c.authorize(user, groups, a)[0]:
            if method in ("POST", "PUT", "PATCH"):
                self.drain()
            return self.reply(403, forbidden(user, a))
        allowed = dict(r.subresources).get(sub, ()) if sub else r.verbs
        if verb not in allowed or (verb == "create" and name) or (r.namespaced and not ns
                                                                  and verb not in ("list", "watch")):
            if method in ("POST", "PUT", "PATCH"):
                self.drain()
            return self.reply(405, status(405, "MethodNotAllowed",
                                          "the server does not allow this method on the requested "
                                          "resource"))
        if res in REVIEWS:
            return self.review(res, user, groups, self.body())
        accept = self.headers.get("Accept", "")
        as_table = accepts(accept, "meta.k8s.io", "v1", "Table")
        include = query.get("includeObject", "Metadata")
        missing = status(404, "NotFound", f'{qualified(res)} "{name}" not found',
                         {"name": name, "group": group, "kind": res})
        if res == "nodes":
            items = [dict({"apiVersion": "v1", "kind": "Node"}, **json.loads(json.dumps(n)),
                          ) for n in NODES]
            for n in items:
                n["metadata"]["creationTimestamp"] = c.started
                n["metadata"]["resourceVersion"] = "1"
            if name:
                node = next((n for n in items if n["metadata"]["name"] == name), None)
                if node is None:
                    return self.reply(404, missing)
                return self.reply(200, table(res, [node], include) if as_table else node)
            try:
                keep = label_selector(query.get("labelSelector", ""))
                fields = field_selector(res, query.get("fieldSelector", ""))
            except ValueError as e:
                return self.reply(400, status(400, "BadRequest", str(e)))
            items = [n for n in items if keep(n["metadata"]["labels"]) and fields(n)]
            if as_table:
                return self.reply(200, table(res, items, include, "1"))
            return self.reply(200, {"apiVersion": "v1", "kind": "NodeList",
                                    "metadata": {"resourceVersion": "1"}, "items": items})
        if verb == "watch":
            return self.watch(ns, res, name, query, as_table, include)
        if verb == "create":
            if r.namespaced and ns not in NAMESPACES:
                # what the API server says when the namespace does not exist (a list just comes back empty)
                self.drain()
                return self.reply(404, status(404, "NotFound", f'namespaces "{ns}" not found',
                                              {"name": ns, "kind": "namespaces"}))
            obj = self.body()
            if (obj.get("apiVersion"), obj.get("kind")) not in ((r.api_version, r.kind), (None, None)):
                return self.reply(400, status(400, "BadRequest",
                                              f"the API version in the data ({obj.get('apiVersion')}) "
                                              f"does not match the expected API version "
                                              f"({r.api_version})"))
            if query.get("dryRun"):
                return self.reply(400, status(400, "BadRequest", "dryRun is not supported"))
            refused = self.validate(res, obj, query)
            if refused:
                return self.reply(400, refused)
            code, created = c.create(ns, res, obj)
            return self.reply(code, clean(created) if code < 300 else created)
        if verb == "list":
            try:
                items = c.list(ns, res, query.get("labelSelector", ""), query.get("fieldSelector", ""))
            except ValueError as e:
                return self.reply(400, status(400, "BadRequest", str(e)))
            with c.lock:
                rv = str(c.version)
                items = [clean(o) for o in items]
            if as_table:
                return self.reply(200, table(res, items, include, rv))
            return self.reply(200, {"apiVersion": r.api_version, "kind": r.kind + "List",
                                    "metadata": {"resourceVersion": rv}, "items": items})
        if verb == "get" and sub == "log":
            text = c.logs((ns, "pods", name), query)
            if text is None:
                pod = c.get(ns, "pods", name)
                if pod is None:
                    return self.reply(404, missing)
                container = pod["spec"]["containers"][0]["name"]
                waiting = [cs["state"]["waiting"].get("reason", "ContainerCreating")
                           for cs in pod["status"].get("containerStatuses") or []
                           if "waiting" in cs.get("state", {})] or ["ContainerCreating"]
                return self.reply(400, status(400, "BadRequest",
                                              f'container "{container}" in pod "{name}" is waiting '
                                              f'to start: {waiting[0]}'))
            return self.reply(200, text, "text/plain")
        if verb == "get":
            with c.lock:
                obj = c.get(ns, res, name)
                obj = clean(obj) if obj else None
            if obj is None:
                return self.reply(404, missing)
            return self.reply(200, table(res, [obj], include) if as_table else obj)
        if verb == "patch":
            kind = {"application/merge-patch+json": "merge",
                    "application/strategic-merge-patch+json": "strategic",
                    "application/json-patch+json": "json"}.get(
                self.headers.get("Content-Type", "").split(";")[0].strip())
            if kind is None:
                self.drain()
                return self.reply(415, status(
                    415, "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types "
                    "include: application/json-patch+json, application/merge-patch+json, "
                    "application/strategic-merge-patch+json"))
            patch = self.body()
            if kind == "json":
                if not isinstance(patch, list):
                    return self.reply(400, status(400, "BadRequest", "a JSON patch is a list"))
            else:
                refused = self.validate(res, patch, query)
                if refused:
                    return self.reply(400, refused)
            try:
                with c.lock:
                    obj = c.patch(ns, res, name, patch, kind)
                    obj = clean(obj) if obj else None
            except ValueError as e:
                return self.reply(422, status(422, "Invalid", str(e)))
            return self.reply(200, obj) if obj else self.reply(404, missing)
        if verb == "update":
            new_obj = self.body()
            refused = self.validate(res, new_obj, query)
            if refused:
                return self.reply(400, refused)
            with c.lock:
                code, obj = c.replace(ns, res, name, new_obj)
                return self.reply(code, clean(obj) if code < 300 else obj)
        if verb == "delete":
            self.drain()
            with c.lock:
                obj = c.delete(ns, res, name)
                obj = clean(obj) if obj else None
            return self.reply(200, obj) if obj else self.reply(404, missing)
        return self.reply(405, status(405, "MethodNotAllowed", method))

    def nonresource(self, method: str, path: str) -> None:
        """Discovery, OpenAPI v3 (operations only; no v2), /version and the health checks."""
        accept = self.headers.get("Accept", "")
        if method != "GET":
            return self.reply(405, status(405, "MethodNotAllowed", method))
        if path in ("/api", "/apis") and accepts(accept, "apidiscovery.k8s.io", "v2",
                                                 "APIGroupDiscoveryList"):
            body = json.dumps(aggregated([""] if path == "/api" else GROUPS)).encode()
            self.send_response(200)
            self.send_header("Content-Type", AGGREGATED)
            self.send_header("Vary", "Accept")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if path == "/api":
            host, port = self.server.server_address[:2]
            return self.reply(200, {"kind": "APIVersions", "versions": ["v1"],
                                    "serverAddressByClientCIDRs": [
                                        {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{host}:{port}"}]})
        if path == "/apis":
            return self.reply(200, {"kind": "APIGroupList", "apiVersion": "v1",
                                    "groups": [api_group(g) for g in GROUPS]})
        if path == "/api/v1":
            return self.reply(200, resource_list(""))
        parts = path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "apis" and parts[1] in GROUPS:
            return self.reply(200, dict(api_group(parts[1]), kind="APIGroup", apiVersion="v1"))
        if len(parts) == 3 and parts[0] == "apis" and parts[1] in GROUPS and parts[2] == "v1":
            return self.reply(200, resource_list(parts[1]))
        if path == "/openapi/v3":
            return self.reply(200, openapi_root())
        if path == "/openapi/v2":
            if "com.github.proto-openapi.spec.v2" in self.headers.get("Accept", ""):
                return self.reply(200, openapi_v2_protobuf(), OPENAPI_V2_PB)
            return self.reply(200, {"swagger": "2.0", "info": {"title": "Kubernetes",
                                                               "version": VERSION["gitVersion"]},
                                    "paths": {}})
        if path.startswith("/openapi/v3/"):
            rest = path[len("/openapi/v3/"):].split("/")
            doc = None
            if rest[:2] == ["api", "v1"] and len(rest) == 2:
                doc = openapi_doc("")
            elif len(rest) == 3 and rest[0] == "apis" and rest[2] == "v1":
                doc = openapi_doc(rest[1])
            if doc is not None:
                return self.reply(200, doc)
        if path in ("/version", "/version/"):
            return self.reply(200, VERSION)
        if path in ("/healthz", "/livez", "/readyz"):
            return self.reply(200, "ok", "text/plain")
        return self.reply(404, status(404, "NotFound", "the server could not find the requested resource"))

    def review(self, res: str, user: str, groups: list[str], obj: dict) -> None:
        """The access reviews, answered from the same RBAC that authorizes requests."""
        spec = obj.get("spec") or {}
        out = {"kind": RESOURCES[res].kind, "apiVersion": RESOURCES[res].api_version,
               "metadata": {"creationTimestamp": None}, "spec": spec}
        if res == "selfsubjectreviews":
            out.pop("spec")
            out["status"] = {"userInfo": {"username": user, "groups": groups}}
            return self.reply(201, out)
        if res == "selfsubjectrulesreviews":
            if not spec.get("namespace"):
                return self.reply(400, status(400, "BadRequest", "no namespace on request"))
            out["status"] = self.cluster.rules(user, groups, spec["namespace"])
            return self.reply(201, out)
        if res == "subjectaccessreviews":
            user, groups = spec.get("user", ""), list(spec.get("groups") or [])
        if spec.get("nonResourceAttributes"):
            n = spec["nonResourceAttributes"]
            a = {"verb": n.get("verb", ""), "path": n.get("path", "")}
        else:
            ra = spec.get("resourceAttributes") or {}
            a = {"verb": ra.get("verb", ""), "group": ra.get("group", ""),
                 "resource": ra.get("resource", ""), "subresource": ra.get("subresource", ""),
                 "namespace": ra.get("namespace", ""), "name": ra.get("name", "")}
        allowed, why = self.cluster.authorize(user, groups, a)
        out["status"] = {"allowed": allowed}
        if why:
            out["status"]["reason"] = why
        return self.reply(201, out)

    def watch(self, ns: str, res: str, name: str, query: dict, as_table: bool, include: str) -> None:
        """A watch: newline-delimited WatchEvents over chunked transfer encoding, from the
        resourceVersion asked for (or the objects there are now, as ADDED, where none or 0 is), until
        timeoutSeconds, the client going away or the server stopping. An object that stops matching
        the selectors is DELETED for this watch, one that starts matching ADDED."""
        c = self.cluster
        try:
            labels_ok = label_selector(query.get("labelSelector", ""))
            fields_ok = field_selector(res, query.get("fieldSelector", ""))
            rv = query.get("resourceVersion", "")
            since = int(rv) if rv not in ("", "0") else None
            timeout = float(query.get("timeoutSeconds") or 1800)
        except ValueError as e:
            return self.reply(400, status(400, "BadRequest", str(e)))

        def matches(o_ns: str, obj: dict) -> bool:
            return (not ns or o_ns == ns) and labels_ok(obj["metadata"].get("labels") or {}) \
                and fields_ok(obj)

        with c.lock:
            if since is None:
                first = [("ADDED", clean(o)) for k, o in sorted(c.objects.items())
                         if k[1] == res and matches(k[0], o) and (not name or k[2] == name)]
                last = c.version
            else:
                first, last = [], since
        # (namespace, name) -> whether the client has it (matching); from a resourceVersion, an
        # object this watch has not mentioned yet is unknown (None), and its events pass as they are
        shown: dict[tuple[str, str], bool] = {(o["metadata"].get("namespace", ""), o["metadata"]["name"]): True
                                              for _, o in first}
        unknown = False if since is None else None
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()

        def send(kind: str, obj: dict) -> None:
            if as_table and kind != "ERROR":
                obj = table(res, [obj], include)
            data = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        deadline = time.monotonic() + timeout
        try:
            for kind, obj in first:
                send(kind, obj)
            while time.monotonic() < deadline and not c.done.is_set():
                events = c.events_after(last)
                if events is None:
                    send("ERROR", status(410, "Expired", f"too old resource version: {last} "
                                                         f"({c.history[0][0] - 1})"))
                    break
                for version, kind, o_ns, o_res, obj in events:
                    last = version
                    if o_res != res or (ns and o_ns != ns) or (name and obj["metadata"]["name"] != name):
                        continue
                    key = (o_ns, obj["metadata"]["name"])
                    had = shown.get(key, unknown)
                    if kind == "DELETED":
                        if had or (had is None and matches(o_ns, obj)):
                            send("DELETED", obj)
                        shown[key] = False
                    elif matches(o_ns, obj):
                        send(kind if had is None else ("MODIFIED" if had else "ADDED"), obj)
                        shown[key] = True
                    else:
                        if had:
                            send("DELETED", obj)
                        shown[key] = False
                if self.client_gone():
                    break
                with c.changed:
                    if c.version <= last and not c.done.is_set():
                        c.changed.wait(0.5)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (OSError, ssl.SSLError):
            pass
        self.close_connection = True

    def client_gone(self) -> bool:
        """Whether the client closed the watch's connection (it sends nothing on it otherwise)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1) == b""
        except ssl.SSLWantReadError:
            return False
        except (OSError, ssl.SSLError):
            return True

    def serve(self, method: str) -> None:
        try:
            self.route(method)
        except UnsupportedBody as e:
            self.reply(415, status(415, "UnsupportedMediaType",
                                   f"the body of the request was in an unknown format ({e}) - "
                                   f"accepted media types include: application/json, "
                                   f"application/merge-patch+json"))

    def do_GET(self) -> None:
        self.serve("GET")

    def do_POST(self) -> None:
        self.serve("POST")

    def do_PUT(self) -> None:
        self.serve("PUT")

    def do_PATCH(self) -> None:
        self.serve("PATCH")

    def do_DELETE(self) -> None:
        self.serve("DELETE")


def clean(obj: dict) -> dict:
    """A stored object as the API serves it: a copy, without the fake's own fields."""
    out = json.loads(json.dumps({k: v for k, v in obj.items() if not k.startswith("_")}, default=str))
    r = RESOURCES.get(obj.get("_res", ""))
    if r:
        out.setdefault("apiVersion", r.api_version)
        out.setdefault("kind", r.kind)
    return out


class PodIdentity(http.server.BaseHTTPRequestHandler):
    """EKS Pod Identity's credentials endpoint: moto's test credentials for a pod that shows its token."""

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != sa_token("physalia", POD_IDENTITY_SA):
            self.send_error(403)
            return
        expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
        body = json.dumps({
            "AccessKeyId": "testing", "SecretAccessKey": "testing", "Token": "testing-session",
            "AccountId": "123456789012",
            "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main() -> None:
    from moto.server import ThreadedMotoServer
    import boto3

    # standard output is the one JSON line: what moto and the rest print goes to standard error
    out = sys.stdout
    sys.stdout = sys.stderr
    network, subnet = make_network()
    gateway = str(subnet.network_address + 1)
    files = tempfile.mkdtemp(prefix="physalia-kube-fake-")
    os.chmod(files, 0o755)
    ca, crt, key = make_tls(gateway, files)
    api_port = free_port(gateway)
    policies = NETWORK_POLICY
    if "--network-policy" in sys.argv:
        policies = sys.argv[sys.argv.index("--network-policy") + 1]
    try:
        cluster = Cluster(network, subnet, gateway, api_port, ca, files, policies)
        cluster.firewall = firewall.Firewall(network, subnet, f"kube-{os.getpid()}")
    except BaseException:
        # a manifest refused (SystemExit) or no netfilter: nothing of this run is left
        docker("network", "rm", network, check=False)
        shutil.rmtree(files, ignore_errors=True)
        raise
    if "--throttle-every" in sys.argv:
        cluster.throttle_every = int(sys.argv[sys.argv.index("--throttle-every") + 1])
    Api.cluster = cluster
    api = http.server.ThreadingHTTPServer((gateway, api_port), Api)
    api.daemon_threads = True
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(crt, key)
    api.socket = tls.wrap_socket(api.socket, server_side=True)
    threading.Thread(target=api.serve_forever, daemon=True).start()

    # EKS serves Pod Identity at http://169.254.170.23/v1/credentials, an address this fake cannot own;
    # the SDKs (aws-config, botocore) refuse plain HTTP to any other address that is not loopback, so
    # the fake serves it over HTTPS with the cluster's CA, which the pod trusts (SSL_CERT_FILE)
    creds = http.server.ThreadingHTTPServer((gateway, 0), PodIdentity)
    creds.daemon_threads = True
    creds.socket = tls.wrap_socket(creds.socket, server_side=True)
    threading.Thread(target=creds.serve_forever, daemon=True).start()
    cluster.creds_url = f"https://{gateway}:{creds.server_address[1]}/v1/credentials"

    moto_port = free_port(gateway)
    moto = ThreadedMotoServer(ip_address=gateway, port=moto_port)
    moto.start()
    cluster.moto_url = f"http://{gateway}:{moto_port}"
    boto3.client("s3", endpoint_url=cluster.moto_url, region_name=REGION,
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)

    kubeconfig = os.path.join(files, "kubeconfig")
    with open(ca, "rb") as f:
        ca_data = base64.b64encode(f.read()).decode()
    with open(kubeconfig, "w") as f:
        json.dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"https://{gateway}:{api_port}",
                                                      "certificate-authority-data": ca_data}}],
            "users": [{"name": "test", "user": {"token": USER_TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "test",
                                                      "namespace": "physalia"}}],
        }, f)
    threading.Thread(target=cluster.loop, daemon=True).start()
    print(json.dumps({"kubeconfig": kubeconfig, "api": f"https://{gateway}:{api_port}",
                      "endpoint": cluster.moto_url, "region": REGION, "bucket": BUCKET,
                      "network": network, "user_token": USER_TOKEN}), file=out, flush=True)
    try:
        sys.stdin.read()
    finally:
        cluster.shutdown()
        api.shutdown()
        creds.shutdown()
        moto.stop()
        ids = docker("ps", "-aq", "--filter", f"label={LABEL}", check=False).stdout.split()
        if ids:
            docker("rm", "-f", *ids, check=False)
        cluster.firewall.close()
        docker("network", "rm", network, check=False)
        shutil.rmtree(files, ignore_errors=True)


if __name__ == "__main__":
    main()
