"""A one-node Kubernetes for tests/tests/kubernetes_job.rs: an API server and a kubelet in one process, whose
pods are real containers of the local Docker Engine.

No cluster can be pulled on the test machine (kind and k3s need images from a registry), so this keeps
the objects the kubernetes backend creates and does what the control plane and a kubelet would do with
them, for the calls `infra/k8s/rbac.yaml` grants (the backend's tests check that set against the code):

- the API server (namespace `physalia` only, as infra/k8s makes it) speaks HTTPS (a CA made for the run; its certificate names the address it listens on)
  on the pod network's gateway, which this machine and the pods reach. It keeps Jobs (batch/v1), Pods,
  Secrets, Services and Events of any namespace; create, get, list (equality label selectors), merge
  patch, delete (with the garbage collector's cascade to objects whose owner reference names a deleted
  Job, and a Job's pods) and pod logs. Every request must carry a bearer token: the user's (kubeconfig,
  allowed everything) or a ServiceAccount's, allowed what the Roles of `infra/k8s/rbac.yaml` bound to it
  grant in their namespace and refused (403 Forbidden, as RBAC words it) otherwise; `/_fake/requests`
  lists `(who, verb, resource)` for the test, `/_fake/objects` what is stored and `/_fake/object/RES/NAME`
  one object.
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

`--throttle-every N` makes the API server throttle as API Priority and Fairness does when a principal's
priority level is saturated: every Nth request of each principal (bearer token) is answered 429
TooManyRequests with `Retry-After: 1` and not carried out; `/_fake/throttled` counts them per principal.

Not done: resource limits, ResourceQuota, ttlSecondsAfterFinished, watches.

Prints one JSON line (`kubeconfig`, the path of a kubeconfig for this machine's user; `endpoint`, moto's
URL; `region`; `bucket`; `network`; `api`, the API server's URL), then serves until its standard input
closes, and removes every container, file and network it made.
"""

import base64
import datetime
import http.server
import ipaddress
import json
import os
import random
import shutil
import socket
import ssl
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid

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
    for third in range(0, 250):
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
                 ca_path: str, files: str):
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
        self.grants = load_rbac(RBAC)

    # --- the API --------------------------------------------------------------------------------

    def stamp(self, obj: dict) -> None:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)

    def create(self, ns: str, res: str, obj: dict) -> tuple[int, dict]:
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + rand5()
            meta["name"] = name
        if not name:
            return 422, status(422, "Invalid", f"{res}: metadata.name: Required value")
        key = (ns, res, name)
        with self.lock:
            if key in self.objects:
                return 409, status(409, "AlreadyExists", f'{res} "{name}" already exists')
            meta["namespace"] = ns
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now()
            if res == "jobs":
                obj.setdefault("status", {})
            if res == "pods":
                obj["status"] = {"phase": "Pending"}
            self.stamp(obj)
            self.objects[key] = obj
            return 201, obj

    def get(self, ns: str, res: str, name: str) -> dict | None:
        with self.lock:
            return self.objects.get((ns, res, name))

    def list(self, ns: str, res: str, selector: str) -> list[dict]:
        want = {}
        for term in filter(None, selector.split(",")):
            if "=" not in term:
                raise ValueError(f"label selector {selector!r}: only k=v terms are supported")
            k, v = term.split("=", 1)
            want[k.rstrip("=")] = v.lstrip("=")
        with self.lock:
            out = []
            for (o_ns, o_res, _), obj in sorted(self.objects.items()):
                if o_res != res or (ns and o_ns != ns):
                    continue
                labels = obj.get("metadata", {}).get("labels") or {}
                if all(labels.get(k) == v for k, v in want.items()):
                    out.append(obj)
            return out

    def patch(self, ns: str, res: str, name: str, patch: dict) -> dict | None:
        def merge(dst: dict, src: dict) -> None:
            for k, v in src.items():
                if v is None:
                    dst.pop(k, None)
                elif isinstance(v, dict) and isinstance(dst.get(k), dict):
                    merge(dst[k], v)
                else:
                    dst[k] = v

        with self.lock:
            obj = self.objects.get((ns, res, name))
            if obj is None:
                return None
            merge(obj, patch)
            self.stamp(obj)
            return obj

    def delete(self, ns: str, res: str, name: str) -> dict | None:
        with self.lock:
            obj = self.objects.pop((ns, res, name), None)
            if obj is None:
                return None
            obj["metadata"]["deletionTimestamp"] = now()
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
        succeeded, failed = phases.count("Succeeded"), phases.count("Failed")
        st["active"] = phases.count("Running") + phases.count("Pending")
        st["succeeded"], st["failed"] = succeeded, failed
        completions = spec.get("completions", 1)
        if not st.get("conditions"):
            if failed > 0:
                st["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                     "message": "Job has reached the specified backoff limit",
                                     "lastTransitionTime": now()}]
            elif succeeded >= completions:
                st["conditions"] = [{"type": "Complete", "status": "True", "lastTransitionTime": now()}]
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


