"""Azure, for tests/tests/aci_job.rs: Container Instances whose container groups run as real containers of
the local Docker Engine, the managed identities' token endpoint, Blob Storage, and the `az` CLI of a
signed-in user. No Azure emulator can be installed on the test machine (Azurite is an npm package, and
nothing emulates ACI), so this process keeps what the aci backend and the job store create and does what
Azure would do with it, for what infra/azure sets up:

- Azure Resource Manager, for Container Instances only (api-version 2026-05-01), in plain HTTP on the
  virtual network's gateway address, which this machine and the containers reach (`backend.aci.
  arm_endpoint` points at it). Subscription SUBSCRIPTION, resource group RESOURCE_GROUP, region LOCATION,
  the workers' subnet SUBNET_ID; any other is refused as ARM refuses it (404 ResourceGroupNotFound, 400
  for a subnet or identity that does not exist). Every request needs a bearer token: the user's (what
  `az` prints, allowed everything) or a managed identity's, allowed what infra/azure's role `Physalia
  ACI launcher` grants on the resource group (the coordinator identity), or nothing (403
  AuthorizationFailed). Every PUT body is validated against the published ContainerGroup schema
  (backends/tests/aci/spec, strictly: an undeclared or read-only property is an error, as
  backends/tests/aci/swagger.rs reads it) and an invalid one is refused (400 InvalidRequestContent) and
  recorded in `/_fake/violations`. An image the Docker Engine does not hold is refused at PUT (400
  InaccessibleImage), as ACI refuses an image it cannot pull. Creates are long-running operations (201
  with `Azure-AsyncOperation`, polled until the group's containers run); GET shows the group as ACI does
  (provisioning state, instance view with the container's current state and exit code, the private IP,
  secret volumes and secure values left out); list, delete (the containers are removed) and a
  container's logs (its output, stdout and stderr interleaved as written).
- Container groups: each container runs, as its image's user, on a Docker network with the subnet's
  addresses (a free /24 of 10.246.0.0/16), at the group's private IP, with the group's environment
  (plain and secure values), command, and secret volumes written as files (read-only, world-readable
  as ACI's tmpfs secret volumes are) at their mount paths. `restartPolicy: Never`: a container that exits
  stays exited; the group's state is Succeeded or Failed by its exit code. infra/azure's network
  security group guards each group's address from before its container starts (tests/firewall.py reads
  the rules from infra/azure/main.tf, its variables' defaults or `--infra-var NAME=VALUE`'s, as
  `terraform apply -var` sets them): only UDP on its QUIC ports, only from inside the subnet.
- Managed identities: a group with user-assigned identities is also attached to the link-local network
  of the instance metadata service (`physalia-azure-imds`, 169.254.169.0/24, shared by every instance of
  this fake on the machine: its address is fixed) whose gateway 169.254.169.254 is this machine; the
  token endpoint there (`/metadata/identity/oauth2/token`, `Metadata: true`) gives a token of the
  identity the request names (`client_id`, `msi_res_id` or `object_id`), or of the group's only one, for
  ARM or for Storage, and refuses a request from any other address, as IMDS refuses a machine without an
  identity. The containers of such a group also get the storage endpoint (`AZURE_STORAGE_ENDPOINT`, plain
  HTTP, and `AZURE_ALLOW_HTTP`): the test's Blob Storage is this process, not `<account>.blob.core.
  windows.net` (the one redirect a real Azure does not need, like AWS_ENDPOINT_URL in the ECS agent).
- Blob Storage, account ACCOUNT with the container CONTAINER (path-style URLs on the gateway): put, get,
  head, delete, batch delete (Blob Batch, which object_store's deletes use) and list (prefix, delimiter,
  marker) of block blobs, with bearer tokens: the user's, or
  the coordinator identity's (infra/azure gives it `Storage Blob Data Contributor` on the account);
  others get 403 AuthorizationPermissionMismatch.
- User delegation SAS, as Azure documents them (Get User Delegation Key; Create a user delegation SAS,
  version 2020-12-06 and later): `POST /<account>?restype=service&comp=userdelegationkey` with a
  principal's bearer token (one with a data role: the key is the principal's; a SAS cannot ask for one)
  and `<KeyInfo><Start/><Expiry/></KeyInfo>` (Expiry at most 7 days ahead) answers a key of that
  principal; a request with `sig` in its query is authorized by the SAS alone: every signed field present,
  the signature the HMAC-SHA256 of the documented string-to-sign under a key this fake issued, the SAS
  and its key within their times, the resource a blob (`sr=b`) and the method within `sp` (`r` for
  GET/HEAD, `w` for PUT, `d` for DELETE), and the key's principal still holding its data role; else 403
  AuthenticationFailed (AuthorizationPermissionMismatch for permissions), as Azure answers. The request
  log's `who` is `sas:<principal>`.
- `az`: a program `bin/az` (put first on PATH) that prints the signed-in user's token for
  `az account get-access-token --resource R` / `--scope S`, as both the aci backend and object_store
  call it.

Location - List Usage (`GET /subscriptions/S/providers/Microsoft.ContainerInstance/locations/L/usages`,
the signed-in user only: infra/azure's role is on the resource group, not the subscription) reports
ContainerGroups (the groups that exist), StandardCores (the cores of those not terminated) and
StandardSpotCores (0) against limits of 100 each, which `--usage-limit NAME=N` (repeatable) or
`PUT /_fake/usage-limits {"NAME": N}` sets (`GET /_fake/usage-limits` reads them); a PUT that would pass
one is refused (409 ContainerGroupQuotaReached, naming the quota, the limit, the usage and the request).

`--throttle-every N` makes Resource Manager throttle as it does when a principal passes its limits: every
Nth ARM request of each principal (counted per principal, after authentication, the long-running
operations' polls included) is answered 429 TooManyRequests with `Retry-After: 1` and
`x-ms-ratelimit-remaining-subscription-reads`/`-writes`/`-deletes: 0`, without being carried out;
`/_fake/throttled` counts them per principal.

Prints one JSON line (`arm`, the ARM endpoint; `blob`, the storage endpoint; `account`; `container`;
`bin`, the folder holding `az`; `network`; `subscription`, `resource_group`, `location`, `subnet_id`,
`coordinator_identity_id`, `pull_identity_id`), then serves until its standard input closes, and removes
every container, file and network it made.
"""

import argparse
import base64
import binascii
import datetime
import email.utils
import hashlib
import hmac
import http.server
import ipaddress
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from xml.etree import ElementTree
from xml.sax.saxutils import escape

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import firewall  # noqa: E402  (tests/firewall.py: infra's rules)

LABEL = f"physalia.aci-fake={os.getpid()}"
API_VERSION = "2026-05-01"
SUBSCRIPTION = "00000000-0000-0000-0000-00000000beef"
RESOURCE_GROUP = "physalia-rg"
LOCATION = "eastus"
RG_ID = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}"
SUBNET_ID = f"{RG_ID}/providers/Microsoft.Network/virtualNetworks/physalia-vnet/subnets/workers"
IDENTITIES = {
    # resource id -> (name, client id, principal id)
    f"{RG_ID}/providers/Microsoft.ManagedIdentity/userAssignedIdentities/physalia-coordinator":
        ("physalia-coordinator", "c0000000-0000-0000-0000-00000000c001", "d0000000-0000-0000-0000-00000000c001"),
    f"{RG_ID}/providers/Microsoft.ManagedIdentity/userAssignedIdentities/physalia-pull":
        ("physalia-pull", "c0000000-0000-0000-0000-00000000f001", "d0000000-0000-0000-0000-00000000f001"),
}
COORDINATOR_IDENTITY, PULL_IDENTITY = list(IDENTITIES)
ACCOUNT = "physaliastore"
CONTAINER = "jobs"
ARM_RESOURCE = "https://management.azure.com/"
STORAGE_RESOURCE = "https://storage.azure.com/"
# tokens are the same in every instance of this fake (IMDS is shared): `<who>.<audience>`
USER = "user"
# infra/azure's `Physalia ACI launcher` role, assigned to the coordinator identity on the resource group;
# and `Storage Blob Data Contributor` on the account
ARM_ROLES = {"physalia-coordinator"}
STORAGE_ROLES = {"physalia-coordinator"}
# Location - List Usage's quotas in LOCATION: (localized name, default limit). The defaults hold every
# test's groups; `--usage-limit NAME=N` or `PUT /_fake/usage-limits {"NAME": N}` sets one.
USAGES = {
    "ContainerGroups": "Container Groups",
    "StandardCores": "Standard Cores",
    "StandardSpotCores": "Standard Spot Cores",
}
USAGE_LIMITS = {"ContainerGroups": 100, "StandardCores": 100, "StandardSpotCores": 100}
# Blob Storage's limits (x-ms-version 2019-12-12 and later): Put Block, Put Blob, blocks per blob
MAX_BLOCK_BYTES = 4000 * 2**20
MAX_PUT_BLOB_BYTES = 5000 * 2**20
MAX_BLOCK_ID_BYTES = 64
MAX_UNCOMMITTED_BLOCKS = 100_000
MAX_COMMITTED_BLOCKS = 50_000
# Get User Delegation Key: a key's expiry at most this far ahead
MAX_DELEGATION_KEY_S = 7 * 24 * 3600
TENANT = "00000000-0000-0000-0000-0000000000aa"
# the signed-in user's object id (the identities' are their principal ids)
USER_OID = "d0000000-0000-0000-0000-0000000000e1"
# user delegation SAS formats this fake verifies: from 2020-12-06 (the string-to-sign's 24 fields)
# until 2025-07-05, which adds fields
SAS_VERSIONS = ("2020-12-06", "2025-07-05")
IMDS_NETWORK = "physalia-azure-imds"
IMDS_IP = "169.254.169.254"
# which IMDS-network address holds which identities, for every instance of this fake
IMDS_CALLERS = "/tmp/physalia-azure-imds-callers"
SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "backends", "tests", "aci", "spec",
                    "aci-containerInstance-2026-05-01.json")


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


