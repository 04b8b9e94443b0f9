"""The clouds' inbound rules, read from infra/, enforced between the containers of a fake's Docker network
(and, for tests/kubernetes/kube_cluster.py, the NetworkPolicies it stores, which it turns into rules here).

infra/ecs gives every task one security group that opens only UDP on the mesh port and the coordinator's
ports, only from members of the group; infra/azure's network security group opens only UDP on its QUIC
ports inside the subnet and denies everything else. The fakes (tests/ecs/ecs_agent.py,
tests/aci/aci_cloud.py) run each task or container group as a container on one Docker network standing
in for the VPC's subnet; without this module any container reached any port of any other, so a job whose
ports the real firewall closes would still pass its tests.

Rules are read from the Terraform files themselves (`ecs_ingress`, `nsg_inbound`), not restated here, so
a change to infra/ is what the fakes enforce. They are applied in this machine's netfilter: one chain per
fake, jumped to for traffic between the network's containers (bridge netfilter: Docker's own isolation
depends on it) and from this machine into them. Stateful, like both clouds' firewalls: replies to a
connection the container opened are let in. A container's rules are in place before it starts (`guard`
before `docker start`), so no packet reaches it unfiltered.

Membership of a security group is the network's subnet: every task the fake runs there carries the one
group infra/ecs creates. This machine, the network's gateway (where moto, the fake Resource Manager and a
client-mode coordinator listen), is no member: containers reach it, it does not reach them.
"""

import ipaddress
import os
import re
import subprocess
import threading
from dataclasses import dataclass

INFRA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "infra")


@dataclass(frozen=True)
class Rule:
    """One inbound rule: `allow` or deny `protocol` (`udp`, `tcp` or `all`) to ports `lo`..`hi` (all
    ports when None) from `source` (a CIDR, or `members` for the task's own security group)."""
    allow: bool
    protocol: str
    lo: int | None
    hi: int | None
    source: str
    name: str = ""

    def describe(self) -> str:
        ports = "all ports" if self.lo is None else (
            f"port {self.lo}" if self.lo == self.hi else f"ports {self.lo}-{self.hi}")
        return f"{'allow' if self.allow else 'deny'} {self.protocol} {ports} from {self.source}"


# --- Terraform -------------------------------------------------------------------------------------

def _blocks(text: str, head: str) -> list[tuple[str, str]]:
    """(the header's labels, body) of every `head ... {` block, braces balanced."""
    out = []
    for m in re.finditer(rf'^\s*{head}([^{{\n]*)\{{', text, re.M):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out.append((m.group(1).strip(), text[m.end():i - 1]))
    return out


def _attrs(body: str) -> dict[str, str]:
    """The block's top-level `name = value` lines (nested blocks skipped)."""
    out, depth = {}, 0
    for line in body.splitlines():
        line = line.split("#", 1)[0].rstrip()
        if depth == 0:
            m = re.match(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.+)$', line)
            if m and not m.group(2).endswith("{"):
                out[m.group(1)] = m.group(2).strip()
        depth += line.count("{") - line.count("}")
    return out