def load_rbac(path: str) -> dict[str, set[tuple[str, str, str, str]]]:
    """ServiceAccount token -> the (namespace, apiGroup, resource, verb) its RoleBindings grant."""
    import yaml

    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d.get("rules") or []
             for d in docs if d["kind"] == "Role"}
    grants: dict[str, set[tuple[str, str, str, str]]] = {}
    for d in docs:
        if d["kind"] != "RoleBinding":
            continue
        ns = d["metadata"]["namespace"]
        rules = roles.get((ns, d["roleRef"]["name"]), [])
        for subject in d.get("subjects") or []:
            if subject["kind"] != "ServiceAccount":
                continue
            token = sa_token(subject.get("namespace", ns), subject["name"])
            for rule in rules:
                for g in rule["apiGroups"]:
                    for r in rule["resources"]:
                        for v in rule["verbs"]:
                            grants.setdefault(token, set()).add((ns, g, r, v))
    return grants


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


RESOURCES = {"jobs": ("batch", "Job", "batch/v1"), "pods": ("", "Pod", "v1"),
             "secrets": ("", "Secret", "v1"), "services": ("", "Service", "v1"),
             "events": ("", "Event", "v1")}


class Api(http.server.BaseHTTPRequestHandler):
    cluster: Cluster
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def reply(self, code: int, body, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def route(self, method: str) -> None:
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = url.path.strip("/").split("/")
        if url.path == "/_fake/objects":
            with self.cluster.lock:
                live = [{"namespace": ns, "resource": r, "name": n}
                        for (ns, r, n) in sorted(self.cluster.objects)]
            return self.reply(200, live)
        if url.path.startswith("/_fake/object/"):
            _, _, _, res, name = url.path.split("/", 4)
            with self.cluster.lock:
                obj = next((o for (_, r, n), o in self.cluster.objects.items()
                            if r == res and n == name), None)
                return self.reply(200, clean(obj, "", "") if obj else None)
        if url.path == "/_fake/nodes":
            return self.reply(200, NODES)
        if url.path == "/_fake/requests":
            with self.cluster.lock:
                return self.reply(200, list(self.cluster.requests))
        if url.path == "/_fake/throttled":
            with self.cluster.lock:
                return self.reply(200, dict(self.cluster.throttled))
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return self.reply(401, status(401, "Unauthorized", "Unauthorized"))
        who = auth[len("Bearer "):]
        c = self.cluster
        if c.throttle_every:
            # API Priority and Fairness rejecting a request whose priority level's queues are full:
            # 429 with Retry-After, the request not carried out
            with c.lock:
                c.seen[who] = c.seen.get(who, 0) + 1
                throttle = c.seen[who] % c.throttle_every == 0
                if throttle:
                    c.throttled[who] = c.throttled.get(who, 0) + 1
            if throttle:
                if method in ("POST", "PATCH", "DELETE"):
                    self.body()
                self.send_response(429)
                data = json.dumps(status(429, "TooManyRequests",
                                         "Too many requests, please try again later.")).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Retry-After", "1")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
        if url.path == "/api/v1/nodes" and method == "GET":
            # cluster-scoped: the user may list nodes; a ServiceAccount only through a ClusterRole,
            # which infra/k8s/rbac.yaml does not grant
            with self.cluster.lock:
                self.cluster.requests.append({"who": who, "verb": "list", "group": "",
                                              "resource": "nodes", "namespace": ""})
            if who != USER_TOKEN:
                account = who.split(".", 2)
                user = f"system:serviceaccount:{account[1]}:{account[2]}" if len(account) == 3 else who
                return self.reply(403, status(
                    403, "Forbidden",
                    f'nodes is forbidden: User "{user}" cannot list resource "nodes" in API group "" '
                    f'at the cluster scope'))
            items = [{"apiVersion": "v1", "kind": "Node", **n} for n in NODES]
            return self.reply(200, {"apiVersion": "v1", "kind": "NodeList",
                                    "metadata": {"resourceVersion": "1"}, "items": items})
        # /api/v1/namespaces/NS/RES[/NAME[/SUB]] or /apis/batch/v1/namespaces/NS/RES[/NAME]
        if parts[:2] == ["api", "v1"]:
            rest = parts[2:]
        elif parts[:3] == ["apis", "batch", "v1"]:
            rest = parts[3:]
        else:
            return self.reply(404, status(404, "NotFound", f"the server could not find {url.path}"))
        if len(rest) < 3 or rest[0] != "namespaces" or rest[2] not in RESOURCES:
            return self.reply(404, status(404, "NotFound", f"the server could not find {url.path}"))
        ns, res = rest[1], rest[2]
        name = rest[3] if len(rest) > 3 else None
        sub = rest[4] if len(rest) > 4 else None
        group, kind, api_version = RESOURCES[res]
        verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete"}.get(
            method, "get" if name else "list")
        resource = res + (f"/{sub}" if sub else "")
        with self.cluster.lock:
            self.cluster.requests.append({"who": who, "verb": verb, "group": group,
                                          "resource": resource, "namespace": ns})
        if who != USER_TOKEN and (ns, group, resource, verb) not in self.cluster.grants.get(who, set()):
            account = who.split(".", 2)
            user = f"system:serviceaccount:{account[1]}:{account[2]}" if len(account) == 3 else who
            return self.reply(403, status(
                403, "Forbidden",
                f'{resource} is forbidden: User "{user}" cannot {verb} resource "{resource}" in API '
                f'group "{group}" in the namespace "{ns}"'))
        c = self.cluster
        if method == "POST" and name is None:
            if ns not in NAMESPACES:
                # what the API server says when the namespace does not exist (a list just comes back empty)
                return self.reply(404, status(404, "NotFound", f'namespaces "{ns}" not found'))
            code, obj = c.create(ns, res, self.body())
            return self.reply(code, obj)
        if method == "GET" and name is None:
            try:
                items = c.list(ns, res, query.get("labelSelector", [""])[0])
            except ValueError as e:
                return self.reply(400, status(400, "BadRequest", str(e)))
            with c.lock:
                body = {"apiVersion": api_version, "kind": kind + "List",
                        "metadata": {"resourceVersion": str(c.version)},
                        "items": json.loads(json.dumps(items, default=str))}
            for item in body["items"]:
                item.pop("_starting", None)
                item.setdefault("apiVersion", api_version)
                item.setdefault("kind", kind)
            return self.reply(200, body)
        missing = status(404, "NotFound", f'{res} "{name}" not found')
        if method == "GET" and sub == "log":
            text = c.logs((ns, "pods", name), query)
            if text is None:
                if c.get(ns, "pods", name) is None:
                    return self.reply(404, missing)
                return self.reply(400, status(400, "BadRequest",
                                              f'container in pod "{name}" is waiting to start'))
            return self.reply(200, text, "text/plain")
        if method == "GET":
            obj = c.get(ns, res, name)
            return self.reply(200, clean(obj, kind, api_version)) if obj else self.reply(404, missing)
        if method == "PATCH":
            if "merge-patch" not in self.headers.get("Content-Type", ""):
                return self.reply(415, status(415, "UnsupportedMediaType", "only merge patches"))
            obj = c.patch(ns, res, name, self.body())
            return self.reply(200, clean(obj, kind, api_version)) if obj else self.reply(404, missing)
        if method == "DELETE":
            self.body()
            obj = c.delete(ns, res, name)
            return self.reply(200, clean(obj, kind, api_version)) if obj else self.reply(404, missing)
        return self.reply(405, status(405, "MethodNotAllowed", method))

    def do_GET(self) -> None:
        self.route("GET")

    def do_POST(self) -> None:
        self.route("POST")

    def do_PATCH(self) -> None:
        self.route("PATCH")

    def do_DELETE(self) -> None:
        self.route("DELETE")


def clean(obj: dict, kind: str, api_version: str) -> dict:
    out = {k: v for k, v in obj.items() if not k.startswith("_")}
    out.setdefault("apiVersion", api_version)
    out.setdefault("kind", kind)
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
    cluster = Cluster(network, subnet, gateway, api_port, ca, files)
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
        docker("network", "rm", network, check=False)
        shutil.rmtree(files, ignore_errors=True)


if __name__ == "__main__":
    main()