def audience(resource: str) -> str | None:
    r = resource.rstrip("/").removesuffix("/.default").rstrip("/")
    if r == ARM_RESOURCE.rstrip("/"):
        return "arm"
    if r == STORAGE_RESOURCE.rstrip("/"):
        return "storage"
    return None


def token_of(who: str, aud: str) -> str:
    return f"{who}.{aud}"


def bearer_principal(header: str | None, aud: str) -> str | None:
    """The principal a bearer token of audience `aud` stands for; None for no or a wrong token."""
    if not header or not header.startswith("Bearer "):
        return None
    who, _, got = header[len("Bearer "):].rpartition(".")
    if got != aud:
        return None
    if who == USER or who in {name for name, _, _ in IDENTITIES.values()}:
        return who
    return None


# --- the swagger validator (backends/tests/aci/swagger.rs, in Python) --------------------------------

class Swagger:
    """Validates request bodies against the spec's definitions: `$ref`, `allOf`, type, int32, enum,
    required, items, additionalProperties; undeclared and read-only properties are errors."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            doc = json.load(f)
        assert doc["swagger"] == "2.0", path
        self.definitions = doc["definitions"]

    def validate(self, name: str, value) -> list[str]:
        errors: list[str] = []
        self.check({"$ref": f"#/definitions/{name}"}, value, "$", errors)
        return errors

    def resolve(self, ref: str, path: str, errors: list[str]):
        if ref.startswith("#/definitions/"):
            d = self.definitions.get(ref[len("#/definitions/"):])
            if d is None:
                errors.append(f"{path}: the spec has no definition {ref}")
            return d
        if ref.endswith("common-types/resource-management/v5/types.json#/definitions/ProxyResource"):
            ro = lambda t: {"type": t, "readOnly": True}  # noqa: E731
            return {"type": "object", "properties": {"id": ro("string"), "name": ro("string"),
                                                     "type": ro("string"), "systemData": ro("object")}}
        errors.append(f"{path}: unresolved external reference {ref}")
        return None

    def flatten(self, schema: dict, path: str, errors: list[str]) -> dict:
        schema = dict(schema)
        while "$ref" in schema:
            s = self.resolve(schema["$ref"], path, errors)
            if s is None:
                return {}
            schema = dict(s)
        parts = schema.pop("allOf", None)
        for part in parts or []:
            part = self.flatten(part, path, errors)
            props = dict(schema.get("properties") or {})
            for k, v in (part.get("properties") or {}).items():
                props.setdefault(k, v)
            if props:
                schema["properties"] = props
            if part.get("required"):
                schema["required"] = list(schema.get("required") or []) + part["required"]
            if "type" not in schema and "type" in part:
                schema["type"] = part["type"]
        return schema

    def check(self, schema: dict, v, path: str, errors: list[str]) -> None:
        if schema.get("readOnly") is True:
            errors.append(f"{path}: read-only property sent in a request")
            return
        schema = self.flatten(schema, path, errors)
        if schema.get("readOnly") is True:
            errors.append(f"{path}: read-only property sent in a request")
            return
        ty = schema.get("type") or ("object" if "properties" in schema else None)
        if ty == "object":
            self.check_object(schema, v, path, errors)
        elif ty == "array":
            if isinstance(v, list):
                for i, item in enumerate(v):
                    self.check(schema.get("items") or {}, item, f"{path}[{i}]", errors)
            else:
                errors.append(f"{path}: expected an array, got {json.dumps(v)}")
        elif ty in ("string", "boolean", "number"):
            ok = {"string": isinstance(v, str), "boolean": isinstance(v, bool),
                  "number": isinstance(v, (int, float)) and not isinstance(v, bool)}[ty]
            if not ok:
                errors.append(f"{path}: expected a {ty}, got {json.dumps(v)}")
        elif ty == "integer":
            if isinstance(v, int) and not isinstance(v, bool):
                if schema.get("format") == "int32" and not -2**31 <= v < 2**31:
                    errors.append(f"{path}: {v} does not fit int32")
            else:
                errors.append(f"{path}: expected an integer, got {json.dumps(v)}")
        elif ty is not None:
            errors.append(f"{path}: the validator does not know type {ty}")
        if "enum" in schema and v not in schema["enum"]:
            errors.append(f"{path}: {json.dumps(v)} is not one of {json.dumps(schema['enum'])}")

    def check_object(self, schema: dict, v, path: str, errors: list[str]) -> None:
        if not isinstance(v, dict):
            errors.append(f"{path}: expected an object, got {json.dumps(v)}")
            return
        props = schema.get("properties") or {}
        for req in schema.get("required") or []:
            if req not in v:
                errors.append(f"{path}: required property {req} is missing")
        additional = schema.get("additionalProperties")
        for k, value in v.items():
            child = f"{path}.{k}"
            if k in props:
                self.check(props[k], value, child, errors)
            elif additional is True:
                pass
            elif isinstance(additional, dict):
                self.check(additional, value, child, errors)
            else:
                errors.append(f"{child}: not a property the spec declares")


# --- networks ---------------------------------------------------------------------------------------

def make_network() -> tuple[str, ipaddress.IPv4Network]:
    """The virtual network's subnet: a free /24 of 10.246.0.0/16 (several fakes may run at once)."""
    name = f"physalia-aci-fake-{os.getpid()}"
    last = ""
    for third in firewall.subnet_order(0, 250):
        net = ipaddress.IPv4Network(f"10.246.{third}.0/24")
        r = docker("network", "create", "--label", LABEL, "--subnet", str(net),
                   "--gateway", str(net.network_address + 1), name, check=False)
        if r.returncode == 0:
            return name, net
        last = r.stderr.strip()
    raise SystemExit(f"no free /24 in 10.246.0.0/16 for a Docker network: {last}")