def variables(module: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The module's variables: their defaults, then `overrides` (as `terraform apply -var` would)."""
    with open(os.path.join(INFRA, module, "variables.tf")) as f:
        text = f.read()
    out = {}
    for labels, body in _blocks(text, "variable"):
        default = _attrs(body).get("default")
        if default is not None:
            out[labels.strip('"')] = default.strip('"')
    out.update(overrides or {})
    return out


def _value(expr: str, var: dict[str, str]) -> str:
    """A Terraform expression of the forms infra/ uses: a literal, `var.X`, `var.X + N`."""
    expr = expr.strip()
    m = re.fullmatch(r'var\.([A-Za-z_0-9]+)\s*([+-])\s*(\d+)', expr)
    if m:
        base = int(var[m.group(1)])
        return str(base + int(m.group(3)) if m.group(2) == "+" else base - int(m.group(3)))
    m = re.fullmatch(r'var\.([A-Za-z_0-9]+)', expr)
    if m:
        if m.group(1) not in var:
            raise ValueError(f"infra: variable {m.group(1)} has no default and no override")
        return var[m.group(1)]
    return expr.strip('"')


def _protocol(p: str) -> str:
    p = p.lower()
    return {"-1": "all", "*": "all"}.get(p, p)


def _resources(module: str, kind: str) -> list[tuple[str, str]]:
    """(labels, body) of every `resource "KIND" "NAME"` block of infra/MODULE/main.tf."""
    with open(os.path.join(INFRA, module, "main.tf")) as f:
        text = f.read()
    return [(labels, body) for labels, body in _blocks(text, "resource") if f'"{kind}"' in labels]


def ecs_ingress(overrides: dict[str, str] | None = None) -> list[dict]:
    """infra/ecs's ingress rules of the workers' security group as EC2 IpPermissions: `GroupId` of
    `referenced_security_group_id` is the placeholder `self` (the group itself)."""
    var = variables("ecs", overrides)
    perms = []
    for labels, body in _resources("ecs", "aws_vpc_security_group_ingress_rule"):
        a = _attrs(body)
        # EC2's own spelling ("udp", "-1" for all); sg_rules reads it back
        perm = {"IpProtocol": _value(a["ip_protocol"], var).lower()}
        if "from_port" in a:
            perm["FromPort"] = int(_value(a["from_port"], var))
            perm["ToPort"] = int(_value(a["to_port"], var))
        if a.get("referenced_security_group_id", "").startswith("aws_security_group.workers."):
            perm["UserIdGroupPairs"] = [{"GroupId": "self", "Description": _value(a.get("description", '""'), var)}]
        elif "cidr_ipv4" in a:
            perm["IpRanges"] = [{"CidrIp": _value(a["cidr_ipv4"], var)}]
        else:
            raise ValueError(f"infra/ecs: ingress rule {labels}: no source this fake understands")
        perms.append(perm)
    if not perms:
        raise ValueError("infra/ecs/main.tf declares no aws_vpc_security_group_ingress_rule")
    return perms


def sg_rules(permissions: list[dict], own_groups: list[str]) -> list[Rule]:
    """A security group's IpPermissions (as EC2's DescribeSecurityGroups returns them) as rules; a
    group names no denials: what no rule allows is dropped."""
    rules = []
    for p in permissions:
        proto = _protocol(p["IpProtocol"])
        lo, hi = (None, None) if proto == "all" else (p.get("FromPort"), p.get("ToPort"))
        for pair in p.get("UserIdGroupPairs", []):
            if pair["GroupId"] in own_groups:
                rules.append(Rule(True, proto, lo, hi, "members", pair.get("Description", "")))
        for r in p.get("IpRanges", []):
            rules.append(Rule(True, proto, lo, hi, r["CidrIp"]))
    return rules


def nsg_inbound(subnet: str, overrides: dict[str, str] | None = None) -> list[Rule]:
    """infra/azure's network security group: its inbound rules by priority, then Azure's default
    rules (AllowVnetInBound 65000, DenyAllInBound 65500). `var.subnet_cidr` is the fake's subnet;
    `overrides` other variables, as `terraform apply -var` would."""
    var = variables("azure", {**(overrides or {}), "subnet_cidr": subnet})
    found = []
    for _, body in _resources("azure", "azurerm_network_security_group"):
        for _, rule in _blocks(body, "security_rule"):
            a = {k: _value(v, var) for k, v in _attrs(rule).items()}
            if a["direction"] != "Inbound":
                continue
            ports = a.get("destination_port_range", "*")
            lo, hi = (None, None) if ports == "*" else (
                tuple(int(x) for x in ports.split("-")) if "-" in ports else (int(ports), int(ports)))
            src = a.get("source_address_prefix", "*")
            src = "0.0.0.0/0" if src in ("*", "Internet") else (subnet if src == "VirtualNetwork" else src)
            found.append((int(a["priority"]), Rule(a["access"] == "Allow", _protocol(a["protocol"]), lo, hi,
                                                   src, a["name"])))
    if not found:
        raise ValueError("infra/azure/main.tf declares no inbound security_rule")
    found += [(65000, Rule(True, "all", None, None, subnet, "AllowVnetInBound")),
              (65500, Rule(False, "all", None, None, "0.0.0.0/0", "DenyAllInBound"))]
    return [r for _, r in sorted(found, key=lambda x: x[0])]


def subnet_order(lo: int, hi: int) -> list[int]:
    """The third octets `lo..hi` to try for a fake's /24, from a random one on: consecutive fakes seldom
    get the same subnet, so their containers' addresses (and the connections tracked between them) differ."""
    import random
    n = hi - lo
    start = random.randrange(n)
    return [lo + (start + i) % n for i in range(n)]


# --- netfilter -------------------------------------------------------------------------------------

def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)}: {r.stderr.strip()}")
    return r