def imds_network() -> None:
    """The metadata service's link-local network, shared by every instance (its address is fixed):
    internal, its gateway 169.254.169.254 this machine."""
    if docker("network", "inspect", IMDS_NETWORK, check=False).returncode == 0:
        return
    r = docker("network", "create", "--internal", "--label", "physalia.aci-fake=shared",
               "--subnet", "169.254.169.0/24", "--gateway", IMDS_IP, IMDS_NETWORK, check=False)
    if r.returncode != 0 and docker("network", "inspect", IMDS_NETWORK, check=False).returncode != 0:
        raise SystemExit(f"cannot make the metadata network: {r.stderr.strip()}")


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def cloud_error(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


# --- Container Instances ----------------------------------------------------------------------------

class Group:
    def __init__(self, name: str, body: dict, ip: str) -> None:
        self.name = name
        self.body = body
        self.ip = ip
        self.provisioning = "Creating"
        self.container: str | None = None
        self.current: dict = {"state": "Waiting", "detailStatus": "ContainerCreating"}
        self.imds_ip: str | None = None
        self.started = now_iso()


class Aci:
    def __init__(self, network: str, subnet: ipaddress.IPv4Network, gateway: str, files: str,
                 fw: "firewall.Firewall", infra_vars: dict[str, str] | None = None) -> None:
        self.network = network
        self.firewall = fw
        # infra/azure's network security group, associated with the workers' subnet, as applied with
        # `infra_vars`
        self.nsg = firewall.nsg_inbound(str(subnet), infra_vars)
        self.gateway = gateway
        self.files = files
        self.hosts = iter(list(subnet.hosts())[9:])  # .10 on, as Azure keeps the first addresses
        self.lock = threading.Lock()
        self.groups: dict[str, Group] = {}
        self.ops: dict[str, dict] = {}
        self.requests: list[dict] = []
        self.violations: list[str] = []
        # --throttle-every: every Nth ARM request of a principal is answered 429 (0: never)
        self.throttle_every = 0
        self.seen: dict[str, int] = {}
        self.throttled: dict[str, int] = {}
        # Location - List Usage: the subscription's limits in LOCATION (`--usage-limit`, `/_fake/usage-limits`)
        self.usage_limits: dict[str, int] = dict(USAGE_LIMITS)
        self.swagger = Swagger(SPEC)
        self.arm = ""
        self.blob = ""
        self.stop = threading.Event()

    def put(self, name: str, body: dict, who: str) -> tuple[int, dict, dict]:
        errors = self.swagger.validate("ContainerGroup", body)
        if errors:
            with self.lock:
                self.violations.extend(f"PUT {name}: {e}" for e in errors)
            return 400, cloud_error("InvalidRequestContent", "; ".join(errors)), {}
        props = body["properties"]
        if body.get("location") != LOCATION:
            return 400, cloud_error(
                "LocationNotAvailableForResourceType",
                f"The provided location '{body.get('location')}' is not available for resource type "
                f"'Microsoft.ContainerInstance/containerGroups' in this test: {LOCATION}"), {}
        for s in props.get("subnetIds") or []:
            if s.get("id", "").lower() != SUBNET_ID.lower():
                return 400, cloud_error(
                    "InvalidSubnet" if "/subnets/" in s.get("id", "") else "LinkedInvalidPropertyId",
                    f"Subnet '{s.get('id')}' does not exist or is not delegated to "
                    "Microsoft.ContainerInstance/containerGroups."), {}
        ids = ((body.get("identity") or {}).get("userAssignedIdentities") or {})
        for rid in ids:
            if rid not in IDENTITIES:
                return 400, cloud_error(
                    "InvalidUserAssignedIdentity",
                    f"The user assigned identity '{rid}' does not exist."), {}
        for c in props["containers"]:
            image = c["properties"]["image"]
            if docker("image", "inspect", image, check=False).returncode != 0:
                return 400, cloud_error(
                    "InaccessibleImage",
                    f"The image '{image}' in container group '{name}' is not accessible. Please check "
                    "the image and registry credential."), {}
        # the region's quotas, as ACI refuses a group that would pass one
        usage = {u["name"]["value"]: u for u in self.usages()["value"]}
        asked = {"ContainerGroups": 1, "StandardCores": math.ceil(sum(
            float(((c["properties"].get("resources") or {}).get("requests") or {}).get("cpu", 0))
            for c in props["containers"]))}
        for quota, n in asked.items():
            u = usage[quota]
            if u["currentValue"] + n > u["limit"]:
                return 409, cloud_error(
                    "ContainerGroupQuotaReached",
                    f"Resource type 'Microsoft.ContainerInstance/containerGroups' container group quota "
                    f"'{quota}' exceeded in region '{LOCATION}'. Limit: '{u['limit']}', Usage: "
                    f"'{u['currentValue']}' Requested: '{n}'."), {}
        with self.lock:
            if name in self.groups:
                return 409, cloud_error("Conflict", f"container group {name} exists already"), {}
            g = Group(name, body, str(next(self.hosts)))
            self.groups[name] = g
            op = uuid.uuid4().hex
            self.ops[op] = {"group": name, "status": "InProgress"}
        threading.Thread(target=self.start_or_fail, args=(g, op), daemon=True).start()
        headers = {
            "Azure-AsyncOperation": f"{self.arm}/subscriptions/{SUBSCRIPTION}/providers/"
                                    f"Microsoft.ContainerInstance/locations/{LOCATION}/operations/{op}"
                                    f"?api-version={API_VERSION}",
            "Retry-After": "1",
        }
        return 201, self.view(g), headers

    def start_or_fail(self, g: Group, op: str) -> None:
        try:
            self.start(g, op)
        except Exception as e:  # the operation ends Failed instead of running forever
            self.fail(g, op, "InternalServerError", f"the fake could not start the group: {e!r}")
            raise

    def start(self, g: Group, op: str) -> None:
        props = g.body["properties"]
        c = props["containers"][0]
        cp = c["properties"]
        container = f"aci-{g.name}-{c['name']}"
        folder = os.path.join(self.files, g.name)
        os.makedirs(folder, exist_ok=True)
        args = ["create", "--name", container, "--label", LABEL, "--network", self.network,
                "--ip", g.ip, "--hostname", g.name[:63]]
        env = {}
        for e in cp.get("environmentVariables") or []:
            env[e["name"]] = e.get("value", e.get("secureValue", ""))
        identities = list(((g.body.get("identity") or {}).get("userAssignedIdentities") or {}))
        if identities:
            env["AZURE_STORAGE_ENDPOINT"] = self.blob
            env["AZURE_ALLOW_HTTP"] = "true"
        volumes = {v["name"]: v for v in props.get("volumes") or []}
        for m in cp.get("volumeMounts") or []:
            v = volumes[m["name"]]
            if "secret" not in v:
                self.fail(g, op, "InvalidVolume", f"volume {m['name']}: only secret volumes are supported")
                return
            root = os.path.join(folder, "secret-" + m["name"])
            os.makedirs(root, exist_ok=True)
            for file, b64 in v["secret"].items():
                path = os.path.join(root, file)
                with open(path, "wb") as f:
                    f.write(base64.b64decode(b64))
                os.chmod(path, 0o444)
            os.chmod(root, 0o555)
            args += ["-v", f"{root}:{m['mountPath']}:ro"]
        # the environment through a file: secure values never appear in an argument
        env_file = os.path.join(folder, "env")
        with open(env_file, "w") as f:
            for k, val in env.items():
                f.write(f"{k}={val}\n")
        os.chmod(env_file, 0o600)
        args += ["--env-file", env_file]
        command = cp.get("command") or []
        if command:
            args += ["--entrypoint", command[0]]
        args.append(cp["image"])
        args += command[1:]
        with self.lock:
            if g.name not in self.groups:
                return
            g.container = container
        self.firewall.guard(g.ip, self.nsg)
        r = docker(*args, check=False)
        os.remove(env_file)
        if r.returncode == 0 and identities:
            r = self.attach_imds(g, container, identities)
        if r.returncode == 0:
            r = docker("start", container, check=False)
        if r.returncode != 0:
            self.fail(g, op, "ContainerGroupDeploymentFailed", r.stderr.strip()[-300:])
            return
        with self.lock:
            g.provisioning = "Succeeded"
            g.current = {"state": "Running", "startTime": now_iso(), "detailStatus": ""}
            self.ops[op]["status"] = "Succeeded"

    def attach_imds(self, g: Group, container: str, identities: list[str]) -> subprocess.CompletedProcess:
        """Connects the container to the metadata network at a free address (Docker gives a created
        container its address only when it starts; the address must be known to answer its token
        requests, and other instances of this fake share the network) and records its identities."""
        os.makedirs(IMDS_CALLERS, exist_ok=True)
        start = random.randrange(2, 250)
        r = None
        for k in range(248):
            ip = f"169.254.169.{2 + (start + k) % 248}"
            r = docker("network", "connect", "--ip", ip, IMDS_NETWORK, container, check=False)
            if r.returncode == 0:
                g.imds_ip = ip
                with open(os.path.join(IMDS_CALLERS, ip), "w") as f:
                    json.dump(identities, f)
                return r
        return r

    def fail(self, g: Group, op: str, code: str, message: str) -> None:
        with self.lock:
            g.provisioning = "Failed"
            g.current = {"state": "Waiting", "detailStatus": code}
            self.ops[op].update({"status": "Failed", "error": {"code": code, "message": message}})

    def observe(self) -> None:
        """The containers' states, every half second."""
        while not self.stop.wait(0.5):
            with self.lock:
                running = [(g, g.container) for g in self.groups.values()
                           if g.container and g.current.get("state") == "Running"]
            for g, container in running:
                r = docker("inspect", "-f", "{{.State.Running}} {{.State.ExitCode}} {{.State.FinishedAt}}",
                           container, check=False)
                if r.returncode != 0:
                    continue
                up, code, finished = r.stdout.split()
                if up == "true":
                    continue
                with self.lock:
                    g.current = {"state": "Terminated", "exitCode": int(code),
                                 "startTime": g.current.get("startTime"), "finishTime": finished,
                                 "detailStatus": "Completed" if code == "0" else "Error"}

    def usages(self) -> dict:
        """Location - List Usage (UsageListResult): the groups that exist count against ContainerGroups, the
        cores of those whose container has not terminated against StandardCores (a stopped group is not
        billed and holds no cores); no group here is a Spot one."""
        with self.lock:
            groups = list(self.groups.values())
            limits = dict(self.usage_limits)
        cores = 0.0
        for g in groups:
            if g.current.get("state") == "Terminated" or g.provisioning == "Failed":
                continue
            for c in g.body["properties"]["containers"]:
                cores += float(((c["properties"].get("resources") or {}).get("requests") or {}).get("cpu", 0))
        current = {"ContainerGroups": len(groups), "StandardCores": math.ceil(cores), "StandardSpotCores": 0}
        return {"value": [{"unit": "Count", "currentValue": current[name], "limit": limits[name],
                           "name": {"value": name, "localizedValue": localized}}
                          for name, localized in USAGES.items()]}

    def view(self, g: Group) -> dict:
        v = json.loads(json.dumps(g.body))
        v["id"] = f"{RG_ID}/providers/Microsoft.ContainerInstance/containerGroups/{g.name}"
        v["name"] = g.name
        v["type"] = "Microsoft.ContainerInstance/containerGroups"
        props = v["properties"]
        for vol in props.get("volumes") or []:
            if "secret" in vol:
                vol["secret"] = {}
        for c in props["containers"]:
            for e in c["properties"].get("environmentVariables") or []:
                e.pop("secureValue", None)
        props["provisioningState"] = g.provisioning
        state = g.current.get("state")
        if g.provisioning == "Failed":
            runtime = "Failed"
        elif state == "Running":
            runtime = "Running"
        elif state == "Terminated":
            runtime = "Succeeded" if g.current.get("exitCode") == 0 else "Failed"
        else:
            runtime = "Pending"
        props["instanceView"] = {"state": runtime, "events": []}
        props["containers"][0]["properties"]["instanceView"] = {
            "restartCount": 0, "currentState": {k: x for k, x in g.current.items() if x is not None},
            "events": []}
        props.setdefault("ipAddress", {})["ip"] = g.ip
        return v

    def delete(self, name: str) -> dict | None:
        with self.lock:
            g = self.groups.pop(name, None)
        if g is None:
            return None
        if g.container:
            docker("rm", "-f", g.container, check=False)
            self.firewall.release(g.ip)
        if g.imds_ip:
            try:
                os.remove(os.path.join(IMDS_CALLERS, g.imds_ip))
            except FileNotFoundError:
                pass
        shutil.rmtree(os.path.join(self.files, name), ignore_errors=True)
        return self.view(g)

    def logs(self, name: str) -> str | None:
        with self.lock:
            g = self.groups.get(name)
        if g is None or not g.container:
            return None if g is None else ""
        r = docker("logs", g.container, check=False)
        return r.stdout + r.stderr if r.returncode == 0 else ""

    def shutdown(self) -> None:
        self.stop.set()
        for name in list(self.groups):
            self.delete(name)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def reply(self, code: int, body=None, headers: dict | None = None, raw: bytes | None = None,
              content_type: str = "application/json") -> None:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if data or raw is not None or body is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""


class Arm(Handler):
    aci: Aci

    def route(self) -> None:
        aci = self.aci
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        body = self.read_body()
        if url.path == "/_fake/usage-limits" and self.command == "PUT":
            try:
                limits = json.loads(body)
                assert isinstance(limits, dict) and all(
                    k in USAGES and isinstance(v, int) and v >= 0 for k, v in limits.items())
            except (ValueError, AssertionError):
                return self.reply(400, cloud_error("InvalidRequestContent",
                                                   f"expected {{NAME: limit}} with NAME one of {list(USAGES)}"))
            with aci.lock:
                aci.usage_limits.update(limits)
                return self.reply(200, aci.usage_limits)
        if url.path.startswith("/_fake/"):
            with aci.lock:
                what = {"groups": lambda: {n: aci.view(g) for n, g in aci.groups.items()},
                        "requests": lambda: aci.requests,
                        "throttled": lambda: aci.throttled,
                        "usage-limits": lambda: aci.usage_limits,
                        "violations": lambda: aci.violations}.get(url.path[len("/_fake/"):])
                return self.reply(200, what()) if what else self.reply(404)
        who = bearer_principal(self.headers.get("Authorization"), "arm")
        with aci.lock:
            entry = {"who": who, "method": self.command, "path": url.path}
            aci.requests.append(entry)
        if query.get("api-version") != API_VERSION:
            with aci.lock:
                aci.violations.append(f"{self.command} {self.path}: api-version is not {API_VERSION}")
            return self.reply(400, cloud_error("InvalidApiVersionParameter",
                                               f"The api-version '{query.get('api-version')}' is invalid."))
        if who is None:
            return self.reply(401, cloud_error("InvalidAuthenticationToken",
                                               "The access token is invalid."))
        if aci.throttle_every:
            with aci.lock:
                aci.seen[who] = aci.seen.get(who, 0) + 1
                throttle = aci.seen[who] % aci.throttle_every == 0
                if throttle:
                    aci.throttled[who] = aci.throttled.get(who, 0) + 1
                    entry["throttled"] = True
            if throttle:
                kind = {"GET": "reads", "DELETE": "deletes"}.get(self.command, "writes")
                return self.reply(429, cloud_error(
                    "TooManyRequests",
                    "The request is being throttled as the limit has been reached for operation type "
                    f"- {'Read' if kind == 'reads' else 'Write'}_ObservationWindow_00:05:00."),
                    {"Retry-After": "1", f"x-ms-ratelimit-remaining-subscription-{kind}": "0"})
        parts = url.path.strip("/").split("/")
        # operations: /subscriptions/S/providers/Microsoft.ContainerInstance/locations/L/operations/ID
        if len(parts) == 8 and parts[2:5] == ["providers", "Microsoft.ContainerInstance", "locations"] \
                and parts[6] == "operations":
            with aci.lock:
                op = aci.ops.get(parts[7])
                if op is None:
                    return self.reply(404, cloud_error("NotFound", "no such operation"))
                return self.reply(200, {k: v for k, v in op.items() if k != "group"}
                                  | {"name": parts[7]}, {"Retry-After": "1"})
        # Location - List Usage: /subscriptions/S/providers/Microsoft.ContainerInstance/locations/L/usages
        if len(parts) == 7 and parts[0] == "subscriptions" \
                and parts[2:5] == ["providers", "Microsoft.ContainerInstance", "locations"] \
                and parts[6] == "usages" and self.command == "GET":
            if parts[1] != SUBSCRIPTION:
                return self.reply(404, cloud_error("SubscriptionNotFound",
                                                   f"The subscription '{parts[1]}' could not be found."))
            if who != USER:
                # infra/azure's role is assigned on the resource group: nothing at the subscription's scope
                return self.reply(403, cloud_error(
                    "AuthorizationFailed",
                    f"The client '{who}' does not have authorization to perform action "
                    "'Microsoft.ContainerInstance/locations/usages/read' over scope "
                    f"'/subscriptions/{SUBSCRIPTION}' or the scope is invalid."))
            if parts[5].lower() != LOCATION:
                return self.reply(400, cloud_error(
                    "LocationNotAvailableForResourceType",
                    f"The provided location '{parts[5]}' is not available for resource type "
                    f"'Microsoft.ContainerInstance/locations/usages' in this test: {LOCATION}"))
            return self.reply(200, aci.usages())
        if len(parts) < 7 or parts[0] != "subscriptions" or parts[2] != "resourceGroups" \
                or parts[4] != "providers" or parts[5] != "Microsoft.ContainerInstance" \
                or parts[6] != "containerGroups":
            with aci.lock:
                aci.violations.append(f"unknown route {self.command} {url.path}")
            return self.reply(404, cloud_error("NotFound", "no such route"))
        if parts[1] != SUBSCRIPTION:
            return self.reply(404, cloud_error("SubscriptionNotFound",
                                               f"The subscription '{parts[1]}' could not be found."))
        if parts[3].lower() != RESOURCE_GROUP:
            return self.reply(404, cloud_error("ResourceGroupNotFound",
                                               f"Resource group '{parts[3]}' could not be found."))
        if who != USER and who not in ARM_ROLES:
            return self.reply(403, cloud_error(
                "AuthorizationFailed",
                f"The client '{who}' does not have authorization to perform action "
                f"'Microsoft.ContainerInstance/containerGroups/{'read' if self.command == 'GET' else 'write'}' "
                f"over scope '{RG_ID}' or the scope is invalid."))
        rest = parts[7:]
        if self.command == "GET" and not rest:
            with aci.lock:
                return self.reply(200, {"value": [aci.view(g) for g in aci.groups.values()]})
        if self.command == "PUT" and len(rest) == 1:
            try:
                doc = json.loads(body)
            except ValueError as e:
                with aci.lock:
                    aci.violations.append(f"PUT {rest[0]}: body is not JSON: {e}")
                return self.reply(400, cloud_error("InvalidRequestContent", "not JSON"))
            code, out, headers = aci.put(rest[0], doc, who)
            return self.reply(code, out, headers)
        if self.command == "GET" and len(rest) == 1:
            with aci.lock:
                g = aci.groups.get(rest[0])
                if g is None:
                    return self.reply(404, cloud_error(
                        "ResourceNotFound",
                        f"The Resource 'Microsoft.ContainerInstance/containerGroups/{rest[0]}' under "
                        f"resource group '{RESOURCE_GROUP}' was not found."))
                return self.reply(200, aci.view(g))
        if self.command == "DELETE" and len(rest) == 1:
            v = aci.delete(rest[0])
            return self.reply(204) if v is None else self.reply(200, v)
        if self.command == "GET" and len(rest) == 4 and rest[1] == "containers" and rest[3] == "logs":
            text = aci.logs(rest[0])
            if text is None:
                return self.reply(404, cloud_error("ResourceNotFound", f"{rest[0]} not found"))
            return self.reply(200, {"content": text})
        with aci.lock:
            aci.violations.append(f"unknown route {self.command} {url.path}")
        return self.reply(404, cloud_error("NotFound", "no such route"))

    do_GET = do_PUT = do_DELETE = do_POST = do_PATCH = route


# --- the instance metadata service's token endpoint --------------------------------------------------

class Imds(Handler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        if url.path != "/metadata/identity/oauth2/token":
            return self.reply(404, {"error": "not_found"})
        if self.headers.get("Metadata", "").lower() != "true":
            return self.reply(400, {"error": "invalid_request",
                                    "error_description": "Required metadata header not specified"})
        try:
            with open(os.path.join(IMDS_CALLERS, self.client_address[0])) as f:
                held = json.load(f)
        except (FileNotFoundError, ValueError):
            held = []
        if not held:
            return self.reply(400, {"error": "invalid_request",
                                    "error_description": "Identity not found"})
        aud = audience(q.get("resource", ""))
        if aud is None:
            return self.reply(400, {"error": "invalid_resource",
                                    "error_description": f"resource {q.get('resource')!r} is unknown"})
        chosen = None
        for key, idx in (("client_id", 1), ("msi_res_id", None), ("object_id", 2)):
            if key in q:
                for rid in held:
                    if (rid.lower() == q[key].lower()) if idx is None else IDENTITIES[rid][idx] == q[key]:
                        chosen = rid
                if chosen is None:
                    return self.reply(400, {"error": "invalid_request",
                                            "error_description": "Identity not found"})
                break
        else:
            if len(held) > 1:
                return self.reply(400, {"error": "invalid_request",
                                        "error_description": "Multiple user assigned identities exist, "
                                        "please specify the clientId / resourceId of the identity in the "
                                        "token request"})
            chosen = held[0]
        name, client_id, _ = IDENTITIES[chosen]
        expires = int(time.time()) + 3600
        self.reply(200, {"access_token": token_of(name, aud), "client_id": client_id,
                         "expires_in": "3600", "expires_on": str(expires), "ext_expires_in": "3600",
                         "not_before": str(expires - 3600), "resource": q["resource"],
                         "token_type": "Bearer"})


class ImdsServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # every instance serves the same fixed address: any of them answers alike
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


# --- Blob Storage ----------------------------------------------------------------------------------

class Staged:
    """A blob's blocks (Put Block, Put Block List): the uncommitted ones by id, the latest upload of each
    id (re-putting an id replaces it), and the committed block list, each block as (id, start, length)
    in the committed blob's bytes."""

    def __init__(self) -> None:
        self.uncommitted: dict[str, bytes] = {}
        self.committed: list[tuple[str, int, int]] = []

    def id_length(self) -> int | None:
        for bid in self.uncommitted:
            return len(bid)
        for bid, _, _ in self.committed:
            return len(bid)
        return None


def block_id(text: str) -> str | None:
    """`text` if it is a block id Azure takes (Base64, at most 64 bytes before encoding), else None."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        return None
    return text if 0 < len(raw) <= MAX_BLOCK_ID_BYTES else None


def principal_oid(who: str) -> str:
    """The object id of a principal this fake knows (the user, or an identity by name)."""
    if who == USER:
        return USER_OID
    return next(oid for name, _, oid in IDENTITIES.values() if name == who)


def principal_of_oid(oid: str) -> str | None:
    if oid == USER_OID:
        return USER
    return next((name for name, _, o in IDENTITIES.values() if o == oid), None)


def azure_time(text: str) -> float | None:
    """Seconds since the epoch of an ISO 8601 UTC time as SAS fields and KeyInfo carry it."""
    try:
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        return None
    return t.timestamp()


# a SAS's permission letter each method needs on a blob
SAS_PERMISSION = {"GET": "r", "HEAD": "r", "PUT": "w", "DELETE": "d"}


class Blobs(Handler):
    lock = threading.Lock()
    # user delegation keys issued: (signed oid, signed start, signed expiry) -> the key (Base64)
    delegation_keys: dict[tuple[str, str, str], str] = {}
    # container -> name -> (bytes, etag, last modified, content type): the committed blobs
    store: dict[str, dict[str, tuple[bytes, str, str, str]]] = {CONTAINER: {}}
    # container -> name -> its blocks; a blob with uncommitted blocks only is in no listing and no GET
    staged: dict[str, dict[str, Staged]] = {CONTAINER: {}}
    requests: list[dict] = []

    def error(self, code: int, err: str, message: str) -> None:
        xml = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{err}</Code>'
               f"<Message>{escape(message)}</Message></Error>").encode()
        self.reply(code, raw=xml, headers={"x-ms-error-code": err}, content_type="application/xml")

    def route(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        if self.command == "PUT":
            # the size limits are the Content-Length's: the body of a request over one is never read
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                return self.error(411, "MissingContentLengthHeader",
                                  "The Content-Length header was not specified.")
            limit = MAX_BLOCK_BYTES if q.get("comp") == "block" else MAX_PUT_BLOB_BYTES
            if int(length) > limit:
                self.close_connection = True
                return self.error(413, "RequestBodyTooLarge",
                                  "The request body is too large and exceeds the maximum permissible "
                                  f"limit.\nMaxLimit: {limit}")
        body = self.read_body()
        sas = "sig" in q
        if sas:
            who, refused = self.sas_principal(url.path, q)
        else:
            who, refused = bearer_principal(self.headers.get("Authorization"), "storage"), None
        with self.lock:
            self.requests.append({"who": who, "method": self.command, "path": url.path,
                                  "comp": q.get("comp"), "bytes": len(body)})
        if url.path == "/_fake/requests":
            with self.lock:
                return self.reply(200, self.requests)
        if refused:
            return self.error(*refused)
        if who is None:
            return self.error(401, "InvalidAuthenticationInfo",
                              "Server failed to authenticate the request: no valid bearer token.")
        if not sas and who != USER and who not in STORAGE_ROLES:
            return self.error(403, "AuthorizationPermissionMismatch",
                              "This request is not authorized to perform this operation using this "
                              "permission.")
        if self.command == "POST" and q.get("restype") == "service" \
                and q.get("comp") == "userdelegationkey":
            if sas:
                return self.error(403, "AuthenticationFailed",
                                  "A user delegation key is given to a Microsoft Entra principal only.")
            return self.user_delegation_key(who, url.path, body)
        parts = urllib.parse.unquote(url.path).lstrip("/").split("/", 2)
        # path-style: /<account>/<container>[/<blob>]
        if len(parts) < 2 or parts[0] != ACCOUNT:
            return self.error(400, "InvalidUri", f"no account {parts[0] if parts else ''!r} here")
        container = parts[1]
        blob = parts[2] if len(parts) > 2 else ""
        with self.lock:
            blobs = self.store.get(container)
        if blobs is None:
            return self.error(404, "ContainerNotFound", "The specified container does not exist.")
        if not blob:
            if self.command == "GET" and q.get("restype") == "container" and q.get("comp") == "list":
                return self.list(blobs, q)
            if self.command == "POST" and q.get("restype") == "container" and q.get("comp") == "batch":
                return self.batch(container, blobs, body)
            return self.error(400, "UnsupportedQueryParameter", f"{self.command} {self.path}")
        staged = self.staged.setdefault(container, {})
        md5 = self.headers.get("Content-MD5")
        if self.command == "PUT" and md5 is not None \
                and md5 != base64.b64encode(hashlib.md5(body).digest()).decode():
            return self.error(400, "Md5Mismatch",
                              "The MD5 value specified in the request did not match with the MD5 value "
                              "calculated by the server.")
        if self.command == "PUT" and q.get("comp") == "block":
            return self.put_block(staged, blob, q.get("blockid"), body)
        if self.command == "PUT" and q.get("comp") == "blocklist":
            return self.put_block_list(blobs, staged, blob, body)
        if self.command == "GET" and q.get("comp") == "blocklist":
            return self.get_block_list(blobs, staged, blob, q.get("blocklisttype", "committed"))
        if self.command == "PUT":
            if q.get("comp"):
                return self.error(400, "UnsupportedQueryParameter", f"comp={q['comp']}")
            if self.headers.get("x-ms-blob-type") != "BlockBlob":
                return self.error(400, "MissingRequiredHeader", "x-ms-blob-type")
            with self.lock:
                if self.headers.get("If-None-Match") == "*" and blob in blobs:
                    return self.error(409, "BlobAlreadyExists", "The specified blob already exists.")
                etag, modified = self.commit(blobs, blob, body)
                # a blob put whole has no committed blocks; its uncommitted ones stay
                if blob in staged:
                    staged[blob].committed = []
            return self.reply(201, raw=b"", headers={"ETag": etag, "Last-Modified": modified})
        with self.lock:
            found = blobs.get(blob)
        if self.command == "DELETE":
            if found is None:
                return self.error(404, "BlobNotFound", "The specified blob does not exist.")
            with self.lock:
                blobs.pop(blob, None)
                staged.pop(blob, None)
            return self.reply(202, raw=b"")
        if self.command in ("GET", "HEAD"):
            if found is None:
                return self.error(404, "BlobNotFound", "The specified blob does not exist.")
            data, etag, modified, ctype = found
            headers = {"ETag": etag, "Last-Modified": modified, "x-ms-blob-type": "BlockBlob",
                       "Accept-Ranges": "bytes"}
            rng = self.headers.get("Range") or self.headers.get("x-ms-range")
            if rng and rng.startswith("bytes=") and self.command == "GET":
                start, _, end = rng[len("bytes="):].partition("-")
                s = int(start)
                e = min(int(end), len(data) - 1) if end else len(data) - 1
                headers["Content-Range"] = f"bytes {s}-{e}/{len(data)}"
                return self.reply(206, raw=data[s:e + 1], headers=headers, content_type=ctype)
            if self.command == "HEAD":
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return
            return self.reply(200, raw=data, headers=headers, content_type=ctype)
        return self.error(405, "UnsupportedHttpVerb", self.command)

    def user_delegation_key(self, who: str, path: str, body: bytes) -> None:
        """Get User Delegation Key: a key of `who` from Start (now if absent) to Expiry."""
        if path.strip("/") != ACCOUNT:
            return self.error(400, "InvalidUri", f"{path}: the key is the account's (/{ACCOUNT})")
        try:
            info = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            return self.error(400, "InvalidXmlDocument", "XML specified is not syntactically valid.")
        start_text = info.findtext("Start")
        expiry_text = info.findtext("Expiry")
        now = time.time()
        start = azure_time(start_text) if start_text else now
        expiry = azure_time(expiry_text) if expiry_text else None
        if info.tag != "KeyInfo" or start is None or expiry is None:
            return self.error(400, "InvalidXmlNodeValue",
                              "KeyInfo needs an Expiry (and may have a Start) in ISO 8601 UTC.")
        if expiry <= start or expiry <= now or expiry - now > MAX_DELEGATION_KEY_S:
            return self.error(400, "InvalidXmlNodeValue",
                              "The key's Expiry must be after its Start and within 7 days of now.")
        fmt = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        oid = principal_oid(who)
        skt, ske = fmt(start), fmt(expiry)
        value = base64.b64encode(os.urandom(32)).decode()
        with self.lock:
            self.delegation_keys[(oid, skt, ske)] = value
        version = self.headers.get("x-ms-version") or ""
        xml = ('<?xml version="1.0" encoding="utf-8"?><UserDelegationKey>'
               f"<SignedOid>{oid}</SignedOid><SignedTid>{TENANT}</SignedTid>"
               f"<SignedStart>{skt}</SignedStart><SignedExpiry>{ske}</SignedExpiry>"
               f"<SignedService>b</SignedService><SignedVersion>{escape(version)}</SignedVersion>"
               f"<Value>{value}</Value></UserDelegationKey>")
        self.reply(200, raw=xml.encode(), content_type="application/xml")

    def sas_principal(self, path: str, q: dict) -> tuple[str | None, tuple | None]:
        """The principal a user delegation SAS in `q` acts for, and the refusal (code, error, message)
        where Azure would refuse it."""
        def failed(detail: str) -> tuple[None, tuple]:
            return None, (403, "AuthenticationFailed",
                          "Server failed to authenticate the request. Make sure the value of "
                          f"Authorization header is formed correctly including the signature.\n{detail}")
        signed = ("sv", "sp", "se", "sr", "skoid", "sktid", "skt", "ske", "sks", "skv", "sig")
        if any(not q.get(k) for k in signed):
            return failed("Signature fields not well formed.")
        if not SAS_VERSIONS[0] <= q["sv"] < SAS_VERSIONS[1]:
            return failed(f"sv={q['sv']}: this fake verifies user delegation SAS of versions "
                          f"{SAS_VERSIONS[0]} up to {SAS_VERSIONS[1]}")
        with self.lock:
            key = self.delegation_keys.get((q["skoid"], q["skt"], q["ske"]))
        if key is None or q["sktid"] != TENANT or q["sks"] != "b":
            return failed("The signed user delegation key is not one this account issued.")
        parts = urllib.parse.unquote(path).lstrip("/").split("/", 2)
        canonical = "/blob/" + "/".join(parts)
        fields = [q.get(k, "") for k in ("sp", "st", "se")] + [canonical] + \
            [q.get(k, "") for k in ("skoid", "sktid", "skt", "ske", "sks", "skv", "saoid", "suoid",
                                    "scid", "sip", "spr", "sv", "sr", "sst", "ses", "rscc", "rscd",
                                    "rsce", "rscl", "rsct")]
        string_to_sign = "\n".join(fields)
        want = base64.b64encode(hmac.new(base64.b64decode(key), string_to_sign.encode(),
                                         hashlib.sha256).digest()).decode()
        if not hmac.compare_digest(want, q["sig"]):
            return failed(f"Signature did not match. String to sign used was {string_to_sign!r}")
        now = time.time()
        start, expiry = azure_time(q["st"]) if q.get("st") else now, azure_time(q["se"])
        key_expiry = azure_time(q["ske"])
        if start is None or expiry is None or key_expiry is None:
            return failed("Signature fields not well formed.")
        if not start <= now < expiry:
            return failed(f"Signed expiry time [{q['se']}] must be after the current time and signed "
                          f"start time [{q.get('st')}] before it.")
        if now >= key_expiry:
            return failed(f"The user delegation key expired at {q['ske']}.")
        who = principal_of_oid(q["skoid"])
        # the SAS grants what its principal holds now, at most
        if who is None or (who != USER and who not in STORAGE_ROLES):
            return f"sas:{who}", (403, "AuthorizationPermissionMismatch",
                                  "This request is not authorized to perform this operation using "
                                  "this permission.")
        if q["sr"] != "b" or len(parts) < 3 or not parts[2]:
            return f"sas:{who}", (403, "AuthorizationResourceTypeMismatch",
                                  "This request is not authorized to perform this operation using "
                                  "this resource type.")
        if SAS_PERMISSION.get(self.command) not in set(q["sp"]) or q.get("comp") not in (None, "block",
                                                                                         "blocklist"):
            return f"sas:{who}", (403, "AuthorizationPermissionMismatch",
                                  "This request is not authorized to perform this operation using "
                                  "this permission.")
        return f"sas:{who}", None

    def commit(self, blobs: dict, blob: str, data: bytes) -> tuple[str, str]:
        """Makes `data` the blob's content (the lock held); returns its ETag and Last-Modified."""
        etag = '"0x' + hashlib.md5(data[:1 << 20] + str(time.time_ns()).encode()).hexdigest()[:16].upper() + '"'
        modified = email.utils.formatdate(usegmt=True)
        blobs[blob] = (data, etag, modified,
                       self.headers.get("x-ms-blob-content-type") or "application/octet-stream")
        return etag, modified

    def put_block(self, staged: dict, blob: str, bid: str | None, body: bytes) -> None:
        """Put Block: a new uncommitted block of `blob`, invisible until a block list commits it. The id
        is Base64 of at most 64 bytes, of the same length as every other block id of the blob."""
        if bid is None or block_id(bid) is None:
            return self.error(400, "InvalidQueryParameterValue",
                              "Value for one of the query parameters specified in the request URI is "
                              f"invalid.\nQueryParameterName: blockid\nQueryParameterValue: {bid}")
        with self.lock:
            s = staged.setdefault(blob, Staged())
            length = s.id_length()
            if length is not None and length != len(bid):
                return self.error(400, "InvalidBlobOrBlock",
                                  "The specified blob or block content is invalid.")
            if bid not in s.uncommitted and len(s.uncommitted) >= MAX_UNCOMMITTED_BLOCKS:
                return self.error(409, "BlockCountExceedsLimit",
                                  "The uncommitted block count cannot exceed the maximum limit of "
                                  f"{MAX_UNCOMMITTED_BLOCKS:,} blocks.")
            s.uncommitted[bid] = body
        md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
        return self.reply(201, raw=b"", headers={"Content-MD5": md5,
                                                 "x-ms-request-server-encrypted": "true"})

    def put_block_list(self, blobs: dict, staged: dict, blob: str, body: bytes) -> None:
        """Put Block List: the blob becomes its listed blocks in order, each looked up where its element
        says (Uncommitted, Committed, or Latest: uncommitted first); a block found nowhere refuses the
        whole list, and the blob is unchanged. Blocks the list leaves out are discarded."""
        try:
            root = ElementTree.fromstring(body)
        except ElementTree.ParseError as e:
            return self.error(400, "InvalidXmlDocument", f"XML specified is not syntactically valid: {e}")
        if root.tag != "BlockList" or any(e.tag not in ("Latest", "Committed", "Uncommitted") for e in root):
            return self.error(400, "InvalidXmlDocument",
                              "XML specified is not syntactically valid: expected <BlockList> of <Latest>, "
                              "<Committed> and <Uncommitted> elements")
        listed = [(e.tag, (e.text or "").strip()) for e in root]
        if len(listed) > MAX_COMMITTED_BLOCKS:
            return self.error(400, "BlockListTooLong",
                              f"The block list may not contain more than {MAX_COMMITTED_BLOCKS:,} blocks.")
        if any(block_id(bid) is None for _, bid in listed):
            return self.error(400, "InvalidBlockId",
                              "The specified block ID is invalid. The block ID must be Base64-encoded.")
        with self.lock:
            if self.headers.get("If-None-Match") == "*" and blob in blobs:
                return self.error(409, "BlobAlreadyExists", "The specified blob already exists.")
            s = staged.get(blob) or Staged()
            old = blobs.get(blob, (b"",))[0]
            committed = {bid: (start, n) for bid, start, n in s.committed}
            pieces: list[bytes] = []
            for where, bid in listed:
                data = None
                if where in ("Uncommitted", "Latest"):
                    data = s.uncommitted.get(bid)
                if data is None and where in ("Committed", "Latest") and bid in committed:
                    start, n = committed[bid]
                    data = old[start:start + n]
                if data is None:
                    return self.error(400, "InvalidBlockList", "The specified block list is invalid.")
                pieces.append(data)
            blocks, at = [], 0
            for (_, bid), data in zip(listed, pieces):
                blocks.append((bid, at, len(data)))
                at += len(data)
            etag, modified = self.commit(blobs, blob, b"".join(pieces))
            done = Staged()
            done.committed = blocks
            staged[blob] = done
        return self.reply(201, raw=b"", headers={"ETag": etag, "Last-Modified": modified,
                                                 "x-ms-request-server-encrypted": "true"})

    def get_block_list(self, blobs: dict, staged: dict, blob: str, which: str) -> None:
        """Get Block List: `blocklisttype` committed (the default), uncommitted or all."""
        if which not in ("committed", "uncommitted", "all"):
            return self.error(400, "InvalidQueryParameterValue",
                              "Value for one of the query parameters specified in the request URI is "
                              f"invalid.\nQueryParameterName: blocklisttype\nQueryParameterValue: {which}")
        with self.lock:
            s = staged.get(blob)
            found = blobs.get(blob)
            if found is None and (s is None or not s.uncommitted):
                return self.error(404, "BlobNotFound", "The specified blob does not exist.")
            s = s or Staged()
            out = ['<?xml version="1.0" encoding="utf-8"?><BlockList>']
            if which in ("committed", "all"):
                out.append("<CommittedBlocks>")
                out += [f"<Block><Name>{bid}</Name><Size>{n}</Size></Block>" for bid, _, n in s.committed]
                out.append("</CommittedBlocks>")
            if which in ("uncommitted", "all"):
                out.append("<UncommittedBlocks>")
                out += [f"<Block><Name>{bid}</Name><Size>{len(d)}</Size></Block>"
                        for bid, d in s.uncommitted.items()]
                out.append("</UncommittedBlocks>")
            out.append("</BlockList>")
            headers = {"x-ms-blob-content-length": str(len(found[0]) if found else 0)}
            if found:
                headers["ETag"] = found[1]
        return self.reply(200, raw="".join(out).encode(), headers=headers, content_type="application/xml")

    def batch(self, container: str, blobs: dict, body: bytes) -> None:
        """Blob Batch: a multipart/mixed body of DELETE subrequests, each with its own token, answered
        part by part (202, or 404 BlobNotFound, 403 for a principal without the role)."""
        ctype = self.headers.get("Content-Type", "")
        if not ctype.startswith("multipart/mixed; boundary="):
            return self.error(400, "InvalidInput", "a batch is multipart/mixed")
        boundary = ctype.split("boundary=", 1)[1].encode()
        answer = "batchresponse_" + uuid.uuid4().hex
        out = []
        for part in body.split(b"--" + boundary)[1:]:
            if part.startswith(b"--"):
                break
            head, _, sub = part.strip(b"\r\n").partition(b"\r\n\r\n")
            cid = None
            for line in head.split(b"\r\n"):
                k, _, v = line.decode().partition(":")
                if k.strip().lower() == "content-id":
                    cid = v.strip()
            lines = sub.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in lines[1:] if line)}
            who = bearer_principal(headers.get("authorization"), "storage")
            name = urllib.parse.unquote(path).lstrip("/").split("/", 2)
            if method != "DELETE" or len(name) < 3 or name[:2] != [ACCOUNT, container]:
                status = "400 Bad Request"
            elif who is None:
                status = "401 Unauthorized"
            elif who != USER and who not in STORAGE_ROLES:
                status = "403 Forbidden"
            else:
                with self.lock:
                    status = "202 Accepted" if blobs.pop(name[2], None) is not None \
                        else "404 The specified blob does not exist."
                    self.staged.get(container, {}).pop(name[2], None)
            out.append(f"--{answer}\r\nContent-Type: application/http\r\nContent-ID: {cid}\r\n\r\n"
                       f"HTTP/1.1 {status}\r\nx-ms-delete-type-permanent: true\r\n\r\n")
        out.append(f"--{answer}--\r\n")
        self.reply(202, raw="".join(out).encode(), content_type=f"multipart/mixed; boundary={answer}")

    def list(self, blobs: dict, q: dict) -> None:
        prefix = q.get("prefix", "")
        delim = q.get("delimiter", "")
        marker = q.get("marker", "")
        limit = int(q.get("maxresults") or 5000)
        with self.lock:
            names = sorted(n for n in blobs if n.startswith(prefix))
        entries: list[tuple[str, bool]] = []
        seen = set()
        for n in names:
            if delim and delim in n[len(prefix):]:
                p = prefix + n[len(prefix):].split(delim, 1)[0] + delim
                if p not in seen:
                    seen.add(p)
                    entries.append((p, True))
            else:
                entries.append((n, False))
        entries = [e for e in entries if e[0] > marker] if marker else entries
        page, rest = entries[:limit], entries[limit:]
        out = [f'<?xml version="1.0" encoding="utf-8"?><EnumerationResults ContainerName="{CONTAINER}">',
               f"<Prefix>{escape(prefix)}</Prefix>", f"<MaxResults>{limit}</MaxResults>"]
        if delim:
            out.append(f"<Delimiter>{escape(delim)}</Delimiter>")
        out.append("<Blobs>")
        for name, is_prefix in page:
            if is_prefix:
                out.append(f"<BlobPrefix><Name>{escape(name)}</Name></BlobPrefix>")
                continue
            with self.lock:
                data, etag, modified, ctype = blobs[name]
            out.append(f"<Blob><Name>{escape(name)}</Name><Properties><Last-Modified>{modified}"
                       f"</Last-Modified><Etag>{etag}</Etag><Content-Length>{len(data)}</Content-Length>"
                       f"<Content-Type>{ctype}</Content-Type><BlobType>BlockBlob</BlobType>"
                       "</Properties></Blob>")
        out.append("</Blobs>")
        out.append(f"<NextMarker>{escape(page[-1][0]) if rest else ''}</NextMarker></EnumerationResults>")
        self.reply(200, raw="".join(out).encode(), content_type="application/xml")

    do_GET = do_PUT = do_DELETE = do_HEAD = do_POST = route