def sweep_dead() -> None:
    """Removes the chains (and their jumps) of fakes that died without closing theirs (killed): a
    chain's name ends with its fake's pid."""
    rules = _iptables("-S").stdout.splitlines()
    for line in rules:
        m = re.fullmatch(r"-N (PHYSALIA-FW-\w+-(\d+))", line.strip())
        if not m or os.path.exists(f"/proc/{m.group(2)}"):
            continue
        chain = m.group(1)
        for jump in rules:
            if jump.startswith("-A ") and jump.endswith(f"-j {chain}"):
                _iptables("-D", *jump[3:].split(), check=False)
        _iptables("-F", chain, check=False)
        _iptables("-X", chain, check=False)


class Firewall:
    """The inbound rules of the containers of one Docker network, each guarded by its own rules."""

    def __init__(self, network: str, subnet: ipaddress.IPv4Network, tag: str) -> None:
        r = subprocess.run(["docker", "network", "inspect", "-f", "{{.Id}}", network],
                           capture_output=True, text=True, check=True)
        self.bridge = "br-" + r.stdout.strip()[:12]
        self.subnet = str(subnet)
        self.gateway = str(subnet.network_address + 1)
        self.chain = f"PHYSALIA-FW-{tag}"[:28]
        self.lock = threading.Lock()
        # each guarded address's lines, as appended
        self.guarded: dict[str, list[list[str]]] = {}
        sweep_dead()
        _iptables("-N", self.chain)
        # first in the chain: replies to what a container opened (both clouds' firewalls are stateful).
        # Replies only (`--ctdir REPLY`): a flow's own later packets are judged by the rules again, so no
        # tracked connection (say, one between an earlier fake's containers at the same addresses, where
        # consecutive fakes got the same subnet) can let a new container through a port its rules close
        _iptables("-A", self.chain, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                  "--ctdir", "REPLY", "-j", "RETURN")
        # between the network's containers (FORWARD, through DOCKER-USER) and from this machine
        self.jumps = [("DOCKER-USER", ["-i", self.bridge, "-o", self.bridge, "-j", self.chain]),
                      ("OUTPUT", ["-o", self.bridge, "-j", self.chain])]
        for chain, rule in self.jumps:
            _iptables("-I", chain, "1", *rule)

    def guard(self, ip: str, rules: list[Rule], from_host: bool = False) -> None:
        """`ip`'s inbound rules, in order (the first that matches decides), then a drop of the rest;
        `from_host`: this machine may open connections to it (a Kubernetes node to its pods). Called
        again for the same `ip`, the new rules replace the old without a moment unguarded: they are
        appended behind the old ones (whose last line drops the rest) before those are deleted."""
        # this machine is the subnet's gateway: outside the VPC or VNet, no member of any group
        lines = [["-d", ip, "-s", self.gateway, "-j", "RETURN" if from_host else "DROP"]]
        for r in rules:
            src = self.subnet if r.source == "members" else r.source
            match = ["-d", ip]
            if src != "0.0.0.0/0":
                match += ["-s", src]
            if r.protocol != "all":
                match += ["-p", r.protocol]
                if r.lo is not None:
                    match += ["--dport", f"{r.lo}:{r.hi}"]
            lines.append(match + ["-j", "RETURN" if r.allow else "DROP"])
        lines.append(["-d", ip, "-j", "DROP"])
        with self.lock:
            old = self.guarded.get(ip, [])
            for line in lines:
                _iptables("-A", self.chain, *line)
            # each delete removes the first line of its text: the old one. Last line first: once the old
            # drop of the rest is gone, what the old rules did not allow falls through to the new ones
            for line in reversed(old):
                _iptables("-D", self.chain, *line)
            self.guarded[ip] = lines

    def release(self, ip: str) -> None:
        """Forgets `ip`'s rules (its container is gone; the address may be given again)."""
        with self.lock:
            for line in self.guarded.pop(ip, []):
                _iptables("-D", self.chain, *line)

    def close(self) -> None:
        with self.lock:
            for chain, rule in self.jumps:
                _iptables("-D", chain, *rule, check=False)
            _iptables("-F", self.chain, check=False)
            _iptables("-X", self.chain, check=False)