def write_az(folder: str) -> str:
    """The signed-in user's `az`: `az account get-access-token --resource R | --scope S --output json`."""
    bin_dir = os.path.join(folder, "bin")
    os.makedirs(bin_dir)
    path = os.path.join(bin_dir, "az")
    with open(path, "w") as f:
        f.write(f"""#!/usr/bin/env python3
import datetime, json, sys, time
args = sys.argv[1:]
if args[:2] != ["account", "get-access-token"]:
    sys.exit("az (test): only `az account get-access-token` is here")
resource = None
for flag in ("--resource", "--scope"):
    if flag in args:
        resource = args[args.index(flag) + 1]
aud = {{"https://management.azure.com": "arm", "https://storage.azure.com": "storage"}}.get(
    (resource or "").removesuffix("/.default").rstrip("/"))
if aud is None:
    sys.exit(f"az (test): no token for {{resource!r}}")
expires = time.time() + 3600
print(json.dumps({{
    "accessToken": "{USER}." + aud,
    "expiresOn": datetime.datetime.fromtimestamp(expires).strftime("%Y-%m-%d %H:%M:%S.%f"),
    "expires_on": int(expires),
    "subscription": "{SUBSCRIPTION}",
    "tenant": "{TENANT}",
    "tokenType": "Bearer",
}}))
""")
    os.chmod(path, 0o755)
    return bin_dir


def usage_limit(text: str) -> tuple[str, int]:
    name, _, n = text.partition("=")
    if name not in USAGES or not n.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=N with NAME one of {', '.join(USAGES)}, got {text!r}")
    return name, int(n)


def main() -> None:
    parser = argparse.ArgumentParser(description="Azure for tests/tests/aci_job.rs (see the module's doc)")
    parser.add_argument("--throttle-every", type=int, default=0, metavar="N",
                        help="answer every Nth ARM request of each principal 429")
    parser.add_argument("--usage-limit", type=usage_limit, action="append", default=[], metavar="NAME=N",
                        help=f"a quota of Location - List Usage ({', '.join(USAGES)})")
    parser.add_argument("--infra-var", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable of infra/azure as `terraform apply -var` sets it (the NSG's rules)")
    parser.add_argument("--blob-only", action="store_true",
                        help="Blob Storage and `az` only, on loopback: no Docker, no root")
    args = parser.parse_args()
    if args.blob_only:
        return blob_only()
    throttle_every = args.throttle_every
    out = sys.stdout
    sys.stdout = sys.stderr
    network, subnet = make_network()
    try:
        fw = firewall.Firewall(network, subnet, f"aci-{os.getpid()}")
    except Exception:
        docker("network", "rm", network, check=False)
        raise
    imds_network()
    gateway = str(subnet.network_address + 1)
    files = tempfile.mkdtemp(prefix="physalia-aci-fake-")
    os.chmod(files, 0o755)
    infra_vars = dict(v.split("=", 1) for v in args.infra_var)
    aci = Aci(network, subnet, gateway, files, fw, infra_vars)
    aci.throttle_every = throttle_every
    aci.usage_limits.update(dict(args.usage_limit))
    Arm.aci = aci
    arm = http.server.ThreadingHTTPServer((gateway, 0), Arm)
    arm.daemon_threads = True
    threading.Thread(target=arm.serve_forever, daemon=True).start()
    aci.arm = f"http://{gateway}:{arm.server_address[1]}"
    blobs = http.server.ThreadingHTTPServer((gateway, 0), Blobs)
    blobs.daemon_threads = True
    threading.Thread(target=blobs.serve_forever, daemon=True).start()
    aci.blob = f"http://{gateway}:{blobs.server_address[1]}/{ACCOUNT}"
    imds = ImdsServer((IMDS_IP, 80), Imds)
    threading.Thread(target=imds.serve_forever, daemon=True).start()
    threading.Thread(target=aci.observe, daemon=True).start()
    bin_dir = write_az(files)
    print(json.dumps({
        "arm": aci.arm, "blob": aci.blob, "account": ACCOUNT, "container": CONTAINER, "bin": bin_dir,
        "network": network, "subscription": SUBSCRIPTION, "resource_group": RESOURCE_GROUP,
        "location": LOCATION, "subnet_id": SUBNET_ID, "coordinator_identity_id": COORDINATOR_IDENTITY,
        "pull_identity_id": PULL_IDENTITY,
    }), file=out, flush=True)
    try:
        sys.stdin.read()
    finally:
        aci.shutdown()
        for s in (arm, blobs, imds):
            s.shutdown()
        ids = docker("ps", "-aq", "--filter", f"label={LABEL}", check=False).stdout.split()
        if ids:
            docker("rm", "-f", *ids, check=False)
        fw.close()
        docker("network", "rm", network, check=False)
        shutil.rmtree(files, ignore_errors=True)


def blob_only() -> None:
    """`--blob-only`: Blob Storage on 127.0.0.1 and the signed-in user's `az`, for tests of the `az://`
    store that need neither Resource Manager nor containers."""
    out = sys.stdout
    sys.stdout = sys.stderr
    files = tempfile.mkdtemp(prefix="physalia-blob-fake-")
    blobs = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Blobs)
    blobs.daemon_threads = True
    threading.Thread(target=blobs.serve_forever, daemon=True).start()
    bin_dir = write_az(files)
    print(json.dumps({"blob": f"http://127.0.0.1:{blobs.server_address[1]}/{ACCOUNT}", "account": ACCOUNT,
                      "container": CONTAINER, "bin": bin_dir}), file=out, flush=True)
    try:
        sys.stdin.read()
    finally:
        blobs.shutdown()
        shutil.rmtree(files, ignore_errors=True)


if __name__ == "__main__":
    main()
